"""Replicas behind vllm-router (server/replicas.py): two `infercept serve` processes (one thread each) and
the router in front, started by the launcher as `make serve REPLICAS=2` starts them, driven by agents on
the official openai SDK (benchmarks/replicas.py's loop: a unique task, forced tool calls, the whole
conversation sent again each step).

* cache_aware (the launcher's default; the router renders each request on every replica, the server's
  /v1/chat/completions/render, and routes by the longest prefix of those ids): every resumed
  step of concurrent agents finds its paused generation (>= 90% of its prompt cached), so it reached the
  replica that paused it, and both replicas served agents; so does every step of chat sessions that name
  their session in the body (only the tool results sent after the first step);
* round_robin over the same replicas, agents one after another: consecutive steps alternate replicas, so
  resumed steps miss (< 90% cached; what the right routing buys);
* kv_aware with session affinity: Responses chains (previous_response_id) and chat sessions whose requests
  carry an X-Session-Id header return to their replica;
* round_robin again: Responses chains, chat sessions and a native session still reach their replica, which
  the replica a request reaches forwards it to (server/replica_forwarding.py; stand-in replicas test each
  kind of request, streams and disconnects without a router), and so do stateless Responses agents that
  send a `prompt_cache_key` (to the key's home replica);
* one replica killed while agents run: agents that start afterwards get no 5xx (the router sends them to
  the other replica).

Skipped where the router is not installed (it is in the test extra; Linux wheels only). ~1.5 min on 2
cores, most of it the two replicas loading the model.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench_modules import load_bench
from infercept.server.metrics import ServerMetrics
from infercept.server.replica_forwarding import Fleet, FleetFile, ForwardToHolder, write_fleet
from infercept.server.replicas import (Child, DropRouterDefaults, memory_share_args, restart_exited, router_argv,
                                       router_executable, serve_options, start_fleet, strip_router_defaults)

ROUTER_MISSING = importlib.util.find_spec("vllm_router") is None or router_executable() is None
needs_router_skip = pytest.mark.skipif(ROUTER_MISSING, reason="vllm-router is not installed (pip install "
                                                          "'infercept[router]'; Linux only)")


def needs_router(test):
    return pytest.mark.slow(needs_router_skip(test))

WORDS = 100  # ~700-token first prompts: a resumed step is ~96% cached at home, ~40% on the other replica


# -- the launcher's request fix-up (no router needed) ---------------------------------------------------

def test_only_the_routers_default_extras_are_dropped():
    routed = {"model": "m", "messages": [], "max_tokens": 5, "session_id": "s", "ignore_eos": False,
              "no_stop_trim": False, "continue_final_message": False, "skip_special_tokens": True,
              "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
              "include_reasoning": True}
    assert json.loads(strip_router_defaults(json.dumps(routed).encode())) == {
        "model": "m", "messages": [], "max_tokens": 5, "session_id": "s", "ignore_eos": False}
    # A value the client chose is the server's to judge (it refuses it); other bodies pass as they are.
    chosen = json.dumps({"model": "m", "no_stop_trim": True, "skip_special_tokens": 1}).encode()
    assert strip_router_defaults(chosen) is chosen
    for body in (b"not json", b"[1, 2]", b'{"model": "m"}'):
        assert strip_router_defaults(body) is body


def test_each_replica_gets_its_share_of_the_default_kv_pool_and_of_vllms_gpu_share(monkeypatch):
    """N replicas each see the memory free at their start: at a lone server's quarter each they would
    claim N quarters together; under vLLM, at its 0.92 of the GPU each, the second would not start. What
    the operator sizes stands."""
    from infercept.server import cli

    for name in ("KV_CACHE_GB", "KV_CACHE_FRACTION", "GPU_MEMORY_UTILIZATION", "BACKEND"):
        monkeypatch.delenv(f"INFERCEPT_{name}", raising=False)
    share = memory_share_args(["--policy", "swap"], 4, "native")
    assert share == ["--kv-cache-fraction", "0.0625"]
    assert cli.engine_kwargs(cli.build_parser().parse_args(["serve", *share]))["kv_cache_fraction"] == 0.0625
    assert cli.engine_kwargs(cli.build_parser().parse_args(["serve"]))["kv_cache_fraction"] is None  # the device's
    assert memory_share_args([], 1, "native") == memory_share_args([], 1, "vllm") == []
    assert memory_share_args(["--kv-cache-gb", "2"], 4, "native") == []
    assert memory_share_args(["--kv-cache-fraction=0.5"], 4, "native") == []

    def serve_backend(serve_args):
        return cli.chosen_backend(serve_options(serve_args))

    vllm = ["--backend", "vllm"]
    share = memory_share_args(vllm, 4, serve_backend(vllm))
    assert share == ["--kv-cache-fraction", "0.0625", "--gpu-memory-utilization", "0.23"]
    assert cli.vllm_engine_args(cli.build_parser().parse_args(["serve", *share, *vllm])) == {
        "gpu_memory_utilization": 0.23}
    # A pool vLLM is given in GiB still needs its GPU share: vLLM checks that much is free at its start.
    assert memory_share_args(["--kv-cache-gb", "2", *vllm], 4, "vllm") == ["--gpu-memory-utilization", "0.23"]
    assert memory_share_args(["--gpu-memory-utilization", "0.4", *vllm], 2, "vllm") == ["--kv-cache-fraction", "0.125"]
    monkeypatch.setenv("INFERCEPT_KV_CACHE_GB", "2")
    assert memory_share_args([], 4, "native") == []
    monkeypatch.setenv("INFERCEPT_BACKEND", "vllm")
    assert serve_backend([]) == "vllm" and memory_share_args([], 2, "vllm") == ["--gpu-memory-utilization", "0.46"]
    monkeypatch.setenv("INFERCEPT_GPU_MEMORY_UTILIZATION", "0.3")
    assert memory_share_args([], 2, "vllm") == []
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)  # auto without an NVIDIA GPU: native
    assert serve_backend(["--backend", "auto"]) == "native"
    with pytest.raises(SystemExit):  # a flag serve refuses stops the launcher before anything starts
        serve_backend(["--no-such-flag"])


FAKE_NVIDIA_SMI = """#!/bin/sh
[ "$1" = "-L" ] && for i in $(seq 0 $(( ${FAKE_GPUS:-3} - 1 ))); do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done
"""


def fake_nvidia_smi(folder: Path) -> str:
    """A folder whose `nvidia-smi -L` lists $FAKE_GPUS (default 3) GPUs, for PATH."""
    (folder / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (folder / "nvidia-smi").chmod(0o755)
    return str(folder)


def test_each_replica_gets_a_gpu_of_its_own_where_there_are_enough(monkeypatch, tmp_path):
    from infercept.server.replicas import gpu_sets, gpus_per_replica, visible_gpus

    path = os.environ.get("PATH", "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert visible_gpus() == []  # no nvidia-smi: no GPU, whatever CUDA_VISIBLE_DEVICES says
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path) + os.pathsep + path)
    monkeypatch.setenv("FAKE_GPUS", "4")
    assert visible_gpus() == ["0", "1", "2", "3"]
    for visible, gpus in (("2,3", ["2", "3"]), ("GPU-a, GPU-b", ["GPU-a", "GPU-b"]), ("1,-1,2", ["1"]), ("", [])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert visible_gpus() == gpus, visible
    native, vllm = serve_options([]), serve_options(["--backend", "vllm", "--tensor-parallel-size", "2"])
    assert gpus_per_replica(native, "native") == 1 and gpus_per_replica(vllm, "vllm") == 2
    assert gpus_per_replica(serve_options(["--device", "cuda:1"]), "native") is None
    assert gpu_sets(["0", "1", "2", "3", "4"], 2) == ["0,1", "2,3"] and gpu_sets(["0", "1"], None) == []


STAND_IN_REPLICA = r"""
import http.server, sys, time
port, log = int(sys.argv[1]), sys.argv[2]
with open(log, "a") as f:
    f.write(f"{port} {time.monotonic()}\n")
