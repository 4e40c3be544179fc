"""Stop strings: StopFilter on its own, then through the server (scripted engine)."""
from __future__ import annotations

import time

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from scripted import call, engine, scripted_service, serving, xtml_answer
from serve.core.stops import StopFilter

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"

# ---- StopFilter on its own ----------------------------------------------------

def feed_all(stops: list[str], pieces: list[str]) -> tuple[str, StopFilter]:
    """Everything shown, piece by piece, then the flush; and the filter."""
    filt = StopFilter(stops)
    shown = "".join(filt.feed(piece) for piece in pieces)
    return shown + filt.flush(), filt


def test_no_stop_strings_pass_everything_at_once():
    filt = StopFilter([])
    assert filt.feed("abc") == "abc" and filt.flush() == "" and not filt.hit


def test_a_possible_start_is_held_back_until_settled():
    filt = StopFilter(["END"])
    assert filt.feed("the E") == "the "         # "E" may begin "END"
    assert filt.feed("x") == "Ex"               # it did not
    assert filt.feed("EN") == ""
    assert filt.feed("D and more") == "" and filt.hit and filt.matched == "END"
    assert filt.feed("after") == "" and filt.flush() == ""


def test_the_earliest_match_wins_and_names_the_shorter_of_equals():
    shown, filt = feed_all(["cd", "bcd", "z"], ["ab", "cdz"])
    assert shown == "a" and filt.matched == "bcd"
    shown, filt = feed_all(["ab", "abc"], ["xab", "c"])
    assert shown == "x" and filt.matched == "ab"   # both start there: the shorter one is found


def test_a_held_back_tail_is_flushed_when_nothing_more_comes():
    shown, filt = feed_all(["STOP"], ["go ST", "O"])
    assert shown == "go STO" and not filt.hit and filt.matched == ""


def test_empty_stop_strings_are_ignored():
    shown, filt = feed_all(["", "x"], ["abc", "dxe"])
    assert shown == "abcd" and filt.matched == "x"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abXY", max_size=30), st.lists(st.text(alphabet="abXY", min_size=1, max_size=3),
                                                      min_size=1, max_size=3),
       st.data())
def test_any_split_shows_what_the_whole_text_shows(text, stops, data):
    # With one stop string inside another ("X" in "YXX"), which ends the text depends on the
    # pieces: the one that completes first as the text streams. Otherwise splits never matter.
    assume(not any(a != b and a in b for a in stops for b in stops))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[:min(found)] if found else text
    shown, filt = feed_all(stops, pieces)
    assert shown == expected and filt.hit == bool(found)


# ---- through the server -------------------------------------------------------

def test_stop_string_across_three_tokens(engine):
    engine.replies = [xtml_answer("The an", "sw", "er is", " 42", thinking=[])]
    with serving(scripted_service(engine, thinking=False)) as srv:
        blocking = call(srv.port, "POST", CHAT, {"messages": USER, "stop": "answer"}).json()
        streamed = call(srv.port, "POST", CHAT, {"messages": USER, "stop": ["answer"],
                                                 "stream": True}).events()
    assert blocking["choices"][0]["message"]["content"] == "The "
    assert blocking["choices"][0]["finish_reason"] == "stop"
    # Generation stopped at the token that completed the stop string.
    assert engine.results[0].cancelled and engine.results[0].n_tokens == 3
    content = [e["choices"][0]["delta"].get("content") for e in streamed[1:-1]]
    assert "".join(c for c in content if c) == "The "
    assert "an" not in "".join(c for c in content if c)
    assert streamed[-2]["choices"][0]["finish_reason"] == "stop"


def test_partial_stop_match_is_released(engine):
    engine.replies = [xtml_answer("an", "sw", "ing", " vary")]
    # Tokens far enough apart that the stream says each as it comes, not a few at once.
    engine.before_token = lambda n: time.sleep(0.03)
    with serving(scripted_service(engine, thinking=False)) as srv:
        streamed = call(srv.port, "POST", CHAT, {"messages": USER, "stop": "answer",
                                                 "stream": True}).events()
    deltas = [e["choices"][0]["delta"].get("content") for e in streamed[1:-2]]
    # "an" and "sw" are held while they could still become "answer", then released together.
    assert deltas[0].startswith("answing") and "".join(deltas) == "answing vary"
    assert streamed[-2]["choices"][0]["finish_reason"] == "stop"


def test_partial_stop_match_at_the_end_is_flushed(engine):
    engine.replies = [xtml_answer("say ", "an")]
    with serving(scripted_service(engine, thinking=False)) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": USER, "stop": "answer"}).json()
    assert body["choices"][0]["message"]["content"] == "say an"


def test_stop_strings_do_not_apply_to_reasoning(engine):
    engine.replies = [xtml_answer("ok", thinking=["the answer"])]
    with serving(scripted_service(engine)) as srv:
        body = call(srv.port, "POST", CHAT, {"messages": USER, "stop": "answer"}).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "the answer" and message["content"] == "ok"


def test_completion_stop_string(engine):
    engine.replies = [["one ", "tw", "o thr", "ee"]]
    with serving(scripted_service(engine)) as srv:
        body = call(srv.port, "POST", "/v1/completions", {"prompt": "count:", "stop": ["two"]}).json()
    assert body["choices"][0]["text"] == "one " and body["choices"][0]["finish_reason"] == "stop"
