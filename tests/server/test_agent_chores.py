"""The agents' own side requests (opencode, Claude Code, Codex, Aider, Continue) known as chores
by their whole prompts, from the agents' published packages (tests/fixtures/agents/); near
misses that are not; and a recognised chore's reply held to --background-max-tokens."""
from __future__ import annotations

import copy
import json

import pytest

from agent_prompts import ASK, CLIENTS, HISTORY, OPENCODE_TURN, Case, chores, codex_title, waited_on
from scripted import ScriptedEngine, call, scripted_service, serving, xtml_answer
from serve.core.agents import agent_chore
from serve.core.work_classes import BACKGROUND, INTERACTIVE, Hints
from serve.core.request import ChatRequest, Sampling
from serve.core.work import Classifier
from test_work_classes import ORDINARY

CASES = chores()
IDS = [f"{c.chore}-{i}" for i, c in enumerate(CASES)]


def work(messages: list[dict]) -> str:
    return Classifier().classify(ChatRequest(copy.deepcopy(messages), Sampling()), None).work


def rewrite(case: Case, change) -> list[dict]:
    """The chore's messages with its fixed text changed by `change`, where it sits."""
    messages = copy.deepcopy(case.messages)
    for message in messages:
        content = message["content"]
        parts = content if isinstance(content, list) else [message]
        key = "text" if isinstance(content, list) else "content"
        for part in parts:
            if case.fixed in part[key]:
                part[key] = part[key].replace(case.fixed, change(case.fixed), 1)
                return messages
    raise AssertionError(f"{case.chore}: its fixed text is not in its messages")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_agents_chore_is_known_by_its_own_prompt(case):
    assert agent_chore(case.messages) == case.chore
    assert work(case.messages) == BACKGROUND


def test_every_client_and_release_was_checked():
    assert {c["package"]: c["version"] for c in CLIENTS.values()} == {
        "opencode-ai": "1.18.33", "@anthropic-ai/claude-code": "2.1.332",
        "@openai/codex": "0.171.0", "aider-chat": "0.86.2", "@continuedev/cli": "1.5.47"}
    assert len({c.chore for c in CASES}) == 9


@pytest.mark.parametrize("name,messages", waited_on().items(), ids=list(waited_on()))
def test_side_requests_the_person_waits_on_are_not_chores(name, messages):
    assert agent_chore(messages) is None
    assert work(messages) == INTERACTIVE


def changed(text: str) -> str:
    """One word of the instruction changed, the rest as it was."""
    words = text.split(" ")
    middle = len(words) // 2
    return " ".join(words[:middle] + ["never"] + words[middle + 1:])


def extra(text: str) -> str:
    """The instruction with a sentence of someone else's after it."""
    stripped = text.rstrip()
    return stripped + "\nAlso say which files you read." + text[len(stripped):]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("change", [changed, extra], ids=["changed", "extra text"])
def test_the_same_prompt_changed_or_added_to_is_not_the_chore(case, change):
    messages = rewrite(case, change)
    assert messages != case.messages
    assert agent_chore(messages) is None
    assert work(messages) == INTERACTIVE


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_person_quoting_the_prompt_is_not_the_chore(case):
    quoted = f"What does this prompt ask for?\n\n{case.fixed}"
    for messages in ([{"role": "user", "content": quoted}],
                     [{"role": "system", "content": "Be brief."}, *HISTORY,
                      {"role": "user", "content": quoted}],
                     # the whole chore in an earlier turn: only this request's shape counts
                     [*case.messages, {"role": "assistant", "content": "Retry for fetchUser"},
                      {"role": "user", "content": "Why that title?"}]):
        assert agent_chore(messages) is None, messages
        assert work(messages) == INTERACTIVE


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_prompts_are_not_agents_chores(text):
    for messages in ([{"role": "user", "content": text}],
                     [{"role": "system", "content": text}, {"role": "user", "content": text}]):
        assert agent_chore(messages) is None


def test_the_codex_title_is_known_whatever_its_length_limit():
    messages = [{"role": "user", "content": codex_title(80)}]
    assert agent_chore(messages) == "Codex thread title"
    # ...but not with the person's prompt left out, nor with a word of it moved
    assert agent_chore([{"role": "user", "content": codex_title(80).partition("\n\nUser")[0]}]) is None
    assert agent_chore([{"role": "user", "content": codex_title(80).replace("80", "eighty")}]) is None


def test_a_claude_code_request_without_its_identity_block_is_still_its_chore():
    title = next(c for c in CASES if c.chore == "Claude Code session title")
    system = CLIENTS["claude-code"]["prompts"]["session_title"]
    messages = [{"role": "system", "content": system}, title.messages[1]]
    assert agent_chore(messages) == "Claude Code session title"
    # Another identity than Claude Code's own is extra system text.
    messages[0]["content"] = "You are a helpful assistant.\n\n" + system
    assert agent_chore(messages) is None


# ---- through the server: a recognised chore is bounded whatever it asks --------------------


def bounded_server(**options):
    engine = ScriptedEngine([xtml_answer("ok")] * 12, ctx_max=65536)   # opencode's 9,700 fit
    return engine, serving(scripted_service(engine, thinking=False, background_max_tokens=64,
                                            max_tokens=4096, **options))


