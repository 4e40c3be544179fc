"""Open-WebUI's task prompts as it sends them: its own templates (tests/fixtures/openwebui/),
filled in as open_webui/utils/task.py fills them. For the classification tests and bench/chores.py."""
from __future__ import annotations

import json
import re
from pathlib import Path

TEMPLATES: dict[str, dict[str, str]] = json.loads(
    (Path(__file__).parent / "fixtures" / "openwebui" / "templates.json").read_text())["templates"]
LATEST = "0.12.4"


def render(template: str, messages: list[dict]) -> str:
    """A template filled in: `{{MESSAGES:END:n}}` is the last n messages as `ROLE: text` lines."""
    def chat(match: re.Match) -> str:
        picked = messages[-int(match.group(1)):]
        return "\n".join(f"{m['role'].upper()}: {m['content']}" for m in picked)
    text = re.sub(r"\{\{MESSAGES:END:(\d+)\}\}", chat, template)
    for variable, value in (("CURRENT_DATE", "2026-12-02"), ("TYPE", "General"),
                            ("PROMPT", "The sun was setting"), ("prompt", "I won the race!"),
                            ("TOOLS", "[]"), ("responses", '["a", "b"]')):
        text = text.replace("{{" + variable + "}}", value)
    return text


def task(name: str, messages: list[dict], version: str = LATEST) -> str:
    """The user message of Open-WebUI's `name` task (TITLE_GENERATION, TAGS_GENERATION, ...)."""
    return render(TEMPLATES[version][f"DEFAULT_{name}_PROMPT_TEMPLATE"], messages)
