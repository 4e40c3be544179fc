"""serve/formats/xtml/render.py: the release vectors segment for segment, properties, errors."""
from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import given, strategies as st

from conftest import ROOT
from serve.formats.xtml.render import (IMAGE_PLACEHOLDER, MARKUP_TOKENS, build_chat_segments,
                                       escape_attr, image_prompt, PromptError, render_text,
                                       unescape_attr)
from serve.core.segment import Segment

FIXTURE = ROOT / "tests" / "fixtures" / "xtml_vectors.json"
SHARED_VECTORS = ROOT.parent / "shared" / "vectors" / "xtml.json"
VECTORS = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]

# Every special a K3 tokenizer knows by spelling, so content can try to forge them.
SPECIAL_SPELLINGS = [*MARKUP_TOKENS, IMAGE_PLACEHOLDER, "<|media_begin|>", "<|media_content|>",
                     "<|media_pad|>", "<|media_end|>", "[BOS]", "[EOS]"]
IMAGE = "<|media_begin|>image 2x2<|media_content|><|media_pad|><|media_end|>"


def pairs(segments: list[Segment]) -> list[list]:
    return [[segment.text, segment.markup] for segment in segments]


def markup_of(segments: list[Segment]) -> list[str]:
    return [segment.text for segment in segments if segment.markup]


def texts_of(segments: list[Segment]) -> list[str]:
    return [segment.text for segment in segments if not segment.markup]


# --- the release encoder's own outputs --------------------------------------

@pytest.mark.parametrize("name", sorted(VECTORS))
def test_matches_release_vector(name: str) -> None:
    case = VECTORS[name]
    assert pairs(build_chat_segments(**case["input"])) == case["segments"]


def test_fixture_is_the_shared_reference_copy() -> None:
    if not SHARED_VECTORS.exists():
        pytest.skip(f"{SHARED_VECTORS} is absent (only the project workspace has shared/)")
    assert json.loads(SHARED_VECTORS.read_text(encoding="utf-8")) == \
        json.loads(FIXTURE.read_text(encoding="utf-8"))


# --- behaviour the vectors imply but do not show ------------------------------

def _call(call_id: str, name: str, arguments: object) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_RESULT = re.compile(r'<\|open\|>message role="tool"(?: tool="([^"]*)")? index="(\d+)"<\|sep\|>'
                         r'(.*?)<\|close\|>', re.S)


def _tool_results(segments: list[Segment]) -> list[tuple[str, str, str]]:
    """(tool name or "", index, content) of each rendered tool result, in order."""
    return TOOL_RESULT.findall(render_text(segments))


