"""The server-side tools: the calculator's arithmetic and its refusals, the document lookup, and the
simulated augmentations' seeded draws (with a tiny time scale so nothing really waits)."""
from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from infercept.tools import ToolSettings, build_registry, get_tool, list_tools
from infercept.tools.calculator import CalculationError, evaluate
from infercept.tools.settings import REPOSITORY_AUGMENTS
from infercept.tools.simulated import SimulatedTool, load_augments


def run(tool, arguments):
    return asyncio.run(tool.run(arguments))


def test_registry_lists_every_tool_and_names_them_on_a_miss():
    names = list_tools()
    assert names == ["calculator", "document_lookup", "math", "qa", "ve", "chatbot", "image", "tts"]
    for name in names:
        tool = get_tool(name)
        assert tool.name == name and tool.description
        assert tool.parameters["type"] == "object" and tool.parameters["required"]
        assert tool.openai_tool()["function"]["parameters"] == tool.parameters
    with pytest.raises(KeyError, match="known tools: calculator, document_lookup"):
        get_tool("shell")


@pytest.mark.parametrize("expression, value", [
    ("24*9/5+32", 75.2), ("2**10", 1024), ("-3//2", -2), ("7 % 3", 1), ("-(2+3)*4", -20), ("+5", 5),
    ("sqrt(16) + log10(1000)", 7.0), ("round(2.567, 2)", 2.57), ("max(3, 1, 2)", 3), ("factorial(5)", 120),
    ("2*pi", 6.283185307179586), ("1.5e3 / 3", 500.0), ("2**-1", 0.5), ("10**1000 // 10**999", 10)])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == pytest.approx(value)


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('true')", "not allowed"), ("(1).__class__", "not allowed"),
    ("().__class__.__bases__", "not allowed"), ("x + 1", "not allowed"), ("open('/etc/passwd')", "not allowed"),
    ("sqrt(x=4)", "not allowed"), ("[1, 2]", "not allowed"), ("lambda: 1", "not allowed"),
    ("'a' * 3", "only numbers"), ("True + 1", "only numbers"), ("1j * 1j", "only numbers"),
    ("9**9**9", "too large"), ("10**5000", "too large"), ("(10**1000) * (10**1000) * (10**1000) * (10**1000) * 10**1000",
                                                         "too large"),
    ("factorial(10**6)", "factorial takes"), ("2.0**100000", "OverflowError"), ("1/0", "ZeroDivisionError"),
    ("sqrt(-1)", "domain"), ("(-8) ** (1/3)", "not a real number"), ("1 +", "not an arithmetic expression"),
    ("1" + "+1" * 300, "longer than"), ("-" * 250 + "1", "more than")])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, reason):
    with pytest.raises(CalculationError, match=reason):
        evaluate(expression)


def test_calculator_tool_reports_errors_as_text():
    calculator = get_tool("calculator")
    assert run(calculator, {"expression": "24*9/5+32"}) == "75.2"
    assert run(calculator, {"expression": "2**0.5"}) == "1.41421356237"
    assert run(calculator, {"expression": "__import__('os')"}).startswith("Error: not allowed")
    with pytest.raises(ValueError, match="must be a string"):
        run(calculator, {"expression": 3})


def test_document_lookup_ranks_passages_by_shared_terms(tmp_path):
    (tmp_path / "pets.md").write_text("# Pets\n\nCats sleep sixteen hours a day.\n\nDogs like long walks.\n")
    (tmp_path / "notes.txt").write_text("Walks in the park are good for dogs and their owners.")
    (tmp_path / "ignored.json").write_text('{"dogs": "walks"}')
    lookup = build_registry(ToolSettings(docs_dir=tmp_path))["document_lookup"]
    found = run(lookup, {"query": "Why do dogs need walks in the park?"}).split("\n\n")
    assert found == ["[notes.txt] Walks in the park are good for dogs and their owners.",
                     "[pets.md] Dogs like long walks."]
    assert run(lookup, {"query": "parrots"}) == "No document mentions 'parrots'."


def test_document_lookup_searches_the_bundled_docs_by_default():
    assert ToolSettings().docs_dir.is_dir()
    answer = run(get_tool("document_lookup"), {"query": "What does cached_tokens report?"})
    assert answer.startswith("[infercept.md]") and "cached_tokens" in answer


def test_simulated_tools_follow_the_augments_profile():
    profiles = load_augments(REPOSITORY_AUGMENTS)
    assert set(profiles) == {"math", "qa", "ve", "chatbot", "image", "tts"}
    for name, profile in profiles.items():
        tool = SimulatedTool(name, profile, seed=1)
        draws = [tool.draw() for _ in range(400)]
        mean_s, sd_s = profile["interception_s"]
        mean_tokens = profile["return_tokens_assumed"][0]
        # 400 lognormal draws: the sample mean is within a few standard errors of the profile's mean
        assert statistics.fmean(d.duration_s for d in draws) == pytest.approx(mean_s, rel=0.25)
        assert statistics.fmean(d.num_tokens for d in draws) == pytest.approx(mean_tokens, rel=0.25, abs=1)
        assert min(d.num_tokens for d in draws) >= 1 and min(d.duration_s for d in draws) > 0


def test_simulated_draws_are_seeded_and_scaled():
    profile = load_augments(REPOSITORY_AUGMENTS)["qa"]
    first = SimulatedTool("qa", profile, seed=7).draw()
    again = SimulatedTool("qa", profile, seed=7)
    scaled = SimulatedTool("qa", profile, seed=7, time_scale=0.001)
    other = SimulatedTool("qa", profile, seed=8)
    a, b, c = again.draw(), scaled.draw(), other.draw()
    assert first == a
    assert b.num_tokens == a.num_tokens and b.duration_s == pytest.approx(a.duration_s * 0.001)
    assert c != a


def test_simulated_tool_waits_the_drawn_time_and_returns_that_many_words():
    profile = load_augments(REPOSITORY_AUGMENTS)["chatbot"]  # 28.6 s mean: scaled to about 3 ms
    expected = SimulatedTool("chatbot", profile, seed=3, time_scale=1e-4).draw()
    tool = SimulatedTool("chatbot", profile, seed=3, time_scale=1e-4)
    started = time.monotonic()
    text = run(tool, {"input": "hello"})
    assert time.monotonic() - started >= expected.duration_s
    assert len(text.split()) == expected.num_tokens


def test_settings_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERCEPT_DOCS_DIR", str(tmp_path))
    monkeypatch.setenv("INFERCEPT_SIMULATED_TIME_SCALE", "0.01")
    monkeypatch.setenv("INFERCEPT_SIMULATED_SEED", "5")
    settings = ToolSettings.from_env()
    assert (settings.docs_dir, settings.simulated_time_scale, settings.simulated_seed) == (tmp_path, 0.01, 5)
    registry = build_registry(settings)
    assert registry["tts"].time_scale == 0.01
    with pytest.raises(ValueError, match="simulated_time_scale"):
        ToolSettings(simulated_time_scale=-1)
