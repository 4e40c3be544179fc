"""serve/service/prompt.py without sockets: checking a chat request and building its prompt."""
from __future__ import annotations

import pytest

from scripted import (IMAGE_POSITIONS, ScriptedEngine, ScriptedLibrary, ScriptedTokenizer, data_url,
                      image_message, tiny_png)
from serve.core.errors import ApiError
from serve.dialects.openai_request import parse_chat_request
from serve.formats.format_choice import NoChatFormat, resolve_chat_format
from serve.service.images import StagedImages
from serve.service.prompt import check_fits, PromptBuilder
from serve.snapshots.reply_memory import ReplyMemory

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
SYSTEM = {"role": "system", "content": "Be brief."}


def builder(engine: ScriptedEngine, chat_format=None, **options) -> PromptBuilder:
    settings = dict(vision=False, reply_memory=None, keep_reasoning=False, snapshots=True,
                    default_thinking=True, tokenizer=ScriptedTokenizer(engine),
                    bos=[engine.specials["[BOS]"]])
    settings.update(options)
    return PromptBuilder(engine, ScriptedLibrary(),
                         chat_format or resolve_chat_format(engine, "/nonexistent"), **settings)


def request(messages, **fields):
    return parse_chat_request({"messages": messages, **fields})


def build(prompts: PromptBuilder, req):
    check = prompts.check(req)
    with StagedImages(None) as staged:
        return prompts.of_chat(req, check, staged)


def test_the_prompt_is_the_rendered_conversation_then_the_generation_prompt():
    engine = ScriptedEngine()
    prompts = builder(engine)
    req = request([SYSTEM, {"role": "user", "content": "Hi"}], tools=TOOLS)
    prompt = build(prompts, req)
    fmt = prompts.chat_format
    conversation = fmt.render(req.messages, tools=TOOLS, thinking=True, add_generation_prompt=False)
    assert prompt.conversation == conversation.segments
    assert prompt.ids == engine.tokenize_segments(conversation.segments + fmt.generation_prompt(True))
    assert prompt.history == engine.tokenize_segments(conversation.segments)
    assert prompt.thinking and not prompt.image_paths
    # Snapshot positions: after the tools, after the system message, the whole conversation.
    tools_end = len(engine.tokenize_segments(conversation.segments[:conversation.ends[0]]))
    system_end = len(engine.tokenize_segments(conversation.segments[:conversation.ends[1]]))
    assert list(prompt.snapshot_at) == [tools_end, system_end, len(prompt.history)]


def test_without_a_prefix_cache_only_the_conversations_end_is_marked():
    prompt = build(builder(ScriptedEngine(), snapshots=False),
                   request([SYSTEM, {"role": "user", "content": "Hi"}], tools=TOOLS))
    assert list(prompt.snapshot_at) == [len(prompt.history)]


def test_the_conversation_is_rendered_once(monkeypatch):
    engine = ScriptedEngine()
    prompts = builder(engine, reply_memory=ReplyMemory())
    reply = {"role": "assistant", "content": "Hello"}
    prompts.reply_memory.remember(prompts.reply(reply, True), [1, 2, 3])
    renders = []
    real = prompts.chat_format.render
    monkeypatch.setattr(prompts.chat_format, "render",
                        lambda messages, **kw: renders.append(len(messages)) or real(messages, **kw))
    build(prompts, request([SYSTEM, {"role": "user", "content": "Hi"}, reply,
                            {"role": "user", "content": "More"}], tools=TOOLS,
                           tool_choice="required"))
    assert renders == [4]


def test_a_remembered_reply_keeps_the_ids_the_model_produced():
    engine = ScriptedEngine()
    prompts = builder(engine, reply_memory=ReplyMemory())
    reply = {"role": "assistant", "content": "Hello"}
    rendered = prompts.reply(reply, False)
    generation = engine.tokenize_segments(prompts.chat_format.generation_prompt(False))
    # The model wrote "Hello" as one piece: re-tokenizing the text would give five ids.
    hello = engine.piece_id("Hello")
    produced = generation + [hello] + engine.tokenize_segments(rendered)[len(generation) + 5:]
    prompts.reply_memory.remember(rendered, produced)
    messages = [{"role": "user", "content": "Hi"}, reply, {"role": "user", "content": "More"}]
    prompt = build(prompts, request(messages, reasoning_effort="none"))
    assert hello in prompt.ids
    plain = build(builder(ScriptedEngine()), request(messages, reasoning_effort="none"))
    assert len(plain.ids) == len(prompt.ids) + 4


def test_what_the_format_cannot_carry_is_refused_by_name():
    engine = ScriptedEngine()
    with pytest.raises(ApiError) as caught:
        builder(engine, chat_format=NoChatFormat(["no XTML markers", "chat.json: missing"])).check(
            request([{"role": "user", "content": "Hi"}]))
    assert caught.value.code == "unsupported_chat_format" and "chat.json: missing" in caught.value.message
    with pytest.raises(ApiError) as caught:
        builder(engine).check(request(image_message(data_url(tiny_png()))))
    assert "--vision" in caught.value.message and caught.value.param.startswith("messages[0]")


def test_thinking_follows_the_request_then_the_default():
    prompts = builder(ScriptedEngine(), default_thinking=False)
    assert prompts.check(request([{"role": "user", "content": "Hi"}])).thinking is False
    assert prompts.check(request([{"role": "user", "content": "Hi"}], reasoning_effort="high")).thinking


def test_images_are_staged_before_the_engine_then_queued_and_expanded():
    engine = ScriptedEngine()
    prompts = builder(engine, vision=True)
    req = request(image_message(data_url(tiny_png())))
    check = prompts.check(req)
    with StagedImages(None) as staged:
        early = prompts.of_chat(req, check, staged)
        assert engine.queued == [] and early.ids == early.text_ids
        prompt = prompts.with_images(early)
        assert engine.queued == list(prompt.image_paths) and len(prompt.image_paths) == 1
    pad = engine.specials["<|media_pad|>"]
    assert prompt.text_ids[prompt.image_start] == pad
    assert len(prompt.ids) == len(prompt.text_ids) + IMAGE_POSITIONS - 1


def test_a_completion_prompt_and_text_too_long_for_the_context():
    engine = ScriptedEngine(ctx_max=64)
    prompts = builder(engine)
    assert prompts.text("ab") == [engine.specials["[BOS]"], ord("a"), ord("b")]
    with pytest.raises(ApiError) as caught:
        check_fits(engine, 64 * engine.longest_token, "prompt", "")
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "prompt"
    check_fits(engine, 63 * engine.longest_token, "prompt", "")   # at least one token left: fine