time.sleep(1.0)  # loading
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_vllm_replicas_start_and_restart_one_after_another_and_native_ones_together(tmp_path, one_at_a_time):
    """Stand-in replicas (a second's start-up, then /health) record when each started: one at a time, each
    starts after the one before answers; else all at once. The same when they all exit and start again."""
    from infercept.server import replicas as launcher

    script, log = tmp_path / "replica.py", tmp_path / "starts"
    script.write_text(STAND_IN_REPLICA)

    def assert_start_order() -> None:
        starts = sorted(float(line.split()[1]) for line in log.read_text().splitlines())
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert len(starts) == 3 and (min(gaps) >= 1.0 if one_at_a_time else max(gaps) < 0.9), gaps

    started: list[Child] = []
    try:
        start_fleet(lambda port: Child(f"replica :{port}", [sys.executable, str(script), str(port), str(log)],
                                       f"http://127.0.0.1:{port}", None), free_ports(3), 30, one_at_a_time, started)
        assert_start_order()
        # All of them exit at once (a GPU fault ends every process on the GPU): they start again as they
        # started, each vLLM replica once the one before it answers again.
        log.write_text("")
        for child in started:
            child.proc.kill()
            child.proc.wait()
        restart_exited(started, one_at_a_time, 30, min_interval=0)
        launcher.wait_ok(started, "/health", 30)
        assert_start_order()
    finally:
        for child in started:
            child.proc.kill()
            child.proc.wait()



