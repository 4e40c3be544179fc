"""Reasoning effort: every OpenAI value onto the K3 release encoder's levels, checked against
its vectors; accepted and reported on every model."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT
from scripted import call, engine, real_service, scripted_service, serving  # noqa: F401
from serve.core.request import REASONING_EFFORTS

VECTORS = json.loads((ROOT / "tests" / "fixtures" / "xtml_vectors.json").read_text("utf-8"))["cases"]
CHAT = "/v1/chat/completions"
OPENAI_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# The documented table (docs/api.md), as the release's levels: None is thinking off.
K3_LEVEL = {"none": None, "minimal": None, "low": "low", "medium": "high", "high": "high",
            "xhigh": "max"}


def release_prompt(level):
    """The release encoder's prompt for `level`, from its vectors. It has none for `high`:
    that is its `low` vector with the effort named `high` (the release accepts low, high
    and max), which the test checks is the only difference."""
    if level is None:
        return VECTORS["no_thinking"]
    if level == "high":
        low = VECTORS["thinking_effort_low"]
        segments = [[text.replace("`thinking_effort=low`", "`thinking_effort=high`"), markup]
                    for text, markup in low["segments"]]
        assert sum(a != b for a, b in zip(segments, low["segments"])) == 1
        return {"input": low["input"], "segments": segments}
    return VECTORS[f"thinking_effort_{level}"]


def test_the_table_is_the_servers():
    assert {value: REASONING_EFFORTS[value] for value in OPENAI_EFFORTS} == K3_LEVEL


@pytest.mark.parametrize("effort", OPENAI_EFFORTS)
def test_each_openai_effort_renders_the_release_prompt_of_its_k3_level(engine, effort):
    case = release_prompt(K3_LEVEL[effort])
    with serving(scripted_service(engine)) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": case["input"]["messages"],
                                            "reasoning_effort": effort}).json()
    assert [[s.text, s.markup] for s in engine.segments] == case["segments"]
    assert body["waste"]["reasoning"] == (K3_LEVEL[effort] or "off")


def test_thinking_without_an_effort_is_reported_on(engine):
    with serving(scripted_service(engine)) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert body["waste"]["reasoning"] == "on"
    assert not any("thinking_effort" in s.text for s in engine.segments)


def test_an_effort_no_one_defines_is_a_400_listing_the_values(engine):
    with serving(scripted_service(engine)) as srv:
        resp = call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                            "reasoning_effort": "extreme"})
    assert resp.status == 400
    error = resp.json()["error"]
    assert error["param"] == "reasoning_effort"
    assert all(value in error["message"] for value in OPENAI_EFFORTS)


def _every_effort_is_accepted(lib_path, container, reported):
    with real_service(lib_path, container) as service, serving(service) as srv:
        for effort in OPENAI_EFFORTS:
            resp = call(srv.port, "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                                 "reasoning_effort": effort, "max_tokens": 2,
                                                 "seed": 1})
            assert resp.status == 200, (effort, resp.body)
            assert resp.json()["waste"]["reasoning"] == reported(effort)


def test_every_openai_effort_is_accepted_on_k3(lib_path, k3_container):
    _every_effort_is_accepted(lib_path, k3_container, lambda effort: K3_LEVEL[effort] or "off")


def test_every_openai_effort_is_accepted_on_a_model_without_reasoning(lib_path, kimi_linear_container):
    _every_effort_is_accepted(lib_path, kimi_linear_container, lambda effort: "unsupported")


def test_every_openai_effort_is_accepted_on_smollm2(lib_path, smollm2):
    _every_effort_is_accepted(lib_path, smollm2, lambda effort: "unsupported")
