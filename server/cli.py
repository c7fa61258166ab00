"""The `infercept` command.

    infercept download [--model ID]     fetch a model (default: the embedded one), print its folder
    infercept generate --prompt TEXT    one completion (--chat applies the chat template)
    infercept chat                      interactive chat in the terminal
    infercept profile                   measure T_fwd(n), saturation point and copy bandwidth
    infercept serve                     the OpenAI-compatible HTTP server

Every command that takes --model defaults to the embedded SmolLM2-135M-Instruct. Heavy imports
happen inside the commands so `infercept --help` is instant.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from infercept.engine import REASONING_PARSERS, CacheConfig  # standard library only: --help stays instant


def _env(name: str, default):
    """INFERCEPT_<NAME>, or `default` when unset or empty (compose files often pass empty values)."""
    return os.environ.get(f"INFERCEPT_{name}") or default


def _env_flag(name: str) -> bool | None:
    """INFERCEPT_<NAME> as a switch: False for 0, false, no or off, True for anything else, None unset."""
    value = _env(name, None)
    return None if value is None else value.lower() not in ("0", "false", "no", "off")


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _share(value: str) -> float:
    """A share of free memory, over 0 and at most 1 (argparse's type: a bad one stops the command line)."""
    share = float(value)
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"{value}: a share of free memory, over 0 and at most 1")
    return share


def add_revision_arg(g) -> None:
    g.add_argument("--revision", default=_env("REVISION", None),
                   help="the Hub repo's branch, tag or commit to serve, for a --model repo id (default: main); "
                        "a commit pins the exact files")


