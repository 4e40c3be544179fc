"""Heartbeats on the stream writer's clock, and the usage a stream's first events say.

The writer on its own, then every dialect over real sockets and the official
clients with a scripted engine that holds its first token (or a request that
holds the engine) for several heartbeats. The same at a scaled K3 clock on the
reference engine is tests/e2e/test_slow_clock.py.
"""
from __future__ import annotations

import io
import threading
import time

import anthropic
import httpx
import openai
import pytest

from scripted import (ScriptedEngine, block_data, call, scripted_service, serving, timed_blocks,
                      xtml_answer, xtml_tool_call)
from serve.dialects import seal
from serve.dialects.sse import EventWriter

BEAT = 0.3        # the servers' heartbeat here, in seconds
HOLD = 1.5        # how long the scripted engine holds the first token: several heartbeats
MESSAGES, RESPONSES, CHAT = "/v1/messages", "/v1/responses", "/v1/chat/completions"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"name": "get_weather", "description": "Current weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
THINKS = {"type": "enabled", "budget_tokens": 2048}
OFF = {"type": "disabled"}
# K3 replies: reasoning first; no reasoning, then text; no reasoning, then a tool call.
NO_REASONING = ["<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>"]
REASONS_THEN_ANSWERS = xtml_answer("Sunny.", thinking=["Let me ", "look."])
ANSWERS = xtml_answer("Sunny.")
CALLS = xtml_tool_call("get_weather", {"city": "Paris"})


def held(engine: ScriptedEngine, at: int = 0, seconds: float = HOLD) -> ScriptedEngine:
    """The engine waits `seconds` before token `at`, as a slow model would."""
    engine.before_token = lambda n: time.sleep(seconds) if n == at else None
    return engine


# ---- the writer's clock ---------------------------------------------------------------


class Sent(io.RawIOBase):
    """A socket's send side that records what went out and when."""

    def __init__(self) -> None:
        super().__init__()
        self.sends: list[tuple[float, bytes]] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sends.append((time.monotonic(), bytes(data)))
        return len(data)


def test_the_writer_beats_after_each_silence_and_comments_do_not_count():
    sent, beats = Sent(), []
    writer: EventWriter

    def beat() -> None:
        beats.append(time.monotonic())
        writer.put(b"data: beat\n\n")

    # The writer's clock starts when it is made: a busy machine may run the test's next line late.
    started = time.monotonic()
    writer = EventWriter(sent, heartbeat=BEAT, on_silence=beat)
    writer.start()
    try:
        time.sleep(4 * BEAT)                       # silence: beats
        assert beats and beats[0] - started >= BEAT
        quiet = len(beats)
        for _ in range(int(4 * BEAT / 0.05)):      # comments only: still beats
            writer.put(b": prefill\n\n", alive=False)
            time.sleep(0.05)
        assert len(beats) > quiet
        # Each heartbeat came at least a heartbeat after the sign of life before it.
        alive = [at for at, data in sent.sends if b"data:" in data]
        assert all(b - a >= BEAT * 0.99 for a, b in zip([started] + alive, beats))
    finally:
        writer.close()   # a failure here must not leave a writer thread for later tests to count
    after = len(beats)
    time.sleep(2 * BEAT)
    assert len(beats) == after and not writer.is_alive()   # a closed stream never beats


def test_data_keeps_the_writer_from_beating():
    sent, beats = Sent(), []
    writer = EventWriter(sent, heartbeat=2.0, on_silence=lambda: beats.append(1))
    writer.start()
    for _ in range(30):                        # a token every 0.05 s for 1.5 s
        writer.put(b"data: token\n\n")
        time.sleep(0.05)
    writer.close()
    assert beats == [] and len(b"".join(data for _, data in sent.sends)) == 30 * 13


# ---- Messages: the block the reply begins with, opened by the first heartbeat ------------


def anthropic_client(port: int, read: float = 60) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0,
                               timeout=httpx.Timeout(read, connect=10))


def streamed(port: int, **fields) -> tuple[list, anthropic.types.Message]:
    """The raw events the official client yields (it drops pings), and its final message."""
    with anthropic_client(port) as client, client.messages.stream(
            model="m", max_tokens=100, messages=fields.pop("messages", ASK), **fields) as stream:
        events = [event for event in stream if event.type.startswith(("message", "content_block"))]
        return events, stream.get_final_message()