def test_tool_result_content_parts_are_separate_text_segments() -> None:
    messages = [{"role": "tool", "tool": "t",
                 "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    segments = build_chat_segments(messages, add_generation_prompt=False)
    assert texts_of(segments)[-3:] == ["one", "two", "message"]


def test_empty_string_argument_has_no_body_segment() -> None:
    messages = [{"role": "assistant", "tool_calls": [_call("a", "f", {"k": "", "n": 0})]}]
    segments = build_chat_segments(messages, add_generation_prompt=False)
    text = render_text(segments)
    assert '<|open|>argument key="k" type="string"<|sep|><|close|>argument' in text
    assert '<|open|>argument key="n" type="number"<|sep|>0<|close|>argument' in text
    assert "" not in texts_of(segments)


def test_non_ascii_arguments_are_not_escaped() -> None:
    messages = [{"role": "assistant", "tool_calls": [_call("a", "f", '{"o": {"city": "Zürich"}}')]}]
    text = render_text(build_chat_segments(messages, add_generation_prompt=False))
    assert '{"city": "Zürich"}' in text


def test_attribute_values_are_escaped_in_one_segment() -> None:
    name = 'a"b<c>&d'
    messages = [{"role": "assistant", "tool_calls": [_call("x", name, {'k"': 1})]}]
    texts = texts_of(build_chat_segments(messages, add_generation_prompt=False))
    assert "a&quot;b&lt;c&gt;&amp;d" in texts
    assert "k&quot;" in texts


def test_dynamic_tools_with_content_add_an_ordinary_system_message() -> None:
    tools = [{"type": "function", "function": {"name": "late"}}]
    messages = [{"role": "system", "tools": tools, "content": "Use them wisely."}]
    text = render_text(build_chat_segments(messages, add_generation_prompt=False))
    declare, _, rest = text.partition("<|end_of_msg|>")
    assert declare.startswith('<|open|>message role="system" type="tool-declare"<|sep|>## New Tools')
    assert '{"function":{"name":"late"},"type":"function"}' in declare
    assert rest == '<|open|>message role="system"<|sep|>Use them wisely.<|close|>message<|sep|><|end_of_msg|>'


def test_effort_precedes_conversation_and_choice_precedes_format() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    segments = build_chat_segments([{"role": "user", "content": "go"}], tools,
                                   thinking_effort="high", tool_choice="none",
                                   response_format={"type": "json_object"})
    kinds = [t for t in texts_of(segments) if t in
             ("tool-declare", "thinking-effort", "user", "tool-choice", "response-format")]
    assert kinds == ["tool-declare", "thinking-effort", "user", "tool-choice", "response-format"]
    assert "`thinking_effort=high`" in render_text(segments)


@pytest.mark.parametrize("kwargs", [{"tool_choice": "auto"}, {"response_format": {"type": "text"}},
                                    {"tools": []}, {"thinking_effort": None}])
def test_options_that_add_nothing(kwargs: dict) -> None:
    messages = [{"role": "user", "content": "go"}]
    assert build_chat_segments(messages, **kwargs) == build_chat_segments(messages)


def test_images_are_consumed_in_order_across_parts_and_placeholders() -> None:
    first, second, third = (IMAGE.replace("2x2", size) for size in ("1x1", "2x2", "3x3"))
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}},
                                     {"type": "text", "text": f"a{IMAGE_PLACEHOLDER}b"}]},
        {"role": "user", "content": f"{IMAGE_PLACEHOLDER}c{IMAGE_PLACEHOLDER}"},
    ]
    segments = build_chat_segments(messages, image_prompts=[first, second, third],
                                   add_generation_prompt=False)
    assert [m for m in markup_of(segments) if m not in MARKUP_TOKENS] == [first, second, third]
    # Three prompts: the part, the first message's placeholder, then the
    # second message's first placeholder; its last one has none left.
    content = [t for t in texts_of(segments) if t not in ("message", " role", '="', "user", '"')]
    assert content == ["a", "b", f"c{IMAGE_PLACEHOLDER}"]
    assert render_text(segments).count(third + "c") == 1


def test_placeholders_beyond_the_prompts_stay_text() -> None:
    messages = [{"role": "user", "content": f"x{IMAGE_PLACEHOLDER}y{IMAGE_PLACEHOLDER}z"}]
    segments = build_chat_segments(messages, image_prompts=[IMAGE])
    assert ["x", IMAGE, f"y{IMAGE_PLACEHOLDER}z"] == [s.text for s in segments[7:10]]
    assert [s.markup for s in segments[7:10]] == [False, True, False]


def test_missing_content_renders_empty() -> None:
    segments = build_chat_segments([{"role": "user"}, {"role": "user", "content": None}],
                                   add_generation_prompt=False)
    assert render_text(segments) == 2 * '<|open|>message role="user"<|sep|><|close|>message<|sep|><|end_of_msg|>'


# --- the release encoder's rules beyond the vectors (issue 8), one test each ------

def _open_tag(segments: list[Segment], name: str) -> list[str]:
    """The texts of the first `<|open|>name ...<|sep|>` header, name and attributes."""
    pairs_ = [(s.text, s.markup) for s in segments]
    start = pairs_.index((name, False))
    return [text for text, _ in pairs_[start:pairs_.index(("<|sep|>", True), start)]]


