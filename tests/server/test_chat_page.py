"""The chat page at GET /, driven in a real headless Chromium through Playwright.

Replies come from the scripted engine where the test needs to hold a reply
mid-stream or choose its text (hostile markup), and from the reference engine
for the whole path with real expert counters.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time

import pytest

from browser import WAIT_MS, browser, page_on
from scripted import (ScriptedEngine, call, real_service, scripted_service, serving, tiny_png,
                      xtml_answer, xtml_tool_call)
from serve.engine.binding import WasteError
from serve.http.page import inline_block
from serve.snapshots.cache import PrefixCache


class Gate:
    """Holds the scripted engine before token `at` until released (or the test's wait runs out)."""

    def __init__(self, at: int):
        self.at = at
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, index: int) -> None:
        if index == self.at:
            self.reached.set()
            self.release.wait(WAIT_MS / 1000)
        elif index > self.at:
            # Past the gate, a slow model's pace: a client that has hung up is seen within a
            # token or two however late its close reaches the server on a busy machine.
            time.sleep(0.1)


def paced_engine(script: list[str], at: int) -> tuple[ScriptedEngine, Gate]:
    engine = ScriptedEngine([script])
    gate = Gate(at)
    engine.before_token = gate
    return engine, gate


# ---- the page as HTTP -----------------------------------------------------------------------