def test_the_middleware_rewrites_chat_and_completions_bodies_only():
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def echo(request):
        body = await request.body()
        return JSONResponse({"body": json.loads(body), "length": request.headers["content-length"] == str(len(body))})

    app = Starlette(routes=[Route("/{path:path}", echo, methods=["POST"])], middleware=[Middleware(DropRouterDefaults)])
    client = TestClient(app)
    routed = {"model": "m", "no_stop_trim": False, "skip_special_tokens": True}
    for path, expected in (("/v1/chat/completions", {"model": "m"}), ("/v1/completions", {"model": "m"}),
                           ("/v1/chat/completions/render", {"model": "m"}), ("/v1/completions/render", {"model": "m"}),
                           ("/v1/responses", routed)):
        answer = client.post(path, json=routed).json()
        assert answer == {"body": expected, "length": True}, path


# -- forwarding to the replica that holds a conversation (no router, no model) ----------------------------

def fleet_member(name: str, held: set, fleet: Fleet, streams: dict):
    """A stand-in for a replica in `fleet`: answers every request with who served it and what it got,
    holds `held` ((Kind, id) pairs), and streams on POST /v1/chat/completions with "stream" in its body."""
    import asyncio
    from types import SimpleNamespace

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def answer(request):
        body = (await request.body()).decode()
        if "stream" in body:
            async def events():
                try:
                    yield b"data: one\n\n"
                    while not streams["go on"].is_set():  # (the client has read the first event by then)
                        await asyncio.sleep(0.01)
                    yield b"data: two\n\n"
                    await asyncio.sleep(30)  # (the client leaves before this ends)
                finally:
                    streams["ended"].set()
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"served_by": name, "path": request.url.path, "query": request.url.query, "body": body,
                             "from_fleet": "x-infercept-fleet" in request.headers,
                             "authorization": request.headers.get("authorization")})

    app = Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST", "DELETE"])])
    app.state.settings = SimpleNamespace(keep_alive_s=5)
    app.state.holds = lambda kind, id: (kind, id) in held
    app.state.metrics = ServerMetrics("m")
    app.add_middleware(ForwardToHolder, fleet=fleet)
    return app


def test_a_request_naming_what_another_replica_holds_is_served_there(tmp_path):
    from live_server import serve_in_thread

    from infercept.server.conversations import Kind

    streams = {"go on": threading.Event(), "ended": threading.Event()}
    held = {(Kind.RESPONSE, "resp_a"), (Kind.SESSION, "sess_a"), (Kind.CHAT, "chat-a"), (Kind.CONVERSATION, "conv_a"),
            (Kind.ITEM, "msg_a")}
    fleet_file = tmp_path / "fleet.json"
    servers = []
    for name, holds in (("a", held), ("b", set())):
        fleet = FleetFile(fleet_file, own_url="")
        app = fleet_member(name, holds, fleet, streams)
        server, thread, url = serve_in_thread(app)
        fleet.own_url = url
        servers.append((server, thread, url, app.state.metrics))
    a, b = servers[0][2], servers[1][2]
    write_fleet(fleet_file, "secret", [a, b])
    try:
        with httpx.Client(base_url=b, timeout=30) as http:
            key = {"Authorization": "Bearer k"}
            for method, path, kw in (
                    ("POST", "/v1/responses", {"json": {"previous_response_id": "resp_a", "input": "x"}}),
                    ("GET", "/v1/responses/resp_a", {}), ("DELETE", "/v1/responses/resp_a", {}),
                    ("POST", "/v1/responses/resp_a/cancel", {}), ("GET", "/v1/responses/resp_a/input_items", {}),
                    ("GET", "/v1/sessions/sess_a", {}), ("POST", "/v1/sessions/sess_a/messages", {"json": {"content": "x"}}),
                    ("POST", "/v1/chat/completions", {"json": {"messages": [], "session_id": "chat-a"}}),
                    ("POST", "/v1/chat/completions", {"json": {"messages": []}, "headers": {"X-Session-Id": "chat-a"}}),
                    ("POST", "/v1/responses", {"json": {"conversation": "conv_a", "input": "x"}}),
                    ("POST", "/v1/responses", {"json": {"conversation": {"id": "conv_a"}, "input": "x"}}),
                    # items by reference alone (the AI SDK with `store`), the first naming the holder
                    ("POST", "/v1/responses", {"json": {"input": [{"type": "item_reference", "id": "msg_a"},
                                                                  {"type": "item_reference", "id": "msg_b"}]}}),
                    ("POST", "/v1/responses", {"json": {"input": [{"id": "msg_a"}, {"role": "user", "content": "x"}]}}),
                    ("GET", "/v1/conversations/conv_a", {}), ("POST", "/v1/conversations/conv_a/items", {"json": {}}),
                    ("DELETE", "/v1/conversations/conv_a/items/msg_1", {})):
                r = http.request(method, path, params={"q": "1"}, json=kw.get("json"),
                                 headers={**key, **kw.get("headers", {})})
                got = r.json()
                assert got["served_by"] == "a" and got["path"] == path and got["query"] == "q=1", (method, path, got)
                assert got["from_fleet"] and got["authorization"] == "Bearer k"  # (the client's key goes along)
                if "json" in kw:
                    assert json.loads(got["body"]) == kw["json"]
            for method, path, kw in (
                    ("POST", "/v1/responses", {"json": {"previous_response_id": "resp_b", "input": "x"}}),
                    ("POST", "/v1/responses", {"json": {"conversation": "conv_b", "input": "x"}}),
                    ("POST", "/v1/responses", {"json": {"input": [{"type": "item_reference", "id": "msg_b"},
                                                                  {"type": "item_reference", "id": "msg_a"}]}}),
                    ("POST", "/v1/responses", {"json": {"input": [{"role": "user", "content": "x", "id": "msg_a"}]}}),
                    ("GET", "/v1/conversations/conv_b/items", {}), ("POST", "/v1/conversations", {"json": {}}),
                    ("GET", "/v1/sessions/sess_b", {}), ("POST", "/v1/chat/completions", {"json": {"messages": []}}),
                    ("POST", "/v1/completions", {"json": {"session_id": "chat-a"}})):  # (completions name none)
                got = http.request(method, path, **kw).json()
                assert got["served_by"] == "b" and not got["from_fleet"], (method, path, got)
            # The question replicas ask each other needs the fleet's token.
            assert http.get("/internal/fleet/holds", params={"kind": "chat", "id": "x"}).status_code == 404
            with httpx.Client(base_url=a, timeout=30) as at_a:
                asked = at_a.get("/internal/fleet/holds", params={"kind": "session", "id": "sess_a"},
                                 headers={"x-infercept-fleet": "secret"})
                assert asked.json() == {"holds": True}
            # A stream is relayed as it is written; the client leaving ends it at the holder too.
            with http.stream("POST", "/v1/chat/completions", json={"session_id": "chat-a", "stream": True}) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                lines = r.iter_lines()
                assert next(lines) == "data: one"
                streams["go on"].set()
                assert next(lines) == ""
                assert next(lines) == "data: two"
            assert streams["ended"].wait(10), "the holder's stream went on after the client left"
            counted = servers[1][3].registry.get_sample_value
            assert [counted("infercept_forwarded_requests_total", {"model": "m", "kind": kind})
                    for kind in ("response", "session", "chat", "conversation", "item")] == [5, 2, 3, 5, 2]
            # The holder gone: served here (as one server answers a conversation it lost).
            servers[0][0].should_exit = True
            servers[0][1].join(timeout=10)
            got = http.get("/v1/sessions/sess_a").json()
            assert got["served_by"] == "b", got
    finally:
        for server, thread, *_ in servers:
            server.should_exit = True
            thread.join(timeout=10)