def model_folder(args: argparse.Namespace) -> str | None:
    """`--model` as the engines load it: a repo id at `--revision` resolved to its snapshot here, so the
    engines (and their own resolution of a repo id, at main) get a folder."""
    if args.revision is None:
        return args.model
    from infercept.engine import resolve_model

    return resolve_model(args.model, revision=args.revision)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=_env("MODEL", None),
                   help="a local Hugging Face model folder, or a Hub repo id (org/name: downloaded into the "
                        "Hugging Face cache first; HF_TOKEN, HF_HUB_OFFLINE) (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    add_revision_arg(g)
    g.add_argument("--dtype", default=_env("DTYPE", "auto"), help="auto, bfloat16, float16 or float32")
    g.add_argument("--device", default=_env("DEVICE", "auto"), help="auto, cpu or cuda[:N]")
    g.add_argument("--kv-cache-gb", type=float, default=_env("KV_CACHE_GB", None),
                   help="device KV pool size in GiB (default: --kv-cache-fraction of the memory free at start-up)")
    g.add_argument("--kv-cache-fraction", type=_share,
                   default=_env("KV_CACHE_FRACTION", CacheConfig.kv_cache_fraction),
                   help="without --kv-cache-gb, the device KV pool's share of the memory free at start-up, "
                        "after the weights (default 0.25 on a CPU, whose memory the machine shares, 0.8 on a GPU; "
                        "the replicas launcher gives each of N replicas sharing a device 1/N of it). "
                        "--backend vllm: on a CPU the same; on a GPU vLLM sizes its pool by "
                        "--gpu-memory-utilization instead")
    g.add_argument("--host-kv-gb", type=float, default=float(_env("HOST_KV_GB", 1.0)),
                   help="host KV pool for swapped-out requests, GiB (default 1)")
    g.add_argument("--max-num-batched-tokens", type=int, default=_env("MAX_NUM_BATCHED_TOKENS", None),
                   help="tokens per forward pass (default: 256 on a CPU; on a GPU the measured profile's "
                        "saturation point, at least 256; --backend vllm: vLLM's own default)")
    g.add_argument("--enforce-eager", action="store_true", default=_env("ENFORCE_EAGER", "0") not in ("0", ""),
                   help="no CUDA graphs (a GPU otherwise replays decode steps from captured graphs)")
    g.add_argument("--async-output", action=argparse.BooleanOptionalAction, default=_env_flag("ASYNC_OUTPUT"),
                   help="the native engine runs a step's output stage (detokenizing, stop strings, tool calls) "
                        "while the next step's forward pass computes (INFERCEPT_ASYNC_OUTPUT=1 or 0). Default: on "
                        "a GPU, not on a CPU, whose pass leaves the host nothing to overlap")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=_env_flag("ASYNC_SCHEDULING"),
                   help="plan and launch each step while the one before computes (INFERCEPT_ASYNC_SCHEDULING=1 "
                        "or 0). Native engine: needs --async-output; default as --async-output. --backend vllm: "
                        "vLLM's own asynchronous scheduling, with our AsyncInterceptScheduler under infercept, "
                        "infercept-paper, preserve and swap; default vLLM's choice (on a GPU where it supports "
                        "it, off on a CPU)")
    g.add_argument("--max-num-seqs", type=int, default=_optional_int(_env("MAX_NUM_SEQS", None)),
                   help="sequences in a forward pass at most (default 64; --backend vllm: vLLM's own default)")
    g.add_argument("--max-model-len", type=int, default=_env("MAX_MODEL_LEN", None))
    g.add_argument("--threads", type=int, default=_env("THREADS", None), help="torch CPU threads")
    g.add_argument("--policy", default=_env("POLICY", None),
                   help="how paused requests keep their KV: infercept (min-waste, the default), preserve, swap, "
                        "discard, improved-discard, prefix-cache, or a Figure 3 ablation step; +swap-preemption or "
                        "+recompute-preemption (e.g. swap+swap-preemption) changes how KV leaves the device "
                        "under memory pressure; infercept-paper is the paper's policy exactly, and "
                        "+las-priority, +program-arrival-priority, +expected-waste, +prefetch, +context-cost, "
                        "+deferred-swap, +admission, +ample-preserve, +ample-no-discard (+no-... to remove one) switch "
                        "on one policy part beyond the paper each (benchmarks/README.md, \"Beyond the paper\"). "
                        "--backend vllm: infercept, infercept-paper, preserve, swap, prefix-cache or discard "
                        "(the last two are stock vLLM), the first four with the parts vLLM runs; +prefetch, "
                        "+admission and a priority other than arrival are refused there, and infercept runs "
                        "without prefetch (docs/operators.md, section 7)")
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                   default=_env_flag("PREFIX_CACHING") is not False,
                   help="do not keep freed KV blocks addressable by content (INFERCEPT_PREFIX_CACHING=0)")
    # vLLM's spellings of switches that are on here anyway, so that its command lines run unchanged.
    g.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_true", default=argparse.SUPPRESS,
                   help="prefix caching, on by default (vLLM's flag)")
    g.add_argument("--enable-chunked-prefill", action="store_true",
                   help="accepted (vLLM's flag): long prompts are always prefilled in chunks here")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device,
                kv_cache_gb=None if args.kv_cache_gb is None else float(args.kv_cache_gb),
                kv_cache_fraction=args.kv_cache_fraction, host_kv_gb=args.host_kv_gb,
                max_num_batched_tokens=None if args.max_num_batched_tokens is None else int(args.max_num_batched_tokens),
                max_model_len=None if args.max_model_len is None else int(args.max_model_len),
                num_threads=None if args.threads is None else int(args.threads), policy=args.policy or "infercept",
                enable_prefix_caching=args.prefix_caching, enforce_eager=args.enforce_eager,
                async_output=args.async_output, async_scheduling=args.async_scheduling,
                # unset: the engine's own default (SchedulerConfig.max_num_seqs)
                **({} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}))


def add_backend_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("backend")
    g.add_argument("--backend", choices=("native", "vllm", "auto"), default=_env("BACKEND", "native"),
                   help="native: InferCept's own engine (default); vllm: vLLM V1 in its own environment "
                        "(docs/operators.md); auto: vllm where its environment exists and an NVIDIA GPU is "
                        "present, else native")
    g.add_argument("--vllm-python", default=_env("VLLM_PYTHON", None),
                   help="python of the vLLM environment (default: .venv-vllm/bin/python, made by `make vllm-env`)")
    v = p.add_argument_group("vLLM's own engine options (--backend vllm only; unset: vLLM's defaults)")
    v.add_argument("--tensor-parallel-size", type=int, default=_env("TENSOR_PARALLEL_SIZE", None))
    v.add_argument("--pipeline-parallel-size", type=int, default=_env("PIPELINE_PARALLEL_SIZE", None))
    v.add_argument("--gpu-memory-utilization", type=float, default=_env("GPU_MEMORY_UTILIZATION", None),
                   help="share of GPU memory vLLM may use (weights, activations and KV)")
    v.add_argument("--quantization", default=_env("QUANTIZATION", None),
                   help="vLLM's weight quantization method (fp8, awq, gptq, ...; default: the checkpoint's)")
    v.add_argument("--kv-cache-dtype", default=_env("KV_CACHE_DTYPE", None),
                   help="vLLM's KV cache dtype (auto, fp8, fp8_e4m3, fp8_e5m2, ...; default auto: the model's)")
    v.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any of vLLM's engine arguments (vllm.engine.arg_utils.EngineArgs), e.g. block_size=32 "
                        "or max_num_partial_prefills=2; VALUE is read as JSON when it parses (numbers, true, "
                        "objects), else as a string; repeatable. An argument with a flag of its own is refused: "
                        "use the flag")


