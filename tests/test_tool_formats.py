"""Every tool-call format the engine parses -- llama3_json, mistral (both forms), pythonic, qwen3_coder,
glm45, deepseek_v31 -- parsed, paused, streamed and forced, for tool_choice auto, "required" and a named
tool (Hermes has its own tests: test_guided_decoding.py, test_server.py).

Each format gets a tiny random model of its family, built here: transformers' Llama or Mistral model
with random weights, a byte-level BPE tokenizer trained on a few sentences whose call markers
(``<|python_tag|>``, ``[TOOL_CALLS]``, ``[ARGS]``, ``<|eot_id|>``...) are special tokens as in the real
vocabularies, and a chat template written for this test after the family's own (how it shows tools,
renders a past call and opens the assistant's turn). A random model calls nothing on its own, so:

* **auto**: the turn is made to write one call in the family's form, markers as their special tokens
  (a test grammar that allows exactly that text): the engine must parse it from the tokens, pause on it
  and report the call;
* **required / named**: the format's own prefill and grammar (`ToolFormat`, as the server uses them)
  must make the model's free choices -- which tool, which arguments -- a valid call of an allowed tool
  (arguments valid under its schema), on which the engine pauses;
* **none**: the no-call grammar must refuse every way the format opens a call.

The server's streaming of grammar-written calls and the resume of the paused turn are checked on a
live server per format. tests/test_vllm_tool_formats.py runs the same turns and server checks on the
vLLM backend.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, PreTrainedTokenizerFast

from infercept.engine import Engine, SamplingParams
from infercept.engine.call_formats import MistralArgsWriter, MistralWriter
from infercept.engine.request import InterceptParams
from infercept.engine.sampling_params import GuidedDecodingParams
from infercept.engine.tool_format import ToolFormat, ToolSpec
from infercept.engine.tool_parsers import parser_for_model
from live_server import MODEL, LiveServer, profile
from stdlib_only import non_stdlib_imports
from test_architectures import randomize

# -- the tools ---------------------------------------------------------------------------------------

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"], "properties": {
    "city": {"enum": ["Paris", "Oslo", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
ALARM = {"type": "object", "additionalProperties": False, "required": ["hour", "period"], "properties": {
    "hour": {"type": "integer", "minimum": 1, "maximum": 12}, "period": {"enum": ["am", "pm"]},
    "label": {"type": "string", "maxLength": 6}}}
TOOLS = (ToolSpec.function("get_weather", WEATHER, "Get the weather in a city"),
         ToolSpec.function("set_alarm", ALARM, "Set an alarm clock"),
         ToolSpec.function("clock", None, "The time now"))
SCHEMAS = {t.name: t.arguments_schema for t in TOOLS}
OPENAI_TOOLS = [dict(t.definition) for t in TOOLS]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- the families ------------------------------------------------------------------------------------

LLAMA31_TEMPLATE = r"""
{{- bos_token + '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023<|eot_id|>' }}
{%- if tools is not none %}
{{- '<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON ' }}
{{- 'for a function call with its proper arguments that best answers the given prompt.\n\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. ' }}
{{- 'Do not use variables.\n\n' }}
{%- for t in tools %}{{- t | tojson }}{{- '\n\n' }}{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- if message.tool_calls | length != 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- if builtin_tools is defined and call.name in builtin_tools %}{{- '<|python_tag|>' + call.name + '.call()' }}
{%- else %}{{- '{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}' }}{%- endif %}
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# Mistral up to v7 (Mistral-7B-Instruct-v0.3): a JSON list after [TOOL_CALLS]; tools before the last user
# turn, so a conversation's rendering moves them and is no prefix of its continuation's (no resume).
MISTRAL_TEMPLATE = r"""
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message.tool_calls %}
{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] ' + ({'content': message.content} | tojson) + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
"""

# Mistral v11+ (Mistral Small 3.2, Magistral, Devstral): [TOOL_CALLS]name[ARGS]{...} per call.
MISTRAL_ARGS_TEMPLATE = r"""
{{- bos_token }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '[INST]' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- for call in message.tool_calls %}
{{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' + (call.function.arguments | tojson) }}
{%- endfor %}
{{- eos_token }}
{%- elif message.role == 'assistant' %}
{{- message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
"""

