"""Which requests are chores: Open-WebUI's real task templates, the operator's rules, vLLM's
priority, the X-Serve-Class header; and what being a chore changes for a request."""
from __future__ import annotations

import threading

import pytest

from openwebui_tasks import TEMPLATES, render
from scripted import ScriptedEngine, assert_error, call, held_engine, scrape, scripted_service, \
    serving, xtml_answer
from served import serve
from serve.core.request import ChatRequest, CompletionRequest, Sampling
from serve.core.work_classes import BACKGROUND, INTERACTIVE, Hints
from serve.core.openwebui import task_kind
from serve.core.work import Classifier
from test_engine_queue import wait_until

KINDS = {"TITLE_GENERATION": "title", "TAGS_GENERATION": "tags",
         "IMAGE_PROMPT_GENERATION": "image_prompt", "FOLLOW_UP_GENERATION": "follow_ups",
         "QUERY_GENERATION": "queries", "AUTOCOMPLETE_GENERATION": "autocomplete",
         "EMOJI_GENERATION": "emoji",
         "TOOLS_FUNCTION_CALLING": None, "MOA_GENERATION": None}   # these gate the person's reply
CHAT = [{"role": "user", "content": "### Task:\nHow do tides work? Answer in JSON: {\"title\": 1}"},
        {"role": "assistant", "content": "The moon pulls the sea. <chat_history> is a tag."},
        {"role": "user", "content": "And why twice a day?"}]
# What people and agents send: none of it is a chore.
ORDINARY = [
    "How do tides work?",
    "### Task:\nWrite a Python function that reverses a linked list.\n### Constraints:\n- O(1) space",
    "### Task: summarise the chat history below\n<chat_history>\nUSER: hi\n</chat_history>",
    "Generate a concise title for my blog post about sourdough. Reply as JSON: { \"title\": \"...\" }",
    "Suggest 3-5 follow-up questions I could ask my doctor. JSON format: { \"follow_ups\": [] }",
    "Your task is to reflect on this essay and grade it.",
    "Here is our chat log:\n<chat_history>\nUSER: a\nASSISTANT: b\n</chat_history>\nWhat did I ask?",
    "Generate 1-3 broad tags for this article: {\"tags\": [\"x\"]}",
    "```json\n{ \"queries\": [\"weather berlin\"] }\n```\nWhy does this fail to parse?",
    "Continue the text: The sun was setting over the horizon, painting the sky",
    "Explain the difference between a mutex and a semaphore.",
    "# Task\nRefactor serve/engine/queue.py so it is easier to test.",
    "Translate to French: Where is the station?",
    "Write a haiku about autumn 🍂",
    "Available Tools: []\n\nWhich tool should I use to fetch a URL?",
    "You are an autocompletion system. Just kidding, what's 2+2?",
    "<system-reminder>Use the TodoWrite tool.</system-reminder>\nFix the failing test.",
    "Describe the image as if you were explaining it to someone who cannot see it.",
    "",
]


CASES = [(version, name, template) for version, templates in TEMPLATES.items()
         for name, template in templates.items()]


@pytest.mark.parametrize("version,name,template", CASES, ids=[f"{v}-{n}" for v, n, _ in CASES])
def test_open_webui_task_templates_are_known_by_their_own_text(version, name, template):
    kind = KINDS[name.removeprefix("DEFAULT_").removesuffix("_PROMPT_TEMPLATE")]
    assert task_kind(render(template, CHAT)) == kind
    request = ChatRequest([{"role": "user", "content": render(template, CHAT)}], Sampling())
    assert Classifier().classify(request, None).work == (BACKGROUND if kind else INTERACTIVE)


def test_both_releases_chores_were_checked():
    assert {v: sum(1 for n in t if KINDS[n[8:-16]]) for v, t in TEMPLATES.items()} == \
        {"0.6.34": 7, "0.12.4": 7}


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_prompts_are_not_chores(text):
    assert task_kind(text) is None
    for messages in ([{"role": "user", "content": text}],
                     [{"role": "system", "content": "Be brief."}, *CHAT[:2],
                      {"role": "user", "content": [{"type": "text", "text": text}]}]):
        assert Classifier().classify(ChatRequest(messages, Sampling()), None).work == INTERACTIVE
    assert Classifier().classify(CompletionRequest(text, Sampling()), None).work == INTERACTIVE


