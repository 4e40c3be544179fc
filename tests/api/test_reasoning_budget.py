"""Reasoning budgets counted in tokens, and "answer now", on the random K3 at a scaled clock.

A budget closes the think channel with the markup K3's release encoder writes when
reasoning ends, and the model goes on in its answer channel; the reply's usage says
how many tokens reasoning took and what ended it. At temperature 0 the reasoning under
a budget of N is exactly the first N tokens of an unbudgeted reply's reasoning, which
is how these tests know the count is right without trusting the server's own.
"""
from __future__ import annotations

import json
import threading

import anthropic
import openai
import pytest

from scripted import ScriptedEngine, call, real_service, scripted_service, serving, xtml_answer
from serve.core.request import ChatRequest, Sampling
from serve.formats.xtml import render as xtml
from serve.service.reasoning_budget import ANSWER_NOW, BUDGET, MODEL
from serve.service.journal import Emitted

DELAY_MS = "2"     # per evaluated token: a scaled clock, not a fast one
BUDGET_TOKENS = 64
ROOM = 160         # max_tokens: the budget, its close and an answer fit; nothing else limits
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def k3(lib_path, k3_container):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", DELAY_MS)
        with real_service(lib_path, k3_container, thinking=True) as service, \
                serving(service) as srv:
            yield service, srv


@pytest.fixture(scope="module")
def clients(k3):
    _, srv = k3
    base = f"http://127.0.0.1:{srv.port}"
    with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120) as oa, \
            anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120) as an:
        yield oa, an


@pytest.fixture(scope="module")
def unbudgeted(clients) -> str:
    """The first BUDGET_TOKENS tokens of the reasoning, when nothing closes it."""
    oa, _ = clients
    reply = oa.chat.completions.create(model="m", messages=ASK, temperature=0,
                                       max_tokens=BUDGET_TOKENS)
    waste = reply.model_extra["waste"]
    assert waste["reasoning_tokens"] == BUDGET_TOKENS and waste["reasoning_ended"] is None
    return reply.choices[0].message.model_extra["reasoning_content"]


def check_budgeted(unbudgeted: str, reasoning: str, answer: str, waste: dict,
                   completion_tokens: int) -> None:
    """The think channel held the budget's tokens at most, then the answer followed."""
    closing = len(xtml.reasoning_end())   # markup segments: at least one id each
    assert waste["reasoning_budget"] == BUDGET_TOKENS
    if waste["reasoning_ended"] == MODEL:   # the random model closed it first: rare, allowed
        assert waste["reasoning_tokens"] <= BUDGET_TOKENS and unbudgeted.startswith(reasoning)
        return
    assert waste["reasoning_ended"] == BUDGET
    assert waste["reasoning_tokens"] == BUDGET_TOKENS and reasoning == unbudgeted
    assert completion_tokens > BUDGET_TOKENS + closing   # tokens after the close: the answer
    assert answer