# vLLM's Llama 3.2 pythonic template, shortened.
PYTHONIC_TEMPLATE = r"""
{{- bos_token + '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}
{{- 'You are an expert in composing functions. If you decide to invoke any of the function(s), you MUST put ' }}
{{- 'it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), ' }}
{{- 'func_name2(params)]\nYou SHOULD NOT include any other text in the response.\n\n' }}
{{- 'Here is a list of functions in JSON format that you can invoke.\n' }}
{{- tools | tojson }}
{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n[' }}
{%- for call in message.tool_calls %}
{{- call.function.name + '(' }}
{%- for name, value in call.function.arguments.items() %}
{{- name + '=' + (value | tojson) }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ')' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# Qwen3-Coder's template, shortened: the tools as JSON in a <tools> block (Qwen's lists them in XML, with an
# example call), each past call as <function=...> of <parameter=...> elements, a value as text (JSON for
# objects and lists). (Short enough that the prompt is one prefill chunk on the vLLM backend: vLLM 0.32's
# CPU worker fails a seeded request whose prompt takes several chunks, "CPU Generator does not use offset".)
QWEN3_CODER_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{{- '\n<tool_call>\n<function=' + call.function.name + '>\n' }}
{%- for name, value in call.function.arguments | items %}
{{- '<parameter=' + name + '>\n' }}
{{- value | tojson if value is mapping or (value is sequence and value is not string) else value | string }}
{{- '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# GLM-4.5's template, shortened: the tools as JSON in a <tools> block, each past call as its name then
# <arg_key>/<arg_value> pairs, each after a newline; a value as text (JSON for what is not a string). A turn
# has no end of its own: the next message's role opens there, and the model ends a turn with the role it
# waits for (<|observation|> after calls).
GLM45_TEMPLATE = r"""
{{- '[gMASK]<sop>' }}
{%- if tools %}
{{- '<|system|>\n# Tools\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|assistant|>\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{{- '\n<tool_call>' + call.function.name + '\n' }}
{%- for name, value in call.function.arguments | items %}
{{- '<arg_key>' + name + '</arg_key>\n<arg_value>' }}
{{- value | tojson if value is not string else value }}
{{- '</arg_value>\n' }}
{%- endfor %}
{{- '</tool_call>' }}
{%- endfor %}
{%- elif message.role == 'tool' %}
{{- '<|observation|>\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- else %}
{{- '<|' + message.role + '|>\n' + message.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}
"""
GLM_SPECIAL = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]

# DeepSeek-V3.1's template, shortened (non-thinking: its generation prompt closes the thinking): the tools as
# JSON, each past call's arguments as JSON between its markers, all of a turn's calls in one section.
DEEPSEEK_V31_TEMPLATE = r"""
{{- bos_token }}
{%- if tools %}{{- '## Tools\n' }}{%- for tool in tools %}{{- (tool | tojson) + '\n' }}{%- endfor %}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<｜User｜>' + message.content }}
{%- elif message.role == 'assistant' %}
{{- '<｜Assistant｜></think>' + (message.content or '') }}
{%- if message.tool_calls %}
{{- '<｜tool▁calls▁begin｜>' }}
{%- for call in message.tool_calls %}
{{- '<｜tool▁call▁begin｜>' + call.function.name + '<｜tool▁sep｜>' + (call.function.arguments | tojson) }}
{{- '<｜tool▁call▁end｜>' }}
{%- endfor %}
{{- '<｜tool▁calls▁end｜>' }}
{%- endif %}
{{- '<｜end▁of▁sentence｜>' }}
{%- elif message.role == 'tool' %}
{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜></think>' }}{%- endif %}
"""
DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]

LLAMA_SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|python_tag|>"]
MISTRAL_SPECIAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


@dataclass(frozen=True)
class Family:
    parser: str  # the tool parser (and the format's family)
    template: str
    special: list[str]
    bos: str
    eos: str
    config: type
    auto_call: str  # a call as the family's model writes it, markers and all
    parallel: bool  # the family writes several calls in one turn
    resumes: bool = True  # the template renders a conversation as a prefix of its continuation


FAMILIES = {
    "llama3_json": Family("llama3_json", LLAMA31_TEMPLATE, LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>",
                          LlamaConfig, '{"name": "get_weather", "parameters": {"city": "Paris"}}', False),
    "mistral": Family("mistral", MISTRAL_TEMPLATE, MISTRAL_SPECIAL, "<s>", "</s>", MistralConfig,
                      '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                      '{"name": "clock", "arguments": {}}]', True, resumes=False),
    "mistral_args": Family("mistral", MISTRAL_ARGS_TEMPLATE, MISTRAL_SPECIAL + ["[ARGS]"], "<s>", "</s>",
                           MistralConfig, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]clock[ARGS]{}',
                           True),
    "pythonic": Family("pythonic", PYTHONIC_TEMPLATE, LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", LlamaConfig,
                       '[get_weather(city="Paris"), clock()]', True),
    "qwen3_coder": Family("qwen3_coder", QWEN3_CODER_TEMPLATE, QWEN_SPECIAL, "<|endoftext|>", "<|im_end|>",
                          LlamaConfig, "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                          "</function>\n</tool_call>\n<tool_call>\n<function=clock>\n</function>\n</tool_call>", True),
    "glm45": Family("glm45", GLM45_TEMPLATE, GLM_SPECIAL, "[gMASK]", "<|observation|>", LlamaConfig,
                    "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
                    "\n<tool_call>clock\n</tool_call>", True),
    "deepseek_v31": Family("deepseek_v31", DEEPSEEK_V31_TEMPLATE, DEEPSEEK_SPECIAL, "<｜begin▁of▁sentence｜>",
                           "<｜end▁of▁sentence｜>", LlamaConfig,
                           '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                           "<｜tool▁call▁end｜><｜tool▁call▁begin｜>clock<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
                           "<｜tool▁calls▁end｜>", True),
}
AUTO_CALLS = {"llama3_json": [("get_weather", {"city": "Paris"})]}  # others: get_weather, then clock

CORPUS = ["what is the weather in paris today", "the sky is clear and the temperature is warm",
          "set an alarm clock for seven in the morning", "the time now is half past nine",
          '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
          '{"name": "set_alarm", "arguments": {"hour": 7, "period": "am", "label": "wake"}}',
          '[get_weather(city="Oslo", days=2), set_alarm(hour=7, period="pm"), clock()]',
          '{"type": "function", "function": {"name": "clock", "description": "The time now", "parameters": '
          '{"type": "object", "properties": {}, "required": [], "additionalProperties": false}}}']


def build_family(folder, family: Family, head_dim: int | None = None) -> None:
    """The family's tiny model in `folder`; `head_dim` None: hidden size / heads (16)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=600, special_tokens=family.special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    others = [s for s in family.special if s not in (family.bos, family.eos)]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=family.bos, eos_token=family.eos,
                                   pad_token=family.eos, additional_special_tokens=others)
    fast.chat_template = family.template.strip()
    fast.save_pretrained(folder)
    # Full attention, as Mistral-7B-v0.3 and Mistral Small ship (MistralConfig's default is a sliding
    # window, a KV cache the vLLM backend's policies do not serve).
    window = {"sliding_window": None} if family.config is MistralConfig else {}
    config = family.config(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim or 16,
                           max_position_embeddings=4096,
                           rms_norm_eps=1e-6, tie_word_embeddings=False,
                           bos_token_id=fast.convert_tokens_to_ids(family.bos),
                           eos_token_id=fast.convert_tokens_to_ids(family.eos), **window)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed=0)  # logits far apart: greedy choices are no near-ties
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    dirs = {}
    for name, family in FAMILIES.items():
        dirs[name] = str(tmp_path_factory.mktemp(f"tiny-{name}"))
        build_family(dirs[name], family)
    return dirs


@pytest.fixture(scope="module")
def tokenizers(family_dirs):
    return {name: AutoTokenizer.from_pretrained(folder) for name, folder in family_dirs.items()}


@pytest.fixture(scope="module")
def engines(family_dirs):
    return {name: Engine(folder, dtype="float32", kv_cache_gb=0.02, host_kv_gb=0.001, max_num_batched_tokens=256,
                         policy="preserve", profile=profile(), progress=False, num_threads=1)
            for name, folder in family_dirs.items()}


def tool_format(tokenizer, name: str) -> ToolFormat:
    return ToolFormat.for_tokenizer(FAMILIES[name].parser, tokenizer)


# -- the format: chosen from the template, grammars that accept and refuse ---------------------------

def test_each_template_picks_its_format(tokenizers):
    for name, tokenizer in tokenizers.items():
        model_type = "mistral" if FAMILIES[name].config is MistralConfig else "llama"
        assert parser_for_model(model_type, tokenizer.chat_template) == FAMILIES[name].parser, name
        fmt = tool_format(tokenizer, name)
        if FAMILIES[name].parser == "mistral":  # the form the template writes
            assert type(fmt.writer) is (MistralArgsWriter if name == "mistral_args" else MistralWriter)
            assert set(fmt.writer.token_ids) == {"[TOOL_CALLS]", "[ARGS]"} & set(FAMILIES[name].special)


def matcher_for(tokenizer):
    ll = llguidance.hf.from_tokenizer(tokenizer, eos_token=[tokenizer.eos_token_id])

    def accepts(lark: str, text: str) -> bool:
        """The grammar lets a model write `text` (special tokens as tokens) and end there."""
        matcher = llguidance.LLMatcher(ll, GuidedDecodingParams(lark=lark).grammar)
        assert not matcher.is_error(), matcher.get_error()
        return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()
    return accepts


def written(name: str, calls: list[tuple[str, dict]]) -> str:
    """`calls` in the form the format's grammars write."""
    if name == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if name == "mistral":
        return "[TOOL_CALLS] [" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]"
    if name == "mistral_args":
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    if name == "qwen3_coder":
        return "".join(f"\n<tool_call>\n<function={n}>\n" + "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in a.items())
            + "</function>\n</tool_call>" for n, a in calls)
    if name == "deepseek_v31":
        return ("<｜tool▁calls▁begin｜>" + "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>"
                                                 for n, a in calls) + "<｜tool▁calls▁end｜>")
    if name == "glm45":
        return "".join(f"\n<tool_call>{n}\n" + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
            for k, v in a.items()) + "</tool_call>" for n, a in calls)
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items()) + ")"
                           for n, a in calls) + "]"