@pytest.mark.parametrize("role", ["system", "user", "assistant"])
def test_rule_1_name_is_an_attribute_after_role(role: str) -> None:
    segments = build_chat_segments([{"role": role, "content": "hi", "name": 'Ann "A" <&>'}],
                                   add_generation_prompt=False)
    assert _open_tag(segments, "message") == ["message", " role", '="', role, '"',
                                              " name", '="', "Ann &quot;A&quot; &lt;&amp;&gt;", '"']
    unnamed = build_chat_segments([{"role": role, "content": "hi", "name": ""}])
    assert unnamed == build_chat_segments([{"role": role, "content": "hi"}])


@pytest.mark.parametrize("message, think", [
    ({"reasoning": "by alias"}, "by alias"),
    ({"reasoning_content": "first", "reasoning": "second"}, "first"),
    ({"reasoning_content": "", "reasoning": "second"}, "second"),
    ({"reasoning_content": " \n\t", "reasoning": "second"}, ""),
    ({"reasoning": " \n"}, ""),
    ({"reasoning_content": " padded "}, " padded "),
])
def test_rule_2_reasoning_is_an_alias_and_whitespace_is_none(message: dict, think: str) -> None:
    turn = {"role": "assistant", "content": "answer", **message}
    text = render_text(build_chat_segments([turn], add_generation_prompt=False))
    assert f"<|open|>think<|sep|>{think}<|close|>think<|sep|><|open|>response" in text
    if not think:
        assert "" not in texts_of(build_chat_segments([turn]))


def test_rule_3_thinking_decides_the_think_channel_of_history() -> None:
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a1", "reasoning_content": "because"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "a2"}]
    on = render_text(build_chat_segments(messages, thinking=True, add_generation_prompt=False))
    off = render_text(build_chat_segments(messages, thinking=False, add_generation_prompt=False))
    assert on.count("<|open|>think<|sep|>") == 2
    assert "<|open|>think<|sep|>because<|close|>think" in on
    assert "<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>a2" in on
    assert "think" not in off and "because" not in off
    assert off.count('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>') == 2


@pytest.mark.parametrize("arguments", ["", None, {}])
def test_rule_4_empty_arguments_render_a_call_without_a_body(arguments: object) -> None:
    messages = [{"role": "assistant", "tool_calls": [_call("a", "f", arguments)]}]
    text = render_text(build_chat_segments(messages, add_generation_prompt=False))
    assert '<|open|>call tool="f" index="1"<|sep|><|close|>call<|sep|>' in text


@pytest.mark.parametrize("arguments, kind", [("[1, 2]", "array"), ("42", "number"), ('"text"', "string"),
                                             ("null", "null"), (" true ", "boolean"), (["x"], "list")])
def test_rule_4_arguments_that_are_not_an_object_are_refused(arguments: object, kind: str) -> None:
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "tool_calls": [_call("a", "f", "{}"), _call("b", "g", arguments)]}]
    with pytest.raises(PromptError) as raised:
        build_chat_segments(messages)
    assert raised.value.field == "messages[1].tool_calls[1].function.arguments"
    assert kind in str(raised.value)


def _assistant_calling(*names: str) -> dict:
    return {"role": "assistant", "tool_calls": [_call(f"id_{n}", n, "{}") for n in names]}


