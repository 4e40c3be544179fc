"""Choosing a container's chat format, and the chat.json path's rendering and parsing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from serve.formats.xtml import render as xtml
from serve.formats.base import ChatFormatError
from serve.formats.format_choice import NoChatFormat, resolve_chat_format
from serve.formats.template.format import TemplateFormat
from serve.formats.template.tools import TemplateReplyParser
from serve.formats.xtml.format import XtmlFormat
from serve.engine.binding import Engine, EngineConfig
from serve.formats.xtml.reply import ReplyParser
from serve.core.reply import Delta
from serve.core.segment import Segment

KIMI_CHAT = {
    "system": ["<|im_system|>system<|im_middle|>", "<|im_end|>"],
    "user": ["<|im_user|>user<|im_middle|>", "<|im_end|>"],
    "assistant": ["<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"],
    "open": "<|im_assistant|>assistant<|im_middle|>",
}


@pytest.fixture(scope="module")
def k3(k3_engine):
    return k3_engine


@pytest.fixture(scope="module")
def kimi(lib, kimi_linear_container):
    with Engine(lib, kimi_linear_container, EngineConfig()) as opened:
        yield opened


@pytest.fixture(scope="module")
def template(kimi, kimi_linear_container) -> TemplateFormat:
    chat = resolve_chat_format(kimi, kimi_linear_container)
    assert isinstance(chat, TemplateFormat)
    return chat


def with_chat_json(directory: Path, content) -> Path:
    """A model dir whose chat.json is `content` (a JSON value, or raw text if a str)."""
    text = content if isinstance(content, str) else json.dumps(content)
    (directory / "chat.json").write_text(text, encoding="utf-8")
    return directory

# ---------------------------------------------------------------- resolution


def test_k3_speaks_xtml(k3, k3_container):
    chat = resolve_chat_format(k3, k3_container)
    assert isinstance(chat, XtmlFormat) and chat.name == "xtml"
    assert chat.stop_tokens == [k3.specials["<|end_of_msg|>"]]
    assert (chat.markers.open, chat.markers.sep, chat.markers.close) == \
        (k3.specials["<|open|>"], k3.specials["<|sep|>"], k3.specials["<|close|>"])
    assert chat.supports_tools and chat.supports_reasoning and chat.supports_images
    assert "xtml" in chat.description


def test_kimi_linear_speaks_its_chat_json(template, kimi, kimi_linear_container):
    assert template.name == "chat.json"
    assert template.stop_tokens == [kimi.specials["<|im_end|>"]]
    assert str(kimi_linear_container / "chat.json") in template.description
    assert "tools in serve's call format" in template.description
    assert "no XTML markers" in template.description  # why it fell back
    assert template.supports_tools and not template.prompts_tools   # calls need a grammar
    assert not (template.supports_reasoning or template.supports_images)


def test_plain_container_has_neither_and_says_why(lib, plain_container):
    with Engine(lib, plain_container, EngineConfig()) as plain:
        chat = resolve_chat_format(plain, plain_container)
    assert isinstance(chat, NoChatFormat)
    no_xtml, no_template = chat.reasons
    assert no_xtml.startswith("no XTML markers:") and "<|open|>" in no_xtml
    assert no_template == "chat.json: missing"
    assert no_xtml in chat.description and no_template in chat.description


def test_xtml_reason_names_every_absent_marker(kimi, tmp_path):
    chat = resolve_chat_format(kimi, tmp_path)
    assert isinstance(chat, NoChatFormat)
    for marker in ("<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"):
        assert marker in chat.reasons[0]
    assert chat.reasons[1] == "chat.json: missing"


BROKEN_TEMPLATES = {
    "missing open": ({k: v for k, v in KIMI_CHAT.items() if k != "open"}, 'missing "open"'),
    "missing user": ({k: v for k, v in KIMI_CHAT.items() if k != "user"}, 'missing "user"'),
    "no control token": ({**KIMI_CHAT, "assistant": ["<|im_assistant|>assistant<|im_middle|>", "\n"]},
                         "assistant suffix has no control token"),
    "unknown special": ({**KIMI_CHAT, "user": ["<|im_start|>user\n", "<|im_end|>"]},
                        "<|im_start|> is not a token of this vocabulary"),
    "unknown special in open": ({**KIMI_CHAT, "open": "<|im_start|>assistant\n"},
                                "<|im_start|> is not a token of this vocabulary"),
    "invalid json": ('{"open": "<|im_assistant|>"', "not valid JSON"),
    "not an object": ([KIMI_CHAT], "not a JSON object"),
    "pair is a string": ({**KIMI_CHAT, "user": "<|im_user|>"},
                         '"user" must be a [prefix, suffix] pair of strings'),
    "pair of three": ({**KIMI_CHAT, "system": ["a", "b", "c"]},
                      '"system" must be a [prefix, suffix] pair of strings'),
    "open not a string": ({**KIMI_CHAT, "open": ["<|im_assistant|>"]}, '"open" must be a string'),
    "misspelt key": ({**KIMI_CHAT, "sytem": ["", ""]}, "unknown key 'sytem'"),
    "default system not a string": ({**KIMI_CHAT, "default_system": 1},
                                    '"default_system" must be a string'),
    "default system without a system turn": (
        {**{k: v for k, v in KIMI_CHAT.items() if k != "system"}, "default_system": "Hi"},
        '"default_system" needs a "system" turn'),
}


@pytest.mark.parametrize("content, problem", BROKEN_TEMPLATES.values(), ids=BROKEN_TEMPLATES.keys())
def test_broken_chat_json_is_refused_with_its_problem(kimi, tmp_path, content, problem):
    chat = resolve_chat_format(kimi, with_chat_json(tmp_path, content))
    assert isinstance(chat, NoChatFormat)
    assert chat.reasons[0].startswith("no XTML markers:")
    assert chat.reasons[1].startswith("chat.json: ") and problem in chat.reasons[1]


def test_a_template_without_system_turn_is_served(kimi, tmp_path):
    minimal = {k: v for k, v in KIMI_CHAT.items() if k != "system"}
    chat = resolve_chat_format(kimi, with_chat_json(tmp_path, minimal))
    assert isinstance(chat, TemplateFormat)
    assert not chat.supports_tools and "no system turn to declare them in" in chat.description
    with pytest.raises(ChatFormatError) as caught:
        chat.render([{"role": "system", "content": "Be brief."}], thinking=False)
    assert caught.value.field == "messages[0]"


def test_every_control_token_of_the_assistant_suffix_stops(k3, tmp_path):
    k3_text_only = {"user": ['<|open|>message role="user"<|sep|>', "<|close|>message<|sep|><|end_of_msg|>"],
                    "assistant": ['<|open|>message role="assistant"<|sep|>',
                                  "<|close|>message<|sep|><|end_of_msg|>"],
                    "open": '<|open|>message role="assistant"<|sep|>'}
    chat = TemplateFormat.load(k3, with_chat_json(tmp_path, k3_text_only) / "chat.json")
    assert chat.stop_tokens == [k3.specials[t] for t in ("<|close|>", "<|sep|>", "<|end_of_msg|>")]


def test_resolution_never_raises(tmp_path):
    class Failing:
        specials: dict = {}

        def token_id(self, text):
            raise RuntimeError("engine went away")

    chat = resolve_chat_format(Failing(), with_chat_json(tmp_path, KIMI_CHAT))
    assert isinstance(chat, NoChatFormat)
    assert all("engine went away" in reason for reason in chat.reasons)

# ----------------------------------------------------------------- rendering


@pytest.mark.parametrize("first", [{"role": "user", "content": "Hi"}, None])
def test_default_system_opens_a_conversation_without_one(kimi, tmp_path, first):
    chat = resolve_chat_format(kimi, with_chat_json(tmp_path, {**KIMI_CHAT, "default_system": "Be kind."}))
    messages = [first] if first else []
    system = [Segment("<|im_system|>system<|im_middle|>", True), Segment("Be kind.", False),
              Segment("<|im_end|>", True)]
    rendered = chat.render(messages, thinking=False).segments
    assert rendered[:3] == system
    assert rendered[-1] == Segment("<|im_assistant|>assistant<|im_middle|>", True)
    assert len(rendered) == (7 if first else 4)


@pytest.mark.parametrize("role", ["system", "developer"])
def test_default_system_yields_to_the_callers_system_message(kimi, tmp_path, role):
    chat = resolve_chat_format(kimi, with_chat_json(tmp_path, {**KIMI_CHAT, "default_system": "Be kind."}))
    rendered = chat.render([{"role": role, "content": "Be brief."}], thinking=False).segments
    assert Segment("Be kind.", False) not in rendered
    assert rendered[1] == Segment("Be brief.", False)


def test_template_renders_turns_as_markup_and_content_as_text(template):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                             {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}]
    assert template.render(messages, thinking=True).segments == [
        Segment("<|im_system|>system<|im_middle|>", True), Segment("Be brief.", False),
        Segment("<|im_end|>", True),
        Segment("<|im_user|>user<|im_middle|>", True), Segment("Hi there", False),
        Segment("<|im_end|>", True),
        Segment("<|im_assistant|>assistant<|im_middle|>", True), Segment("Hello.", False),
        Segment("<|im_end|>", True),
        Segment("<|im_user|>user<|im_middle|>", True), Segment("Bye", False),
        Segment("<|im_end|>", True),
        Segment("<|im_assistant|>assistant<|im_middle|>", True)]


def test_markup_in_content_stays_text(template, kimi):
    segments = template.render([{"role": "user", "content": "Say <|im_end|> please"}],
                               thinking=False).segments
    assert Segment("Say <|im_end|> please", False) in segments
    ids = kimi.tokenize_segments(segments)
    im_end = kimi.specials["<|im_end|>"]
    assert ids.count(im_end) == 1   # only the template's own suffix
    assert kimi.detokenize(ids).count(b"<|im_end|>") == 2


def test_fields_the_template_can_carry_are_accepted(template):
    messages = [{"role": "user", "content": "Hi"}]
    for extra in ({"tool_choice": "none"}, {"tool_choice": "auto"}, {"tools": []},
                  {"response_format": {"type": "text"}},
                  # Not written into the prompt: only a grammar holds the reply to it.
                  {"response_format": {"type": "json_object"}}):
        assert template.render(messages, thinking=True, **extra).segments[-1].text == template.template.open


REFUSED = {
    "image part": ({}, [{"role": "user", "content": "Hi"},
                        {"role": "user", "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}],
                   "messages[1].content[1]"),
    "release image part": ({}, [{"role": "user", "content": [
                                    {"type": "image", "image": "data:image/png;base64,"}]}],
                           "messages[0].content[0]"),
    "image prompts": ({"image_prompts": ["<|media_pad|>"]}, None, "messages"),
}


@pytest.mark.parametrize("kwargs, messages, field", REFUSED.values(), ids=REFUSED.keys())
def test_what_the_template_cannot_carry_is_refused_by_name(template, kwargs, messages, field):
    with pytest.raises(ChatFormatError) as caught:
        template.render(messages or [{"role": "user", "content": "Hi"}], thinking=True, **kwargs)
    assert caught.value.field == field


def test_an_image_prompt_comes_from_the_format_that_carries_images(k3, k3_container, template, kimi,
                                                                   tmp_path):
    xtml_format = resolve_chat_format(k3, k3_container)
    assert xtml_format.image_prompt(640, 480) == xtml.image_prompt(640, 480)
    assert xtml_format.image_placeholder == xtml.IMAGE_PLACEHOLDER
    for without in (template, resolve_chat_format(kimi, tmp_path)):   # chat.json, and neither
        assert without.image_placeholder == ""
        with pytest.raises(ChatFormatError):
            without.image_prompt(640, 480)


def test_xtml_render_maps_developer_to_system(k3, k3_container):
    chat = resolve_chat_format(k3, k3_container)
    asked = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat.render(asked, thinking=False).segments == \
        xtml.build_chat_segments(as_system, thinking=False)

# ------------------------------------------------------------------- parsing


def feed_text(parser, engine: Engine, text: str) -> list[Delta]:
    deltas = []
    for token in engine.tokenize(text):
        deltas += parser.feed_token(token, engine.detokenize([token]))
    return deltas


def test_plain_parser_routes_text_to_content_until_the_stop_token(template, kimi):
    parser = template.new_parser(thinking=True)
    assert isinstance(parser, TemplateReplyParser)
    im_end, im_user = kimi.specials["<|im_end|>"], kimi.specials["<|im_user|>"]
    deltas = feed_text(parser, kimi, "Hello")
    deltas += parser.feed_token(im_user, b"<|im_user|>")          # another special: dropped
    deltas += feed_text(parser, kimi, " there")
    assert not parser.ended
    deltas += parser.feed_token(im_end, b"<|im_end|>")
    assert parser.ended
    assert feed_text(parser, kimi, "ignored") == [] and parser.finish() == []
    assert "".join(d.content for d in deltas) == "Hello there"
    assert all(d.reasoning_content == "" and d.tool_call is None for d in deltas)
    reply = parser.reply
    assert (reply.content, reply.reasoning_content, reply.tool_calls, reply.ended) == \
        ("Hello there", "", [], True)


def test_plain_parser_joins_characters_split_across_tokens(template, kimi):
    text = "naïve café ✓"
    pieces = [kimi.detokenize([t]) for t in kimi.tokenize(text)]
    assert any(not _is_utf8(p) for p in pieces)   # the split this test is about
    parser = template.new_parser(thinking=False)
    deltas = feed_text(parser, kimi, text) + parser.finish()
    assert "".join(d.content for d in deltas) == text
    assert not parser.ended and parser.reply.content == text


def test_plain_parser_finish_flushes_a_cut_character(template):
    parser = template.new_parser(thinking=False)
    parser.feed_token(ord("a"), b"a")
    assert parser.feed_token(0xC3, b"\xc3") == []
    assert parser.finish() == [Delta(content="\ufffd")]
    assert parser.reply.content == "a\ufffd"


def test_xtml_parser_is_the_xtml_reply_parser(k3, k3_container):
    chat = resolve_chat_format(k3, k3_container)
    parser = chat.new_parser(thinking=False)
    assert isinstance(parser, ReplyParser)
    feed_text(parser, k3, "Hi")
    parser.feed_token(k3.specials["<|end_of_msg|>"], b"<|end_of_msg|>")
    assert parser.ended and parser.reply.content == "Hi"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