def test_a_prompt_cache_key_is_served_by_its_home_replica(tmp_path):
    """Every replica sends a request with a `prompt_cache_key` to the same replica, the key's home by
    rendezvous hashing; a conversation held elsewhere still wins; a home out of reach leaves the request
    where it is; a replica joining the fleet takes only keys from the others, none moves between them."""
    from live_server import serve_in_thread

    from infercept.server.conversations import Kind

    streams = {"go on": threading.Event(), "ended": threading.Event()}
    fleet_file = tmp_path / "fleet.json"
    servers, urls = [], {}
    for name in ("a", "b", "c"):
        fleet = FleetFile(fleet_file, own_url="")
        app = fleet_member(name, {(Kind.RESPONSE, "resp_c")} if name == "c" else set(), fleet, streams)
        server, thread, url = serve_in_thread(app)
        fleet.own_url = urls[name] = url
        servers.append((server, thread, app.state.metrics))
    name_of = {url: name for name, url in urls.items()}
    write_fleet(fleet_file, "secret", [urls["a"], urls["b"]])
    keys = [f"agent-{i}" for i in range(24)]
    reader = FleetFile(fleet_file, own_url="")
    try:
        clients = {name: httpx.Client(base_url=url, timeout=30) for name, url in urls.items()}

        def served_by(at: str, path: str, body: dict) -> str:
            return clients[at].post(path, json=body).json()["served_by"]

        homes = {key: name_of[reader.home(key)] for key in keys}
        assert set(homes.values()) == {"a", "b"}  # (24 keys: both replicas are some key's home)
        for key in keys:
            for at in ("a", "b"):
                assert served_by(at, "/v1/chat/completions", {"messages": [], "prompt_cache_key": key}) == homes[key]
                assert served_by(at, "/v1/responses", {"input": "x", "prompt_cache_key": key}) == homes[key]
        counted = [m.registry.get_sample_value("infercept_forwarded_requests_total",
                                               {"model": "m", "kind": "prompt_cache_key"}) for _, _, m in servers[:2]]
        assert counted == [2.0 * sum(h == "b" for h in homes.values()), 2.0 * sum(h == "a" for h in homes.values())]
        # A key of another shape, or on a route that takes none, is served where it arrives.
        for body in ({"messages": [], "prompt_cache_key": 7}, {"messages": [], "prompt_cache_key": ""}):
            assert served_by("a", "/v1/chat/completions", body) == "a"
        assert served_by("a", "/v1/completions", {"prompt": "x", "prompt_cache_key": keys[0]}) == "a"
        # The fleet grows: keys move to the new replica only.
        write_fleet(fleet_file, "secret", [urls["a"], urls["b"], urls["c"]])
        grown = {key: name_of[reader.home(key)] for key in keys}
        assert "c" in grown.values() and all(grown[k] in (homes[k], "c") for k in keys)
        for key in keys:
            assert served_by("a", "/v1/responses", {"input": "x", "prompt_cache_key": key}) == grown[key]
        # The conversation's holder wins over the key's home.
        key_of_a = next(k for k in keys if grown[k] == "a")
        assert served_by("a", "/v1/responses", {"previous_response_id": "resp_c", "prompt_cache_key": key_of_a}) == "c"
        # The home gone: served here.
        key_of_c = next(k for k in keys if grown[k] == "c")
        servers[2][0].should_exit = True
        servers[2][1].join(timeout=10)
        assert served_by("b", "/v1/chat/completions", {"messages": [], "prompt_cache_key": key_of_c}) == "b"
        for client in clients.values():
            client.close()
    finally:
        for server, thread, _ in servers:
            server.should_exit = True
            thread.join(timeout=10)