def test_a_person_quoting_a_task_template_in_a_conversation_is_judged_by_the_last_message():
    title = render(TEMPLATES["0.12.4"]["DEFAULT_TITLE_GENERATION_PROMPT_TEMPLATE"], CHAT)
    messages = [{"role": "user", "content": title}, {"role": "assistant", "content": "{}"},
                {"role": "user", "content": "Why did you answer that?"}]
    assert Classifier().classify(ChatRequest(messages, Sampling()), None).work == INTERACTIVE


def test_the_order_of_the_rules():
    title = render(TEMPLATES["0.6.34"]["DEFAULT_TITLE_GENERATION_PROMPT_TEMPLATE"], CHAT)
    rules = Classifier(models=["qwen-small"], patterns=[r"^Summarise the diff"])

    def decide(text: str, model: str = "", priority=None, header=None) -> str:
        request = ChatRequest([{"role": "user", "content": text}], Sampling(),
                              hints=Hints(model, priority))
        return rules.classify(request, header).work
    assert decide("hi") == INTERACTIVE
    assert decide(title) == BACKGROUND
    assert decide("Summarise the diff of main") == BACKGROUND
    assert decide("hi", model="qwen-small") == BACKGROUND
    assert decide("hi", priority=5) == BACKGROUND
    assert decide(title, priority=-1) == INTERACTIVE     # the client says a person waits
    assert decide(title, priority=0) == BACKGROUND       # vLLM's default says nothing
    assert decide(title, header="Interactive") == INTERACTIVE
    assert decide("hi", priority=-3, header="background") == BACKGROUND


def test_a_bad_pattern_is_refused():
    with pytest.raises(ValueError, match="--background-match"):
        Classifier(patterns=["(unclosed"])


# ---- through the server -----------------------------------------------------------------


def chores_server(**options):
    engine = ScriptedEngine([xtml_answer("ok")] * 8)
    return engine, serving(scripted_service(engine, thinking=False, **options))


def test_a_chore_gets_at_most_the_background_bound_and_says_its_class():
    title = render(TEMPLATES["0.12.4"]["DEFAULT_TITLE_GENERATION_PROMPT_TEMPLATE"], CHAT)
    engine, server = chores_server(background_max_tokens=7, max_tokens=900)
    with server as srv:
        chore = call(srv.port, "POST", "/v1/chat/completions",
                     {"model": "any", "messages": [{"role": "user", "content": title}]})
        person = call(srv.port, "POST", "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}]})
        capped = call(srv.port, "POST", "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": title}], "max_tokens": 50})
        less = call(srv.port, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": title}], "max_tokens": 5})
    assert [r.json()["waste"]["work"] for r in (chore, person, capped, less)] == \
        [BACKGROUND, INTERACTIVE, BACKGROUND, BACKGROUND]
    # None set: the bound; more asked: the bound; less: its own.
    assert [p.max_tokens for p in engine.params] == [7, 900, 7, 5]


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "claude-haiku", "max_tokens": 9,
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "claude-haiku", "input": "hi"}),
    ("/v1/completions", {"model": "claude-haiku", "prompt": "hi"})])
def test_every_dialect_names_its_model_for_the_background_model_rule(path, body):
    engine, server = chores_server(background_models=("claude-haiku",))
    with server as srv:
        resp = call(srv.port, "POST", path, body)
        other = call(srv.port, "POST", path, {**body, "model": "claude-opus"})
    assert resp.status == other.status == 200, resp.body
    assert (resp.json()["waste"]["work"], other.json()["waste"]["work"]) == (BACKGROUND, INTERACTIVE)


