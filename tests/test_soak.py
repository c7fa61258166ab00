"""The 60-second soak (benchmarks/soak.py): agents with every kind of fault against a real `infercept
serve`, then the invariants after the drain (no 5xx, no leaked KV or paused generation, sessions idle or
paused, flat RSS, exit 0 on SIGTERM). The 10-minute runs are in benchmarks/README.md."""
from __future__ import annotations

import json

from bench_modules import load_bench

soak = load_bench("soak")


def test_a_minute_of_agents_and_faults_leaves_nothing_behind(default_model_dir, tmp_path):
    output = tmp_path / "soak.json"
    status = soak.main(["--seconds", "60", "--agents", "6", "--policies", "infercept", "--model", default_model_dir,
                        "--output", str(output)])
    result = json.loads(output.read_text())["results"][0]
    assert {kind for kind, n in result["steps"].items() if n} == set(soak.STEPS), result["steps"]  # every fault ran
    assert result["checks"] == {name: True for name in result["checks"]}, (result["checks"], result["errors"])
    assert status == 0 and result["resumes"] > 0
