"""Replicas of `infercept serve` behind vLLM's router (the `vllm-router` package), one URL for clients.

    python -m infercept.server.replicas --replicas 2                  # router on 127.0.0.1:8000,
                                                                      # replicas on 8001 and 8002
    python -m infercept.server.replicas --replicas 4 --threads 2 -- --policy swap --kv-cache-gb 1
    make serve REPLICAS=2 [THREADS=2]

A paused generation lives in the process that paused it, so the request that resumes it has to reach
that replica. vllm-router 0.1.17 has no one policy that does this for every kind of client, so the
launcher offers two (`--router-policy`):

* `cache_aware` (the default): the router asks every replica to render a chat request into prompt token
  ids (the server's `POST /v1/chat/completions/render`, vLLM's route) and sends it where the longest
  prefix of those ids went before (when that prefix is over `--cache-threshold` of the request; otherwise
  to the least loaded replica). An implicit resume (the whole conversation sent again with the tool
  results: the OpenAI SDK's chat loop, LangChain, ...) renders to ids that extend those of the turn that
  paused, and so does a chat request that continues a session named in its body (`session_id`: the
  replica that holds the session renders its stored conversation first), so both go home. Not by the
  router: a session named in the X-Session-Id header alone (the router sends no headers with its render
  calls) and Responses chains (`previous_response_id`: the router does not render stateful requests
  and balances them by load); those the replica they reach forwards home (below).
* `kv_aware` with session affinity (`--affinity-ttl`, default 3600 s), for clients that send an
  `X-Session-Id` header: chat sessions and Responses chains whose requests carry the header stay on the
  replica their first request went to. Requests without the header are balanced by load (the router's
  KV-aware matching needs KV events that the server does not publish), so implicit resumes then miss.

Whatever the policy, a request that names its conversation (a Responses chain, a chat session, a native
session) and reaches a replica that does not hold it is forwarded to the one that does, and one that
carries a `prompt_cache_key` to the key's home replica: server/replica_forwarding.py, with the fleet file
this launcher writes (`replica --fleet FILE`).

The launcher starts the replicas (`infercept serve` on consecutive ports, `--threads` each). On a host
with a GPU (or a tensor x pipeline parallel set) for each, each replica gets its own by
CUDA_VISIBLE_DEVICES; otherwise they share the device, each with 1/N of a lone server's default KV pool
and, under `--backend vllm`, of vLLM's GPU share, unless the flags after `--` size them
(`memory_share_args`). It waits for their /health (vLLM's sharing a GPU one at a time: `start_fleet`),
starts the router, waits for its /readiness, and then watches: a replica that exits is started again on
its port (the router sends its traffic to the others meanwhile and takes it back once it is healthy);
if the router exits, everything stops. Ctrl-C or SIGTERM stops the router, then the
replicas (each with its own graceful shutdown), then exits. While it runs, the fleet grows and shrinks by
signal, as gunicorn's workers do: SIGTTIN starts one more replica on the next free port and, once it is
healthy, adds it to the router (`/add_worker`), which sends it new agents from then on; SIGTTOU takes the
newest replica out of the router (`/remove_worker`) and stops it gracefully (its paused generations are
released and counted; their agents' next steps go to the others and recompute).

    kill -TTIN $(pgrep -f 'infercept.server.replicas --replicas')    # one more replica

Each replica runs `infercept serve` through this module (`replica` below), which puts two ASGI layers
in front of the server's app and changes nothing else: ForwardToHolder (above), and DropRouterDefaults,
which removes the SGLang sampling fields the router adds to every chat and completion body it forwards or
renders (`no_stop_trim: false`, `skip_special_tokens: true`, ...; the server refuses unknown fields with
a 400) when they hold exactly the router's defaults; any other value still reaches the server, which
takes the fields it knows (`skip_special_tokens`, vLLM's too) and refuses the others.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .replica_forwarding import DnsFleet, FleetFile, ForwardToHolder, buffered, buffered_replay, write_fleet

ROUTER_PACKAGE = "vllm-router"  # pinned in pyproject.toml's `router` extra
VLLM_GPU_MEMORY_UTILIZATION = 0.92  # vLLM 0.32's default gpu_memory_utilization: a lone server's share
ROUTER_POLICIES = ("cache_aware", "kv_aware", "round_robin", "consistent_hash", "power_of_two", "random")

# The fields vllm-router 0.1.17 adds to every chat/completions body it forwards, with the values it
# writes when the client sent none (ignore_eos is one of the server's own fields, so it is not here).
ROUTER_DEFAULTS = {"no_stop_trim": False, "continue_final_message": False, "skip_special_tokens": True,
                   "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
                   "include_reasoning": True}
# (and to the render calls it makes of each replica for cache_aware, from the same body)
REWRITTEN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/chat/completions/render", "/v1/completions/render")


# -- a replica ----------------------------------------------------------------------------------------

class DropRouterDefaults:
    """ASGI middleware: removes ROUTER_DEFAULTS from a JSON body POSTed to REWRITTEN_PATHS where they
    hold exactly those values. Everything else passes through unchanged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in REWRITTEN_PATHS:
            return await self.app(scope, receive, send)
        body, replay = await buffered(receive)
        if body is None:  # the client went away before sending its body
            return await self.app(scope, replay, send)
        stripped = strip_router_defaults(body)
        if stripped is body:
            return await self.app(scope, replay, send)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = dict(scope, headers=headers + [(b"content-length", str(len(stripped)).encode())])
        return await self.app(scope, buffered_replay(stripped, receive), send)