GOOD = [("get_weather", {"city": "Oslo", "days": 2}), ("set_alarm", {"hour": 7, "period": "am", "label": "wake"}),
        ("clock", {})]
BAD = {"unknown tool": [("launch", {})], "bad enum": [("get_weather", {"city": "Lima"})],
       "missing required": [("set_alarm", {"hour": 7})], "out of range": [("set_alarm", {"hour": 13, "period": "am"})],
       "extra property": [("get_weather", {"city": "Oslo", "when": 1})]}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_forced_grammars_allow_exactly_the_valid_calls(name, tokenizers):
    tokenizer = tokenizers[name]
    fmt, accepts = tool_format(tokenizer, name), matcher_for(tokenizer)
    parallel = FAMILIES[name].parallel

    def forced(tool_name: str | None, calls, parallel_calls: bool = parallel) -> bool:
        prefill, text = fmt.forced_prefill(tool_name), written(name, calls)
        if not text.startswith(prefill):
            return False
        return accepts(fmt.forced_grammar(TOOLS, tool_name, parallel_calls), text[len(prefill):])

    for call in GOOD:
        assert forced(None, [call]), call  # "required": any tool
        assert forced(call[0], [call], False), call  # named: that tool
        for other in TOOLS:
            if other.name != call[0]:
                assert not forced(other.name, [call], False), (other.name, call)
    assert forced(None, GOOD) is parallel  # several calls where the family writes them
    assert not forced(None, GOOD[:2], False)
    for what, calls in BAD.items():
        assert not forced(None, calls), what
        if calls[0][0] in SCHEMAS:
            assert not forced(calls[0][0], calls, False), what
    assert not forced(None, [])  # a forced turn calls


