"""GET /dashboard in a real browser (Debian's headless Chromium): after a tool loop paused and resumed a
generation, the page polls /metrics, draws its charts, and the numbers it shows are the server's."""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile

import httpx
import pytest

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make test installs it as root)")
# Flags for this machine's closed network: no background connections, no sandbox (root), no GPU.
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def browse(url: str, tmp_path, *args: str) -> str:
    # A profile of its own each time, so that no Chromium finds one still held by the one before (a
    # screenshot right after a DOM dump in the same profile once hung for 120 s, 2026-12-04).
    profile = tempfile.mkdtemp(prefix="profile-", dir=tmp_path)
    done = subprocess.run([CHROMIUM, *HEADLESS, f"--user-data-dir={profile}", "--window-size=1280,1000",
                           "--virtual-time-budget=3500", *args, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def shown(dom: str, id: str) -> float:
    found = re.search(rf'id="{re.escape(id)}">([^<]*)<', dom)
    assert found is not None, f"the page shows no #{id}"
    return float(found.group(1))


def test_the_dashboard_draws_live_charts_whose_numbers_are_the_servers(server, tmp_path):
    server.abort_paused()
    client = server.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=40, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], max_tokens=4)
    # One paused generation stays, so the paused panel has something to show.
    client.chat.completions.create(model="smol", messages=messages[:1], tools=[WEATHER], tool_choice="required",
                                   max_tokens=40, temperature=0)
    server.paused_kv_locations()

    dom = browse(server.base + "/dashboard", tmp_path, "--dump-dom")
    text = httpx.get(server.base + "/metrics").text  # nothing runs now: the numbers hold still
    assert int(re.search(r'data-polls="(\d+)"', dom).group(1)) >= 3, "the page did not poll every second"
    assert shown(dom, "kv-device-total") == metric(text, "infercept_kv_device_blocks_total")
    assert shown(dom, "kv-device-used") == metric(text, "infercept_kv_device_blocks_used") > 0
    for state in ("device", "host", "partial", "discarded"):
        assert shown(dom, f"paused-{state}") == metric(text, "infercept_paused_requests", kv_state=state)
    assert metric(text, "infercept_paused_requests") == 1
    assert shown(dom, "generated-total") == metric(text, "infercept_generation_tokens_total") > 0
    assert shown(dom, "interceptions-get_weather") == metric(text, "infercept_interception_seconds_count",
                                                             tool="get_weather") >= 1
    charts = dom[:dom.index("<script")].split("<svg")[1:]
    assert len(charts) == 5
    for chart in charts:  # every chart has a line of at least 3 polls (a rate has none at the first poll)
        assert max(points.count(",") for points in re.findall(r'points="([^"]*)"', chart)) >= 3, chart

    screenshot = tmp_path / "dashboard.png"
    browse(server.base + "/dashboard", tmp_path, f"--screenshot={screenshot}")
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 10_000
    server.abort_paused()