def strip_router_defaults(body: bytes) -> bytes:
    """`body` without the router's default extras (the same object when there is nothing to drop, or
    when it is not a JSON object: the server answers that as it always does)."""
    try:
        request = json.loads(body)
    except ValueError:
        return body
    if not isinstance(request, dict):
        return body
    drop = [k for k, v in ROUTER_DEFAULTS.items() if k in request and request[k] is v]
    if not drop:
        return body
    for key in drop:
        del request[key]
    return json.dumps(request).encode()


FLEET_TOKEN_ENV = "INFERCEPT_FLEET_TOKEN"  # --fleet-dns: the fleet's token (the same on every replica)
FLEET_SELF_ENV = "INFERCEPT_FLEET_SELF"  # --fleet-dns: this replica's address, where its hostname's is not it


def replica(argv: list[str]) -> None:
    """`infercept serve ARGV` with DropRouterDefaults in front of the app, and with ForwardToHolder in front
    of that (server/replica_forwarding.py) given the fleet first: `--fleet FILE` (the launcher's fleet
    file) or `--fleet-dns NAME` (every address NAME resolves to, at this replica's port: a Kubernetes
    headless Service; the token in $INFERCEPT_FLEET_TOKEN, this replica's address its hostname's or
    $INFERCEPT_FLEET_SELF)."""
    import infercept.server.app as app_module
    from infercept.server.cli import main as cli_main

    fleet = None
    port = argv[argv.index("--port") + 1] if "--port" in argv else "8000"
    if argv[:1] == ["--fleet"]:
        fleet, argv = FleetFile(argv[1], f"http://127.0.0.1:{port}"), argv[2:]
    elif argv[:1] == ["--fleet-dns"]:
        token = os.environ.get(FLEET_TOKEN_ENV, "")
        if not token:
            sys.exit(f"replica --fleet-dns: set {FLEET_TOKEN_ENV} to the fleet's token (the same on every replica)")
        own = os.environ.get(FLEET_SELF_ENV) or socket.gethostbyname(socket.gethostname())
        fleet, argv = DnsFleet(argv[1], int(port), token, own), argv[2:]
    build_app = app_module.build_app

    def build_app_behind_router(*args, **kwargs):
        app = build_app(*args, **kwargs)
        app.add_middleware(DropRouterDefaults)
        if fleet is not None:
            app.add_middleware(ForwardToHolder, fleet=fleet)
        return app

    app_module.build_app = build_app_behind_router  # cmd_serve imports it from the module when it runs
    cli_main(["serve", *argv])


# -- the launcher ----------------------------------------------------------------------------------------

def router_executable() -> str | None:
    """vllm-router's command: beside this Python first (a virtual environment), then on PATH."""
    return (shutil.which("vllm-router", path=os.path.dirname(sys.executable))
            or shutil.which("vllm-router"))