VLLM_ONLY = ("tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization", "quantization",
             "kv_cache_dtype")
# vLLM's engine arguments the server's own flags set: --vllm-arg refuses them, naming the flag.
FLAG_OF_ENGINE_ARG = {"model": "--model", "dtype": "--dtype", "max_model_len": "--max-model-len",
                      "max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
                      "enable_prefix_caching": "--no-prefix-caching", "kv_cache_memory_bytes": "--kv-cache-gb",
                      "enforce_eager": "--enforce-eager", "async_scheduling": "--async-scheduling",
                      "generation_config": "--generation-config",
                      "override_generation_config": "--override-generation-config",
                      **{name: "--" + name.replace("_", "-") for name in VLLM_ONLY}}


def chosen_backend(args: argparse.Namespace) -> str:
    """`--backend`, with `auto` resolved: vllm where its python exists and `nvidia-smi` is on the PATH."""
    if args.backend != "auto":
        return args.backend
    from infercept.engine import default_vllm_python

    python = args.vllm_python or default_vllm_python()
    return "vllm" if os.path.isfile(python) and shutil.which("nvidia-smi") else "native"


def parse_vllm_args(items: list[str]) -> dict:
    """`--vllm-arg KEY=VALUE`s as engine arguments: KEY with dashes or underscores, VALUE as JSON when it
    parses, else the string. ValueError for an item without `=`, or a KEY one of our flags sets."""
    parsed = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ValueError(f"--vllm-arg {item!r}: expected KEY=VALUE")
        if key in FLAG_OF_ENGINE_ARG:
            raise ValueError(f"--vllm-arg {item!r}: {key} has a flag of its own, {FLAG_OF_ENGINE_ARG[key]}")
        try:
            parsed[key] = json.loads(value)
        except ValueError:
            parsed[key] = value
    return parsed


def vllm_only_args(args: argparse.Namespace) -> dict:
    """The vLLM-only flags that were given, as engine arguments."""
    return {name: getattr(args, name) for name in VLLM_ONLY if getattr(args, name) is not None}


def vllm_engine_args(args: argparse.Namespace) -> dict:
    """The engine arguments of vLLM's own the flags give: the vLLM-only flags, --enforce-eager,
    --async-scheduling or --no-async-scheduling and every --vllm-arg. What is not given stays at vLLM's
    default."""
    return (vllm_only_args(args) | ({"enforce_eager": True} if args.enforce_eager else {})
            | ({} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling})
            | parse_vllm_args(args.vllm_arg))


