"""serve/formats/xtml/reply.py: reading K3 replies back, token-wise and as text, whole or malformed."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from serve.formats.xtml.reply import (CLOSE, END_OF_MSG, MAX_HEADER_CHARS, OPEN, SEP, Markers,
                                      ReplyParser)
from serve.core.reply import default_call_id, Delta, Reply
from serve.formats.xtml.render import build_chat_segments

MARKERS = Markers(open=1, sep=2, close=3, end_of_msg=4)
MARKER_ID = {OPEN: 1, SEP: 2, CLOSE: 3, END_OF_MSG: 4}
EOS, MEDIA_PAD = 5, 6          # specials that are not structure
SPECIALS = frozenset({EOS, MEDIA_PAD})
TEXT_ID = 100                  # any ordinary token; the parser only looks at its bytes

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- drivers ----------------------------------------------------------------------------

def counter_ids():
    """Deterministic call ids, so two parses of one reply compare equal."""
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def new_parser(thinking: bool = True) -> ReplyParser:
    return ReplyParser(MARKERS, thinking=thinking, special_ids=SPECIALS, new_call_id=counter_ids())


def split_bytes(data: bytes, sizes: list[int]) -> list[bytes]:
    """Cut `data` into consecutive chunks of the given sizes, cycling; cuts may split characters."""
    chunks, at = [], 0
    for size in itertools.cycle(sizes):
        if at >= len(data):
            return chunks
        chunks.append(data[at:at + size])
        at += size


def run_tokens(script: list[tuple[str, bool]], sizes: list[int] = (1_000_000,),
               thinking: bool = True) -> tuple[list[Delta], Reply]:
    """Feed (text, is_markup) pairs token-wise: markup as marker ids, text as byte chunks."""
    parser = new_parser(thinking)
    deltas = []
    for text, markup in script:
        if markup:
            deltas += parser.feed_token(MARKER_ID[text], text.encode())
        else:
            for chunk in split_bytes(text.encode(), list(sizes)):
                deltas += parser.feed_token(TEXT_ID, chunk)
    deltas += parser.finish()
    return deltas, parser.reply


def run_text(text: str, sizes: list[int] = (1_000_000,), thinking: bool = True) -> tuple[list[Delta], Reply]:
    parser = new_parser(thinking)
    deltas = []
    at = 0
    for size in itertools.cycle(sizes):
        if at >= len(text):
            break
        deltas += parser.feed(text[at:at + size])
        at += size
    deltas += parser.finish()
    return deltas, parser.reply


def markup(*parts: str) -> list[tuple[str, bool]]:
    """A script from plain strings: the four marker spellings are markup, the rest text."""
    return [(part, part in MARKER_ID) for part in parts]


def accumulate(deltas: list[Delta]) -> Reply:
    """What a streaming client rebuilds from the deltas, checking their shape on the way."""
    total = Reply()
    for delta in deltas:
        assert sum([bool(delta.reasoning_content), bool(delta.content), delta.tool_call is not None]) == 1
        total.reasoning_content += delta.reasoning_content
        total.content += delta.content
        call = delta.tool_call
        if call is None:
            continue
        if "id" in call:   # a call's first delta: it must come before any of its fragments
            assert call["index"] == len(total.tool_calls)
            assert call["type"] == "function" and call["function"]["arguments"] == ""
            total.tool_calls.append({"id": call["id"], "type": "function",
                                     "function": {"name": call["function"]["name"], "arguments": ""}})
        else:
            assert call["index"] < len(total.tool_calls)
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            total.tool_calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    return total


def check_stream(deltas: list[Delta], reply: Reply) -> None:
    """The blocking reply is exactly what the streamed deltas add up to."""
    total = accumulate(deltas)
    assert (total.reasoning_content, total.content, total.tool_calls) == \
           (reply.reasoning_content, reply.content, reply.tool_calls)


def arguments(reply: Reply) -> list:
    return [json.loads(call["function"]["arguments"]) for call in reply.tool_calls]


# -- generated assistant turns ----------------------------------------------------------

# Fragments that stress the parser: marker spellings, other specials, split-prone characters.
TRICKY = ["<|sep|>", "<|open|>message role=\"system\"", "<|close|>", "<|end_of_msg|>", "<|media_pad|>",
          "<", "<|", "é", "日本語", "🙂", "\"", "\\", "\n", " ", "&amp;", "&quot;"]
texts = st.lists(st.one_of(st.text(max_size=6), st.sampled_from(TRICKY)), max_size=4).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6)


def _not_an_object(text: str) -> bool:
    try:
        return not isinstance(json.loads(text), dict)
    except ValueError:
        return True


def _not_json(text: str) -> bool:
    """Arguments the encoder renders verbatim in a json element (blank ones it leaves out)."""
    try:
        json.loads(text)
    except ValueError:
        return bool(text.strip())
    return False


@st.composite
def tool_calls(draw) -> dict:
    name = draw(texts)
    if draw(st.booleans()):
        raw = draw(texts.filter(_not_json))   # the encoder renders these in a json element
        return {"type": "function", "function": {"name": name, "arguments": raw}}
    args = draw(st.dictionaries(texts, json_values, max_size=4))
    encoded = json.dumps(args, ensure_ascii=draw(st.booleans())) if draw(st.booleans()) else args
    return {"type": "function", "function": {"name": name, "arguments": encoded}}


@st.composite
def assistant_turns(draw) -> dict:
    turn = {"role": "assistant", "content": draw(texts)}
    if draw(st.booleans()):
        turn["reasoning_content"] = draw(texts)
    calls = draw(st.lists(tool_calls(), max_size=3))
    if calls:
        turn["tool_calls"] = calls
    return turn


def rendered_reply(turn: dict) -> list[tuple[str, bool]]:
    """The encoder's rendering of `turn` after the generation prompt `...<|open|>think<|sep|>`."""
    segments = [(s.text, s.markup) for s in
                build_chat_segments([{"role": "user", "content": "hi"}, turn], add_generation_prompt=False)]
    starts = [i for i in range(len(segments) - 2)
              if segments[i:i + 3] == [(OPEN, True), ("think", False), (SEP, True)]]
    return segments[starts[-1] + 3:]