@pytest.mark.parametrize("thinking, reply, blocks", [
    (THINKS, REASONS_THEN_ANSWERS, ["thinking", "text"]),   # the thinking block goes on
    (OFF, ANSWERS, ["text"]),                               # the text block goes on
    (THINKS, NO_REASONING + ["Sunny."] + ANSWERS[1:], ["thinking", "text"]),   # closed empty
    (OFF, CALLS, ["text", "tool_use"]),                     # closed empty by a tool call first
    (THINKS, NO_REASONING + CALLS, ["thinking", "tool_use"]),
])
def test_the_first_heartbeat_opens_the_block_the_reply_begins_with(thinking, reply, blocks):
    engine = held(ScriptedEngine([reply]))
    with serving(scripted_service(engine, thinking=False), heartbeat=BEAT) as srv:
        events, message = streamed(srv.port, thinking=thinking, tools=TOOLS)
    assert [block.type for block in message.content] == blocks
    opened = events[1]
    assert opened.type == "content_block_start" and opened.index == 0
    assert opened.content_block.type == ("thinking" if thinking is THINKS else "text")
    # Heartbeats: empty deltas of block 0 before anything the model wrote.
    deltas = [e for e in events if e.type == "content_block_delta"]
    empty = [e for e in deltas if e.index == 0 and getattr(e.delta, e.delta.type.split("_")[0], None) == ""]
    assert empty and deltas.index(empty[0]) == 0
    first = message.content[0]
    if first.type == "thinking":
        assert seal.verify(first.thinking, first.signature)   # signed, empty or not
        assert first.thinking == ("Let me look." if reply is REASONS_THEN_ANSWERS else "")
    if blocks[-1] == "tool_use":
        assert message.content[-1].input == {"city": "Paris"} and message.stop_reason == "tool_use"
    else:
        assert message.content[-1].text == "Sunny."
    # Block indices are the content's: each block opens once, in order.
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(blocks)))


@pytest.mark.parametrize("thinking, reply", [(THINKS, NO_REASONING + ["Sunny."] + ANSWERS[1:]),
                                             (OFF, CALLS)])
def test_an_empty_opened_block_sent_back_changes_nothing_in_the_prompt(thinking, reply):
    engine = held(ScriptedEngine([reply, ANSWERS]))
    with serving(scripted_service(engine, thinking=False), heartbeat=BEAT) as srv:
        _, message = streamed(srv.port, thinking=thinking, tools=TOOLS)
        content = [block.model_dump(exclude_none=True) for block in message.content]
        empty, rest = content[0], content[1:]
        assert empty.get("thinking", empty.get("text")) == ""
        later = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"],
                                               "content": "18 degrees"} for block in rest
                                              if block["type"] == "tool_use"] or "Thanks."}]
        engine.before_token = None
        for sent_back in (content, rest):   # as received, and as if the block had never been
            with anthropic_client(srv.port) as client:
                client.messages.create(model="m", max_tokens=10, thinking=thinking, tools=TOOLS,
                                       messages=ASK + [{"role": "assistant", "content": sent_back}]
                                       + later)
    assert engine.prompts[-1] == engine.prompts[-2]


def test_a_heartbeat_between_tokens_is_an_empty_delta_of_the_open_block():
    engine = held(ScriptedEngine([xtml_answer("Sun", "ny", "today.")]), at=2)
    with serving(scripted_service(engine, thinking=False), heartbeat=BEAT) as srv:
        sent, blocks = timed_blocks(srv.port, MESSAGES, {"model": "m", "max_tokens": 50,
                                                         "messages": ASK, "stream": True})
    events = [block_data(block) for _, block in blocks if block_data(block) is not None]
    texts = [(e["index"], e["delta"]["text"]) for e in events if e["type"] == "content_block_delta"]
    assert {index for index, _ in texts} == {0} and texts[-1] == (0, "today.")
    # Said before the third token was held (in one delta or two), then empty while it was.
    beat = [text for _, text in texts].index("")
    assert "".join(text for _, text in texts[:beat]) == "Sunny" and 0 < beat < len(texts) - 1
    names = [e["type"] for e in events]
    assert "ping" in names and names[-1] == "message_stop"
    assert names.index("message_stop") == len(names) - 1   # nothing after the end