def build_backend(args: argparse.Namespace):
    """The engine behind the server, loaded and ready (`--backend`)."""
    args.backend = chosen_backend(args)
    if args.backend == "native":
        from infercept.engine import NativeBackend

        if args.async_scheduling and args.async_output is False:
            raise SystemExit("infercept serve: --async-scheduling needs the output stage beside the next pass: "
                             "drop --no-async-output")
        given = [FLAG_OF_ENGINE_ARG[n] for n in vllm_only_args(args)]
        if given or args.vllm_arg:
            raise SystemExit(f"infercept serve: {', '.join(given + ['--vllm-arg'] * bool(args.vllm_arg))} "
                             "only apply to --backend vllm")
        return NativeBackend.create(model_folder(args), **engine_kwargs(args))
    from infercept.engine import VllmBackend

    if args.async_output is not None:
        raise SystemExit("infercept serve: --async-output applies to the native engine; with --backend vllm, "
                         "--async-scheduling runs vLLM's asynchronous scheduling")
    # The vLLM worker takes the engine flags it has a meaning for; vLLM reads its own VLLM_* variables.
    return VllmBackend.create(
        model_folder(args), python=args.vllm_python, policy=args.policy or "infercept",
        dtype=args.dtype, max_model_len=None if args.max_model_len is None else int(args.max_model_len),
        kv_cache_gb=None if args.kv_cache_gb is None else float(args.kv_cache_gb),
        kv_cache_fraction=args.kv_cache_fraction, host_kv_gb=args.host_kv_gb,
        # Unless given, vLLM's own defaults (those `vllm serve` takes on the hardware), not the native engine's
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=None if args.max_num_batched_tokens is None else int(args.max_num_batched_tokens),
        enable_prefix_caching=args.prefix_caching, tool_parser=args.tool_parser,
        engine_args=vllm_engine_args(args))


def cmd_download(args: argparse.Namespace) -> None:
    from infercept.engine import resolve_model

    folder = resolve_model(args.model, revision=args.revision)
    if not os.path.isdir(folder):  # a path: nothing to fetch
        raise FileNotFoundError(f"{folder!r}: no such folder")
    print(folder)


def cmd_generate(args: argparse.Namespace) -> None:
    from infercept.engine import LLM, SamplingParams

    llm = LLM(model_folder(args), **engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)


