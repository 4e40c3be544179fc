"""Remembered reply ids laid over a rendered message, and the memory that keeps them.

The overlay may change a prompt's ids but never its text or its structure:
whatever the remembered ids are, the result decodes to the same bytes as the
message tokenized as usual, with the same special tokens in the same order.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scripted import ScriptedEngine
from serve.formats.xtml import render as xtml
from serve.snapshots.history_ids import overlay, tokenize_history
from serve.snapshots.reply_memory import ReplyMemory
from serve.core.segment import Segment

ENGINE = ScriptedEngine()
SPECIALS = frozenset(ENGINE.specials.values())
OPENING = xtml.generation_prompt(True)


def rendered(content: str, reasoning: str = "") -> list[Segment]:
    return xtml.build_chat_segments([{"role": "assistant", "content": content,
                                      "reasoning_content": reasoning}], add_generation_prompt=False)


def reply_ids(*pieces: str) -> list[int]:
    """The generation prompt's ids, then one id per piece, as the scripted model samples them."""
    return ENGINE.tokenize_segments(OPENING) + [ENGINE.piece_id(p) for p in pieces]


def closing(content: str = "") -> list[str]:
    return ["<|close|>", "think", "<|sep|>", "<|open|>", "response", "<|sep|>", *([content] if content else []),
            "<|close|>", "response", "<|sep|>", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>"]


def assert_same_prompt(ids: list[int], segments: list[Segment]) -> None:
    usual = ENGINE.tokenize_segments(segments)
    assert ENGINE.detokenize(ids) == ENGINE.detokenize(usual)
    assert [i for i in ids if i in SPECIALS] == [i for i in usual if i in SPECIALS]


def test_a_whole_reply_takes_the_ids_the_model_sampled():
    pieces = ["Let me", " think", *closing("The rise and fall")]
    ids = overlay(ENGINE, rendered("The rise and fall", "Let me think"), reply_ids(*pieces))
    assert ids == reply_ids(*pieces)


def test_a_reply_cut_short_is_closed_by_tokenizing_the_rest():
    remembered = reply_ids("Let me", " thi")      # max_tokens, inside a word
    segments = rendered("", "Let me thi")
    ids = overlay(ENGINE, segments, remembered)
    assert ids[:len(remembered)] == remembered
    assert_same_prompt(ids, segments)


def test_ids_stop_at_the_last_token_wholly_before_a_cut():
    remembered = reply_ids("Let me", " think", *closing("The rise and fall")[:6], "The rise", " and fall")
    segments = rendered("The rise and ", "Let me think")   # a stop string cut "fall"
    ids = overlay(ENGINE, segments, remembered)
    kept = remembered.index(ENGINE.piece_id(" and fall"))
    assert ids[:kept] == remembered[:kept] and ids[kept] != remembered[kept]
    assert_same_prompt(ids, segments)


def test_a_special_the_model_wrote_never_stands_where_the_message_has_text():
    # The client's text spells markup; the remembered reply had the real token there.
    segments = rendered("a<|close|>b", "")
    remembered = reply_ids(*closing()[:6], "a", "<|close|>", "b")
    ids = overlay(ENGINE, segments, remembered)
    assert_same_prompt(ids, segments)
    upto_a = len(reply_ids(*closing()[:6])) + 1
    assert ids[:upto_a] == remembered[:upto_a]   # the remembered ids serve up to the special


def test_text_the_model_wrote_never_stands_where_the_message_has_markup():
    segments = rendered("ok", "")
    remembered = reply_ids("<|close|", ">think", "<|sep|>")   # markup spelled as text pieces
    ids = overlay(ENGINE, segments, remembered)
    assert_same_prompt(ids, segments)
    assert ids == ENGINE.tokenize_segments(segments)


def test_history_overlays_each_remembered_reply_where_it_is_rendered():
    pieces = ["Hm", ".", *closing("Yes")]
    reply = {"role": "assistant", "content": "Yes", "reasoning_content": "Hm."}
    messages = [{"role": "user", "content": "Yes?"}, reply, {"role": "user", "content": "Sure?"}, reply]
    segments = xtml.build_chat_segments(messages, add_generation_prompt=False)
    ids, _ = tokenize_history(ENGINE, segments, [(rendered("Yes", "Hm."), reply_ids(*pieces))] * 2)
    assert ids.count(ENGINE.piece_id("Hm")) == 2
    assert_same_prompt(ids, segments)
    # A reply that is not in the conversation changes nothing.
    assert tokenize_history(ENGINE, segments, [(rendered("No"), reply_ids("No"))])[0] == \
        ENGINE.tokenize_segments(segments)


def test_history_tells_where_each_cut_between_messages_falls():
    pieces = ["Hm", ".", *closing("Yes")]
    reply = {"role": "assistant", "content": "Yes", "reasoning_content": "Hm."}
    messages = [{"role": "user", "content": "Yes?"}, reply, {"role": "user", "content": "Sure?"}]
    segments, ends = xtml.build_chat(messages, add_generation_prompt=False)
    inside = ends[1] + 2   # within the remembered reply: no position there
    ids, positions = tokenize_history(ENGINE, segments, [(rendered("Yes", "Hm."), reply_ids(*pieces))],
                                      cuts=[ends[0], ends[1], inside, ends[2], ends[3]])
    assert ids == tokenize_history(ENGINE, segments, [(rendered("Yes", "Hm."), reply_ids(*pieces))])[0]
    assert set(positions) == {ends[0], ends[1], ends[2], ends[3]}
    assert positions[ends[1]] == len(ENGINE.tokenize_segments(segments[:ends[1]]))
    # After the reply, positions count its remembered ids, not its text re-tokenized.
    tail = ENGINE.tokenize_segments(segments[ends[2]:])
    assert positions[ends[2]] == len(ids) - len(tail) and positions[ends[3]] == len(ids)


text = st.text(alphabet="ab <|>éx\u00e9\U0001f30a", max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(text, st.sampled_from(sorted(ENGINE.specials))), max_size=12), text, text)
def test_the_prompt_keeps_its_text_and_structure_whatever_was_remembered(pieces, content, reasoning):
    segments = rendered(content, reasoning)
    assert_same_prompt(overlay(ENGINE, segments, reply_ids(*[p for p in pieces if p])), segments)


