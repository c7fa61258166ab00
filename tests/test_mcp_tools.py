"""MCP tools the server runs itself, against real MCP servers made with the official SDK
(tests/mcp_calc_server.py, over stdio and over streamable HTTP in a subprocess).

The model is scripted (a real small model would not reliably call `calc__multiply`): a user message
`call NAME {json}` makes the scripted engine emit that call and pause; a resume answers
`Result: <the tool message it was given>`. Everything between is the real server: `build_app` with
uvicorn in a thread, driven by the official openai SDK and plain HTTP.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from live_server import serve_in_thread
from scripted_backend import ScriptedBackend

from infercept.engine.backend import ToolCall
from infercept.server.app import build_app
from infercept.server.mcp_config import McpServerConfig, load_mcp_config
from infercept.server.mcp_tools import function_name
from infercept.server.settings import McpSettings, ServerSettings

CALC_SERVER = str(Path(__file__).resolve().parent / "mcp_calc_server.py")
MULTIPLY = 'call {}__multiply {{"a": 6, "b": 7}}'


class McpScriptedBackend(ScriptedBackend):
    """`call NAME {json}` in the last user message: that call, paused. A resume answers with the tool
    message appended to the paused context (as the model's chat template renders it)."""

    async def generate(self, prompt, params, request_id, intercept=None):
        asked = self.tokenizer.decode(prompt).rsplit("<|im_start|>user", 1)[-1]
        match = re.search(r"call (\S+) (\{.*?\})<\|im_end\|>", asked, re.S)
        if match is None or intercept is None:
            async for out in super().generate(prompt, params, request_id, intercept):
                yield out
            return
        self.calls.append(("generate", request_id))
        name, arguments = match.groups()
        raw = f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
        out = self._out(request_id, prompt, raw, paused=True, content="", tool_calls=[ToolCall(name, arguments, raw)])
        self.paused[request_id] = len(prompt) + len(out.token_ids)
        yield out

    async def resume(self, request_id, appended, params=None, intercept=None):
        self.calls.append(("resume", request_id))
        context = self.paused.pop(request_id)
        text = self.tokenizer.decode(appended)
        result = re.search(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text, re.S)
        answer = f"Result: {result.group(1) if result else text}"
        yield self._out(request_id, [0] * (context + len(appended)), answer, finished=True, cached=context)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_http_mcp(port: int) -> subprocess.Popen:
    """The calc MCP server over streamable HTTP on `port`, in a subprocess, once it accepts connections."""
    proc = subprocess.Popen([sys.executable, CALC_SERVER, "http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the HTTP MCP server did not start"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)


@pytest.fixture(scope="module")
def http_mcp():
    """The calc MCP server over streamable HTTP: its URL."""
    port = _free_port()
    proc = _start_http_mcp(port)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(timeout=10)


def _serve(default_model_dir, servers, timeout: float, ttl: float = 300.0):
    backend = McpScriptedBackend(default_model_dir)
    settings = ServerSettings(served_model_name="fake", mcp=McpSettings(servers=tuple(servers), call_timeout_s=timeout,
                                                                         tools_ttl_s=ttl))
    app = build_app(backend, settings)
    server, thread, base = serve_in_thread(app)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    return SimpleNamespace(backend=backend, app=app, server=server, thread=thread, base=base, client=client)


def _stop(srv) -> None:
    srv.server.should_exit = True
    srv.thread.join(timeout=30)
    assert not srv.thread.is_alive()


@pytest.fixture(scope="module")
def mcp_server(default_model_dir, http_mcp, tmp_path_factory):
    """calc over stdio, web over HTTP; down (a closed port) and missing (no such command) unreachable."""
    pidfile = tmp_path_factory.mktemp("mcp") / "calc.pid"
    servers = [McpServerConfig("calc", command=sys.executable, args=(CALC_SERVER, "stdio"),
                               env={"MCP_CALC_PIDFILE": str(pidfile)}),
               McpServerConfig("web", url=http_mcp),
               McpServerConfig("down", url=f"http://127.0.0.1:{_free_port()}/mcp"),
               McpServerConfig("missing", command="/nonexistent/mcp-server")]
    srv = _serve(default_model_dir, servers, timeout=30)
    srv.pidfile = pidfile
    yield srv
    _stop(srv)


def _ask(srv, content: str, server_tools: list[str], **kwargs):
    return srv.client.chat.completions.create(model="fake", messages=[{"role": "user", "content": content}],
                                              extra_body={"server_tools": server_tools}, **kwargs)


@pytest.mark.parametrize("server", ["calc", "web"])  # stdio, streamable HTTP
def test_a_chat_completion_runs_the_mcp_tool_while_the_generation_waits_paused(mcp_server, server):
    before = len(mcp_server.backend.calls)
    r = _ask(mcp_server, MULTIPLY.format(server), [f"mcp:{server}/multiply"])
    assert r.choices[0].message.content == "Result: 42" and r.choices[0].finish_reason == "stop"
    calls = mcp_server.backend.calls[before:]
    assert [kind for kind, _ in calls] == ["generate", "resume"] and calls[0][1] == calls[1][1]  # one paused id
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # the resumed turn reused the paused context


def test_a_session_enables_a_whole_server_and_keeps_the_mcp_result(mcp_server):
    http = httpx.Client(base_url=mcp_server.base + "/v1", timeout=60)
    r = http.post("/sessions", json={"server_tools": ["mcp:calc", "mcp:calc/multiply"]})  # the second: no double
    assert r.status_code == 200, r.text
    assert sorted(r.json()["server_tools"]) == ["calc__fail", "calc__hang", "calc__multiply", "calc__picture",
                                                 "calc__stall"]
    session = r.json()["id"]
    r = http.post(f"/sessions/{session}/messages", json={"content": MULTIPLY.format("calc")})
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == "Result: 42" and len(r.json()["steps"]) == 2
    messages = http.get(f"/sessions/{session}").json()["messages"]
    tool = [m for m in messages if m["role"] == "tool"]
    assert [m["content"] for m in tool] == ["42"]
    assert tool[0]["tool_call_id"] == messages[1]["tool_calls"][0]["id"]


@pytest.mark.parametrize("content, expected", [
    ("call calc__fail {}", "error: MCP tool calc/fail failed: Error executing tool fail"),
    ("call web__fail {}", "error: MCP tool web/fail failed: Error executing tool fail"),
    ('call calc__multiply {"a": 6}', "error: MCP tool calc/multiply failed: Error executing tool multiply"),
    ("call calc__picture {}", "error: MCP tool calc/picture returned no text, only image content"),
])
def test_a_failed_call_is_an_error_result_the_model_reads(mcp_server, content, expected):
    r = _ask(mcp_server, content, ["mcp:calc", "mcp:web"])
    assert r.choices[0].message.content.startswith("Result: " + expected), r.choices[0].message.content
    assert mcp_server.backend.calls[-1][0] == "resume"


@pytest.mark.parametrize("name", ["mcp:nope/multiply", "mcp:calc/nope", "mcp:down/multiply", "mcp:down",
                                  "mcp:missing/multiply"])
def test_tools_of_unknown_or_unreachable_servers_are_a_400(mcp_server, name):
    with pytest.raises(openai.BadRequestError, match="unknown server tool") as refused:
        _ask(mcp_server, MULTIPLY.format("calc"), [name])
    assert refused.value.body["param"] == "server_tools"
    assert httpx.get(mcp_server.base + "/health").status_code == 200  # the server is up all the same


def test_an_unreachable_server_is_a_warning_at_start_up_not_a_failure(default_model_dir, caplog):
    srv = _serve(default_model_dir, [McpServerConfig("down", url=f"http://127.0.0.1:{_free_port()}/mcp")], timeout=5)
    try:
        assert httpx.get(srv.base + "/health").status_code == 200
        assert _ask(srv, "Hi", ["calculator"]).choices[0].message.content == "Hello there."  # other tools still work
        assert any(r.levelname == "WARNING" and "MCP server down" in r.getMessage() and "ConnectError" in r.getMessage()
                   for r in caplog.records)
    finally:
        _stop(srv)


def test_a_server_that_comes_up_later_is_connected_at_the_next_try(default_model_dir):
    port = _free_port()
    srv = _serve(default_model_dir, [McpServerConfig("late", url=f"http://127.0.0.1:{port}/mcp")], timeout=5, ttl=0.5)
    proc = None
    try:
        with pytest.raises(openai.BadRequestError, match="unknown server tool"):
            _ask(srv, MULTIPLY.format("late"), ["mcp:late/multiply"])
        proc = _start_http_mcp(port)
        deadline = time.monotonic() + 30
        while srv.app.state.mcp_tools.connections["late"].client is None:
            assert time.monotonic() < deadline, "not connected after the server came up"
            time.sleep(0.1)
        assert _ask(srv, MULTIPLY.format("late"), ["mcp:late/multiply"]).choices[0].message.content == "Result: 42"
    finally:
        _stop(srv)
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


def test_a_stdio_server_that_dies_is_started_again(default_model_dir, tmp_path):
    pidfile = tmp_path / "calc.pid"
    srv = _serve(default_model_dir, [McpServerConfig("calc", command=sys.executable, args=(CALC_SERVER, "stdio"),
                                                     env={"MCP_CALC_PIDFILE": str(pidfile)})], timeout=10, ttl=0.5)
    try:
        first = pidfile.read_text()
        os.kill(int(first), signal.SIGKILL)
        try:  # at once: an error result, or a 400 between connections; never a 5xx
            r = _ask(srv, MULTIPLY.format("calc"), ["mcp:calc/multiply"])
            assert r.choices[0].message.content.startswith(("Result: error: MCP tool calc/multiply", "Result: 42"))
        except openai.BadRequestError:
            pass
        deadline = time.monotonic() + 30
        while pidfile.read_text() == first or srv.app.state.mcp_tools.connections["calc"].client is None:
            assert time.monotonic() < deadline, "the MCP server was not started again"
            time.sleep(0.1)
        r = _ask(srv, MULTIPLY.format("calc"), ["mcp:calc/multiply"])
        assert r.choices[0].message.content == "Result: 42"
    finally:
        _stop(srv)


def test_a_tool_that_hangs_past_the_timeout_is_an_error_result(default_model_dir, http_mcp):
    srv = _serve(default_model_dir, [McpServerConfig("web", url=http_mcp)], timeout=1.5)
    try:
        r = _ask(srv, 'call web__hang {"seconds": 60}', ["mcp:web/hang"])
        assert r.choices[0].message.content == "Result: error: MCP tool web/hang gave no result within 1.5 s"
        r = _ask(srv, MULTIPLY.format("web"), ["mcp:web/multiply"])  # the connection still serves
        assert r.choices[0].message.content == "Result: 42"
    finally:
        _stop(srv)


def test_the_lifespan_stops_the_stdio_server_before_the_engine(default_model_dir, tmp_path):
    """Closed by the lifespan's shutdown (before the engine's), not left to the event loop's teardown."""
    pidfile = tmp_path / "calc.pid"
    srv = _serve(default_model_dir, [McpServerConfig("calc", command=sys.executable, args=(CALC_SERVER, "stdio"),
                                                     env={"MCP_CALC_PIDFILE": str(pidfile)})], timeout=30)
    pid = int(pidfile.read_text())
    os.kill(pid, 0)  # running while the server runs
    alive_at_engine_shutdown = []
    srv.backend.shutdown = lambda: alive_at_engine_shutdown.append(_alive(pid))
    _stop(srv)
    assert alive_at_engine_shutdown == [False]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_function_names_are_valid_and_tell_tools_apart():
    assert function_name("calc", "multiply") == "calc__multiply"
    odd = [function_name("calc", t) for t in ("a/b", "a b", "a" * 80, "a" * 81)]
    assert all(re.fullmatch(r"[A-Za-z0-9_\-.]{1,64}", n) for n in odd) and len(set(odd)) == len(odd)
    assert odd[0].startswith("calc__a_b_") and function_name("calc", "a/b") == odd[0]  # deterministic


def test_the_config_file_shape(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "calc": {"command": "python", "args": ["s.py"], "env": {"K": "v"}, "autoApprove": []},
        "web": {"type": "http", "url": "http://127.0.0.1:1/mcp", "headers": {"Authorization": "Bearer x"}},
        "off": {"command": "python", "disabled": True}}}))
    calc, web = load_mcp_config(path)
    assert (calc.transport, calc.command, calc.args, dict(calc.env)) == ("stdio", "python", ("s.py",), {"K": "v"})
    assert (web.transport, web.url, dict(web.headers)) == ("http", "http://127.0.0.1:1/mcp", {"Authorization": "Bearer x"})
    for bad, says in [({"servers": {}}, "mcpServers"),
                      ({"mcpServers": {"a__b": {"command": "x"}}}, "server name"),
                      ({"mcpServers": {"a": {"command": "x", "url": "http://h"}}}, "either"),
                      ({"mcpServers": {"a": {"url": "ftp://h"}}}, "url"),
                      ({"mcpServers": {"a": {"type": "sse", "url": "http://h"}}}, "SSE"),
                      ({"mcpServers": {"a": {"command": "x", "args": "y"}}}, "args")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=says):
            load_mcp_config(path)


def test_serve_flags_and_environment(tmp_path, monkeypatch):
    from infercept.server import cli

    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"calc": {"command": "python", "args": ["s.py"]}}}))
    args = cli.build_parser().parse_args(["serve", "--mcp-config", str(path), "--mcp-timeout", "5"])
    mcp = cli.server_settings(args).mcp
    assert ([s.name for s in mcp.servers], mcp.call_timeout_s, mcp.tools_ttl_s) == (["calc"], 5.0, 300.0)
    monkeypatch.setenv("INFERCEPT_MCP_CONFIG", str(path))
    monkeypatch.setenv("INFERCEPT_MCP_TOOLS_TTL", "60")
    mcp = cli.server_settings(cli.build_parser().parse_args(["serve"])).mcp
    assert ([s.name for s in mcp.servers], mcp.call_timeout_s, mcp.tools_ttl_s) == (["calc"], 30.0, 60.0)
    assert cli.server_settings(cli.build_parser().parse_args(["serve", "--mcp-config", ""])).mcp.servers == ()
    with pytest.raises(ValueError, match="--mcp-timeout"):
        cli.server_settings(cli.build_parser().parse_args(["serve", "--mcp-timeout", "0"]))