def test_chat_blocking_and_streamed_through_openai(clients, unbudgeted):
    oa, _ = clients
    body = dict(model="m", messages=ASK, temperature=0, max_tokens=ROOM,
                extra_body={"thinking_token_budget": BUDGET_TOKENS})
    done = oa.chat.completions.create(**body)
    message = done.choices[0].message
    assert done.usage.completion_tokens_details.reasoning_tokens == \
        done.model_extra["waste"]["reasoning_tokens"]
    check_budgeted(unbudgeted, message.model_extra["reasoning_content"], message.content or "",
                   done.model_extra["waste"], done.usage.completion_tokens)

    pieces: list[tuple[str, str]] = []
    usage = waste = None
    for chunk in oa.chat.completions.create(**body, stream=True,
                                            stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage, waste = chunk.usage, chunk.model_extra["waste"]
        for choice in chunk.choices:
            reasoning = (choice.delta.model_extra or {}).get("reasoning_content")
            if reasoning:
                pieces.append(("reasoning", reasoning))
            if choice.delta.content:
                pieces.append(("content", choice.delta.content))
    kinds = [kind for kind, _ in pieces]
    assert "reasoning" not in kinds[kinds.index("content"):]   # one channel, then the other
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == BUDGET_TOKENS
    check_budgeted(unbudgeted, "".join(t for k, t in pieces if k == "reasoning"),
                   "".join(t for k, t in pieces if k == "content"), waste, usage.completion_tokens)
    assert "".join(t for k, t in pieces if k == "content") == message.content


def test_messages_blocking_and_streamed_through_anthropic(clients):
    _, an = clients
    # A budget under 8,192 also asks K3 for its low effort: the same prompt, with no budget
    reference = an.messages.create(model="m", messages=ASK, temperature=0,
                                   max_tokens=BUDGET_TOKENS, thinking={"type": "adaptive"},
                                   extra_body={"output_config": {"effort": "low"}})
    unbudgeted = reference.content[0].thinking
    body = dict(model="m", messages=ASK, temperature=0, max_tokens=ROOM,
                thinking={"type": "enabled", "budget_tokens": BUDGET_TOKENS})
    done = an.messages.create(**body)
    assert [block.type for block in done.content][:2] == ["thinking", "text"]
    check_budgeted(unbudgeted, done.content[0].thinking, done.content[1].text,
                   done.model_extra["waste"], done.usage.output_tokens)
    with an.messages.stream(**body) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    kinds = [event.delta.type for event in events if event.type == "content_block_delta"]
    # Messages has no usage field for reasoning: serve's `waste` says it, streamed too.
    ended, = [event.model_extra["waste"] for event in events if event.type == "message_delta"]
    assert ended["reasoning_tokens"] == done.model_extra["waste"]["reasoning_tokens"]
    assert ended["reasoning_ended"] == done.model_extra["waste"]["reasoning_ended"]
    assert kinds.index("text_delta") > kinds.index("thinking_delta")
    assert "thinking_delta" not in kinds[kinds.index("text_delta"):]
    def texts(message) -> list[tuple[str, str]]:
        return [(block.type, getattr(block, block.type)) for block in message.content]
    assert texts(streamed) == texts(done)


def test_responses_blocking_and_streamed_through_openai(clients, unbudgeted):
    oa, _ = clients
    body = dict(model="m", input=ASK, temperature=0, max_output_tokens=ROOM,
                reasoning={"max_tokens": BUDGET_TOKENS})
    done = oa.responses.create(**body)
    assert done.usage.output_tokens_details.reasoning_tokens == BUDGET_TOKENS
    reasoning = "".join(part.text for item in done.output if item.type == "reasoning"
                        for part in item.content or ())
    check_budgeted(unbudgeted, reasoning, done.output_text, done.model_extra["waste"],
                   done.usage.output_tokens)
    events = list(oa.responses.create(**body, stream=True))
    kinds = [event.type for event in events
             if event.type in ("response.reasoning_text.delta", "response.output_text.delta")]
    # max_output_tokens ends the answer: the last event is response.incomplete
    streamed = events[-1].response
    assert events[-1].type == "response.incomplete" and done.status == "incomplete"
    assert "response.reasoning_text.delta" not in kinds[kinds.index("response.output_text.delta"):]
    assert streamed.output_text == done.output_text
    assert streamed.usage.output_tokens_details.reasoning_tokens == BUDGET_TOKENS


def test_a_budget_of_zero_is_thinking_off(clients):
    oa, an = clients
    chat = oa.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=4,
                                      extra_body={"thinking_token_budget": 0})
    assert "reasoning_content" not in chat.choices[0].message.model_extra
    assert chat.model_extra["waste"]["reasoning"] == "off"
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0
    # Greedy, as above: a sampled four-token reply may say nothing at all, and then has
    # no text block to count.
    message = an.messages.create(model="m", messages=ASK, max_tokens=4, temperature=0,
                                 thinking={"type": "enabled", "budget_tokens": 0})
    assert [block.type for block in message.content] == ["text"]
    response = oa.responses.create(model="m", input=ASK, max_output_tokens=4, temperature=0,
                                   reasoning={"max_tokens": 0})
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"thinking_token_budget": -2}, "thinking_token_budget"),
    ("/v1/chat/completions", {"thinking_token_budget": "64"}, "thinking_token_budget"),
    ("/v1/chat/completions", {"thinking_token_budget": 6.5}, "thinking_token_budget"),
    ("/v1/responses", {"reasoning": {"max_tokens": -2}}, "reasoning.max_tokens"),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": True}},
     "thinking.budget_tokens"),
])
def test_a_budget_that_is_not_a_count_is_refused_naming_its_field(k3, path, body, param):
    _, srv = k3
    messages = {"input": ASK} if path == "/v1/responses" else {"messages": ASK}
    resp = call(srv.port, "POST", path, {"model": "m", "max_tokens": 4, **messages, **body})
    assert resp.status == 400
    error = resp.json()["error"]
    assert error.get("param", param) == param and param in error["message"]