def check_matches(reply: Reply, turn: dict) -> None:
    assert reply.ended
    reasoning = turn.get("reasoning_content") or ""
    assert reply.reasoning_content == (reasoning if reasoning.strip() else "")  # blank renders empty
    assert reply.content == turn["content"]
    calls = turn.get("tool_calls", [])
    assert [c["function"]["name"] for c in reply.tool_calls] == [c["function"]["name"] for c in calls]
    for got, sent in zip(reply.tool_calls, calls):
        sent_args = sent["function"]["arguments"]
        if isinstance(sent_args, str) and _not_an_object(sent_args):
            assert got["function"]["arguments"] == sent_args
        else:
            expected = json.loads(sent_args) if isinstance(sent_args, str) else sent_args
            assert json.loads(got["function"]["arguments"]) == expected


chunk_sizes = st.lists(st.integers(1, 7), min_size=1, max_size=6)


# -- round trip -------------------------------------------------------------------------

@PROPERTY
@given(assistant_turns(), chunk_sizes)
def test_round_trip_token_wise(turn, sizes):
    # Marker spellings inside text are ordinary tokens here, so everything round-trips.
    deltas, reply = run_tokens(rendered_reply(turn), sizes)
    check_matches(reply, turn)
    check_stream(deltas, reply)