@pytest.mark.parametrize("results, expected", [
    # Every result names a call: re-sorted into call order, named by the call.
    ([{"tool_call_id": "id_c", "tool": "ignored", "content": "C"}, {"tool_call_id": "id_a", "content": "A"}],
     [("a", "1", "A"), ("c", "2", "C")]),
    # One result without a usable id: the run stays as sent; its own field names it.
    ([{"tool_call_id": "id_c", "content": "C"}, {"tool_call_id": "nope", "tool": "own", "content": "O"},
      {"tool_call_id": "id_a", "content": "A"}],
     [("c", "1", "C"), ("own", "2", "O"), ("a", "3", "A")]),
    ([{"name": "by_name", "content": "N"}, {"tool_call_id": "id_b", "content": "B"}],
     [("by_name", "1", "N"), ("b", "2", "B")]),
    ([{"tool": "first", "name": "second", "content": "T"}], [("first", "1", "T")]),
    # Nothing to go on: the call at the same position, the first result getting the first call.
    ([{"content": "1"}, {"tool_call_id": "unknown", "content": "2"}, {"content": "3"}],
     [("a", "1", "1"), ("b", "2", "2"), ("c", "3", "3")]),
])
def test_rule_5_tool_result_names(results: list[dict], expected: list) -> None:
    messages = [{"role": "user", "content": "go"}, _assistant_calling("a", "b", "c"),
                *({"role": "tool", **result} for result in results)]
    assert _tool_results(build_chat_segments(messages, add_generation_prompt=False)) == expected


def test_rule_5_results_after_an_interlude_still_answer_the_latest_calls() -> None:
    messages = [_assistant_calling("a", "b"),
                {"role": "tool", "tool_call_id": "id_a", "content": "A"},
                {"role": "user", "content": "and b?"},
                {"role": "tool", "content": "B"}]
    assert _tool_results(build_chat_segments(messages)) == [("a", "1", "A"), ("b", "2", "B")]


@pytest.mark.parametrize("messages, field", [
    ([{"role": "user", "content": "go"}, {"role": "tool", "content": "r"}], "messages[1]"),
    ([_assistant_calling("a"), {"role": "tool", "tool_call_id": "id_a", "content": "r"},
      {"role": "tool", "tool_call_id": "id_z", "content": "r"}], "messages[2]"),
    ([_assistant_calling("a"), {"role": "tool", "tool": "", "name": "", "content": "r"},
      {"role": "tool", "content": "r"}], "messages[2]"),
])
def test_rule_5_a_result_with_no_name_to_find_is_refused(messages: list, field: str) -> None:
    with pytest.raises(PromptError) as raised:
        build_chat_segments(messages)
    assert raised.value.field == field


SCHEMA_CASE = VECTORS["response_format_json_schema"]
SCHEMA = SCHEMA_CASE["input"]["response_format"]["json_schema"]["schema"]


@pytest.mark.parametrize("kwargs", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "json_schema": SCHEMA}}},
    {"response_format": {"type": "json_schema", "json_schema": SCHEMA}},
    {"response_schema": SCHEMA},
    {"response_schema": SCHEMA, "response_format": {"type": "text"}},
], ids=["json_schema.json_schema", "bare", "response_schema", "response_schema with text"])
def test_rule_6_the_schema_is_found_where_the_release_looks(kwargs: dict) -> None:
    # Each form renders exactly as the vector's `json_schema.schema` does.
    segments = build_chat_segments(SCHEMA_CASE["input"]["messages"], **kwargs)
    assert pairs(segments) == SCHEMA_CASE["segments"]


def test_rule_6_schema_wins_over_a_nested_json_schema() -> None:
    form = {"type": "json_schema", "json_schema": {"schema": SCHEMA, "json_schema": {"type": "string"}}}
    assert pairs(build_chat_segments(SCHEMA_CASE["input"]["messages"], response_format=form)) == \
        SCHEMA_CASE["segments"]


def test_rule_6_response_schema_and_a_response_format_are_not_both_given() -> None:
    with pytest.raises(ValueError, match="response_schema"):
        build_chat_segments([{"role": "user", "content": "go"}], response_schema=SCHEMA,
                            response_format={"type": "json_object"})


@pytest.mark.parametrize("effort", ["high", "medium", "nonsense", 5])
def test_rule_7_thinking_effort_is_ignored_with_thinking_off(effort: object) -> None:
    messages = [{"role": "user", "content": "go"}]
    assert build_chat_segments(messages, thinking=False, thinking_effort=effort) == \
        build_chat_segments(messages, thinking=False)