# ---- the memory ----------------------------------------------------------------


def test_memory_recalls_by_rendering_and_forgets_the_least_recently_used():
    memory = ReplyMemory(capacity_bytes=3 * 4 * 10)
    for n in range(3):
        memory.remember(rendered(f"reply {n}"), list(range(10)))
    assert memory.recall(rendered("reply 0")) is not None   # now the most recently used
    memory.remember(rendered("reply 3"), list(range(10)))
    assert memory.recall(rendered("reply 1")) is None
    assert [memory.recall(rendered(f"reply {n}")) is not None for n in (0, 2, 3)] == [True] * 3
    assert len(memory) == 3 and memory.used_bytes == 120


def test_memory_keeps_nothing_larger_than_itself():
    memory = ReplyMemory(capacity_bytes=16)
    memory.remember(rendered("long"), list(range(5)))
    assert len(memory) == 0 and memory.recall(rendered("long")) is None


def test_memory_refuses_no_capacity():
    try:
        ReplyMemory(capacity_bytes=0)
    except ValueError as e:
        assert "capacity" in str(e)
    else:
        raise AssertionError("a memory of no bytes was accepted")


def test_reasoning_is_recalled_in_its_conversation_only():
    # Replies cut in the think channel all render alike without their reasoning.
    memory = ReplyMemory()
    before_a, before_b = [Segment("question a", False)], [Segment("question b", False)]
    memory.remember(rendered("", "thought a"), [1], "thought a", (before_a, rendered("")))
    memory.remember(rendered("", "thought b"), [2], "thought b", (before_b, rendered("")))
    assert memory.recall_without_reasoning(rendered(""), lambda: before_a).reasoning == "thought a"
    assert memory.recall_without_reasoning(rendered(""), lambda: before_b).reasoning == "thought b"
    assert memory.recall_without_reasoning(rendered(""), lambda: []) is None


def test_the_conversation_is_rendered_only_when_a_reply_could_match():
    memory = ReplyMemory()
    memory.remember(rendered("yes", "because"), [1], "because", ([], rendered("yes")))

    def never() -> list:
        raise AssertionError("rendered the conversation for a reply nobody remembers")

    assert memory.recall_without_reasoning(rendered("no"), never) is None


def test_a_forgotten_reply_leaves_nothing_to_recall_without_reasoning():
    memory = ReplyMemory(capacity_bytes=64)
    memory.remember(rendered("yes", "because"), [1], "because", ([], rendered("yes")))
    memory.remember(rendered("other"), list(range(14)))   # evicts the first
    assert memory.recall_without_reasoning(rendered("yes"), lambda: []) is None
    assert memory._without_reasoning == {}