@pytest.fixture(scope="module")
def no_reasoning(lib_path, kimi_linear_container):
    """A chat.json model: no think channel to budget."""
    with real_service(lib_path, kimi_linear_container) as service, serving(service) as srv:
        yield srv


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"thinking_token_budget": 8}, "thinking_token_budget"),
    ("/v1/responses", {"reasoning": {"max_tokens": 8}}, "reasoning.max_tokens"),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 8}},
     "thinking.budget_tokens"),
])
def test_a_model_without_a_think_channel_refuses_a_budget_asked_for(no_reasoning, path, body,
                                                                    param):
    messages = {"input": ASK} if path == "/v1/responses" else {"messages": ASK}
    base = {"model": "m", "max_tokens": 2, **messages}
    resp = call(no_reasoning.port, "POST", path, {**base, **body})
    assert resp.status == 400 and param in resp.json()["error"]["message"], resp.body
    assert call(no_reasoning.port, "POST", path, base).status == 200   # none asked: served
    zero = {"thinking_token_budget": 0} if "chat" in path else \
        {"reasoning": {"max_tokens": 0}} if "responses" in path else \
        {"thinking": {"type": "enabled", "budget_tokens": 0}}
    assert call(no_reasoning.port, "POST", path, {**base, **zero}).status == 200


def test_the_servers_budget_applies_when_a_request_sets_none(lib_path, k3_container):
    with real_service(lib_path, k3_container, thinking=True, reasoning_budget=8) as service, \
            serving(service) as srv:
        body = {"model": "m", "messages": ASK, "temperature": 0, "max_tokens": 40}
        resp = call(srv.port, "POST", "/v1/chat/completions", body)
        reply = resp.json()
        assert resp.status == 200 and reply["waste"]["reasoning_budget"] == 8
        assert reply["waste"]["reasoning_tokens"] <= 8
        resp = call(srv.port, "POST", "/v1/chat/completions", {**body, "thinking_token_budget": -1})
        reply = resp.json()
        assert resp.status == 200 and reply["waste"]["reasoning_budget"] is None
        assert reply["waste"]["reasoning_tokens"] > 8
        # Ollama's API has no budget field, so the server's applies; its last piece's `waste`
        # says what reasoning took and that the budget ended it.
        resp = call(srv.port, "POST", "/api/chat", {"model": "m", "messages": ASK, "stream": False,
                                                    "think": True, "options": {"temperature": 0,
                                                                               "num_predict": 40}})
        reply = resp.json()
        assert resp.status == 200 and reply["message"]["thinking"] and reply["message"]["content"]
        assert resp.headers["x-serve-job"].startswith("job-")   # answer now and stop reach it
        assert reply["waste"]["reasoning_budget"] == 8 and reply["waste"]["reasoning_tokens"] == 8
        assert reply["waste"]["reasoning_ended"] == "budget"


# ---- answer now: the mechanism, called from a thread outside the run ------------------


@pytest.mark.parametrize("logprobs", [None, 1], ids=["waste_generate", "serve's decoder"])
def test_answer_now_closes_the_reasoning_at_the_next_token(k3, logprobs):
    service, _ = k3
    run = service.new_journal(lambda: False)
    request = ChatRequest(messages=ASK, sampling=Sampling(temperature=0.0, max_tokens=ROOM),
                          logprobs=logprobs)
    replies: list = []

    def answer() -> None:
        try:
            replies.append(service.chat(request, run))
        finally:
            run.end()   # as the HTTP side does once the call returns
    worker = threading.Thread(target=answer)
    worker.start()
    kinds: list[str] = []
    called_at = None
    try:
        more, position = True, 0
        while more:
            events, more = run.read(position)
            position += len(events)
            for event in events:
                if isinstance(event, Emitted):
                    kinds.append("reasoning" if event.delta.reasoning_content else
                                 "content" if event.delta.content else "other")
            if called_at is None and kinds.count("reasoning") >= 5:
                called_at = len(kinds)
                assert run.reasoning is not None and run.reasoning.answer_now()
    finally:
        worker.join(120)
    reply, = replies
    waste = reply.usage.waste
    assert called_at is not None and waste["reasoning_ended"] == ANSWER_NOW
    assert 5 <= waste["reasoning_tokens"] < ROOM // 2   # closed soon after the call
    assert reply.message["reasoning_content"] and reply.message["content"]   # both kept
    assert "reasoning" not in kinds[kinds.index("content"):]
    assert reply.usage.completion_tokens == ROOM   # the answer went on to max_tokens
    assert not run.reasoning.answer_now()   # nothing left to close