def test_rule_8_both_image_part_forms_take_the_next_prompt() -> None:
    first, second = (IMAGE.replace("2x2", size) for size in ("1x1", "3x3"))
    parts = [{"type": "image", "image": "data:image/png;base64,AA=="}, {"type": "text", "text": "and"},
             {"type": "image_url", "image_url": {"url": "u"}}]
    segments = build_chat_segments([{"role": "user", "content": parts}], image_prompts=[first, second])
    assert [m for m in markup_of(segments) if m not in MARKUP_TOKENS] == [first, second]
    as_openai = [{"type": "image_url", "image_url": {"url": "v"}}, *parts[1:]]
    assert segments == build_chat_segments([{"role": "user", "content": as_openai}],
                                           image_prompts=[first, second])


def test_rule_9_a_named_tool_choice_is_required_plus_a_note() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    named = build_chat_segments([{"role": "user", "content": "go"}], tools,
                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                response_format={"type": "json_object"})
    required = build_chat_segments([{"role": "user", "content": "go"}], tools, tool_choice="required",
                                   response_format={"type": "json_object"})
    text, plain = render_text(named), render_text(required)
    note = ('<|open|>message role="system"<|sep|>You MUST call the tool `get_weather` and no other '
            'tool in the next message.<|close|>message<|sep|><|end_of_msg|>')
    # The required note as the release writes it, then the named note, then the rest.
    choice_end = plain.index("in the next message.<|close|>message<|sep|><|end_of_msg|>") + \
        len("in the next message.<|close|>message<|sep|><|end_of_msg|>")
    assert text == plain[:choice_end] + note + plain[choice_end:]
    assert "\n" not in note


@pytest.mark.parametrize("choice", [{"type": "function"}, {"type": "function", "function": {"name": ""}},
                                    {"type": "tool", "function": {"name": "f"}}, {"function": "f"}])
def test_rule_9_a_malformed_named_choice_is_refused(choice: dict) -> None:
    with pytest.raises(ValueError, match="tool_choice"):
        build_chat_segments([{"role": "user", "content": "go"}], tool_choice=choice)


# --- errors -------------------------------------------------------------------

@pytest.mark.parametrize("effort", ["medium", "minimal", "LOW", ""])
def test_unsupported_thinking_effort_raises(effort: str) -> None:
    with pytest.raises(ValueError, match="thinking_effort"):
        build_chat_segments([{"role": "user", "content": "go"}], thinking_effort=effort)


@pytest.mark.parametrize("role", ["developer", "function", "bot", None])
def test_unknown_role_raises_naming_it(role: object) -> None:
    with pytest.raises(ValueError, match=repr(role)):
        build_chat_segments([{"role": role, "content": "hi"}])


def test_image_part_without_a_prompt_raises() -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]
    with pytest.raises(ValueError, match="image"):
        build_chat_segments(messages)
    with pytest.raises(ValueError, match="image"):
        build_chat_segments(messages * 2, image_prompts=[IMAGE])


@pytest.mark.parametrize("kwargs", [{"tool_choice": "sometimes"},
                                    {"response_format": {"type": "yaml"}},
                                    {"messages": [{"role": "user", "content": [{"type": "audio"}]}]}])
def test_other_unsupported_requests_raise(kwargs: dict) -> None:
    kwargs.setdefault("messages", [{"role": "user", "content": "go"}])
    with pytest.raises(ValueError):
        build_chat_segments(**kwargs)