@PROPERTY
@given(assistant_turns(), chunk_sizes)
def test_round_trip_as_text(turn, sizes):
    script = rendered_reply(turn)
    # Text mode cannot tell a spelled marker from a real one: only turns without them.
    assume(not any(m in text for text, is_markup in script if not is_markup for m in MARKER_ID))
    text = "".join(t for t, _ in script)
    assume(sum(text.count(m) for m in MARKER_ID) == sum(is_markup for _, is_markup in script))
    deltas, reply = run_text(text, sizes)
    check_matches(reply, turn)
    check_stream(deltas, reply)


@PROPERTY
@given(assistant_turns(), chunk_sizes, chunk_sizes)
def test_every_split_gives_the_same_reply(turn, sizes_a, sizes_b):
    script = rendered_reply(turn)
    whole_deltas, whole = run_tokens(script)
    for sizes in (sizes_a, sizes_b):
        deltas, reply = run_tokens(script, sizes)
        assert reply == whole
        assert accumulate(deltas) == accumulate(whole_deltas)
    text = "".join(t for t, _ in script)
    text_whole_deltas, text_whole = run_text(text)
    for sizes in (sizes_a, sizes_b):
        deltas, reply = run_text(text, sizes)
        assert reply == text_whole
        assert accumulate(deltas) == accumulate(text_whole_deltas)


def test_round_trip_without_thinking_starts_in_response():
    turn = {"role": "assistant", "content": "4", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]}
    script = rendered_reply(turn)
    start = script.index(("response", False)) + 2   # past `response<|sep|>`
    deltas, reply = run_tokens(script[start:], thinking=False)
    assert (reply.reasoning_content, reply.content) == ("", "4")
    assert arguments(reply) == [{"a": 2, "b": 2}]
    check_stream(deltas, reply)


def test_all_argument_types_from_the_release_vector():
    turn = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "everything", "arguments": {"s": "text", "n": 42, "f": 1.5, "b": True, "b2": False,
                                            "nul": None, "obj": {"k": "v"}, "arr": [1, "two", None]}}}]}
    deltas, reply = run_tokens(rendered_reply(turn), [3])
    check_matches(reply, turn)
    assert reply.tool_calls[0]["function"]["arguments"] == (
        '{"s": "text", "n": 42, "f": 1.5, "b": true, "b2": false, "nul": null, '
        '"obj": {"k": "v"}, "arr": [1, "two", null]}')


# -- streaming shape --------------------------------------------------------------------

def test_tool_call_streams_name_first_then_argument_fragments():
    parser = new_parser()
    out = []
    for part in [CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="get_weather" index="1"', SEP,
                 OPEN, 'argument key="city" type="string"', SEP, "Pa", "ris", CLOSE, "argument", SEP]:
        out.append(parser.feed_token(MARKER_ID.get(part, TEXT_ID), part.encode()))
    header = [d.tool_call for d in out[8]]
    assert header == [{"index": 0, "id": "call_0", "type": "function",
                       "function": {"name": "get_weather", "arguments": ""}}]
    assert [d.tool_call for d in out[11]] == [{"index": 0, "function": {"arguments": '{"city": "'}}]
    assert [d.tool_call for d in out[12]] == [{"index": 0, "function": {"arguments": "Pa"}}]
    assert [d.tool_call for d in out[16]] == [{"index": 0, "function": {"arguments": '"'}}]
    tail = parser.feed_token(3, b"") + parser.feed_token(TEXT_ID, b"call") + parser.feed_token(2, b"")
    assert [d.tool_call for d in tail] == [{"index": 0, "function": {"arguments": "}"}}]
    assert parser.reply.tool_calls[0]["function"]["arguments"] == '{"city": "Paris"}'


def test_string_arguments_are_json_escaped_as_they_stream():
    script = markup(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                    OPEN, 'argument key="q" type="string"', SEP, 'say "hi"\\\n\t', CLOSE, "argument", SEP,
                    CLOSE, "call", SEP)
    deltas, reply = run_tokens(script, [1])
    assert arguments(reply) == [{"q": 'say "hi"\\\n\t'}]
    check_stream(deltas, reply)