def test_page_is_served_without_the_key_with_a_policy_pinning_its_script():
    with serving(scripted_service(), api_key="sekrit") as srv:
        resp = call(srv.port, "GET", "/")
        assert call(srv.port, "GET", "/v1/models").status == 401
        assert call(srv.port, "POST", "/", {}).status == 405
    assert resp.status == 200 and resp.headers["content-type"] == "text/html; charset=utf-8"
    html = resp.body.decode()
    policy = dict(part.strip().split(" ", 1) for part in resp.headers["content-security-policy"].split(";"))
    script = re.search(r"<script>(.*?)</script>", html, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert policy["script-src"] == f"'sha256-{digest}'"
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    assert policy["trusted-types"] == "'none'"
    assert "unsafe" not in resp.headers["content-security-policy"]
    # Offline: nothing in the page names another origin.
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", html)


def test_a_page_without_exactly_one_script_block_is_refused():
    with pytest.raises(ValueError, match="exactly one <script> block, found 2"):
        inline_block("<script>a()</script><p>text</p><script>b()</script>", "script")
    with pytest.raises(ValueError, match="exactly one <style> block, found 0"):
        inline_block("<p>no style</p>", "style")


# ---- the page in a browser ------------------------------------------------------------------


def test_page_loads_and_shows_the_model(browser):
    with page_on(browser, scripted_service()) as p:
        p.open()
        assert p.text("#stat-model-id") == "scripted"
        assert p.text("#stat-experts") == "16 (top-2)"
        assert p.page.locator("#attach-label").is_hidden()  # no vision tower
        assert p.page.locator("#key-form").is_hidden()
        assert p.errors == []


def test_streamed_text_appears_while_the_reply_runs_and_fills_the_panel(browser):
    script = xtml_answer("Hello", " there", ", streaming", " friend.",
                         thinking=["Let", " me", " think"])
    engine, gate = paced_engine(script, at=script.index(", streaming"))
    with page_on(browser, scripted_service(engine)) as p:
        p.open()
        p.send("Say hello")
        p.wait_text(".msg.assistant .md", "^Hello there$")  # the first half, while the engine waits
        assert gate.reached.is_set() and not gate.release.is_set()
        assert p.page.locator("#stop").is_visible()
        gate.release.set()
        p.wait_state("^done")
        assert p.text(".msg.assistant .md") == "Hello there, streaming friend."
        # The reasoning arrives folded, and opens on a click.
        fold = p.page.locator(".msg.assistant details.reasoning")
        assert fold.get_attribute("open") is None
        assert p.text(".msg.assistant details.reasoning summary") == "Reasoning (12 characters)"
        p.page.click(".msg.assistant details.reasoning summary")
        assert p.text(".msg.assistant details.reasoning .text") == "Let me think"
        # The panel: the usage chunk's waste object (3 hits and 1 miss of 4096 bytes per token).
        tokens = engine.results[-1].n_tokens
        assert p.text("#stat-tokens") == str(tokens)
        assert p.text("#stat-hit-rate") == "75.0%"
        assert p.text("#stat-bytes") == f"{4096 * tokens / 1024:.1f} KiB"
        assert re.fullmatch(r"\d+\.\d\d s", p.text("#stat-ttft"))
        assert re.fullmatch(r"\d+\.\d\d", p.text("#stat-tps"))
        assert p.text("#stat-cached") == "0"
        # The reply keeps its own figures.
        assert re.fullmatch(rf"{tokens} tokens · \d+\.\d tok/s · 0 prompt tokens cached · expert hits 75.0% · "
                            rf"{p.text('#stat-bytes')} read · first token {p.text('#stat-ttft')}",
                            p.text(".msg.assistant .foot"))
        assert p.errors == []


def test_stop_asks_the_server_to_stop_and_the_reply_finishes(browser):
    """Stop calls POST /v1/jobs/{id}/stop instead of hanging up: the job ends at its next
    token, and the stream finishes normally with what was said (a 200, not a 499)."""
    script = xtml_answer("word0", *[f" word{i}" for i in range(1, 20)])
    engine, gate = paced_engine(script, at=3)
    lines: list[str] = []
    with page_on(browser, scripted_service(engine, thinking=False), log=lines.append) as p:
        p.open()
        p.send("Talk for a while")
        p.wait_text(".msg.assistant .md", "word2$")
        p.page.click("#stop")
        p.wait_state("^stopping$")   # asked; the job stops at its next token
        gate.release.set()  # the engine goes on to token 3, where it sees the stop
        p.wait_state("^stopped$")
        p.wait_visible("#send")
        assert "stopped" in p.text(".msg.assistant .foot")
        assert p.text(".msg.assistant .md") == "word0 word1 word2"
        # The request's log line is written once its generation has returned.
        assert wait_until(lambda: any("POST /v1/chat/completions" in line for line in lines)), lines
        assert any(re.search(r"POST /v1/jobs/job-\w+/stop 200 ", line) for line in lines), lines
        assert any("POST /v1/chat/completions 200 " in line for line in lines), lines
    result = engine.results[-1]
    # The three shown, and the first that found the client gone (its close may come late).
    assert result.cancelled and 4 <= result.n_tokens < len(script)
    logged = next(line for line in lines if "POST /v1/chat/completions" in line)
    assert f" tokens={result.n_tokens} " in logged


def wait_until(condition) -> bool:
    """Polls `condition` until it holds or the test's wait runs out."""
    idle = threading.Event()
    for _ in range(WAIT_MS // 20):
        if condition():
            return True
        idle.wait(0.02)
    return condition()


HOSTILE = ['<img src=x onerror="window.__pwned = 1">', " and ",
           "<script>window.__pwned = 2</script>", " and [a link](javascript:window.__pwned=3)",
           " and <a href=\"javascript:window.__pwned=4\">there</a>"]


def test_hostile_markup_in_a_reply_shows_as_text_and_runs_nothing(browser):
    engine = ScriptedEngine([xtml_answer(*HOSTILE, thinking=['<b onmouseover="window.__pwned=5">x</b>'])])
    with page_on(browser, scripted_service(engine)) as p:
        p.open()
        p.ask('<img src=y onerror="window.__pwned = 7"> from the user')
        p.page.click(".msg.assistant details.reasoning summary")
        assert p.text(".msg.assistant .md") == "".join(HOSTILE)
        assert p.text(".msg.user .body") == '<img src=y onerror="window.__pwned = 7"> from the user'
        assert p.text(".msg.assistant details.reasoning .text") == '<b onmouseover="window.__pwned=5">x</b>'
        counts = p.page.evaluate("""() => ({
            img: document.querySelectorAll('#messages img').length,
            script: document.querySelectorAll('#messages script, #messages b').length,
            links: [...document.querySelectorAll('#messages a')].map(a => a.href),
            pwned: window.__pwned})""")
        assert counts == {"img": 0, "script": 0, "links": [], "pwned": None}
        # And the policy itself refuses script the page did not ship.
        outcome = p.page.evaluate("""() => {
            try {
                const s = document.createElement('script');
                s.text = 'window.__pwned = 8';
                document.body.append(s);
                return 'appended';
            } catch (e) { return e.name; }
        }""")
        assert outcome == "TypeError" and p.page.evaluate("window.__pwned") is None
        # Errors only from the probe above, none from the page's own code.
        assert all("TrustedScript" in e for e in p.errors), p.errors


def test_tool_calls_show_as_readable_blocks(browser):
    engine = ScriptedEngine([xtml_tool_call("lookup", {"q": '<svg onload="window.__pwned=6">'})])
    with page_on(browser, scripted_service(engine, thinking=False)) as p:
        p.open()
        p.ask("look something up")
        assert p.text(".msg.assistant .tool .name") == "tool call: lookup"
        assert p.text(".msg.assistant .tool pre") == '{\n  "q": "<svg onload=\\"window.__pwned=6\\">"\n}'
        assert p.page.evaluate("document.querySelectorAll('#messages svg').length") == 0
        assert p.errors == []


def test_markdown_renders_code_lists_emphasis_and_http_links(browser):
    reply = ("Some **bold** and *soft* and `inline` text.\n\n- one\n- two\n\n1. first\n2. second\n\n"
             "```python\nprint('<b>')\n```\n\nSee [the docs](https://example.org/a) or ftp://x.org.")
    with page_on(browser, scripted_service(ScriptedEngine([xtml_answer(reply)]), thinking=False)) as p:
        p.open()
        p.ask("format something")
        md = ".msg.assistant .md"
        assert p.text(f"{md} strong") == "bold" and p.text(f"{md} em") == "soft"
        assert p.page.locator(f"{md} p code").inner_text() == "inline"
        assert p.page.locator(f"{md} ul li").all_inner_texts() == ["one", "two"]
        assert p.page.locator(f"{md} ol li").all_inner_texts() == ["first", "second"]
        assert p.text(f"{md} pre code") == "print('<b>')"
        assert p.page.locator(f"{md} a").evaluate_all("as => as.map(a => [a.textContent, a.href])") == \
            [["the docs", "https://example.org/a"]]
        assert p.errors == []


def test_prefill_progress_shows_while_the_prompt_is_evaluated(browser):
    engine = ScriptedEngine([xtml_answer("ok")])
    gate = Gate(at=2)
    engine.before_eval = gate  # holds prefill before its third chunk
    with page_on(browser, scripted_service(engine, prefill_chunk=8, thinking=False)) as p:
        p.open()
        p.send("A prompt long enough to be prefilled in several small chunks.")
        p.wait_text("#prefill-text", r"^prefill 16 / \d+ tokens$")
        assert p.text("#state") == "prefilling"
        width = p.page.evaluate("parseFloat(document.getElementById('prefill-bar').style.width)")
        total = int(re.search(r"/ (\d+)", p.text("#prefill-text")).group(1))
        assert width == pytest.approx(100 * 16 / total, abs=0.1)
        gate.release.set()
        p.wait_state("^done")
        assert p.text("#prefill-text") == f"prefill {total} / {total} tokens"
        assert p.errors == []


def test_a_request_waiting_for_the_engine_shows_its_place_in_line(browser):
    engine = ScriptedEngine([xtml_answer("first"), xtml_answer("second"), xtml_answer("mine")])
    gate = Gate(at=0)  # the first request holds the engine at its first token
    engine.before_token = gate
    seen: list[str] = []
    with page_on(browser, scripted_service(engine, thinking=False)) as p:
        p.open()
        # Each position is a new text node: recorded as it is added, whatever the page shows later.
        p.page.expose_function("seen", lambda text: seen.append(text))
        p.page.evaluate("""() => new MutationObserver(records => records.forEach(r => r.addedNodes.forEach(
            n => window.seen(n.data)))).observe(document.getElementById('queue'), {childList: true})""")
        others = [threading.Thread(target=call, args=(p.port, "POST", "/v1/chat/completions",
                                                      {"messages": [{"role": "user", "content": "hi"}]}))
                  for _ in range(2)]
        try:
            others[0].start()
            assert gate.reached.wait(WAIT_MS / 1000)
            others[1].start()
            assert wait_until(lambda: queue_length(p.port) == 1)
            p.send("me too")
            p.wait_text("#queue", "^queue position: 2 ahead$")
            assert p.text("#state") == "queued"
        finally:
            gate.release.set()
            for t in others:
                t.join(WAIT_MS / 1000)
        p.wait_state("^done")
        assert p.text(".msg.assistant .md") == "mine"
        assert p.text("#stat-queued") == "2 requests"
        assert p.page.locator("#queue").is_hidden()
    # Positions only count down (how far depends on when the page reads them).
    positions = [int(text.split()[2]) for text in seen if text]
    assert positions[0] == 2 and positions == sorted(positions, reverse=True)


def test_a_reply_that_waited_behind_a_chore_says_so(browser):
    engine = ScriptedEngine([xtml_answer("a title"), xtml_answer("mine")])
    gate = Gate(at=0)  # the chore holds the engine at its first token
    engine.before_token = gate
    with page_on(browser, scripted_service(engine, thinking=False)) as p:
        p.open()
        chore = threading.Thread(target=call, args=(
            p.port, "POST", "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a title?"}], "priority": 1}))
        try:
            chore.start()
            assert gate.reached.wait(WAIT_MS / 1000)
            p.send("hello")
            assert wait_until(lambda: queue_length(p.port) == 1)
            time.sleep(0.3)   # the reply waits at least this long behind the chore
        finally:
            gate.release.set()
            chore.join(WAIT_MS / 1000)
        p.wait_state("^done")
        assert p.text(".msg.assistant .md") == "mine"
        behind = p.text("#stat-behind-chores")
        assert re.fullmatch(r"\d+\.\d\d s", behind) and float(behind.split()[0]) >= 0.3
        assert f"waited {behind} behind chores" in p.text(".msg.assistant .foot")


