"""serve/snapshots/checkpoints.py on its own: where a prompt is worth a snapshot."""
from __future__ import annotations

from scripted import ScriptedEngine
from serve.snapshots.checkpoints import preamble_ends, spaced

SPACING = 4096
from serve.formats.format_choice import resolve_chat_format
from serve.formats.template.format import TemplateFormat

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Be kind."}]
TURN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"}]
XTML = resolve_chat_format(ScriptedEngine(), "/nonexistent")


def render(messages, **fields):
    return XTML.render(messages, thinking=False, add_generation_prompt=False, **fields)


def test_the_tools_the_leading_system_messages_and_the_conversation_before_notes():
    messages = SYSTEM + TURN
    whole = render(messages, tools=TOOLS, tool_choice="required")
    ends = preamble_ends(whole, messages, notes=True)
    # Each boundary is where that part, rendered on its own, ends in the whole.
    tools_only = render([], tools=TOOLS).segments
    with_system = render(SYSTEM, tools=TOOLS).segments
    with_turns = render(messages, tools=TOOLS).segments
    assert ends == [len(tools_only), len(with_system), len(with_turns)]
    for n, part in zip(ends, (tools_only, with_system, with_turns)):
        assert whole.segments[:n] == part


def test_no_boundary_at_either_end_and_none_for_absent_parts():
    # No tools, no system messages, no notes: the only candidates are 0 and the whole.
    whole = render(TURN)
    assert preamble_ends(whole, TURN, notes=True) == []
    assert preamble_ends(render(SYSTEM + TURN), SYSTEM + TURN, notes=False) == [
        len(render(SYSTEM).segments)]


def test_a_run_of_tool_results_has_no_boundary_inside():
    calls = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for i in (1, 2)]}
    messages = [*SYSTEM, {"role": "user", "content": "Go"}, calls,
                {"role": "tool", "tool_call_id": "c1", "content": "one"},
                {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    whole = render(messages, tools=TOOLS)
    assert 5 not in whole.ends and whole.ends[4] < whole.ends[6] == len(whole.segments)
    assert whole.message(3) and whole.message(4) == []


def test_a_chat_json_template_marks_where_its_default_system_message_ends(kimi_linear_container):
    fmt = resolve_chat_format(ScriptedEngine(specials=[
        "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
        "<|im_middle|>"]), kimi_linear_container)
    assert isinstance(fmt, TemplateFormat)
    whole = fmt.render(TURN, thinking=False, add_generation_prompt=False)
    assert [s.text for s in whole.message(0)] == [s.text for s in fmt.render(
        TURN[:1], thinking=False, add_generation_prompt=False).message(0)]
    assert preamble_ends(whole, TURN, notes=False) == ([whole.ends[0]] if whole.ends[0] else [])


def test_spaced_marks_are_the_multiples_strictly_inside():
    assert spaced(0, 3 * SPACING, SPACING) == [SPACING, 2 * SPACING]
    assert spaced(SPACING, 2 * SPACING + 1, SPACING) == [2 * SPACING]
    assert spaced(10, 20, spacing=5) == [15]
    assert spaced(0, SPACING, SPACING) == []