def test_json_element_streams_verbatim():
    script = markup(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                    OPEN, 'json type="object"', SEP, '{"a": [1,', " 2]}", CLOSE, "json", SEP, CLOSE, "call", SEP)
    deltas, reply = run_tokens(script)
    fragments = [d.tool_call["function"]["arguments"] for d in deltas if d.tool_call and "id" not in d.tool_call]
    assert fragments == ['{"a": [1,', " 2]}"]
    assert reply.tool_calls[0]["function"]["arguments"] == '{"a": [1, 2]}'


def test_parallel_calls_are_numbered_in_order_with_fresh_ids():
    call = [OPEN, 'call tool="f" index="7"', SEP, CLOSE, "call", SEP]
    parser = ReplyParser(MARKERS, thinking=False)
    for part in [CLOSE, "response", SEP, OPEN, "tools", SEP] + call + call:
        parser.feed(part)
    calls = parser.reply.tool_calls
    assert [c["function"]["arguments"] for c in calls] == ["{}", "{}"]
    assert calls[0]["id"] != calls[1]["id"]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)


def test_default_call_id_shape():
    ids = {default_call_id() for _ in range(20)}
    assert len(ids) == 20
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


# -- tokens and bytes -------------------------------------------------------------------

def test_marker_spellings_written_as_text_tokens_stay_text():
    parser = new_parser(thinking=False)
    for piece in [b"use <|sep|> and ", b"<|close|>", b"response", b"<|sep|>", b" to end"]:
        parser.feed_token(TEXT_ID, piece)
    parser.feed_token(MARKERS.close, b"")
    parser.feed_token(TEXT_ID, b"response")
    parser.feed_token(MARKERS.sep, b"")
    parser.feed_token(TEXT_ID, b"after")
    parser.finish()
    assert parser.reply.content == "use <|sep|> and <|close|>response<|sep|> to endafter"


def test_special_ids_that_are_not_structure_are_dropped():
    parser = new_parser()
    deltas = []
    for token_id, piece in [(TEXT_ID, b"th"), (MEDIA_PAD, b"<|media_pad|>"), (TEXT_ID, b"ink"),
                            (MARKERS.close, b""), (TEXT_ID, b"think"), (EOS, b"[EOS]"), (MARKERS.sep, b""),
                            (TEXT_ID, b"ok"), (EOS, b"[EOS]")]:
        deltas += parser.feed_token(token_id, piece)
    deltas += parser.finish()
    assert (parser.reply.reasoning_content, parser.reply.content) == ("think", "ok")
    check_stream(deltas, parser.reply)


@PROPERTY
@given(assistant_turns(), chunk_sizes, st.lists(st.sampled_from([EOS, MEDIA_PAD]), max_size=8), st.randoms())
def test_special_ids_never_reach_the_reply(turn, sizes, specials, random):
    tokens = [(MARKER_ID[text], b"") if is_markup else (TEXT_ID, chunk)
              for text, is_markup in rendered_reply(turn)
              for chunk in ([b""] if is_markup else split_bytes(text.encode(), sizes))]
    for special in specials:   # specials anywhere except after the end
        piece = b"<|media_pad|>" if special == MEDIA_PAD else b"[EOS]"
        tokens.insert(random.randrange(len(tokens)), (special, piece))
    parser = new_parser()
    for token_id, piece in tokens:
        parser.feed_token(token_id, piece)
    parser.finish()
    check_matches(parser.reply, turn)


def test_a_character_split_across_tokens_arrives_whole_where_it_completes():
    parser = new_parser(thinking=False)
    data = "a🙂é".encode()
    got = [parser.feed_token(TEXT_ID, data[i:i + 1]) for i in range(len(data))]
    assert [[d.content for d in deltas] for deltas in got] == [["a"], [], [], [], ["🙂"], [], ["é"]]