def test_glm47s_compact_calls_are_written_where_its_template_writes_them(tokenizers):
    """GLM-4.7's template writes a call's tags without newlines: so do the format's prefill and grammar,
    and its partial calls read that form."""
    template = "{{- '<tool_call>' + tc.name }}{% for k, v in args %}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}" \
               "</arg_value>{% endfor %}</tool_call>"
    fmt, accepts = ToolFormat("glm47", template), matcher_for(tokenizers["glm45"])
    assert parser_for_model("glm4_moe", template) == "glm45" and fmt.forced_prefill("clock") == "<tool_call>clock"
    compact = written("glm45", GOOD).replace("\n", "")
    prefill = fmt.forced_prefill(None)
    assert compact.startswith(prefill) and accepts(fmt.forced_grammar(TOOLS, None, True), compact[len(prefill):])
    assert not accepts(fmt.forced_grammar(TOOLS, None, True), written("glm45", GOOD)[len(prefill) + 1:])
    assert [(c.name, json.loads(c.arguments)) for c in fmt.partial_calls(compact, TOOLS)] == GOOD


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_no_call_grammar_refuses_every_call_opening(name, tokenizers):
    tokenizer = tokenizers[name]
    fmt, accepts = tool_format(tokenizer, name), matcher_for(tokenizer)
    grammar = fmt.no_call_grammar()
    for calls in ([GOOD[0]], GOOD):
        text = written(name, calls)
        assert not accepts(grammar, text), text
        assert not accepts(grammar, "  " + text)
    opening = {"llama3_json": ["{", "<|python_tag|>", "The answer<|python_tag|>"],
               "mistral": ["[TOOL_CALLS]", "Sure.[TOOL_CALLS]"], "mistral_args": ["[TOOL_CALLS]", "Sure.[TOOL_CALLS]"],
               "pythonic": ["[", " [clock()]", "<|python_tag|>"],
               "qwen3_coder": ["<tool_call>", "\n<tool_call>", "Sure.\n<tool_call>"],
               "glm45": ["<tool_call>", "\n<tool_call>", "Sure.\n<tool_call>clock"],
               "deepseek_v31": ["<｜tool▁calls▁begin｜>", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"]}[name]
    for text in opening:
        assert not accepts(grammar, text), text
    for text in ("", "The weather in Paris is clear.", "Use [links](x) and {braces}; [1, 2]."):
        assert accepts(grammar, text), text


@pytest.mark.parametrize("name", list(FAMILIES))
def test_answer_or_call_grammar(name, tokenizers):
    tokenizer = tokenizers[name]
    fmt, accepts = tool_format(tokenizer, name), matcher_for(tokenizer)
    answer = {"type": "object", "required": ["answer"], "additionalProperties": False,
              "properties": {"answer": {"type": "string", "maxLength": 8}}}
    grammar = fmt.answer_or_call_grammar(TOOLS, FAMILIES[name].parallel, answer)
    for call in GOOD:
        assert accepts(grammar, written(name, [call])), call
    assert accepts(grammar, '{"answer": "sunny"}')
    assert not accepts(grammar, '{"answer": "sunny", "x": 1}') and not accepts(grammar, "It is sunny.")
    assert not accepts(grammar, written(name, BAD["bad enum"]))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_partial_calls_follow_written_calls(name, tokenizers):
    """What a stream shows while a grammar writes the calls: each call once its name is complete, its
    arguments as far as written (JSON forms) or once it is complete (pythonic), never more than written."""
    fmt = tool_format(tokenizers[name], name)
    calls = GOOD if FAMILIES[name].parallel else GOOD[:1]
    text = written(name, calls)
    final = fmt.partial_calls(text)
    assert [(c.name, json.loads(c.arguments), c.complete) for c in final] == [(n, a, True) for n, a in calls]
    shown = []
    for i in range(len(text) + 1):
        partial = fmt.partial_calls(text[:i])
        assert len(partial) >= len(shown)
        for before, now, whole in zip(shown, partial, final):
            assert now.name == whole.name and whole.arguments.startswith(now.arguments)
            assert now.arguments.startswith(before.arguments)
        shown = partial
    assert fmt.partial_calls("The weather is " + text) == []


@pytest.mark.parametrize("name, text, shown", [
    ("llama3_json", "The weather is clear.", "The weather is clear."),
    ("llama3_json", '{"name": "clock"', ""),
    ("llama3_json", "Let me check.<|python_", "Let me check."),
    ("mistral", "Let me check.[TOOL_CALLS] [", "Let me check."),
    ("mistral_args", "Sure [TOOL_C", "Sure"),
    ("pythonic", "[clock(", ""),
    ("pythonic", "  [", ""),
    ("pythonic", "<|python_st", ""),
    ("pythonic", "See [the docs](x) and [1, 2].", "See [the docs](x) and [1, 2]."),
    ("qwen3_coder", "Let me check.\n<tool_", "Let me check."),
    ("qwen3_coder", "Use <b>bold</b> <function=x>.", "Use <b>bold</b> <function=x>."),
    ("glm45", "Let me check.\n<tool_ca", "Let me check."),
    ("glm45", "Use <arg_key> as a word.", "Use <arg_key> as a word."),
    ("deepseek_v31", "Let me check.<｜tool▁calls▁begin｜>", "Let me check."),
])
def test_what_an_auto_stream_may_show(name, text, shown, tokenizers):
    """An auto turn streams text the format can tell is no call (pythonic calls open the message, so
    brackets later on are text)."""
    assert tool_format(tokenizers[name], name).safe_content(text) == shown


def test_pythonic_tools_a_grammar_cannot_write_are_refused():
    fmt = ToolFormat("pythonic")
    with pytest.raises(ValueError, match="keyword"):
        fmt.forced_grammar((ToolSpec.function("f", {"type": "object", "properties": {"first-name": {}},
                                                    "required": ["first-name"]}),), None, True)
    with pytest.raises(ValueError, match="anyOf"):
        fmt.forced_grammar((ToolSpec.function("f", {"anyOf": [{"required": ["a"]}]}),), None, True)
    with pytest.raises(ValueError, match="identifier"):
        fmt.forced_grammar((ToolSpec.function("get-weather"),), None, True)
    # an optional parameter that is no identifier is left out; a $ref resolves against the tool's $defs
    schema = {"type": "object", "properties": {"x-y": {}, "unit": {"$ref": "#/$defs/unit"}}, "required": ["unit"],
              "$defs": {"unit": {"enum": ["c", "f"]}}}
    assert GuidedDecodingParams(lark=fmt.forced_grammar((ToolSpec.function("f", schema),), None, True))


def test_qwen3_coder_tools_a_grammar_cannot_write_are_refused():
    fmt = ToolFormat("qwen3_coder")
    for schema, said in (({"type": "string", "pattern": "^a"}, "enforces enum"),
                         ({"type": ["string", "integer"]}, "strings only or no strings"),
                         ({"type": "string", "enum": ["x", 1]}, "enum holds other values"), ({}, "strings only")):
        with pytest.raises(ValueError, match=said):
            fmt.forced_grammar((ToolSpec.function("f", {"type": "object", "properties": {"a": schema}}),), None, True)
    with pytest.raises(ValueError, match="function name"):
        fmt.forced_grammar((ToolSpec.function("get weather"),), None, True)
    # a $ref resolves against the tool's $defs; a string's length bounds are the grammar's
    schema = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/unit"}, "note": {"type": "string",
              "minLength": 2}}, "required": ["unit"], "$defs": {"unit": {"enum": ["c", "f"]}}}
    assert GuidedDecodingParams(lark=fmt.forced_grammar((ToolSpec.function("f", schema),), None, True))