def cmd_chat(args: argparse.Namespace) -> None:
    from infercept.engine import LLM, SamplingParams

    llm = LLM(model_folder(args), **engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    messages: list[dict] = []
    print("Chatting with the model; an empty line or Ctrl-D quits.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        out = llm.chat(messages, params)
        messages.append({"role": "assistant", "content": out.text})
        print(f"model> {out.text}")


def cmd_profile(args: argparse.Namespace) -> None:
    from infercept.engine import profile_model

    profile, path = profile_model(model_folder(args), args.repeats, args.output, **engine_kwargs(args))
    print(f"saturation point {profile.saturation_point} tokens, "
          f"d2h {profile.d2h_bytes_per_s / 1e9:.1f} GB/s, h2d {profile.h2d_bytes_per_s / 1e9:.1f} GB/s")
    print(path)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=int(_env("PORT", 8000)), help="port (default 8000; 0 = any free)")
    g.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes; give it several times for several "
                        "tenants, named key-1, key-2, ... (or INFERCEPT_API_KEY: one key, the tenant 'default')")
    g.add_argument("--api-keys-file", default=_env("API_KEYS_FILE", None),
                   help="tenants, one per line: KEY [NAME] [max_paused=N] [max_paused_tokens=N]; each tenant "
                        "sees only its own sessions, responses and paused generations (docs/operators.md)")
    g.add_argument("--shared-prefix-cache", action="store_true", default=_env("SHARED_PREFIX_CACHE", "") == "1",
                   help="tenants share cached prompt blocks (a common system prompt computed once for all); by "
                        "default each tenant's are apart, so cached_tokens and timing never reveal what "
                        "another tenant sent")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME", default=_env("SERVED_MODEL_NAME", "").split() or None,
                   help="model name clients use (default: the model folder's name, or the Hub repo id); more names "
                        "are aliases the server answers to as well, each listed in /v1/models (as vLLM's flag)")
    g.add_argument("--chat-template", default=_env("CHAT_TEMPLATE", None), metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template used instead of the model's own: a file, or the template itself "
                        "(as vLLM's flag); tool calls are read in the format it renders (--tool-parser otherwise)")
    g.add_argument("--max-concurrent-requests", type=int, default=int(_env("MAX_CONCURRENT_REQUESTS", 512)),
                   help="requests generating at once; beyond, 429 with Retry-After (default 512)")
    g.add_argument("--keep-alive-timeout", type=float, default=float(_env("KEEP_ALIVE_TIMEOUT", 75.0)),
                   help="seconds an idle HTTP keep-alive connection stays open; keep it above the idle timeout of "
                        "the clients' and proxies' connection pools, or their next request on a connection the "
                        "server just closed fails (default 75)")
    g.add_argument("--tool-parser", "--tool-call-parser", dest="tool_parser", default=_env("TOOL_PARSER", None),
                   help="tool-call format: hermes, llama3_json, mistral, pythonic, qwen3_coder, glm45 (= glm47) or "
                        "deepseek_v31 (default: from the model's chat template); on --backend vllm also any of "
                        "vLLM's tool parsers, as vLLM's --tool-call-parser names them (kimi_k2, deepseek_v3, ...; "
                        "vllm:NAME picks vLLM's where ours has the same name), read when the model ends its turn "
                        "(docs/operators.md, tool-call formats)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted so that vLLM's command lines run unchanged: tool_choice auto is always on here")
    g.add_argument("--reasoning-parser", default=_env("REASONING_PARSER", None), choices=sorted(REASONING_PARSERS),
                   help="thinking format, as vLLM names it: qwen3, deepseek_r1 (glm45, glm47: qwen3's). "
                        "<think>...</think> goes to reasoning_content (chat) or a reasoning item (Responses), "
                        "tool calls are read after it, and a resumed turn keeps the paused generation's thinking "
                        "tokens (default: none)")
    g.add_argument("--generation-config", default=_env("GENERATION_CONFIG", "auto"),
                   help="sampling defaults for the fields a request leaves out: auto = the model's "
                        "generation_config.json, as its authors recommend (default), none = neutral (temperature 1, "
                        "no truncation; vLLM calls it 'vllm'), or a folder holding a generation_config.json")
    g.add_argument("--override-generation-config", default=_env("OVERRIDE_GENERATION_CONFIG", None), metavar="JSON",
                   help="sampling defaults set over --generation-config, in its field names, e.g. "
                        "'{\"temperature\": 0}' (greedy unless a request asks otherwise); fields: temperature, "
                        "top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, max_new_tokens")
    g.add_argument("--log-level", default=_env("LOG_LEVEL", "info"), help="server log level (default info)")
    m = p.add_argument_group("MCP", "MCP servers whose tools the server runs itself while the generation waits "
                             "(docs/operators.md)")
    m.add_argument("--mcp-config", default=_env("MCP_CONFIG", None),
                   help="JSON file in the mcpServers shape (name -> command/args/env/cwd or url/headers); their tools "
                        "are server_tools named mcp:<server>/<tool> or mcp:<server>, and Responses API mcp tools by "
                        "server_label")
    m.add_argument("--mcp-timeout", type=float, default=float(_env("MCP_TIMEOUT", 30.0)),
                   help="seconds an MCP tool call may take before the model reads a timeout error as its result; also "
                        "the bound on connecting to a server (default 30)")
    m.add_argument("--mcp-tools-ttl", type=float, default=float(_env("MCP_TOOLS_TTL", 300.0)),
                   help="seconds an MCP server's tool list is kept before it is listed again, and between tries of "
                        "a server that could not be reached (default 300)")
    m.add_argument("--mcp-allow-url", action="append", metavar="PATTERN",
                   default=_env("MCP_ALLOW_URL", "").split(),
                   help="a URL pattern (fnmatch glob over the whole URL, e.g. 'https://tools.internal/*') a "
                        "Responses request may name as its own MCP server in {\"type\": \"mcp\", \"server_url\": "
                        "...}; repeatable (INFERCEPT_MCP_ALLOW_URL: space-separated). Default: none, so per-request "
                        "server URLs are refused with 400 and clients use only --mcp-config servers, by server_label")
    c = p.add_argument_group("conversations", "What the server keeps between requests (server/conversations.py). "
                             "Each flag also reads INFERCEPT_<NAME> (INFERCEPT_IDLE_TTL, ...); the old names "
                             "--session-ttl / INFERCEPT_SESSION_TTL and --max-sessions / INFERCEPT_MAX_SESSIONS "
                             "still work.")
    c.add_argument("--idle-ttl", "--session-ttl", dest="idle_ttl", type=float,
                   default=float(_env("IDLE_TTL", _env("SESSION_TTL", 600.0))),
                   help="seconds a generation paused at a tool call waits for its result before it is aborted, "
                        "and a chat session_id or /v1/sessions session is kept unused (default 600; "
                        "--session-ttl is the old name)")
    c.add_argument("--max-paused-tokens", type=int, default=_optional_int(_env("MAX_PAUSED_TOKENS", None)),
                   help="context tokens of all paused generations at most (default: as many as the device and "
                        "host KV pools hold); beyond it or --max-paused, the one keeping the least KV is aborted")
    c.add_argument("--max-paused", "--max-sessions", dest="max_paused", type=int,
                   default=_optional_int(_env("MAX_PAUSED", _env("MAX_SESSIONS", None))),
                   help="paused generations kept at most (default: no count limit, memory decides; "
                        "--max-sessions is the old name)")
    c.add_argument("--max-named-sessions", type=int, default=int(_env("MAX_NAMED_SESSIONS", 16_384)),
                   help="chat session_id conversations and /v1/sessions sessions kept at most; beyond, the least "
                        "recently used one that is not generating is closed (default 16384)")
    c.add_argument("--response-ttl", type=float, default=float(_env("RESPONSE_TTL", 3600.0)),
                   help="seconds a stored Responses-API response stays retrievable and chainable after its "
                        "creation, and a conversation (/v1/conversations) is kept after its last use (default 3600)")
    c.add_argument("--resume-without-tools", action=argparse.BooleanOptionalAction,
                   default=bool(_env_flag("RESUME_WITHOUT_TOOLS")),
                   help="a chat request that sends no tools but continues a paused generation with its calls' "
                        "results (AutoGen's reflection step) is served with the paused prompt's tools and "
                        "tool_choice none, so it resumes instead of being recomputed (default off: the model "
                        "sees tool definitions the request did not send, and cannot call them)")
    c.add_argument("--max-stored-responses", type=int, default=int(_env("MAX_STORED_RESPONSES", 1024)),
                   help="stored Responses-API responses kept at most; beyond, the oldest is forgotten (default 1024)")
    c.add_argument("--max-conversations", type=int, default=int(_env("MAX_CONVERSATIONS", 1024)),
                   help="Responses-API conversations (/v1/conversations) kept at most, each --response-ttl seconds "
                        "after its last use; beyond, the least recently used one is forgotten (default 1024)")