def test_an_incomplete_character_is_flushed_with_a_replacement():
    parser = new_parser(thinking=True)
    parser.feed_token(TEXT_ID, "é".encode()[:1])
    parser.feed_token(MARKERS.close, b"")   # the channel ends mid-character
    parser.feed_token(TEXT_ID, b"think")
    parser.feed_token(MARKERS.sep, b"")
    parser.feed_token(TEXT_ID, "🙂".encode()[:2])
    deltas = parser.finish()
    assert (parser.reply.reasoning_content, parser.reply.content) == ("\ufffd", "\ufffd")
    assert [d.content for d in deltas] == ["\ufffd"]


# -- malformed output -------------------------------------------------------------------

def parse(*parts: str, thinking: bool = True) -> Reply:
    """Token-wise parse of a script written as strings; checks stream consistency too."""
    deltas, reply = run_tokens(markup(*parts), [2], thinking=thinking)
    check_stream(deltas, reply)
    return reply


def test_reply_cut_mid_header_drops_the_header():
    reply = parse("hmm", CLOSE, "think", SEP, "answer", OPEN, "too")
    assert (reply.reasoning_content, reply.content, reply.tool_calls) == ("hmm", "answer", [])
    assert not reply.ended


def test_header_interrupted_by_another_marker_is_dropped():
    reply = parse(OPEN, "response", CLOSE, "think", SEP, "answer")
    assert (reply.reasoning_content, reply.content) == ("", "answer")


def test_reply_cut_mid_string_argument_keeps_the_json_as_generated():
    # No layer closes the JSON for the model: a cut call must not look like a finished one.
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                  OPEN, 'argument key="city" type="string"', SEP, "Par")
    assert reply.tool_calls[0]["function"]["arguments"] == '{"city": "Par'


@pytest.mark.parametrize("value_type, body, expected", [
    ("number", "4", 4),
    ("boolean", "tr", "tr"),          # unparseable: kept as the raw text
    ("number", "NaN", "NaN"),         # Python would parse it, JSON does not
    ("array", "[1, 2", "[1, 2"),
    ("made-up", "[1]", [1]),          # unknown types are parsed if they can be
])
def test_typed_argument_values(value_type, body, expected):
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                  OPEN, f'argument key="k" type="{value_type}"', SEP, body, CLOSE, "argument", SEP,
                  CLOSE, "call", SEP)
    assert arguments(reply) == [{"k": expected}]


@pytest.mark.parametrize("body", ["4", "tr", "[1, 2"])
def test_reply_cut_mid_typed_argument_keeps_its_text_unclosed(body):
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                  OPEN, 'argument key="k" type="number"', SEP, body)
    assert reply.tool_calls[0]["function"]["arguments"] == '{"k": ' + body


def test_argument_nested_past_the_json_parsers_depth_is_kept_as_text():
    # json.loads raises RecursionError here, which is not a ValueError.
    body = "[" * 5000
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                  OPEN, 'argument key="k" type="array"', SEP, body, CLOSE, "argument", SEP,
                  CLOSE, "call", SEP)
    assert arguments(reply) == [{"k": body}]


@pytest.mark.parametrize("stray", [OPEN, CLOSE])
def test_stray_marker_before_a_long_answer_does_not_swallow_it(stray):
    prose = "The markup uses angle brackets. " * 100   # far longer than any header
    assert len(prose) > MAX_HEADER_CHARS
    reply = parse(CLOSE, "think", SEP, OPEN, "response", SEP, "Sure. ", stray, prose,
                  CLOSE, "response", SEP, END_OF_MSG)
    assert reply.content == "Sure. " + prose and reply.ended


def test_header_up_to_the_limit_still_counts():
    key = "k" * (MAX_HEADER_CHARS - len('argument key="" type="string"'))
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                  OPEN, f'argument key="{key}" type="string"', SEP, "v", CLOSE, "argument", SEP,
                  CLOSE, "call", SEP)
    assert arguments(reply) == [{key: "v"}]