def test_answer_now_after_the_reasoning_ended_says_so(k3):
    service, _ = k3
    run = service.new_journal(lambda: False)
    reply = service.chat(ChatRequest(messages=ASK, sampling=Sampling(temperature=0.0,
                                                                     max_tokens=40),
                                     thinking_token_budget=4), run)
    assert reply.usage.waste["reasoning_ended"] == BUDGET
    assert run.reasoning is not None and not run.reasoning.answer_now()
    off = service.new_journal(lambda: False)
    service.chat(ChatRequest(messages=ASK, sampling=Sampling(max_tokens=2), thinking=False), off)
    assert off.reasoning is None   # a reply that does not think has nothing to close


# ---- waste_generate in pieces: a scripted model, so that what each piece is handed shows ----


def test_a_model_closing_its_reasoning_first_ends_the_piece_and_serve_writes_the_rest():
    """Under a budget the first closing id is a stop token: the model's own `<|close|>` ends
    the piece, and the next piece's prompt is the rest of the closing markup."""
    answer = xtml_answer("Hello")
    engine = ScriptedEngine(replies=[["Let me think.", "<|close|>"], answer])
    service = scripted_service(engine, thinking=True)
    with serving(service) as srv:
        resp = call(srv.port, "POST", "/v1/chat/completions",
                    {"messages": ASK, "thinking_token_budget": 8})
    body = resp.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello",
                                             "reasoning_content": "Let me think."}
    assert (body["waste"]["reasoning_tokens"], body["waste"]["reasoning_ended"]) == (1, MODEL)
    closing = engine.tokenize_segments(xtml.reasoning_end())
    assert engine.params[0].max_tokens == 8 and closing[0] in engine.params[0].stop_tokens
    assert engine.prompts[1][-(len(closing) - 1):] == closing[1:]   # the rest, after the model's
    assert closing[0] not in engine.params[1].stop_tokens


def test_a_spent_budget_hands_the_next_piece_the_whole_closing_markup():
    engine = ScriptedEngine(replies=[["a", "b", "c", "d"], xtml_answer("Hi")])
    service = scripted_service(engine, thinking=True)
    with serving(service) as srv:
        body = call(srv.port, "POST", "/v1/chat/completions",
                    {"messages": ASK, "thinking_token_budget": 3}).json()
    closing = engine.tokenize_segments(xtml.reasoning_end())
    assert engine.params[0].max_tokens == 3
    assert engine.prompts[1][-len(closing):] == closing
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi",
                                             "reasoning_content": "abc"}
    assert (body["waste"]["reasoning_tokens"], body["waste"]["reasoning_ended"]) == (3, BUDGET)
    assert body["usage"]["completion_tokens"] == 3 + len(closing) + len(xtml_answer("Hi"))


def test_a_budget_under_a_grammar_closes_where_the_grammar_lets_the_answer_follow(clients):
    """Serve's decoder, constrained: the forced close goes through the grammar's matcher too."""
    oa, _ = clients
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    reply = oa.chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=ROOM,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        extra_body={"thinking_token_budget": 8})
    waste = reply.model_extra["waste"]
    assert waste["constrained"] and waste["reasoning_ended"] == BUDGET
    assert waste["reasoning_tokens"] == 8
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content)["a"], int)


def test_a_budget_whose_close_cannot_fit_leaves_max_tokens_to_end_the_reply():
    engine = ScriptedEngine(replies=[list("abcdefgh")])
    service = scripted_service(engine, thinking=True)
    with serving(service) as srv:
        body = call(srv.port, "POST", "/v1/chat/completions",
                    {"messages": ASK, "thinking_token_budget": 3, "max_tokens": 6}).json()
    assert len(engine.tokenize_segments(xtml.reasoning_end())) + 3 >= 6   # no room to close
    assert [p.max_tokens for p in engine.params] == [6]   # one piece, to max_tokens
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["reasoning_content"] == "abcdef"
    assert (body["waste"]["reasoning_tokens"], body["waste"]["reasoning_ended"]) == (6, None)