def test_opencodes_title_asking_32000_tokens_is_held_to_the_chores_bound_and_its_turn_is_not():
    # As opencode sent them, blocking here; the turn without its tools (they need the
    # optional structured-output packages: tests/api cover tools).
    title, turn = ({key: value for key, value in OPENCODE_TURN[name].items()
                    if key not in ("stream", "stream_options", "tools", "tool_choice")}
                   for name in ("title", "turn"))
    assert title["max_tokens"] == turn["max_tokens"] == 32000      # what opencode sends
    engine, server = bounded_server()
    with server as srv:
        replies = [call(srv.port, "POST", "/v1/chat/completions", body) for body in
                   (title, turn, {**title, "max_tokens": 20})]
    assert [r.status for r in replies] == [200] * 3, replies[0].body
    assert [r.json()["waste"]["work"] for r in replies] == [BACKGROUND, INTERACTIVE, BACKGROUND]
    # The turn's own 32000 is honoured; the title's is cut to 64, and less is left as it is.
    assert [p.max_tokens for p in engine.params] == [64, 32000, 20]


def test_a_claude_code_title_through_the_messages_api_is_bounded_and_a_declared_chore_is_not():
    case = next(c for c in CASES if c.chore == "Claude Code session title")
    body = {"model": "claude-haiku-4-5", "max_tokens": 1024, "stream": False,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332"},
                       {"type": "text", "text": CLIENTS["claude-code"]["prompts"]["identity"]},
                       {"type": "text", "text": CLIENTS["claude-code"]["prompts"]["session_title"]}],
            "messages": [case.messages[1]]}
    declared = {"model": "x", "max_tokens": 1024, "messages": [{"role": "user", "content": ASK}]}
    engine, server = bounded_server(background_models=("claude-haiku-4-5",))
    with server as srv:
        replies = [call(srv.port, "POST", "/v1/messages", body),
                   call(srv.port, "POST", "/v1/messages", {**body, "model": "claude-opus"}),
                   call(srv.port, "POST", "/v1/messages", {**declared, "model": "claude-haiku-4-5"}),
                   call(srv.port, "POST", "/v1/messages", declared,
                        headers={"X-Serve-Class": "background"})]
    assert [r.status for r in replies] == [200] * 4, [r.body for r in replies]
    assert [r.json()["waste"]["work"] for r in replies] == [BACKGROUND] * 4
    # Known by its prompt (under either model name) or by its model: bounded. Declared by
    # its client: the client's own max_tokens.
    assert [p.max_tokens for p in engine.params] == [64, 64, 64, 1024]


def test_the_bound_applies_to_an_open_webui_chore_that_asks_for_more():
    from openwebui_tasks import task
    body = {"messages": [{"role": "user", "content": task("TITLE_GENERATION", HISTORY)}],
            "max_tokens": 1000}
    engine, server = bounded_server()
    with server as srv:
        reply = call(srv.port, "POST", "/v1/chat/completions", body)
    assert reply.status == 200 and reply.json()["waste"]["work"] == BACKGROUND
    assert engine.params[0].max_tokens == 64


def test_the_classifier_bound_lowers_only_recognised_chores():
    rules = Classifier(models=["small"], bound=10)
    title = next(c for c in CASES if c.chore == "opencode title")

    def decide(messages, header=None, max_tokens=500, model="", priority=None) -> int:
        request = ChatRequest(copy.deepcopy(messages), Sampling(max_tokens=max_tokens),
                              hints=Hints(model, priority))
        rules.classify(request, header)
        return request.sampling.max_tokens
    person = [{"role": "user", "content": ASK}]
    assert decide(title.messages) == 10
    assert decide(title.messages, max_tokens=None) is None   # the server's chore default, later
    assert decide(title.messages, max_tokens=3) == 3
    assert decide(person, model="small") == 10
    assert decide(person) == 500
    assert decide(person, header="background") == 500
    assert decide(person, priority=4) == 500
    assert decide(title.messages, header="interactive") == 500


def test_the_fixture_holds_only_prompt_text():
    for client in CLIENTS.values():
        assert set(client) == {"package", "version", "source", "prompts"}
        assert all(isinstance(text, str) and text.strip() for text in client["prompts"].values())
    for body in OPENCODE_TURN.values():
        assert body["messages"][-1] == {"role": "user", "content": json.dumps(ASK)}


def test_codexs_title_through_the_responses_api_is_a_bounded_chore():
    input_items = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions instructions>workspace-write"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": codex_title()}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context>\n  <shell>bash</shell>\n"
                                                    "</environment_context>"}]}]
    body = {"model": "gpt-5.5", "instructions": "You are Codex, a coding agent.",
            "input": input_items, "max_output_tokens": 4000, "stream": False}
    person = {**body, "input": [{"type": "message", "role": "user",
                                 "content": [{"type": "input_text", "text": ASK}]}]}
    engine, server = bounded_server()
    with server as srv:
        replies = [call(srv.port, "POST", "/v1/responses", b) for b in (body, person)]
    assert [r.status for r in replies] == [200, 200], [r.body for r in replies]
    assert [r.json()["waste"]["work"] for r in replies] == [BACKGROUND, INTERACTIVE]
    assert [p.max_tokens for p in engine.params] == [64, 4000]