def test_reply_cut_right_after_call_header_gives_empty_arguments():
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP)
    assert reply.tool_calls[0]["function"] == {"name": "f", "arguments": ""}


def test_a_call_closed_without_arguments_has_an_empty_object():
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                  CLOSE, "call", SEP)
    assert reply.tool_calls[0]["function"] == {"name": "f", "arguments": "{}"}


def test_reply_cut_mid_marker_in_text_mode_keeps_the_partial_marker_as_text():
    _, reply = run_text("reason<|close|>think<|sep|>answer <|clo", thinking=True)
    assert (reply.reasoning_content, reply.content) == ("reason", "answer <|clo")


def test_text_mode_finds_markers_split_across_chunks():
    parser = new_parser()
    for chunk in ["r<", "|cl", "ose|", ">think<|", "sep|><", "|open|>response<|sep|>a<|media_pad|><", "b"]:
        parser.feed(chunk)
    parser.finish()
    assert (parser.reply.reasoning_content, parser.reply.content) == ("r", "a<|media_pad|><b")


def test_close_for_something_never_opened_is_dropped():
    reply = parse("r", CLOSE, "tools", SEP, CLOSE, "think", SEP, "a", CLOSE, "call", SEP, "b")
    assert (reply.reasoning_content, reply.content, reply.ended) == ("r", "ab", False)


def test_unknown_element_text_goes_to_the_enclosing_channel():
    reply = parse("x", OPEN, 'b weight="bold"', SEP, "y", CLOSE, "b", SEP, "z", CLOSE, "think", SEP,
                  OPEN, "response", SEP, OPEN, "i", SEP, "ok", CLOSE, "response", SEP)
    assert (reply.reasoning_content, reply.content) == ("xyz", "ok")


def test_unknown_element_inside_tools_is_dropped_with_its_text():
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, "\n", OPEN, "note", SEP, "chatter", CLOSE, "note", SEP,
                  OPEN, 'call tool="f"', SEP, " ", OPEN, 'argument key="a" type="number"', SEP, "1",
                  CLOSE, "argument", SEP, "\n", CLOSE, "call", SEP, CLOSE, "tools", SEP)
    assert (reply.content, arguments(reply)) == ("", [{"a": 1}])


def test_text_directly_in_message_is_content():
    reply = parse(CLOSE, "think", SEP, "forgot the response element")
    assert reply.content == "forgot the response element"


def test_junk_attributes_are_ignored():
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP,
                  OPEN, 'call junk =x tool="a &amp; b" index=1 "', SEP, CLOSE, "call", SEP)
    assert reply.tool_calls[0]["function"] == {"name": "a & b", "arguments": "{}"}


def test_attribute_values_are_unescaped():
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                  OPEN, 'argument key="&quot;&lt;k&gt;&quot;" type="string"', SEP, "v",
                  CLOSE, "call", SEP)
    assert arguments(reply) == [{'"<k>"': "v"}]


def test_stray_sep_is_dropped():
    assert parse("a", SEP, "b").reasoning_content == "ab"


def test_closing_an_outer_element_closes_what_it_contains():
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                  OPEN, 'argument key="s" type="string"', SEP, "v", CLOSE, "tools", SEP, "after")
    assert (arguments(reply), reply.content) == ([{"s": "v"}], "after")


def test_a_call_holds_one_json_body_or_arguments_not_both():
    reply = parse(CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP,
                  OPEN, 'argument key="a" type="number"', SEP, "1", CLOSE, "argument", SEP,
                  OPEN, "json", SEP, '{"b": 2}', CLOSE, "json", SEP, CLOSE, "call", SEP,
                  OPEN, 'call tool="g"', SEP, OPEN, "json", SEP, '{"c": 3}', CLOSE, "json", SEP,
                  OPEN, 'argument key="d" type="number"', SEP, "4", CLOSE, "argument", SEP)
    assert arguments(reply) == [{"a": 1}, {"c": 3}]