def test_the_call_writers_import_only_the_standard_library():
    assert non_stdlib_imports(Path(__file__).resolve().parents[1] / "engine" / "call_formats.py") == []


# -- the engine: parsed, paused, forced --------------------------------------------------------------

def auto_grammar(tokenizer, text: str) -> str:
    """A grammar that allows exactly `text`, its special tokens as their tokens (by id)."""
    specials = {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
    pieces = [p for p in re.split("(" + "|".join(map(re.escape, specials)) + ")", text) if p]
    return "start: " + " ".join(f"<[{specials[p]}]>" if p in specials else json.dumps(p) for p in pieces)


def run_turn(engine: Engine, prompt_ids: list[int], params: SamplingParams, intercept: InterceptParams):
    rid = engine.add_request(prompt_ids, params, intercept=intercept)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    out = [o for o in outs if o.request_id == rid][-1]
    if out.paused:
        engine.abort(rid)
    return out


SAMPLINGS = {"greedy": dict(temperature=0), "sampled": dict(temperature=1.0, seed=3)}


def ending_bias(tokenizer) -> dict[int, float]:
    """Logit biases under which a random model ends a string, an object, a list, a call and the turn
    wherever the grammar lets it: the forced grammars allow open objects (`clock` has no parameters
    schema), free strings and parallel calls, which such a model may go on writing until max_tokens (the
    grammar tests above check that longer calls pass). The grammar still decides what may be written;
    the model still picks the tool and the values."""
    closers = [tokenizer.convert_tokens_to_ids(t) for t in ('"', "}", "]", ")")]
    return dict.fromkeys([*closers, tokenizer.eos_token_id], 100.0)


def forced_turn(name: str, mode: str, sampling: str, tokenizer):
    """A turn of `mode` (auto, required, named) as the server would start it on the family's model: the
    prompt ids (prompt and prefill, each tokenized on its own, as the server does), the prefill, the
    sampling and the intercept parameters. Under auto, a test grammar writes the family's call (a random
    model calls nothing by itself)."""
    family = FAMILIES[name]
    fmt = tool_format(tokenizer, name)
    tool_name = "set_alarm" if mode == "named" else None
    prefill = fmt.forced_prefill(tool_name) if mode != "auto" else ""
    prompt = tokenizer.apply_chat_template(QUESTION, tools=OPENAI_TOOLS, tokenize=False, add_generation_prompt=True)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt_ids = encode(prompt) + encode(prefill)
    parallel = family.parallel and mode != "named"
    lark = auto_grammar(tokenizer, family.auto_call) if mode == "auto" else \
        fmt.forced_grammar(TOOLS, tool_name, parallel)
    params = SamplingParams(max_tokens=160, guided=GuidedDecodingParams(lark=lark),
                            logit_bias=ending_bias(tokenizer) if mode != "auto" else None,
                            skip_special_tokens=not fmt.keeps_special_tokens, **SAMPLINGS[sampling])
    intercept = InterceptParams(tool_parser=fmt.family, tools=TOOLS, parallel_calls=parallel, text_prefix=prefill)
    return prompt_ids, prefill, params, intercept


def check_paused_on_calls(name: str, mode: str, out, prefill: str, tokenizer) -> None:
    """`out`, the last output of a `forced_turn`, paused on valid calls of the allowed tools, which are
    the whole turn, after the grammar ended it."""
    fmt = tool_format(tokenizer, name)
    assert out.paused and out.finish_reason == "tool_calls", (out.finish_reason, prefill + out.text)
    assert out.token_ids[-1] == tokenizer.eos_token_id, prefill + out.text  # the grammar ended the turn: EOS
    assert out.content == ""  # nothing but calls (the end-of-sequence token is no content)
    calls = [(c.name, json.loads(c.arguments)) for c in out.tool_calls]
    assert calls, prefill + out.text
    for call_name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[call_name])
    if mode == "auto":
        assert calls == AUTO_CALLS.get(name, [("get_weather", {"city": "Paris"}), ("clock", {})])
    elif mode == "named":
        assert [n for n, _ in calls] == ["set_alarm"]
    else:
        assert len(calls) == 1 or FAMILIES[name].parallel
    # the same text, judged again, is the same verdict (what a stream and the final message agree on)
    assert [(c.name, c.arguments) for c in fmt.parser.parse(prefill + out.text, SCHEMAS).tool_calls] == \
        [(c.name, c.arguments) for c in out.tool_calls]


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("mode", ["auto", "required", "named"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_engine_pauses_on_the_formats_calls(name, mode, sampling, tokenizers, engines):
    prompt_ids, prefill, params, intercept = forced_turn(name, mode, sampling, tokenizers[name])
    check_paused_on_calls(name, mode, run_turn(engines[name], prompt_ids, params, intercept), prefill, tokenizers[name])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tool_choice_none_never_calls(name, tokenizers, engines):
    tokenizer, engine = tokenizers[name], engines[name]
    fmt = tool_format(tokenizer, name)
    prompt = tokenizer.apply_chat_template(QUESTION, tools=OPENAI_TOOLS, tokenize=False, add_generation_prompt=True)
    for seed in range(3):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, skip_special_tokens=False,
                                guided=GuidedDecodingParams(lark=fmt.no_call_grammar()))
        out = run_turn(engine, tokenizer.encode(prompt, add_special_tokens=False), params,
                       InterceptParams(tool_parser=fmt.family, tools=TOOLS))
        assert not out.paused and not out.tool_calls and out.finished
        assert not fmt.parser.parse(out.text).tool_calls and not fmt.parser.pending_call_open(out.text)
        assert not any(t in out.token_ids for t in tokenizer.all_special_ids if t != tokenizer.eos_token_id)


# -- the server: streamed calls, and the resume of the paused turn -----------------------------------

@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(request, family_dirs):
    server = LiveServer(family_dirs[request.param], "preserve", prefix_caching=False)
    yield request.param, server
    server.close()


def test_streamed_forced_calls_and_their_resume(family_server, tokenizers):
    name, srv = family_server
    check_served_calls(name, srv.client(), tokenizers[name], srv.abort_paused)
    srv.assert_no_leak()


def check_served_calls(name: str, client, tokenizer, abort_paused) -> None:
    """The live server of the family's model (served as MODEL): forced calls streamed and returned, the
    request with a call's result resuming the paused turn, auto under a JSON response_format and
    tool_choice none. `abort_paused()` drops the server's paused generations."""
    parallel = FAMILIES[name].parallel
    bias = {str(t): b for t, b in ending_bias(tokenizer).items()}
    for choice in ("required", {"type": "function", "function": {"name": "set_alarm"}}):
        stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=OPENAI_TOOLS, tool_choice=choice,
                                                temperature=0, max_tokens=160, stream=True,
                                                parallel_tool_calls=parallel, logit_bias=bias)
        pieces: dict[int, dict] = {}
        finish, content, deltas = None, "", 0
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = pieces.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] = entry["name"] or (call.function.name if call.function else None)
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
                deltas += bool(call.function and call.function.arguments)
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and content == "", (name, choice, pieces)
        assert pieces and all(p["id"] and p["name"] for p in pieces.values())
        for p in pieces.values():
            jsonschema.validate(json.loads(p["arguments"]), SCHEMAS[p["name"]])
        if choice != "required":
            assert [p["name"] for p in pieces.values()] == ["set_alarm"]
        # JSON arguments stream as the grammar writes them (but "{}", in one piece); a pythonic, qwen3_coder
        # or glm45 call shows once it is complete
        whole = name in ("pythonic", "qwen3_coder", "glm45") or all(p["arguments"] == "{}" for p in pieces.values())
        assert deltas == len(pieces) if whole else deltas > len(pieces)
        abort_paused()

    # non-streamed: the same call, and the request that brings its result resumes the paused turn
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=OPENAI_TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=160, parallel_tool_calls=False,
                                           logit_bias=bias, extra_body={"return_token_ids": True})
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and not message.content
    (call,) = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    paused = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    # The turn was written exactly as the template renders the call: the paused context is the
    # conversation up to the call, rendered (prompt, prefill and generated call, end of turn included).
    assistant = {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}
    generated = tokenizer.decode(paused, skip_special_tokens=False)
    rendered = tokenizer.apply_chat_template(QUESTION + [assistant], tools=OPENAI_TOOLS, tokenize=False)
    if FAMILIES[name].resumes:  # (Qwen's template ends a turn with a newline after its end token; GLM's
        # ends none: the model ends it with the role it waits for, where the tool message opens)
        expected = rendered.removesuffix("\n")
        assert generated == (expected if expected.endswith(FAMILIES[name].eos) else expected + FAMILIES[name].eos)
    else:  # (the tools go before the last user turn: the call's turn alone is compared)
        assert generated.rsplit("[/INST]", 1)[1] == rendered.rsplit("[/INST]", 1)[1]
    conversation = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "clear"}]
    second = client.chat.completions.create(model=MODEL, messages=conversation, tools=OPENAI_TOOLS, temperature=0,
                                            max_tokens=4, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert second.choices[0].finish_reason == "length"
    if FAMILIES[name].resumes:
        assert second.model_extra["prompt_token_ids"][:len(paused)] == paused
        assert second.usage.prompt_tokens_details.cached_tokens == len(paused) - 1
        # and the resumed context is the conversation as the template renders it, nothing doubled
        fresh = tokenizer.apply_chat_template(QUESTION + [assistant, conversation[-1]], tools=OPENAI_TOOLS,
                                              tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(second.model_extra["prompt_token_ids"], skip_special_tokens=False) == fresh
    else:  # served fresh: the paused turn was released
        assert second.usage.prompt_tokens_details.cached_tokens == 0
    assert "clear" in tokenizer.decode(second.model_extra["prompt_token_ids"])

    # auto under a JSON response_format: calls or the JSON answer, whichever the model picks, both valid
    # (the tools whose arguments are bounded: a random model may write an open object's keys forever)
    answer = {"type": "object", "required": ["answer"], "additionalProperties": False,
              "properties": {"answer": {"type": "string", "maxLength": 8}}}
    outcomes = set()
    for seed in range(4):
        out = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=OPENAI_TOOLS[:2], temperature=1.0, seed=seed, max_tokens=160,
            parallel_tool_calls=False, response_format={"type": "json_schema", "json_schema": {
                "name": "answer", "schema": answer}}).choices[0]
        outcomes.add(out.finish_reason)
        if out.finish_reason == "tool_calls":
            for c in out.message.tool_calls:
                jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        else:
            assert out.finish_reason == "stop" and not out.message.tool_calls, out
            jsonschema.validate(json.loads(out.message.content), answer)
        abort_paused()
    assert outcomes <= {"tool_calls", "stop"}

    # tool_choice none: text, never a call
    none = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=OPENAI_TOOLS, tool_choice="none",
                                          temperature=1.0, seed=1, max_tokens=16)
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason in ("stop", "length")
    abort_paused()