def queue_length(port: int) -> float:
    """serve_queue_length, from /metrics."""
    body = call(port, "GET", "/metrics").body.decode()
    return float(re.search(r"^serve_queue_length (\S+)$", body, re.M).group(1))


def test_settings_reach_the_request(browser):
    engine = ScriptedEngine([xtml_answer("fine")])
    with page_on(browser, scripted_service(engine)) as p:
        p.open()
        p.page.fill("#system", "You are terse.")
        p.page.fill("#temperature", "0.3")
        p.page.fill("#max-tokens", "7")
        p.page.select_option("#thinking", "none")
        with p.page.expect_request("**/v1/chat/completions") as req:
            p.ask("hello")
        body = req.value.post_data_json
        assert body["messages"] == [{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": "hello"}]
        assert (body["temperature"], body["max_tokens"], body["reasoning_effort"]) == (0.3, 7, "none")
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert (engine.params[-1].temperature, engine.params[-1].max_tokens) == (pytest.approx(0.3), 7)
        # Settings survive a reload.
        p.page.reload()
        p.loaded()
        assert p.page.input_value("#system") == "You are terse."
        assert p.page.input_value("#thinking") == "none"


def test_conversations_are_kept_and_can_be_deleted(browser):
    engine = ScriptedEngine([xtml_answer("first answer"), xtml_answer("second answer")])
    with page_on(browser, scripted_service(engine, thinking=False)) as p:
        p.open()
        p.ask("first question")
        p.page.click("#new-chat")
        assert p.page.locator(".msg").count() == 0
        p.ask("second question")
        p.page.reload()
        p.loaded()
        titles = p.page.locator("#conversations .title").all_inner_texts()
        assert titles == ["second question", "first question"]
        assert p.text(".msg.assistant .md") == "second answer"
        p.page.click("#conversations li:nth-child(2) .title")
        assert p.text(".msg.user .body") == "first question"
        assert p.text(".msg.assistant .md") == "first answer"
        p.page.click("#conversations li:nth-child(1) .delete")
        p.page.reload()
        p.loaded()
        assert p.page.locator("#conversations .title").all_inner_texts() == ["first question"]
        stored = json.loads(p.page.evaluate("localStorage.getItem('serve.chat.conversations')"))
        assert [m["content"] for m in stored["conversations"][0]["messages"]] == ["first question", "first answer"]


def test_history_is_sent_on_the_next_turn(browser):
    engine = ScriptedEngine([xtml_answer("one"), xtml_answer("two")])
    with page_on(browser, scripted_service(engine, thinking=False)) as p:
        p.open()
        p.ask("ask one")
        with p.page.expect_request("**/v1/chat/completions") as req:
            p.ask("ask two")
        assert req.value.post_data_json["messages"] == [
            {"role": "user", "content": "ask one"}, {"role": "assistant", "content": "one"},
            {"role": "user", "content": "ask two"}]


def test_an_image_can_be_attached_when_the_model_has_vision(browser, tmp_path):
    engine = ScriptedEngine([xtml_answer("a red square")])
    png = tmp_path / "red.png"
    png.write_bytes(tiny_png())
    with page_on(browser, scripted_service(engine, vision=True, thinking=False)) as p:
        p.open()
        p.wait_visible("#attach-label")
        p.page.set_input_files("#attach", str(png))
        p.wait_count("#attachments img", 1)
        with p.page.expect_request("**/v1/chat/completions") as req:
            p.ask("what is this?")
        content = req.value.post_data_json["messages"][0]["content"]
        assert content[0] == {"type": "text", "text": "what is this?"}
        assert content[1]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(tiny_png()).decode()
        assert len(engine.images_added) == 1
        assert p.page.locator(".msg.user img").count() == 1
        assert p.errors == []


def test_with_an_api_key_the_page_asks_for_it_and_keeps_it_in_the_browser(browser):
    engine = ScriptedEngine([xtml_answer("authorized")])
    with page_on(browser, scripted_service(engine, thinking=False), api_key="sekrit") as p:
        p.page.goto(f"http://127.0.0.1:{p.port}/")
        p.page.wait_for_selector("#key-form:not([hidden])")
        assert p.text("#state") == "an API key is needed"
        p.page.fill("#api-key", "wrong")
        p.page.click("#key-form button")
        p.page.wait_for_selector("#key-form:not([hidden])")
        p.page.fill("#api-key", "sekrit")
        p.page.click("#key-form button")
        p.loaded()
        assert p.page.locator("#key-form").is_hidden()
        with p.page.expect_request("**/v1/chat/completions") as req:
            p.ask("hi")
        assert req.value.headers["authorization"] == "Bearer sekrit"
        assert p.text(".msg.assistant .md") == "authorized"
        assert p.page.evaluate("localStorage.getItem('serve.chat.apiKey')") == "sekrit"
        p.page.click("#forget-key")
        p.page.wait_for_selector("#key-form:not([hidden])")
        assert p.page.evaluate("localStorage.getItem('serve.chat.apiKey')") is None


def test_a_server_error_is_shown_on_the_reply(browser):
    with page_on(browser, scripted_service(ScriptedEngine(ctx_max=64))) as p:
        p.open()
        p.send("a message far too long for a sixty-four token context " * 3)
        p.wait_state("^error$")
        assert "context" in p.text(".msg.assistant .foot.error")
        assert p.page.locator("#send").is_visible()


def test_an_error_in_the_middle_of_a_stream_is_shown_and_the_text_so_far_kept(browser):
    engine = ScriptedEngine([xtml_answer("partial", " answer", " never", " finished")])

    def fail(index: int) -> None:
        if index == 2:
            raise WasteError(-5, "WASTE_E_IO", "I/O error", "expert record unreadable", "waste_generate")

    engine.before_token = fail
    with page_on(browser, scripted_service(engine, thinking=False)) as p:
        p.open()
        with p.page.expect_response("**/v1/chat/completions") as response:
            p.send("go")
        p.wait_state("^error$")
        last = [line for line in response.value.text().split("\n") if line.startswith("data: {")][-1]
        assert p.text(".msg.assistant .md") == "partial answer"
        assert p.text(".msg.assistant .foot.error") == "error: " + json.loads(last[6:])["error"]["message"]
        assert p.page.locator("#send").is_visible()


# ---- the whole stack ------------------------------------------------------------------------


def test_real_model_conversation_fills_the_panel(browser, lib_path, k3_container, tmp_path):
    cache = PrefixCache(64 << 20, parent_dir=str(tmp_path))
    try:
        with real_service(lib_path, k3_container, prefix_cache=cache) as service:
            with page_on(browser, service) as p:
                p.open()
                assert p.text("#stat-model-id") == "real"
                p.page.fill("#max-tokens", "24")
                p.page.fill("#temperature", "0")
                p.ask("Tell me about the lighthouse.")
                first_cached = p.text("#stat-cached")
                p.page.select_option("#thinking", "none")
                p.send("And the keeper?")
                p.wait_count(".msg.assistant", 2)
                p.wait_state("^done")
                # Thinking on, then off: one folded reasoning, then an answer.
                assert p.page.locator(".msg.assistant details.reasoning").count() == 1
                assert p.text(".msg.assistant .md").strip()
                assert first_cached == "0" and int(p.text("#stat-cached")) > 0  # the first turn, reused
                assert 0 < int(p.text("#stat-tokens")) <= 24
                assert re.fullmatch(r"\d+\.\d%", p.text("#stat-hit-rate"))
                assert re.fullmatch(r"\d+(\.\d)? (B|KiB|MiB)", p.text("#stat-bytes"))
                assert p.errors == []
    finally:
        cache.close()


def test_answer_now_ends_the_reasoning_and_the_same_stream_answers(browser, lib_path, k3_container):
    """While a reply is in its reasoning the page offers "Answer now", which calls
    POST /v1/jobs/{id}/answer: the think channel closes at the next token, the stream goes on
    with the answer (never breaking), and what was reasoned stays in the reply."""
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WASTE_DELAY_MS", "40")   # a reply of 160 tokens lasts some 6 s
        with real_service(lib_path, k3_container) as service, \
                page_on(browser, service, log=lines.append) as p:
            p.open()
            p.page.fill("#max-tokens", "160")
            p.page.fill("#temperature", "0")
            p.page.select_option("#thinking", "high")
            with p.page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
                p.send("Weather in Paris?")
            assert p.page.locator("#answer").is_hidden()   # no reasoning yet to end
            p.wait_text(".msg.assistant details.reasoning .text", r"[\s\S]{20,}")
            assert not p.text(".msg.assistant .md").strip(), "the model answered by itself"
            p.page.click("#answer")
            p.wait_state("^done")
            stream = sent.value.text()
            assert p.page.locator("#answer").is_hidden()
            # (folded once the answer began: its text is in the page, not shown)
            reasoned = p.last(".msg.assistant details.reasoning .text").text_content() or ""
            answered = p.text(".msg.assistant .md")
            assert re.fullmatch(r"\d+ tokens, ended by answer now", p.text("#stat-reasoning"))
            assert p.text("#stat-tokens") == "160"   # the answer went on to max_tokens
            assert p.errors == []
    assert any(re.search(r"POST /v1/jobs/job-\w+/answer 200 ", line) for line in lines), lines
    assert any("POST /v1/chat/completions 200 " in line for line in lines), lines
    # The stream itself: reasoning, then only answer, to its normal end.
    kinds = []
    for block in stream.split("\n\n"):
        data = block[len("data: "):] if block.startswith("data: ") else None
        if data and data != "[DONE]":
            delta = (json.loads(data).get("choices") or [{}])[0].get("delta") or {}
            kinds += ["R"] * bool(delta.get("reasoning_content")) + ["C"] * bool(delta.get("content"))
    assert stream.rstrip().endswith("data: [DONE]") and "C" in kinds and kinds[0] == "R"
    assert "R" not in kinds[kinds.index("C"):]
    # (Chromium hands over an event stream's bytes re-encoded: only its structure is compared)
    assert reasoned.strip() and answered.strip()