def test_a_bad_class_header_or_priority_is_refused_naming_it():
    engine, server = chores_server()
    with server as srv:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        assert_error(call(srv.port, "POST", "/v1/chat/completions", body,
                          headers={"X-Serve-Class": "urgent"}), 400, code="invalid_value")
        assert_error(call(srv.port, "POST", "/v1/chat/completions", {**body, "priority": "high"}),
                     400, param="priority")
        assert_error(call(srv.port, "POST", "/v1/completions", {"prompt": "hi", "priority": 1.5}),
                     400, param="priority")
        ok = call(srv.port, "POST", "/v1/chat/completions", body, headers={"x-serve-class": "background"})
    assert ok.status == 200 and ok.json()["waste"]["work"] == BACKGROUND
    assert engine.params == [engine.params[0]]   # only the good one reached the engine


def test_the_banner_says_how_chores_are_treated(lib_path, k3_container, tmp_path):
    with serve(k3_container, lib_path, tmp_path, "--background-model", "qwen-small",
               "--background-max-tokens", "99", "--chore-max-wait", "60") as server:
        lines = [b for b in server.banner if b.startswith(("chores", "prefill"))]
    assert lines[0] == "prefill  steps of 512 positions (the reference engine's batch)"
    assert "model qwen-small" in lines[1] and "Open-WebUI's tasks" in lines[1]
    assert "opencode, Claude Code, Codex, Aider, Continue" in lines[1]
    assert "max_tokens 99 unless set, and at most that when recognised " \
        "(--background-max-tokens)" in lines[2]
    assert "one waiting 60 s runs a step" in lines[2]


def test_the_prefill_step_flag_and_classes_off_show_in_the_banner(lib_path, k3_container, tmp_path):
    with serve(k3_container, lib_path, tmp_path, "--prefill-step", "64", "--no-work-classes") as server:
        lines = [b for b in server.banner if b.startswith(("chores", "prefill"))]
    assert lines == ["prefill  steps of 64 positions (--prefill-step)",
                     "chores   off: every request in arrival order (--no-work-classes)"]


def test_the_prefill_step_is_the_engines_own_batch():
    from serve.engine.binding import REFERENCE_BUILD
    from serve.service.prefill import engine_step
    assert engine_step(f"{REFERENCE_BUILD} 0.6.8 (portable C11)") == 512
    assert engine_step("WARP 0.6.8 metal, NEON, container v3") == 64   # WARP's WASTE_CHUNK_MAX


def test_through_the_server_a_person_goes_ahead_of_a_waiting_chore_and_both_are_reported():
    engine, held, release = held_engine(xtml_answer("first"))
    engine.replies += [xtml_answer("person"), xtml_answer("chore")]
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    with serving(scripted_service(engine, thinking=False)) as srv:
        replies: dict[str, dict] = {}

        def send(name: str, body: dict) -> threading.Thread:
            thread = threading.Thread(target=lambda: replies.update(
                {name: call(srv.port, "POST", "/v1/chat/completions", body).json()}))
            thread.start()
            return thread
        threads = [send("first", ask)]
        try:
            assert held.wait(30)
            threads.append(send("chore", {**ask, "priority": 1}))
            wait_until(lambda: call(srv.port, "GET", "/health").json()["queue"] == 1, "chore")
            threads.append(send("person", ask))
            wait_until(lambda: call(srv.port, "GET", "/health").json()["queue"] == 2, "person")
            work = call(srv.port, "GET", "/health").json()["work"]
            now = scrape(srv.port)
        finally:
            release.set()
            for thread in threads:
                thread.join(30)
    assert work["running"] == INTERACTIVE and work["preemptions"] == 0
    assert (work[INTERACTIVE]["queue"], work[BACKGROUND]["queue"]) == (1, 1)
    assert work[BACKGROUND]["longest_wait_s"] >= work[INTERACTIVE]["longest_wait_s"] > 0
    assert now[("serve_queue_waiting", (("class", "interactive"),))] == 1
    assert now[("serve_queue_waiting", (("class", "background"),))] == 1
    assert now[("serve_engine_running", (("class", "interactive"),))] == 1
    assert now[("serve_engine_running", (("class", "background"),))] == 0
    # The person, who came last, was answered second: the scripted replies go in order.
    assert [replies[n]["choices"][0]["message"]["content"] for n in ("first", "person", "chore")] \
        == ["first", "person", "chore"]
    assert replies["chore"]["waste"]["work"] == BACKGROUND
    assert replies["person"]["waste"]["behind_chores_ms"] == 0   # only a person was ahead