@pytest.mark.parametrize("messages, field", [
    ("hello", "messages must be a list"),
    (["hello"], "messages[0] must be an object, not str"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list"),
    ([{"role": "user", "content": {"type": "text"}}], "messages[0].content must be"),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0] must be an object"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text"),
    ([{"role": "assistant", "content": "x", "reasoning_content": 5}], "messages[0].reasoning_content"),
    ([{"role": "assistant", "content": "x", "reasoning": ["r"]}], "messages[0].reasoning"),
    ([{"role": "user", "content": "x", "name": 5}], "messages[0].name"),
    ([{"role": "system", "content": "x", "name": {"n": 1}}], "messages[0].name"),
    ([{"role": "assistant", "tool_calls": {"id": "a"}}], "messages[0].tool_calls must be a list"),
    ([{"role": "assistant", "tool_calls": ["f"]}], "messages[0].tool_calls[0] must be an object"),
    ([{"role": "assistant", "tool_calls": [{"function": "f"}]}], "messages[0].tool_calls[0].function"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": [{"id": ["a"], "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0].id"),
    ([{"role": "user", "content": "go"}, {"role": "tool", "tool": 5, "content": "r"}], "messages[1].tool "),
    ([{"role": "tool", "name": 5, "content": "r"}], "messages[0].name"),
    ([{"role": "tool", "tool_call_id": ["a"], "content": "r"}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [_call("a", "f", {"k": [{1}]})]}], "tool argument is not JSON"),
    ([{"role": "assistant", "tool_calls": [_call("a", "f", "[" * 100000 + "]" * 100000)]}],
     "tool call arguments are nested too deeply"),
])
def test_malformed_messages_raise_value_error_naming_the_field(messages: object, field: str) -> None:
    # These crashed with AttributeError/TypeError (a 500 over HTTP), or put a
    # non-string segment in front of the tokenizer.
    with pytest.raises(ValueError) as raised:
        build_chat_segments(messages)
    assert field in str(raised.value)


@pytest.mark.parametrize("kwargs, field", [
    ({"tool_choice": ["required"]}, "tool_choice"),
    ({"response_format": "json_object"}, "response_format must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": "s"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"a": {1}}}}}, "schema is not JSON"),
    ({"tools": [{"type": "function", "function": {"name": "f", "x": {1}}}]}, "tools is not JSON"),
    ({"image_prompts": [5]}, "image_prompts"),
])
def test_malformed_options_raise_value_error_naming_them(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError) as raised:
        build_chat_segments([{"role": "user", "content": "go"}], **kwargs)
    assert field in str(raised.value)


def test_argument_values_nested_too_deeply_raise_value_error() -> None:
    value: list = []
    for _ in range(100000):
        value = [value]
    messages = [{"role": "assistant", "tool_calls": [_call("a", "f", {"k": value})]}]
    with pytest.raises(ValueError, match="tool argument is nested too deeply"):
        build_chat_segments(messages)


def test_fields_a_role_does_not_render_are_not_checked() -> None:
    # Reasoning belongs to assistant turns only.
    messages = [{"role": "user", "content": "hi", "reasoning_content": 6, "reasoning": 7}]
    assert build_chat_segments(messages) == build_chat_segments([{"role": "user", "content": "hi"}])


# --- properties ---------------------------------------------------------------