def chat_template(given: str) -> str:
    """`--chat-template`: a file's text, or the template given inline; ValueError if it is neither, or
    is not Jinja that parses."""
    import jinja2

    if os.path.isfile(given):
        with open(given) as f:
            text = f.read()
    elif "{{" in given or "{%" in given:
        text = given
    else:
        raise ValueError(f"--chat-template {given!r}: no such file, and not a Jinja template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: line {e.lineno}: {e.message}") from None
    return text


def server_settings(args: argparse.Namespace):
    from infercept.server.mcp_config import load_mcp_config
    from infercept.server.settings import ConversationPolicy, McpSettings, ServerSettings, Tenant

    policy = ConversationPolicy(idle_ttl=args.idle_ttl, max_paused_tokens=args.max_paused_tokens,
                                max_paused=args.max_paused, max_named_sessions=args.max_named_sessions,
                                response_ttl=args.response_ttl, max_stored_responses=args.max_stored_responses,
                                max_conversations=args.max_conversations,
                                resume_without_tools=args.resume_without_tools)
    from infercept.server.tenants import load_keys_file

    keys = args.api_key or []  # one key: the tenant "default"; several: key-1, key-2, ... by position
    api_key = (keys[0] if len(keys) == 1 else None) if keys else _env("API_KEY", None)
    tenants = tuple(Tenant(f"key-{i}", key) for i, key in enumerate(keys, 1)) if len(keys) > 1 else ()
    if args.api_keys_file:
        tenants += load_keys_file(args.api_keys_file)
    mcp = McpSettings(servers=load_mcp_config(args.mcp_config) if args.mcp_config else (),
                      call_timeout_s=args.mcp_timeout, tools_ttl_s=args.mcp_tools_ttl,
                      allow_urls=tuple(args.mcp_allow_url))
    overrides = {}
    if args.override_generation_config:
        try:
            overrides = json.loads(args.override_generation_config)
        except ValueError:
            overrides = None
        if not isinstance(overrides, dict):
            raise ValueError(f"--override-generation-config {args.override_generation_config!r}: expected a JSON "
                             "object, e.g. '{\"temperature\": 0}'")
    names = args.served_model_name or [None]
    return ServerSettings(host=args.host, port=args.port, api_key=api_key or None, tenants=tenants,
                          shared_prefix_cache=args.shared_prefix_cache,
                          served_model_name=names[0], more_model_names=tuple(names[1:]),
                          chat_template=chat_template(args.chat_template) if args.chat_template else None,
                          conversations=policy,
                          max_concurrent_requests=args.max_concurrent_requests, tool_parser=args.tool_parser,
                          reasoning_parser=args.reasoning_parser, mcp=mcp, keep_alive_s=args.keep_alive_timeout,
                          generation_config=args.generation_config, override_generation_config=overrides)