def test_a_fleet_named_by_dns_forwards_as_the_launchers_file_does(monkeypatch):
    """Kubernetes' shape, without Kubernetes: replicas on one port at two addresses (127.0.0.1 and
    127.0.0.2, as pods have their own), a name that resolves to both (a headless Service; the lookup is
    the only thing stood in for here), and the token every replica is given. A conversation held by the
    other replica and a prompt_cache_key whose home it is are forwarded there; a replica that leaves the
    name's answer is asked no more."""
    import socket

    import uvicorn

    from infercept.server import replica_forwarding
    from infercept.server.conversations import Kind
    from infercept.server.replica_forwarding import DnsFleet

    port, = free_ports(1)
    answers = {"fleet.test": ["127.0.0.1", "127.0.0.2"]}
    resolve = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host not in answers:
            return resolve(host, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, args[0] if args else 0)) for a in answers[host]]

    monkeypatch.setattr(replica_forwarding.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(replica_forwarding, "RESOLVE_EVERY_S", 0.0)
    streams = {"go on": threading.Event(), "ended": threading.Event()}
    servers, fleets = [], {}
    for name, address, held in (("a", "127.0.0.1", set()), ("b", "127.0.0.2", {(Kind.RESPONSE, "resp_b")})):
        fleet = fleets[name] = DnsFleet("fleet.test", port, "secret", address)
        app = fleet_member(name, held, fleet, streams)
        server = uvicorn.Server(uvicorn.Config(app, host=address, port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
    try:
        for server, _ in servers:
            deadline = time.monotonic() + 30
            while not server.started:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert fleets["a"].peers() == [f"http://127.0.0.2:{port}"] and fleets["a"].own_url == f"http://127.0.0.1:{port}"
        key = next(k for k in (f"agent-{i}" for i in range(64)) if fleets["a"].home(k).startswith("http://127.0.0.2"))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as at_a:
            assert at_a.get("/v1/responses/resp_b").json()["served_by"] == "b"
            assert at_a.post("/v1/responses", json={"input": "x", "prompt_cache_key": key}).json()["served_by"] == "b"
            answers["fleet.test"] = ["127.0.0.1"]  # b left the Service's endpoints
            deadline = time.monotonic() + 10
            while fleets["a"].peers():
                assert time.monotonic() < deadline, "the name was not looked up again"
                at_a.get("/v1/responses/resp_x")  # (a request starts the lookup)
                time.sleep(0.05)
            assert at_a.post("/v1/responses", json={"input": "x", "prompt_cache_key": key}).json()["served_by"] == "a"
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(timeout=10)


# -- the launcher and the router ------------------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    """`n` consecutive free loopback ports."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65535 and all(_free(base + i) for i in range(n)):
            return [base + i for i in range(n)]
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_ok(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


class Cluster:
    def __init__(self, tmp: Path):
        self.router_port, = free_ports(1)
        self.replica_ports = free_ports(2)
        self.url = f"http://127.0.0.1:{self.router_port}"
        self.workers = [f"http://127.0.0.1:{p}" for p in self.replica_ports]
        self.logs = tmp
        self.metrics_port, = free_ports(1)
        # Three GPUs (a fake nvidia-smi): each replica gets its own by CUDA_VISIBLE_DEVICES (the CPU build of
        # torch takes no notice), and one added by signal the third.
        env = {**os.environ, "PATH": fake_nvidia_smi(tmp) + os.pathsep + os.environ.get("PATH", ""), "FAKE_GPUS": "3"}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infercept.server.replicas", "--replicas", "2", "--threads", "1",
             "--port", str(self.router_port), "--base-port", str(self.replica_ports[0]),
             "--metrics-port", str(self.metrics_port), "--log-dir", str(tmp), "--no-restart",
             # Pools sized for the tests' agents (~23k tokens each): by default each replica's would be a
             # quarter of the free memory, which the prefix cache fills (7 GB resident, 2026-12-04).
             "--", "--log-level", "warning", "--kv-cache-gb", "0.5", "--host-kv-gb", "0.25"],
            stdout=open(tmp / "launcher.log", "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def replica_gpus(self, port: int) -> str | None:
        """The CUDA_VISIBLE_DEVICES of the replica listening on `port`."""
        for entry in Path(f"/proc/{self.replica_pid(port)}/environ").read_bytes().split(b"\0"):
            if entry.startswith(b"CUDA_VISIBLE_DEVICES="):
                return entry.split(b"=", 1)[1].decode()
        return None

    def replica_pid(self, port: int) -> int:
        """The replica process listening on `port` (its command line names the port)."""
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = cmdline.read_bytes().split(b"\0")
            except OSError:
                continue
            if b"infercept.server.replicas" in argv and b"replica" in argv and str(port).encode() in argv:
                return int(cmdline.parent.name)
        raise LookupError(port)

    def extra_router(self, policy: str):
        """Another vllm-router over the same replicas (as the launcher would start it with `policy`)."""
        port, metrics = free_ports(1)[0], free_ports(1)[0]
        proc = subprocess.Popen(router_argv(router_executable(), self.workers, "127.0.0.1", port, policy, metrics),
                                stdout=open(self.logs / f"router-{policy}.log", "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        wait_ok(f"http://127.0.0.1:{port}/readiness", proc, 60)
        return proc, f"http://127.0.0.1:{port}"

    def log_tails(self, lines: int = 30) -> str:
        """Why a request failed, in the failure: each replica's process and /health as they are now, and the
        end of every log of the launcher, its router and replicas (the routers' without their start-up's
        DEBUG lines and kv_index warnings, so that their health checks and circuit breakers show)."""
        noise = ("DEBUG:", "kv_index")
        tails = [f"--- {log.name}\n" + "\n".join(
                     [line for line in log.read_text(errors="replace").splitlines()
                      if not any(n in line for n in noise)][-lines:])
                 for log in sorted(self.logs.glob("*.log"))]
        return "\n".join([*map(self.replica_state, self.replica_ports), *tails])

    def replica_state(self, port: int) -> str:
        try:
            pid = f"pid {self.replica_pid(port)}"
        except LookupError:
            pid = "no process"
        start = time.monotonic()
        try:
            health = f"/health {httpx.get(f'http://127.0.0.1:{port}/health', timeout=10).status_code}"
        except httpx.HTTPError as e:
            health = f"/health {type(e).__name__}"
        return f"--- replica :{port}: {pid}, {health} in {time.monotonic() - start:.1f} s"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("replicas"))
    try:
        wait_ok(cluster.url + "/readiness", cluster.proc, 600)
        yield cluster
    finally:
        cluster.stop()
    # SIGTERM stopped the router and both replicas, and the launcher exited cleanly.
    assert cluster.proc.returncode == 0, (cluster.logs / "launcher.log").read_text()
    assert not any(_listening(p) for p in [cluster.router_port, *cluster.replica_ports])


@pytest.fixture(scope="module")
def bench():
    return load_bench("replicas")


def test_the_benchmark_counts_the_cpu_of_each_process_under_a_root(bench):
    """A busy child and an idle one under this process: only the busy one uses a core's worth over the run."""
    import subprocess
    import sys
    import time

    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 2: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    try:
        time.sleep(0.4)  # both interpreters started (their start-up is CPU time too)
        before, start = bench.process_cpu(os.getpid()), time.perf_counter()
        time.sleep(0.8)
        rows = bench.cpu_by_process(before, bench.process_cpu(os.getpid()), time.perf_counter() - start)
    finally:
        busy.wait()
        idle.wait()
    cores = {row["pid"]: row["cores"] for row in rows}
    assert cores.get(busy.pid, 0) > 0.3, rows  # (a core, less what the machine's other work takes)
    assert idle.pid not in cores, rows  # under 1% of a core: left out


def assert_no_errors(run: dict, cluster: Cluster) -> None:
    errors = [loop["error"] for loop in run["agents"]]
    assert errors == [None] * len(errors), f"{errors}\n{cluster.log_tails()}"


def resumed_shares(run: dict, cluster: Cluster) -> list[float]:
    assert_no_errors(run, cluster)
    return [s["cached_share"] for loop in run["agents"] for s in loop["steps"] if s["step"] > 0]


def router_render_results(cluster) -> dict[str, float]:
    """vllm-router's count of the prompt ids it asked the replicas for, by result (`render`: answered;
    `render_unavailable`: a replica did not answer, the request was balanced by load)."""
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).text
    results: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm_router_kv_routing_inputs_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            results[result] = results.get(result, 0) + float(line.rsplit(" ", 1)[1])
    return results


def requests_served(worker: str) -> float:
    text = httpx.get(worker + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("infercept_requests_total{"))


@needs_router
def test_implicit_resumes_and_named_sessions_return_to_their_replica(cluster, bench):
    run = bench.run_agents(cluster.url, 4, "home", steps=3, words=WORDS)
    shares = resumed_shares(run, cluster)
    assert len(shares) == 8 and min(shares) >= 0.9, shares
    assert all(requests_served(w) > 0 for w in cluster.workers), "the router used one replica only"
    # It routed by the ids the replicas rendered (their /v1/chat/completions/render), not by load alone.
    renders = router_render_results(cluster)
    assert renders.get("render", 0) >= 2 * 12, renders  # 12 requests, each rendered on both replicas
    # session_id in the body (and the header): after the first step only the tool results are sent.
    sessions = bench.run_agents(cluster.url, 2, "named", steps=3, words=WORDS, mode="session")
    shares = resumed_shares(sessions, cluster)
    assert len(shares) == 4 and min(shares) >= 0.9, shares


@needs_router
def test_round_robin_sends_resumes_elsewhere(cluster, bench):
    proc, url = cluster.extra_router("round_robin")
    try:
        # One agent at a time: each one's consecutive steps go to alternating replicas.
        run = bench.run_agents(url, 4, "rr", at_once=False, steps=3, words=WORDS)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    shares = resumed_shares(run, cluster)
    assert min(shares) < 0.9, shares


@needs_router
def test_responses_chains_and_header_sessions_return_home_under_kv_aware_affinity(cluster, bench):
    proc, url = cluster.extra_router("kv_aware")
    try:
        runs = [bench.run_agents(url, 2, f"keyed-{mode}", steps=3, words=WORDS, mode=mode)
                for mode in ("responses", "session")]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for run in runs:
        shares = resumed_shares(run, cluster)
        assert len(shares) == 4 and min(shares) >= 0.9, shares


@needs_router
def test_responses_chains_and_sessions_reach_their_replica_under_round_robin(cluster, bench):
    """Round robin sends each agent's consecutive requests to alternating replicas; the replica that does
    not hold the chain or the session a request names forwards it to the one that does
    (server/replica_forwarding.py), and one that gets a `prompt_cache_key` another replica is the home
    of forwards it there (Responses as Codex sends them: nothing stored, the whole input each step), so
    every resumed step is a resume."""
    proc, url = cluster.extra_router("round_robin")
    try:
        runs = [bench.run_agents(url, 2, f"rr-{mode}", at_once=False, steps=3, words=WORDS, mode=mode)
                for mode in ("responses", "session", "cache_key")]
        with httpx.Client(base_url=url + "/v1", timeout=120) as http:  # a native session, message by message
            session = http.post("/sessions", json={"temperature": 0, "max_tokens": 3}).json()["id"]
            for word in ("Hello.", "And again.", "Once more."):
                r = http.post(f"/sessions/{session}/messages", json={"content": word})
                assert r.status_code == 200, r.text
            seen = [http.get(f"/sessions/{session}") for _ in range(2)]
            assert [r.status_code for r in seen] == [200, 200] and len(seen[1].json()["messages"]) == 6, seen[1].text
            # A background response, polled, streamed again and cancelled through either replica.
            model = bench.default_model(url)
            queued = http.post("/responses", json={"model": model, "input": "Hi", "max_output_tokens": 24,
                                                   "temperature": 0, "background": True}).json()
            deadline = time.monotonic() + 120
            while (polled := http.get(f"/responses/{queued['id']}").json())["status"] in ("queued", "in_progress"):
                assert time.monotonic() < deadline, polled
                time.sleep(0.05)
            assert polled["status"] in ("completed", "incomplete"), polled
            for _ in range(2):
                cancelled = http.post(f"/responses/{queued['id']}/cancel")
                assert cancelled.status_code == 200 and cancelled.json()["status"] == polled["status"], cancelled.text
                items = http.get(f"/responses/{queued['id']}/input_items")
                assert items.status_code == 200 and items.json()["data"][0]["content"][0]["text"] == "Hi", items.text
            # vllm-router drops the query of a GET it passes on: streamed again, it is the replicas' own
            # ports (either one: the other forwards), and through the router the response as JSON.
            again = http.get(f"/responses/{queued['id']}", params={"stream": "true", "starting_after": 1})
            assert again.status_code == 200 and again.json()["id"] == queued["id"], again.text[:300]
            for worker in cluster.workers:
                again = httpx.get(f"{worker}/v1/responses/{queued['id']}", params={"stream": "true", "starting_after": 1},
                                  timeout=60)
                assert again.status_code == 200 and '"sequence_number":2' in again.text.replace(" ", ""), again.text[:300]
            # An item one replica stored, named by reference alone (the AI SDK with `store`): round robin
            # sends one of each two requests to the other replica, which forwards it to the item's.
            stored = http.post("/responses", json={"model": model, "input": "Hi", "max_output_tokens": 16,
                                                   "temperature": 0}).json()
            for reference in [{"type": "item_reference", "id": stored["output"][0]["id"]}] * 2 + [
                    {"id": stored["output"][0]["id"]}] * 2:
                step = http.post("/responses", json={"model": model, "max_output_tokens": 16, "temperature": 0,
                                                     "input": [{"role": "user", "content": "Hi"}, reference,
                                                               {"role": "user", "content": "And again."}]})
                assert step.status_code == 200 and step.json()["status"] in ("completed", "incomplete"), step.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # (without forwarding: previous_response_not_found, tool results without their calls, and resumes missed)
    for run in runs:
        shares = resumed_shares(run, cluster)
        assert len(shares) == 4 and min(shares) >= 0.9, shares


def router_worker_urls(cluster) -> list[str]:
    """The replicas the router sends requests to (its /list_workers)."""
    text = httpx.get(cluster.url + "/list_workers", timeout=10).text
    return sorted(set(re.findall(r"http://127\.0\.0\.1:\d+", text)))


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(1)
    raise TimeoutError(what)


@needs_router
def test_the_fleet_grows_and_shrinks_by_signal(cluster, bench):
    """SIGTTIN to the launcher: a third replica starts, joins the router and takes new agents; SIGTTOU: it
    leaves the router and stops, and the agents after that finish on the other two."""
    assert router_worker_urls(cluster) == sorted(cluster.workers)
    assert [cluster.replica_gpus(p) for p in cluster.replica_ports] == ["0", "1"]
    os.kill(cluster.proc.pid, signal.SIGTTIN)
    grown = wait_for(lambda: [urls for urls in [router_worker_urls(cluster)] if len(urls) == 3], 300,
                     "no third replica in the router")[0]
    new, = set(grown) - set(cluster.workers)
    assert cluster.replica_gpus(int(new.rsplit(":", 1)[1])) == "2"
    os.kill(cluster.proc.pid, signal.SIGTTIN)  # no GPU left for a fourth
    wait_for(lambda: "no replica added: each GPU has one" in (cluster.logs / "launcher.log").read_text(), 30,
             "a fourth replica was not refused")
    assert len(router_worker_urls(cluster)) == 3
    run = bench.run_agents(cluster.url, 4, "grown", steps=2, words=WORDS)
    assert_no_errors(run, cluster)
    assert requests_served(new) > 0, "the added replica took no new agent"
    os.kill(cluster.proc.pid, signal.SIGTTOU)
    wait_for(lambda: router_worker_urls(cluster) == sorted(cluster.workers), 120, "the replica is still routed to")
    port = int(new.rsplit(":", 1)[1])
    wait_for(lambda: not _listening(port), 120, "the removed replica still listens")
    after = bench.run_agents(cluster.url, 2, "shrunk", steps=2, words=WORDS)
    assert_no_errors(after, cluster)


@needs_router
def test_a_dead_replica_fails_over(cluster, bench):
    victim_url = cluster.workers[1]
    victim = cluster.replica_pid(cluster.replica_ports[1])
    killed = threading.Event()
    lock = threading.Lock()
    in_flight: list[float] = []  # requests the victim was serving (running or queued) when it died

    def kill_while_it_generates(step: int) -> None:
        with lock:
            if killed.is_set():
                return
            lines = bench.metric_lines(victim_url)
            serving = bench.metric(lines, "infercept_requests_running") + bench.metric(lines, "infercept_requests_waiting")
            if serving > 0 or step > 0:  # (by the agents' second step, kill it whatever it does)
                in_flight.append(serving)
                killed.set()
                os.kill(victim, signal.SIGKILL)

    # Agents with requests in flight on the replica when it dies: the router sends those again to the
    # other replica (a non-streamed request that got no answer), so they finish too ...
    during = bench.run_agents(cluster.url, 4, "during", steps=3, words=WORDS, on_step=kill_while_it_generates)
    assert killed.is_set()
    print("requests on the killed replica:", in_flight)
    assert_no_errors(during, cluster)
    # ... and agents that start afterwards: all of them finish, none sees a 5xx.
    after = bench.run_agents(cluster.url, 4, "after", steps=3, words=WORDS)
    assert_no_errors(after, cluster)
    shares = resumed_shares(after, cluster)
    assert min(shares) >= 0.9, shares  # all on the surviving replica, so all at home