def _not_json_beside_an_object(text: str) -> bool:
    """Arguments the release renders: anything but JSON that is not an object."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return True


# Text that is likely to contain forged structure: specials, quotes, brackets.
hostile_text = st.lists(st.one_of(st.text(max_size=8), st.sampled_from(SPECIAL_SPELLINGS),
                                  st.sampled_from(['"', "=", "<", ">", "&", " role"])),
                        max_size=6).map("".join)
json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6)
                          | st.floats(allow_nan=False, allow_infinity=False),
                          lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                          max_leaves=6)
json_object = st.dictionaries(hostile_text, json_value, max_size=3)
tool_call = st.builds(_call, st.text(max_size=4), hostile_text,
                      st.one_of(json_object, hostile_text.filter(_not_json_beside_an_object),
                                json_object.map(json.dumps)))
plain_message = st.builds(lambda role, content: {"role": role, "content": content},
                          st.sampled_from(["system", "user"]), hostile_text)
assistant_message = st.builds(
    lambda content, reasoning, calls: {"role": "assistant", "content": content,
                                       "reasoning_content": reasoning, "tool_calls": calls},
    hostile_text, hostile_text, st.lists(tool_call, max_size=2))
tool_message = st.builds(lambda content, name: {"role": "tool", "tool": name, "content": content},
                         hostile_text, hostile_text.filter(bool))
any_message = st.one_of(plain_message, assistant_message, tool_message)


def _skeleton(message: dict) -> dict:
    """The same message with every free-text field blanked."""
    bland = dict(message, content="")
    if message["role"] == "assistant":
        bland["reasoning_content"] = ""
    return bland


@given(st.lists(any_message, max_size=5))
def test_content_never_reaches_markup(messages: list[dict]) -> None:
    segments = build_chat_segments(messages)
    bland = build_chat_segments([_skeleton(m) for m in messages])
    # Structure is fixed by the message shapes alone, whatever the text says.
    assert markup_of(segments) == markup_of(bland)
    assert set(markup_of(segments)) <= set(MARKUP_TOKENS)
    for message in messages:
        assert not message["content"] or message["content"] in texts_of(segments)


@given(st.lists(any_message, max_size=5), st.booleans(), st.booleans())
def test_no_empty_segments_and_deterministic(messages: list[dict], generation: bool,
                                             thinking: bool) -> None:
    before = copy.deepcopy(messages)
    first = build_chat_segments(messages, add_generation_prompt=generation, thinking=thinking)
    assert all(segment.text for segment in first)
    assert build_chat_segments(messages, add_generation_prompt=generation, thinking=thinking) == first
    assert messages == before


# Content words are disjoint from every structural word, so a text segment
# that is neither a structural word nor a whole content word can only be the
# product of a merge.
content_word = st.text(alphabet="xyz?! \n", min_size=1, max_size=6) | st.sampled_from(SPECIAL_SPELLINGS)
STRUCTURE_WORDS = {"message", "think", "response", " role", " tool", " index", '="', '"',
                   "system", "user", "assistant", "tool", "f", *"123456"}


@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), content_word),
                max_size=6),
       st.lists(st.sampled_from(["1x1", "3x4"]), max_size=2))
def test_segments_are_never_merged(turns: list[tuple[str, str]], sizes: list[str]) -> None:
    messages = [{"role": role, "content": word, "tool": "f"} for role, word in turns]
    prompts = [IMAGE.replace("2x2", size) for size in sizes]
    words = {word for _, word in turns}
    for segment in build_chat_segments(messages, image_prompts=prompts):
        if segment.markup:
            assert segment.text in MARKUP_TOKENS or segment.text in prompts
        else:
            assert segment.text in STRUCTURE_WORDS or segment.text in words


@given(st.text())
def test_attribute_escaping_round_trips(value: str) -> None:
    escaped = escape_attr(value)
    assert not set('"<>') & set(escaped)
    assert unescape_attr(escaped) == value


@given(hostile_text.filter(bool))
def test_attribute_value_is_one_escaped_segment(name: str) -> None:
    messages = [{"role": "tool", "tool": name, "content": "r"}]
    texts = texts_of(build_chat_segments(messages, add_generation_prompt=False))
    assert texts[texts.index(" tool") + 2] == escape_attr(name)
    assert unescape_attr(texts[texts.index(" tool") + 2]) == name


@given(st.lists(st.one_of(plain_message, assistant_message), max_size=5))
def test_rendering_composes_per_message(messages: list[dict]) -> None:
    whole = render_text(build_chat_segments(messages, add_generation_prompt=False))
    parts = "".join(render_text(build_chat_segments([m], add_generation_prompt=False))
                    for m in messages)
    assert whole == parts


def test_image_prompt_is_the_release_media_block():
    case = VECTORS["image_part"]["input"]
    assert image_prompt(640, 480) == case["image_prompts"][0]

