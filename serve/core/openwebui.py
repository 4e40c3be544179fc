"""Open-WebUI's chores, known by the fixed text of its own task prompt templates.

Open-WebUI (0.6 to 0.12, open_webui/config.py's DEFAULT_*_PROMPT_TEMPLATE) sends
each chore as one user message built from a template: title, tags, follow-ups,
search queries, autocomplete and image prompt all open with `### Task:` and
quote the chat between `<chat_history>` tags, and each asks for JSON under a
key of its own; the emoji chore opens with a sentence of its own. A person's
message matches only if it repeats a template's skeleton (its first line, both
tags and the output key): tests/server/test_work_classes.py checks the real
templates of both releases, and a corpus of ordinary prompts that must not
match. A template an operator rewrote is named with --background-match.

Two of its templates are not chores: the tool-choosing prompt and the
mixture-of-agents prompt gate the person's own reply, so they stay interactive.
"""
from __future__ import annotations

from typing import Optional

TASK_OPENING = "### Task:"
HISTORY_TAGS = ("<chat_history>", "</chat_history>")
# Each `### Task:` template's output key, as its `### Output:` section writes it.
TASK_KEYS = (
    ("title", '"title":'),
    ("tags", '"tags":'),
    ("follow_ups", '"follow_ups":'),
    ("queries", '"queries":'),
    ("autocomplete", '{ "text":'),
    ("image_prompt", '"prompt":'),
)
EMOJI_OPENING = ("Your task is to reflect the speaker's likely facial expression through a "
                 "fitting emoji.")


def task_kind(text: str) -> Optional[str]:
    """Which Open-WebUI chore a user message's text is, or None when it is none of them."""
    text = text.lstrip()
    if text.startswith(EMOJI_OPENING) and "Message: ```" in text:
        return "emoji"
    if not text.startswith(TASK_OPENING):
        return None
    opens, closes = text.find(HISTORY_TAGS[0]), text.rfind(HISTORY_TAGS[1])
    if opens < 0 or closes < opens:
        return None
    # The key is looked for in the template's own text, before the quoted chat.
    head = text[:opens]
    for kind, key in TASK_KEYS:
        if key in head:
            return kind
    return None
