"""Heartbeats at a scaled K3 clock: `python3 -m serve` on the reference engine, WASTE_DELAY_MS set.

A 512-token prefill chunk lasts about 4.6 s, several times the 1 s heartbeat;
one waste_eval call holds the engine thread all that time. In each dialect,
through a raw socket and through the official client, the longest silence
before the first token, as that dialect's clients count silence, stays near
the heartbeat.
"""
from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from served import serve
from slow_clock import CHUNK, DELAY_MS, DIALECTS, prompt_text
from scripted import longest_silence, timed_blocks

BEAT = 1.0
MARGIN = 1.5       # for a busy machine: far below a chunk's silence all the same
CHUNK_S = CHUNK * DELAY_MS / 1000
ITEMS = 36         # 550 to 650 tokens as the dialects render them: a whole chunk, then the rest


@pytest.fixture(scope="module")
def slow(k3_container, lib_path, tmp_path_factory):
    """A server whose engine evaluates a token in DELAY_MS; no snapshots, so every request
    prefills its whole prompt."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", str(DELAY_MS))
        with serve(k3_container, lib_path, tmp_path_factory.mktemp("slow"), "--heartbeat", str(BEAT),
                   "--no-prefix-cache", "--quiet") as served:
            yield served.port


@pytest.mark.parametrize("name", DIALECTS)
def test_a_raw_stream_is_never_silent_longer_than_the_heartbeat(slow, name):
    dialect = DIALECTS[name]
    sent, blocks = timed_blocks(slow, dialect.path, dialect.body(prompt_text(ITEMS, f"raw-{name}")))
    first = next(at for at, block in blocks if dialect.token(block))
    assert first - sent >= CHUNK_S   # the prefill did hold the engine for a whole chunk
    assert longest_silence(sent, blocks, dialect.counts, dialect.token) <= BEAT + MARGIN


def timeout() -> httpx.Timeout:
    """A client that gives up after this much silence: less than one chunk."""
    return httpx.Timeout(BEAT + MARGIN, connect=10)


@pytest.mark.parametrize("name", ["chat", "completions"])
def test_the_openai_client_reads_through_a_prefill_longer_than_its_read_timeout(slow, name):
    text = prompt_text(ITEMS, f"client-{name}")
    with openai.OpenAI(base_url=f"http://127.0.0.1:{slow}/v1", api_key="x", max_retries=0,
                       timeout=timeout()) as client:
        sent = time.monotonic()
        if name == "chat":
            chunks = list(client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": text}], max_tokens=4, stream=True))
        else:
            chunks = list(client.completions.create(model="m", prompt=text, max_tokens=4, stream=True))
    assert time.monotonic() - sent >= CHUNK_S and chunks[-1].choices[0].finish_reason


def gaps(sent: float, stamped: list[tuple[float, str]], first: str) -> float:
    """The longest wait between the events a client yielded, up to the first of type `first`."""
    last, longest = sent, 0.0
    for at, kind in stamped:
        longest, last = max(longest, at - last), at
        if kind == first:
            return longest
    raise AssertionError(f"no {first} among {[kind for _, kind in stamped]}")


def test_the_openai_client_sees_responses_events_through_the_prefill(slow):
    text = prompt_text(ITEMS, "client-responses")
    with openai.OpenAI(base_url=f"http://127.0.0.1:{slow}/v1", api_key="x", max_retries=0,
                       timeout=timeout()) as client:
        sent = time.monotonic()
        stamped = [(time.monotonic(), event.type) for event in client.responses.create(
            model="m", input=text, max_output_tokens=4, stream=True, reasoning={"effort": "none"})]
    # The first piece of the reply, or its end when the random weights wrote nothing visible.
    reply = ("response.output_text.delta", "response.function_call_arguments.delta",
             "response.completed", "response.incomplete")
    first = next(at for at, kind in stamped if kind in reply)
    assert first - sent >= CHUNK_S
    assert gaps(sent, [(at, "token" if at == first else kind) for at, kind in stamped],
                "token") <= BEAT + MARGIN
    assert [kind for _, kind in stamped].count("response.in_progress") >= 1 + int(CHUNK_S / BEAT) // 2


def test_the_anthropic_client_sees_content_events_through_the_prefill(slow):
    text = prompt_text(ITEMS, "client-messages")
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{slow}", api_key="x", max_retries=0,
                             timeout=timeout()) as client:
        sent = time.monotonic()
        events = client.messages.create(model="m", max_tokens=4, stream=True,
                                        messages=[{"role": "user", "content": text}])
        stamped = [(time.monotonic(), event) for event in events]   # the client drops pings
    kinds = [(at, event.type) for at, event in stamped]
    start = stamped[0][1].message.usage
    assert start.input_tokens > CHUNK   # the prompt's size, known before the prefill
    firsts = [at for at, event in stamped if event.type == "message_delta" or
              (event.type == "content_block_delta" and (getattr(event.delta, "thinking", "")
                                                        or getattr(event.delta, "text", "")
                                                        or getattr(event.delta, "partial_json", "")))]
    assert firsts[0] - sent >= CHUNK_S
    assert gaps(sent, [(at, "token" if at == firsts[0] else kind) for at, kind in kinds],
                "token") <= BEAT + MARGIN