def test_a_heartbeat_inside_a_tool_call_is_an_empty_piece_of_its_arguments():
    held_at = CALLS.index("Paris")   # the call's block is open, its argument not yet written
    engine = held(ScriptedEngine([CALLS]), at=held_at)
    with serving(scripted_service(engine, thinking=False), heartbeat=BEAT) as srv:
        events, message = streamed(srv.port, thinking=OFF, tools=TOOLS)
    pieces = [e.delta.partial_json for e in events
              if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert "" in pieces and message.content[-1].input == {"city": "Paris"}


# ---- a request waiting in line beats too; the usage once the prompt is known --------------


class Holder:
    """A first request that holds the engine until released, so the next one waits in line;
    the next one's first token is then held as long again."""

    def __init__(self, engine: ScriptedEngine):
        self.inside, self.release = threading.Event(), threading.Event()
        engine.before_token = self._hold

    def _hold(self, n: int) -> None:
        if n == 0 and not self.release.is_set():
            self.inside.set()
            assert self.release.wait(30)
        elif n == 0:
            time.sleep(HOLD)


def waiting_stream(path: str, body: dict, thinking: bool = False) -> tuple[list[str], ScriptedEngine]:
    """`body` streamed while another request holds the engine for several heartbeats."""
    engine = ScriptedEngine([ANSWERS])
    holder = Holder(engine)
    with serving(scripted_service(engine, thinking=thinking), heartbeat=BEAT) as srv:
        first = threading.Thread(target=call, args=(srv.port, "POST", CHAT,
                                                    {"messages": ASK, "max_tokens": 5}))
        first.start()
        assert holder.inside.wait(30)
        threading.Timer(HOLD, holder.release.set).start()
        _, blocks = timed_blocks(srv.port, path, body)
        first.join(30)
    return [block for _, block in blocks], engine


def test_a_messages_stream_waiting_in_line_opens_at_its_first_heartbeat():
    blocks, engine = waiting_stream(MESSAGES, {"model": "m", "max_tokens": 20, "messages": ASK,
                                               "stream": True})
    assert blocks[0] == ": queue 1"
    events = [block_data(b) for b in blocks if block_data(b) is not None]
    start = events[0]["message"]["usage"]
    # Opened by a heartbeat before the prompt was built: its size comes at the end.
    assert start["input_tokens"] == 0 and start["cache_read_input_tokens"] == 0
    assert events[1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    assert events[2]["delta"] == {"type": "text_delta", "text": ""}
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0]   # reused
    assert events[-2]["usage"]["input_tokens"] == len(engine.prompts[-1])


def test_a_responses_stream_waiting_in_line_says_its_usage_once_known():
    blocks, engine = waiting_stream(RESPONSES, {"model": "m", "input": "Weather in Paris?",
                                                "stream": True, "reasoning": {"effort": "none"}})
    events = [block_data(b) for b in blocks if block_data(b) is not None]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:3]] == ["response.created", "response.in_progress",
                                               "response.in_progress"]
    assert events[0]["response"]["usage"] is None   # opened while waiting in line
    beats = [e["response"] for e in events if e["type"] == "response.in_progress"]
    assert all(beat["status"] == "in_progress" and beat["id"] == events[0]["response"]["id"]
               for beat in beats)
    known = [beat["usage"] for beat in beats if beat["usage"] is not None]
    final = events[-1]["response"]["usage"]
    # Heartbeats after the prompt was built say its size (the engine held the first token).
    assert known and known[0]["input_tokens"] == final["input_tokens"] == len(engine.prompts[-1])
    assert known[0]["output_tokens"] == 0


def test_the_first_events_carry_the_prompt_and_its_cached_part(snapshot_cache):
    engine = ScriptedEngine([ANSWERS])
    long_ask = [{"role": "user", "content": "Weather in Paris? " * 30}]
    service = scripted_service(engine, thinking=False, prefix_cache=snapshot_cache)
    with serving(service) as srv:
        for turn in range(2):   # the second restores the first's snapshot
            m = call(srv.port, "POST", MESSAGES, {"model": "m", "max_tokens": 5, "messages": long_ask,
                                                  "stream": True}).named_events()
            r = call(srv.port, "POST", RESPONSES, {"model": "m", "input": long_ask, "stream": True,
                                                   "max_output_tokens": 5}).named_events()
            assert m[0][1]["message"]["usage"] == {**m[-2][1]["usage"], "output_tokens": 0}
            created, completed = r[0][1]["response"]["usage"], r[-1][1]["response"]["usage"]
            assert created == {**completed, "output_tokens": 0, "total_tokens": created["input_tokens"],
                               "output_tokens_details": {"reasoning_tokens": 0}}
            assert r[1][1]["response"]["usage"] == created
    assert m[0][1]["message"]["usage"]["cache_read_input_tokens"] > 0
    assert created["input_tokens_details"]["cached_tokens"] > 0


# ---- Responses and chat completions between tokens ---------------------------------------


def test_a_responses_heartbeat_between_tokens_shows_the_output_so_far():
    engine = held(ScriptedEngine([xtml_answer("Sun", "ny", "today.")]), at=2)
    with serving(scripted_service(engine, thinking=False), heartbeat=BEAT) as srv:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x",
                           max_retries=0) as client, client.responses.stream(
                model="m", input="Weather in Paris?", reasoning={"effort": "none"}) as stream:
            events = list(stream)
            final = stream.get_final_response()
    assert final.output_text == "Sunnytoday."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = next(e for e in events if e.type == "response.output_item.added")
    beats = [e for e in events if e.type == "response.in_progress"
             and e.sequence_number > added.sequence_number]
    assert beats and beats[0].response.output[0].id == added.item.id
    assert beats[0].response.output[0].status == "in_progress"
    assert beats[0].response.usage.input_tokens == final.usage.input_tokens


def test_chat_heartbeats_keep_a_client_read_timeout_shorter_than_the_silence():
    engine = held(ScriptedEngine([xtml_answer("Sun", "ny")]), seconds=3 * HOLD)
    with serving(scripted_service(engine, thinking=False), heartbeat=BEAT) as srv:
        # The client gives up after HOLD without a byte; the model is silent for 3 * HOLD.
        with openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0,
                           timeout=httpx.Timeout(HOLD, connect=10)) as client:
            chunks = list(client.chat.completions.create(model="m", messages=ASK, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "Sunny"
        held(engine)
        raw = call(srv.port, "POST", CHAT, {"messages": ASK, "stream": True}).comments()
    assert "keepalive" in raw
