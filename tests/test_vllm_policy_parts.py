"""Which of a policy's parts the vLLM backend runs (engine/vllm_backend/policy_parts.py), without vLLM: a
name asking for a part only the native engine runs is refused by name before vLLM starts, the default
`infercept` starts whole (prefetch included), and docs/operators.md says the same as the code.
tests/vllm_scheduler_cases.py checks the same inside vLLM's scheduler, and that the parts it runs act
there."""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

from infercept.engine.policy import POLICIES, VARIANTS, Policy, make_policy
from infercept.engine.policy.names import PARTS, part_setting
from infercept.engine.vllm_backend import policy_parts
from infercept.engine.vllm_backend.policy_parts import HONOURED, NATIVE_ONLY, summary, vllm_policy

from unstarted_worker import WorkerStarted

ROOT = Path(__file__).resolve().parent.parent
# The parts a name may write that switch on a part only the native engine runs.
NATIVE_ONLY_ON = [v for v in VARIANTS if part_setting(v)[0] in NATIVE_ONLY and part_setting(v)[1] != getattr(
    Policy, part_setting(v)[0])]
HONOURED_VARIANTS = [v for v in VARIANTS if part_setting(v)[0] in HONOURED]


def test_every_part_is_either_run_on_vllm_or_native_only():
    assert set(HONOURED) | set(NATIVE_ONLY) == set(PARTS)
    assert not set(HONOURED) & set(NATIVE_ONLY)
    assert {part_setting(v)[0] for v in VARIANTS} == set(PARTS), "a variant sets an attribute PARTS does not name"
    assert {"admission", "las-priority", "program-arrival-priority"} == set(NATIVE_ONLY_ON)


@pytest.mark.parametrize("base", ["infercept", "infercept-paper", "preserve", "swap"])
@pytest.mark.parametrize("part", NATIVE_ONLY_ON)
def test_a_name_asking_for_a_native_only_part_is_refused_naming_it(base, part):
    with pytest.raises(ValueError) as refused:
        vllm_policy(f"{base}+{part}")
    message = str(refused.value)
    assert f"+{part}" in message and "does not run on the vLLM backend" in message, message
    assert "native engine (--backend native)" in message, message


def test_several_native_only_parts_are_all_named():
    with pytest.raises(ValueError, match=r"\+admission, \+las-priority do not run on the vLLM backend"):
        vllm_policy("infercept-paper+expected-waste+admission+las-priority")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_runs_on_vllm_with_the_native_only_parts_off_and_the_others_as_named(name):
    native, on_vllm = make_policy(name), vllm_policy(name)
    for attribute in NATIVE_ONLY:
        assert getattr(on_vllm, attribute) == getattr(Policy, attribute), (name, attribute)
    for attribute in HONOURED:
        assert getattr(on_vllm, attribute) == getattr(native, attribute), (name, attribute)
    assert make_policy(on_vllm.label).label == on_vllm.label  # the label names what runs


def test_the_default_policy_runs_on_vllm_whole_with_prefetch():
    policy = vllm_policy("infercept")
    assert policy.prefetch is True and policy.label == "infercept"
    assert (policy.expected_waste, policy.deferred_swap, policy.ample_preserve, policy.preemption) == (
        True, True, "by-copy-overlap", "swap")
    assert vllm_policy("infercept+no-prefetch").prefetch is False
    assert vllm_policy("infercept-paper+prefetch").prefetch is True


@pytest.mark.parametrize("part", HONOURED_VARIANTS)
def test_the_parts_vllm_runs_pass_through_as_named(part):
    attribute, value = part_setting(part)
    assert getattr(vllm_policy(f"infercept-paper+{part}"), attribute) == value


def test_the_summary_names_every_part_once():
    line = summary()
    for attribute in PARTS:
        assert len(re.findall(rf"\b{attribute.replace('_', '-')}\b", line)) == 1, (attribute, line)


# -- the start-up check: before vLLM starts ---------------------------------------------------------------


def create(policy: str):
    from infercept.engine import VllmBackend

    return VllmBackend.create("/nonexistent/model", python=sys.executable, policy=policy)


@pytest.mark.parametrize("policy,named", [("infercept+admission", "+admission"), ("swap+las-priority", "+las-priority"),
                                          ("preserve+admission", "+admission"),
                                          ("infercept-paper+program-arrival-priority", "+program-arrival-priority")])
def test_the_backend_refuses_a_native_only_part_before_vllm_starts(worker_configs, policy, named):
    with pytest.raises(ValueError, match=re.escape(named) + ".*native engine"):
        create(policy)
    assert worker_configs == [], "the vLLM worker was started"


@pytest.mark.parametrize("policy", ["prefix-cache+admission", "discard+expected-waste"])
def test_stock_vllm_takes_no_parts(worker_configs, policy):
    with pytest.raises(ValueError, match="stock vLLM.*runs none of the policy's parts"):
        create(policy)
    assert worker_configs == []


@pytest.mark.parametrize("policy", ["infercept", "infercept-paper+prefetch",
                                    "infercept-paper+deferred-swap+context-cost+expected-waste",
                                    "infercept-paper+ample-no-discard", "preserve+swap-preemption",
                                    "infercept+no-prefetch+arrival-priority"])
def test_the_backend_starts_a_policy_with_parts_vllm_runs(worker_configs, caplog, policy):
    with caplog.at_level(logging.WARNING, logger="infercept.vllm_backend"), pytest.raises(WorkerStarted):
        create(policy)
    (config,) = worker_configs
    assert config["engine"]["additional_config"]["infercept"]["policy"] == policy
    assert config["engine"]["scheduler_cls"].startswith("engine.vllm_backend.scheduler.")
    assert not [r for r in caplog.records if r.name == "infercept.vllm_backend"], "nothing was switched off"


# -- the docs say what the code does --------------------------------------------------------------------------

def test_the_operators_guide_lists_each_part_as_the_code_runs_it():
    """docs/operators.md, the vLLM backend's section: one table row per part, whose vLLM column starts with
    "runs" for the parts vLLM runs and "refused" for the others."""
    text = (ROOT / "docs" / "operators.md").read_text()
    section = text[text.index("## 7. The vLLM backend"):text.index("## 8.")]
    rows = {m.group(1): (m.group(2).strip(), m.group(3).strip())
            for m in re.finditer(r"^\| `([a-z-]+)`[^|]*\|([^|]*)\|([^|]*)\|$", section, re.M)}
    for attribute in PARTS:
        shown = attribute.replace("_", "-")
        assert shown in rows, f"no row for {shown} in docs/operators.md section 7"
        native, vllm = rows[shown]
        assert native.startswith("runs"), (shown, native)
        assert vllm.startswith("runs" if attribute in HONOURED else "refused"), (shown, vllm)


def test_policy_parts_imports_no_vllm():
    """The server's environment has no vLLM: the start-up check reads this module there."""
    source = Path(policy_parts.__file__).read_text()
    assert "vllm" not in {line.split()[1].split(".")[0] for line in source.splitlines()
                          if line.startswith(("import ", "from "))}