def model_from_tag(args: argparse.Namespace) -> None:
    """`serve MODEL` (vLLM's spelling) is `--model MODEL`; both, naming different models, is an error."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ValueError(f"two models given: {args.model_tag!r} and --model (or INFERCEPT_MODEL) {args.model!r}; give one")
    args.model = args.model_tag


def cmd_serve(args: argparse.Namespace) -> None:
    import logging
    import signal

    import uvicorn

    from infercept.server.app import build_app, served_model_name
    from infercept.server.serving_base import STREAM_CUT_S

    model_from_tag(args)
    settings = server_settings(args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("infercept.server").setLevel(args.log_level.upper())
    print(f"infercept: loading {args.model or 'the embedded SmolLM2-135M-Instruct'} ...", file=sys.stderr, flush=True)
    backend = build_backend(args)
    # An engine that failed for good stops the server (uvicorn's graceful shutdown) and the exit status
    # below says so, so Docker or Kubernetes restarts it instead of a 503 forever.
    app = build_app(backend, settings, on_engine_failure=lambda: setattr(server, "should_exit", True),
                    shutting_down=lambda: server.should_exit)
    name = served_model_name(backend, settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                            timeout_keep_alive=settings.keep_alive_s, timeout_graceful_shutdown=int(STREAM_CUT_S) + 2)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                info = backend.info
                policy = info.policy or args.policy or "infercept"  # as it runs: a part switched off shows
                print(f"infercept: serving {name} ({args.backend}, {info.dtype}, {info.device}, policy {policy}) "
                      f"on http://{host}:{port}", flush=True)
                if info.policy_note:
                    print(f"infercept: {info.policy_note}", flush=True)

    server = Server(config)
    # SIGTERM is how Docker and Kubernetes stop a container: a graceful stop is a success, status 0.
    # (uvicorn restores the handler it found and raises the signal again after its shutdown; with the
    # default handler the process would die by it, status 143.)
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    server.run()  # SIGTERM/SIGINT: stop accepting, finish or cut streams, shut the engine down
    if app.state.engine_failed:
        print("infercept: the engine failed; exiting with status 1", file=sys.stderr, flush=True)
        sys.exit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infercept", description="InferCept: inference for tool-using agents")
    sub = parser.add_subparsers(dest="command", required=True)

    download = sub.add_parser("download", help="fetch a model ahead of serving it (default: the embedded one, "
                              "fetched and converted); prints its folder")
    download.add_argument("--model", default=None, help="a Hugging Face Hub repo id (org/name), downloaded into "
                          "the Hugging Face cache as `serve --model` would")
    add_revision_arg(download)
    download.set_defaults(func=cmd_download)

    for name, func, help_ in (("generate", cmd_generate, "one completion"),
                              ("chat", cmd_chat, "interactive chat in the terminal")):
        p = sub.add_parser(name, help=help_)
        add_engine_args(p)
        if name == "generate":
            p.add_argument("--prompt", required=True)
            p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
            p.add_argument("--seed", type=int, default=None)
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        p.add_argument("--top-p", type=float, default=1.0)
        p.set_defaults(func=func)
    p = sub.add_parser("profile", help="measure the cost model the min-waste policy uses; writes JSON")
    add_engine_args(p)
    p.add_argument("--output", default=None,
                   help="where to write the profile (default: the cache path the engine loads at start-up)")
    p.add_argument("--repeats", type=int, default=5)
    p.set_defaults(func=cmd_profile)
    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="the model, as `vllm serve MODEL` takes it: the same as --model")
    add_engine_args(p)
    add_backend_args(p)
    add_server_args(p)
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, PermissionError) as e:  # a gated Hub model: PermissionError
        print(f"infercept: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
