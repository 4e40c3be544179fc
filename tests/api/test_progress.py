"""Prefill progress a client can read: each chunk's `: prefill N/M {...}` comment, on the
random K3 at a scaled clock, estimating the first token from the measured rate; and every
dialect's stream still parsing in its own SDK with the comments in it."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from scripted import real_service, serving, timed_blocks
from serve.snapshots.policy import SnapshotPolicy
from slow_clock import DIALECTS, prompt_text

DELAY_MS = "10"   # per evaluated token: a 64-position chunk lasts about 0.64 s
CHUNK = 64


@pytest.fixture(scope="module")
def k3(lib_path, k3_container):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", DELAY_MS)
        # A policy that measures (the tests' SlowEnginePolicy holds fixed costs)
        with real_service(lib_path, k3_container, thinking=False, prefill_chunk=CHUNK,
                          snapshot_policy=SnapshotPolicy()) as service, \
                serving(service) as srv:
            yield srv


def reports(blocks: list[tuple[float, str]]) -> list[tuple[float, int, int, dict]]:
    """(arrival, done, total, report) of each progress comment."""
    found = []
    for at, block in blocks:
        if block.startswith(": prefill "):
            counts, _, report = block[len(": prefill "):].partition(" ")
            done, total = map(int, counts.split("/"))
            found.append((at, done, total, json.loads(report)))
    return found


def test_the_first_tokens_estimate_after_a_chunk_is_within_a_quarter(k3):
    chat = DIALECTS["chat"]
    sent, blocks = timed_blocks(k3.port, chat.path, chat.body(prompt_text(60, "eta")))
    first_token = next(at for at, block in blocks if chat.token(block))
    found = reports(blocks)
    assert len(found) >= 4, [b for _, b in blocks][:5]
    for at, done, total, report in found:
        assert report["positions"] == total and report["restored"] == 0
        assert report["evaluated"] == done
        assert report["positions_per_second"] > 0   # measured from the first chunk on
    # Once one chunk has run: the estimate of what is left against what it took
    at, done, total, report = found[0]
    actual = first_token - at
    assert report["first_token_seconds"] == pytest.approx(actual, rel=0.25), (report, actual)
    assert report["first_token_at"] > 0


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_each_dialects_stream_with_progress_parses_in_its_own_sdk(k3, dialect):
    spec = DIALECTS[dialect]
    body = spec.body(prompt_text(20, f"sdk {dialect}"))
    _, blocks = timed_blocks(k3.port, spec.path, body)
    assert reports(blocks), "no progress comment: the prompt is too short to prove anything"
    base = f"http://127.0.0.1:{k3.port}"
    fresh = {**body, "stream": True}
    if dialect == "chat":
        with openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
            chunks = list(client.chat.completions.create(**{**fresh, "model": "m"}))
        assert chunks[-1].choices[0].finish_reason == "length"
    elif dialect == "responses":
        with openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
            events = list(client.responses.create(**fresh))
        assert events[-1].type in ("response.completed", "response.incomplete")
    else:
        with anthropic.Anthropic(base_url=base, api_key="x", max_retries=0) as client:
            with client.messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
                message = s.get_final_message()
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