def router_argv(exe: str, workers: list[str], host: str, port: int, policy: str, metrics_port: int,
                cache_threshold: float = 0.5, affinity_ttl: float = 3600, extra: list[str] = ()) -> list[str]:
    """vllm-router's command line for `policy` (kv_aware: with session affinity for `affinity_ttl` s)."""
    by_policy = {"cache_aware": ["--cache-threshold", str(cache_threshold)],
                 "kv_aware": ["--kv-aware-session-affinity-ttl-secs", str(int(affinity_ttl))]}
    return [exe, "--host", host, "--port", str(port), "--worker-urls", *workers, "--policy", policy,
            *by_policy.get(policy, []),
            # Notice a dead replica in seconds (the default is a minute); requests fail over to the
            # others by the router's retries before that.
            "--health-check-interval-secs", "5", "--health-check-timeout-secs", "5",
            # A request whose replica dies under it is retried, but cache-aware routing picks the same
            # replica for every retry (the prefix is there) until its circuit opens: after the default ten
            # failures, the two requests' retries spent. After two, a retry goes to another replica.
            "--cb-failure-threshold", "2",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", "warning", *extra]


def _pdeathsig() -> None:
    """In the child before exec: SIGTERM when the launcher dies, even by SIGKILL (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Child:
    """A process of the launcher, in its own process group (the terminal's Ctrl-C reaches the launcher
    only, which stops the children in order)."""

    def __init__(self, name: str, argv: list[str], url: str, log: IO | None, gpus: str | None = None):
        self.name, self.argv, self.url, self.log = name, argv, url, log
        self.gpus = gpus  # its CUDA_VISIBLE_DEVICES; None: the launcher's
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.start()

    def start(self) -> None:
        env = None if self.gpus is None else {**os.environ, "CUDA_VISIBLE_DEVICES": self.gpus}
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT if self.log else None,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                     preexec_fn=_pdeathsig if sys.platform == "linux" else None)
        self.started = time.monotonic()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def wait_ok(children: list[Child], path: str, timeout: float) -> None:
    """Until GET child.url + path answers 200 for every child; raises if one exits or time runs out."""
    import httpx

    deadline, waiting = time.monotonic() + timeout, list(children)
    while waiting:
        for child in list(waiting):
            if not child.running():
                raise RuntimeError(f"{child.name} exited with status {child.proc.returncode} while starting")
            try:
                if httpx.get(child.url + path, timeout=2).status_code == 200:
                    waiting.remove(child)
            except httpx.HTTPError:
                pass
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout:.0f} s: {', '.join(c.name for c in waiting)}")
        if waiting:
            time.sleep(0.5)


def stop(children: list[Child], timeout: float) -> None:
    """SIGTERM to each, SIGKILL to what still runs after `timeout` seconds."""
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"infercept replicas: {child.name} did not stop in {timeout:.0f} s; killing it",
                  file=sys.stderr, flush=True)
            child.signal(signal.SIGKILL)
            child.proc.wait()


class Stop(Exception):
    pass


def port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def router_workers(router: Child, action: str, url: str) -> None:
    """`action` (add_worker, remove_worker) `url` on the running router; raises unless it answers 2xx."""
    import httpx

    response = httpx.post(f"{router.url}/{action}", params={"url": url}, timeout=30)
    if response.status_code >= 300:
        raise RuntimeError(f"the router refused {action} {url}: {response.status_code} {response.text[:200]}")


def build_parser() -> argparse.ArgumentParser:
    env = lambda name, default: os.environ.get(f"INFERCEPT_{name}") or default  # noqa: E731
    p = argparse.ArgumentParser(
        prog="python -m infercept.server.replicas", allow_abbrev=False,
        description="N `infercept serve` replicas behind vllm-router on one URL. Arguments after `--` go to "
                    "every `infercept serve` (engine and server flags; not --port or --threads).")
    p.add_argument("--replicas", type=int, default=int(env("REPLICAS", 2)), help="how many (default 2)")
    p.add_argument("--host", default=env("HOST", "127.0.0.1"), help="the router's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(env("PORT", 8000)), help="the router's port (default 8000)")
    p.add_argument("--base-port", type=int, default=None,
                   help="the first replica's port; the others follow (default: --port + 1)")
    p.add_argument("--replica-host", default=env("REPLICA_HOST", "127.0.0.1"),
                   help="the replicas' address (default 127.0.0.1: the router is the way in); 0.0.0.0 in a "
                        "container lets a Prometheus beside it scrape each replica's /metrics")
    p.add_argument("--threads", type=int, default=int(env("THREADS", 1)),
                   help="torch CPU threads of each replica (default 1)")
    p.add_argument("--router-policy", choices=ROUTER_POLICIES, default="cache_aware",
                   help="cache_aware (default): an implicit resume (the conversation sent again) goes to the "
                        "replica that served its prefix; kv_aware: a request with an X-Session-Id header goes "
                        "to the replica of its session (chat sessions, Responses chains); the others keep no "
                        "conversation on its replica")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="cache_aware: the share of a request's text its best replica must have seen for the "
                        "request to go there rather than to the least loaded replica (default 0.5; a resume "
                        "shares ~90%% or more, a new conversation only what it has in common with others)")
    p.add_argument("--affinity-ttl", type=float, default=3600,
                   help="kv_aware: seconds an idle X-Session-Id stays bound to its replica (default 3600, the "
                        "server's --response-ttl; sessions live --idle-ttl, 600 s)")
    p.add_argument("--metrics-port", type=int, default=29000, help="the router's Prometheus port (default 29000)")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for vllm-router, e.g. --router-arg=--retry-max-retries=3 (repeat)")
    p.add_argument("--log-dir", default=None,
                   help="write each process's output to <dir>/replica-<port>.log and router.log instead of "
                        "this terminal")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for health (default 900)")
    p.add_argument("--no-restart", dest="restart", action="store_false",
                   help="leave a replica that exits stopped (default: start it again)")
    return p


def serve_options(serve_args: list[str]) -> argparse.Namespace:
    """`infercept serve`'s options with these flags (and the INFERCEPT_* variables). A flag `serve`
    refuses stops the launcher here, with `serve`'s message, before anything starts."""
    from infercept.server import cli

    return cli.build_parser().parse_args(["serve", *serve_args])


def gpus_per_replica(options: argparse.Namespace, backend: str) -> int | None:
    """The GPUs one replica uses (vLLM's tensor x pipeline parallel size); None where its flags name its
    device themselves (`--device cpu` or `cuda:N`)."""
    if backend == "vllm":
        return (options.tensor_parallel_size or 1) * (options.pipeline_parallel_size or 1)
    return 1 if options.device in ("auto", "cuda") else None


def visible_gpus() -> list[str]:
    """The NVIDIA GPUs the launcher may hand out: CUDA_VISIBLE_DEVICES' entries where it is set (indices
    or UUIDs, up to the first invalid one, as CUDA reads it), else every GPU `nvidia-smi -L` lists; none
    without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        gpus = []
        for entry in (e.strip() for e in named.split(",")):
            if not entry or entry.startswith("-"):
                break
            gpus.append(entry)
        return gpus
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, _ in enumerate(line for line in listed.splitlines() if line.startswith("GPU "))]


def gpu_sets(gpus: list[str], per_replica: int | None) -> list[str]:
    """`gpus` cut into disjoint sets of `per_replica` (CUDA_VISIBLE_DEVICES values), in order: one per
    replica, as far as they go; none where the replicas' flags pick their devices themselves."""
    if not per_replica:
        return []
    return [",".join(gpus[i:i + per_replica]) for i in range(0, len(gpus) - per_replica + 1, per_replica)]


def memory_share_args(serve_args: list[str], replicas: int, backend: str) -> list[str]:
    """The serve flags that give each of N replicas on one machine 1/N of what a lone server takes, where
    the flags and the environment leave it to the defaults (`backend`: the one `serve` runs, native or vllm):
    * the default KV pool (`--kv-cache-fraction`): every replica sees the memory free at its start,
      before the others fill their pools (or, on a GPU, load their weights), so N of them taking a lone
      server's share each would together take N times it (and the prefix cache does fill a pool). A
      quarter of the device shared N ways, a CPU's or a GPU's (`SHARED_KV_CACHE_FRACTION`), fits whatever
      order they start in;
    * under `--backend vllm`, vLLM's share of the GPU (`--gpu-memory-utilization`, a fraction of the
      card's whole memory, model included): vLLM refuses to start where less than that is free, so a
      second replica at a lone server's share would not start. (Ignored on a CPU, where the KV pool is
      sized as the native engine's.)"""
    from infercept.engine import SHARED_KV_CACHE_FRACTION

    def given(flags: tuple[str, ...], names: tuple[str, ...]) -> bool:
        return any(a.split("=")[0] in flags for a in serve_args) or any(os.environ.get(f"INFERCEPT_{n}") for n in names)

    if replicas == 1:
        return []
    share = []
    if not given(("--kv-cache-gb", "--kv-cache-fraction"), ("KV_CACHE_GB", "KV_CACHE_FRACTION")):
        share += ["--kv-cache-fraction", f"{SHARED_KV_CACHE_FRACTION / replicas:.4g}"]
    if backend == "vllm" and not given(("--gpu-memory-utilization",), ("GPU_MEMORY_UTILIZATION",)):
        share += ["--gpu-memory-utilization", f"{VLLM_GPU_MEMORY_UTILIZATION / replicas:.4g}"]
    return share


def start_fleet(new_replica: Callable[[int], Child], ports: list[int], timeout: float, one_at_a_time: bool,
                started: list[Child]) -> None:
    """A replica on each port, into `started` (which the caller stops if this raises), until every one
    answers /health. `one_at_a_time`: each starts once the one before is healthy, as vLLM needs on one
    GPU: an instance sizes its KV cache by how the device's free memory changes while it loads and
    profiles, so two starting together each count the other's model as their own (vLLM's KV cache shrinks,
    or it stops with "No available memory for the cache blocks")."""
    for port in ports:
        started.append(new_replica(port))
        if one_at_a_time:
            wait_ok(started[-1:], "/health", timeout)
    wait_ok(started, "/health", timeout)


def restart_exited(replicas: list[Child], one_at_a_time: bool, timeout: float, min_interval: float = 10.0) -> None:
    """Start again each replica that exited, at most once every `min_interval` seconds each (not in a tight
    loop if it cannot start at all). `one_at_a_time` (vLLM replicas sharing a GPU, which a GPU fault
    ends together): each once the one before is healthy again, as at the fleet's start (`start_fleet`)."""
    for r in replicas:
        if r.running():
            continue
        print(f"infercept replicas: {r.name} exited with status {r.proc.returncode}; its paused generations are "
              f"lost, the router sends its requests to the others; starting it again", file=sys.stderr, flush=True)
        time.sleep(max(0.0, min_interval - (time.monotonic() - r.started)))
        r.start()
        if one_at_a_time:
            try:
                wait_ok([r], "/health", timeout)
            except (RuntimeError, TimeoutError) as e:  # (it is started again on a later round)
                print(f"infercept replicas: {r.name} did not come back: {e}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["replica"]:
        return replica(argv[1:])
    serve_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1:]
    args = build_parser().parse_args(argv)
    if args.replicas < 1:
        raise SystemExit("infercept replicas: --replicas must be at least 1")
    if any(a.split("=")[0] in ("--port", "--threads", "--host") for a in serve_args):
        raise SystemExit("infercept replicas: give --port, --threads and --host to the launcher, not after --")
    exe = router_executable()
    if exe is None:
        raise SystemExit(f"infercept replicas: {ROUTER_PACKAGE} is not installed: pip install 'infercept[router]' "
                         f"(or make serve REPLICAS=N, which installs it)")
    from infercept.server import cli

    options = serve_options(serve_args)
    backend = cli.chosen_backend(options)
    # A GPU (or vLLM's tensor x pipeline set) of its own for each replica where there are enough; else they
    # share the device, each with its share of the memory, vLLM's starting one at a time.
    gpus = visible_gpus()
    sets = gpu_sets(gpus, gpus_per_replica(options, backend))
    sets = sets if len(sets) >= args.replicas else []
    if not sets:
        serve_args = memory_share_args(serve_args, args.replicas, backend) + serve_args
    one_at_a_time = backend == "vllm" and bool(gpus) and not sets
    base = args.base_port or args.port + 1
    ports = [base + i for i in range(args.replicas)]
    logs = Path(args.log_dir) if args.log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)

    def log(name: str):
        return open(logs / f"{name}.log", "a", buffering=1) if logs else None

    def on_signal(sig, frame):
        raise Stop(signal.Signals(sig).name)

    fleet_dir = tempfile.mkdtemp(prefix="infercept-fleet-")
    fleet_file, fleet_token = os.path.join(fleet_dir, "fleet.json"), secrets.token_hex(16)

    def new_replica(port: int, gpus: str | None) -> Child:
        return Child(f"replica :{port}", [sys.executable, "-m", "infercept.server.replicas", "replica",
                                          "--fleet", fleet_file,
                                          "--host", args.replica_host, "--port", str(port),
                                          "--threads", str(args.threads), *serve_args],
                     f"http://127.0.0.1:{port}", log(f"replica-{port}"), gpus)

    def scale(step: int) -> None:
        """One replica more (step 1) or fewer (-1), the router told; never below one."""
        if step > 0:
            taken = {r.gpus for r in replicas}
            free_sets = [gpus for gpus in sets if gpus not in taken]
            if sets and not free_sets:
                print("infercept replicas: no replica added: each GPU has one", file=sys.stderr, flush=True)
                return
            port = max(int(r.url.rsplit(":", 1)[1]) for r in replicas) + 1
            while not port_free(port):
                port += 1
            child = new_replica(port, free_sets[0] if sets else None)
            try:
                wait_ok([child], "/health", args.startup_timeout)
                router_workers(router, "add_worker", child.url)
            except (RuntimeError, TimeoutError) as e:  # the fleet serves on as it was
                stop([child], 60)
                print(f"infercept replicas: {child.name} not added: {e}", file=sys.stderr, flush=True)
                return
            replicas.append(child)
            write_fleet(fleet_file, fleet_token, [r.url for r in replicas])
            print(f"infercept replicas: {child.name} added ({len(replicas)} replicas)", flush=True)
        elif len(replicas) > 1:
            child = replicas[-1]
            try:
                router_workers(router, "remove_worker", child.url)
            except RuntimeError as e:
                print(f"infercept replicas: {child.name} not removed: {e}", file=sys.stderr, flush=True)
                return
            replicas.pop()
            write_fleet(fleet_file, fleet_token, [r.url for r in replicas])
            stop([child], 60)
            print(f"infercept replicas: {child.name} removed and stopped ({len(replicas)} replicas)", flush=True)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    scaling: list[int] = []  # signals in, handled by the loop (not inside the handler: it starts processes)
    signal.signal(signal.SIGTTIN, lambda sig, frame: scaling.append(1))
    signal.signal(signal.SIGTTOU, lambda sig, frame: scaling.append(-1))
    replicas: list[Child] = []
    router: Child | None = None
    status = 0
    try:
        write_fleet(fleet_file, fleet_token, [f"http://127.0.0.1:{port}" for port in ports])
        print(f"infercept replicas: starting {args.replicas} on ports {ports[0]}-{ports[-1]} "
              f"({args.threads} thread{'s' * (args.threads != 1)} each"
              f"{', GPUs ' + ' | '.join(sets[:args.replicas]) if sets else ''}{', one at a time' * one_at_a_time}) ...",
              file=sys.stderr, flush=True)
        gpus_of = dict(zip(ports, sets))  # (none without GPUs of their own)
        start_fleet(lambda port: new_replica(port, gpus_of.get(port)), ports, args.startup_timeout, one_at_a_time,
                    replicas)
        workers = [r.url for r in replicas]
        router = Child("router", router_argv(exe, workers, args.host, args.port, args.router_policy,
                                             args.metrics_port, args.cache_threshold, args.affinity_ttl,
                                             args.router_arg),
                       f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}",
                       log("router"))
        wait_ok([router], "/readiness", 120)
        print(f"infercept replicas: serving on http://{args.host}:{args.port}/v1 ({ROUTER_PACKAGE}, "
              f"{args.router_policy}; replicas {', '.join(workers)})", flush=True)
        while True:
            time.sleep(0.5)
            while scaling:
                scale(scaling.pop(0))
            if not router.running():
                raise RuntimeError(f"the router exited with status {router.proc.returncode}; stopping")
            if args.restart:
                restart_exited(replicas, one_at_a_time, args.startup_timeout)
    except Stop as stopped:
        print(f"infercept replicas: stopping ({stopped})", file=sys.stderr, flush=True)
    except (RuntimeError, TimeoutError) as e:
        print(f"infercept replicas: {e}", file=sys.stderr, flush=True)
        status = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if router is not None:
            stop([router], 15)
        stop(replicas, 60)
        shutil.rmtree(fleet_dir, ignore_errors=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