def test_elements_only_count_where_they_belong():
    # A call outside tools, and think inside response, are unknown elements: their text stays put.
    reply = parse(CLOSE, "think", SEP, OPEN, "response", SEP, OPEN, 'call tool="f"', SEP, "x",
                  CLOSE, "call", SEP, OPEN, "think", SEP, "y")
    assert (reply.reasoning_content, reply.content, reply.tool_calls) == ("", "xy", [])


@pytest.mark.parametrize("ending", [[CLOSE, "message", SEP], [END_OF_MSG]])
def test_input_after_the_end_is_ignored(ending):
    parser = new_parser()
    for part in ["r", CLOSE, "think", SEP, OPEN, "tools", SEP, OPEN, 'call tool="f"', SEP, *ending,
                 "more", OPEN, "response", SEP, "text"]:
        parser.feed_token(MARKER_ID.get(part, TEXT_ID), part.encode())
    assert parser.ended
    assert parser.finish() == []
    reply = parser.reply
    assert (reply.reasoning_content, reply.content, reply.ended) == ("r", "", True)
    assert reply.tool_calls[0]["function"]["arguments"] == "{}"


def test_finish_without_an_end_is_not_ended():
    parser = new_parser()
    parser.feed("thinking")
    parser.finish()
    assert not parser.ended and parser.reply.reasoning_content == "thinking"


# -- random token soup ------------------------------------------------------------------

SOUP_TEXTS = ["think", "response", "tools", "message", 'call tool="f"', "call", 'argument key="k"',
              ' type="string"', ' type="number"', ' type="object"', "argument", "1", "{", '"', "x",
              "\n", "\xe2\x82", "\xac", "junk=", "<|"]
soup_event = st.one_of(st.sampled_from([OPEN, SEP, CLOSE, END_OF_MSG]), st.sampled_from([EOS, MEDIA_PAD]),
                       st.sampled_from(SOUP_TEXTS), st.binary(max_size=3))


def _feed_soup(events: list, thinking: bool, with_json: bool) -> tuple[list[Delta], ReplyParser]:
    parser = new_parser(thinking)
    deltas = []
    for event in events:
        if isinstance(event, int):
            deltas += parser.feed_token(event, b"[special]")
        elif event in MARKER_ID:
            deltas += parser.feed_token(MARKER_ID[event], b"")
        else:
            piece = event if isinstance(event, bytes) else event.encode("latin-1", "ignore")
            # Without a `j` no header can spell `json`, whose verbatim body could be anything.
            deltas += parser.feed_token(TEXT_ID, piece if with_json else piece.replace(b"j", b"J"))
    deltas += parser.finish()
    return deltas, parser


@PROPERTY
@given(st.lists(soup_event, max_size=60), st.booleans())
def test_random_token_soup_leaves_valid_json_arguments(events, thinking):
    deltas, parser = _feed_soup(events, thinking, with_json=False)
    check_stream(deltas, parser.reply)
    for call in parser.reply.tool_calls:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert "[special]" not in parser.reply.content + parser.reply.reasoning_content


@PROPERTY
@given(st.lists(st.one_of(soup_event, st.just("json")), max_size=60), st.booleans())
def test_random_token_soup_with_json_bodies_never_raises(events, thinking):
    deltas, parser = _feed_soup(events, thinking, with_json=True)
    check_stream(deltas, parser.reply)


@PROPERTY
@given(st.lists(st.one_of(st.sampled_from([OPEN, SEP, CLOSE, END_OF_MSG]), st.sampled_from(SOUP_TEXTS),
                          st.text(max_size=3)), max_size=60), chunk_sizes)
def test_random_text_soup_never_raises_and_splits_agree(parts, sizes):
    text = "".join(parts)
    whole_deltas, whole = run_text(text)
    deltas, reply = run_text(text, sizes)
    check_stream(deltas, reply)
    assert reply == whole and accumulate(deltas) == accumulate(whole_deltas)
