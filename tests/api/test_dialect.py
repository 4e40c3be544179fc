"""serve/dialects/translation.py on its own: what the Anthropic and Responses translations share."""
from __future__ import annotations

import pytest

from serve.core.errors import ApiError, invalid
from serve.core.reply import Delta
from serve.dialects.translation import (Blocks, chat_request, Conversation, Parts, renamed, string_field,
                                   tool_call)


def test_an_error_names_the_field_as_the_client_did_or_its_nearest_named_parent():
    fields = {"messages": "input", "messages[1]": "input[3]", "stop": "stop_sequences"}
    error = renamed(invalid("messages[1].content[0].text", "messages[1].content[0].text is bad"), fields)
    assert error.param == "input[3].content[0].text" and error.message == "input[3].content[0].text is bad"
    assert renamed(invalid("stop", "too many"), fields).param == "stop_sequences"
    unnamed = invalid("tools[0]", "no")
    assert renamed(unnamed, fields) is unnamed   # nothing to rename: the error as it was
    kept = renamed(ApiError(400, "x", param="stop", code="c", headers={"H": "v"}), fields)
    assert (kept.code, kept.headers) == ("c", {"H": "v"})


def test_a_translated_request_is_validated_as_chat_and_its_errors_renamed():
    fields = {"messages": "input", "messages[0]": "input[0]"}
    ok = chat_request({"messages": [{"role": "user", "content": "hi"}]}, fields, ["web_search"])
    assert ok.request.messages[0]["content"] == "hi" and ok.left_out == ["web_search"]
    with pytest.raises(ApiError) as caught:
        chat_request({"messages": [{"role": "nobody", "content": "hi"}]}, fields, [])
    assert caught.value.param.startswith("input[0]")


def test_string_fields_and_tool_calls():
    assert string_field({"name": "f"}, "name", "tools[0]") == "f"
    with pytest.raises(ApiError) as caught:
        string_field({"name": 3}, "name", "tools[0]")
    assert caught.value.param == "tools[0].name"
    assert tool_call("c1", "f", {"a": "é"}) == {"id": "c1", "type": "function",
                                                "function": {"name": "f", "arguments": '{"a": "é"}'}}
    assert tool_call("c1", "f", '{"a":1}')["function"]["arguments"] == '{"a":1}'


def test_parts_join_neighbouring_text_and_remember_where_each_came_from():
    parts = Parts()
    assert not parts
    parts.text("one", "content[0]")
    parts.text("two", "content[1]")
    assert parts.content() == "one\n\ntwo" and parts.fields == ["content[0]"]
    parts.image("data:image/png;base64,AA", "content[2]")
    assert parts.content() == [{"type": "text", "text": "one\n\ntwo"},
                               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
    conversation = Conversation()
    conversation.add({"role": "system", "content": "s"}, "system")
    conversation.add({"role": "user", "content": parts.content()}, "messages[0]", parts)
    assert conversation.fields == {"messages[0]": "system", "messages[1]": "messages[0]",
                                   "messages[1].content[0]": "content[0]",
                                   "messages[1].content[1]": "content[2]"}


def test_blocks_open_add_and_close_in_reply_order():
    blocks = Blocks()
    steps = [(step, block.kind, piece) for delta in (
        Delta(reasoning_content="hm"), Delta(reasoning_content="m"), Delta(content="Hi"),
        Delta(tool_call={"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}),
        Delta(tool_call={"index": 0, "function": {"arguments": "{}"}})) for step, block, piece
        in blocks.feed(delta)] + [(step, block.kind, piece) for step, block, piece in blocks.finish()]
    assert steps == [("open", "reasoning", ""), ("add", "reasoning", "hm"), ("add", "reasoning", "m"),
                     ("close", "reasoning", ""), ("open", "text", ""), ("add", "text", "Hi"),
                     ("close", "text", ""), ("open", "tool", ""), ("add", "tool", "{}"),
                     ("close", "tool", "")]
    assert [b.text for b in blocks.blocks] == ["hmm", "Hi", "{}"] and blocks.reasoning_pieces == 2
    assert (blocks.blocks[2].call_id, blocks.blocks[2].name, blocks.blocks[2].index) == ("c1", "f", 2)
