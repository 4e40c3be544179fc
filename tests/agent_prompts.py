"""The agents' side requests as they send them, built from their own prompt texts
(tests/fixtures/agents/prompts.json) the way each agent builds them; and opencode's
recorded turn (tests/fixtures/agents/opencode-turn.json). For the classification tests
and bench/chores.py."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
CLIENTS: dict[str, dict] = json.loads((FIXTURES / "prompts.json").read_text())
OPENCODE_TURN: dict[str, dict] = json.loads((FIXTURES / "opencode-turn.json").read_text())["requests"]
ASK = "how do I add a retry to fetchUser in src/api.ts?"
HISTORY = [{"role": "user", "content": ASK},
           {"role": "assistant", "content": "Wrap the fetch in a loop that backs off."}]
CODEX_CONTEXT = ("<environment_context>\n  <cwd>/home/user/project</cwd>\n  <shell>bash</shell>\n"
                 "</environment_context>")


def prompt(client: str, name: str) -> str:
    return CLIENTS[client]["prompts"][name]


def claude_system(name: str) -> str:
    """A Claude Code side request's system text as the Messages dialect joins its blocks (the
    billing block is left out): the identity, a blank line, the request's own prompt."""
    return prompt("claude-code", "identity") + "\n\n" + prompt("claude-code", name)


def claude_fork(text: str) -> list[dict]:
    """A fork of the main conversation: its system prompt and history, then the fixed text."""
    return [{"role": "system", "content": prompt("claude-code", "identity") + "\n\nYou are an "
             "interactive agent that helps users with software engineering tasks."},
            *HISTORY, {"role": "user", "content": text}]


def codex_title(limit: int = 36) -> str:
    return prompt("codex", "thread_title").replace("{max}", str(limit)) + \
        prompt("codex", "thread_title_user") + ASK


@dataclass(frozen=True)
class Case:
    chore: str            # the name serve gives it (the log's reason)
    messages: list[dict]
    fixed: str            # the agent's own fixed text in them, where near misses change it


def chores() -> list[Case]:
    """Each recognised chore as its agent sends it."""
    suggestion, away = prompt("claude-code", "prompt_suggestion"), prompt("claude-code", "away_summary")
    return [
        Case("opencode title", OPENCODE_TURN["title"]["messages"], prompt("opencode", "title")),
        Case("opencode title", [
            {"role": "system", "content": prompt("opencode", "title_v2")},
            {"role": "user", "content": prompt("opencode", "title_user")},
            {"role": "user", "content": [{"type": "text", "text": ASK}]}],
            prompt("opencode", "title_v2")),
        Case("Claude Code session title", [
            {"role": "system", "content": claude_system("session_title")},
            {"role": "user", "content": f"<session>\n{ASK}\n</session>\n\n"
                                        + prompt("claude-code", "session_title_language")}],
            prompt("claude-code", "session_title")),
        Case("Claude Code tool-use label", [
            {"role": "system", "content": claude_system("tool_use_summary")},
            {"role": "user", "content": "Tools completed:\n\nTool: Read\nInput: {\"file_path\": "
                                        "\"src/api.ts\"}\nOutput: export async function fetchUser"
                                        "\n\nLabel:"}],
            prompt("claude-code", "tool_use_summary")),
        Case("Claude Code agent progress label", [
            {"role": "system", "content": claude_system("agent_progress")},
            {"role": "user", "content": "<notes>\n<started_not_finished>Bash: npm test"
                                        "</started_not_finished>\n</notes>\n\n"
                                        + prompt("claude-code", "agent_progress_ask") + "\n\n"
                                        + prompt("claude-code", "agent_progress_language")}],
            prompt("claude-code", "agent_progress")),
        Case("Claude Code prompt suggestion", claude_fork(suggestion), suggestion),
        Case("Claude Code away recap", claude_fork(away), away),
        Case("Codex thread title", [
            {"role": "system", "content": "You are Codex, a coding agent based on GPT-5."},
            {"role": "user", "content": [{"type": "input_text", "text": codex_title()}]},
            {"role": "user", "content": CODEX_CONTEXT}],
            codex_title().partition(prompt("codex", "thread_title_user"))[0]),
        Case("Aider history summary", [
            {"role": "system", "content": prompt("aider", "summarize")},
            {"role": "user", "content": "".join(f"# {m['role'].upper()}\n{m['content']}\n"
                                                for m in HISTORY)}],
            prompt("aider", "summarize")),
        Case("Continue session title", [
            {"role": "user", "content": prompt("continue", "title") + HISTORY[1]["content"]}],
            prompt("continue", "title")),
    ]


def waited_on() -> dict[str, list[dict]]:
    """The agents' side requests the person waits on: none of them is a chore."""
    return {
        "opencode turn": OPENCODE_TURN["turn"]["messages"],
        "opencode compaction": [
            {"role": "system", "content": prompt("opencode", "compaction")},
            {"role": "user", "content": "[User]: " + ASK + "\n\n[Assistant]: Wrap it in a loop."}],
        "Claude Code /rename": claude_fork(prompt("claude-code", "rename")),
        "Codex compaction": [*HISTORY, {"role": "user", "content": prompt("codex", "compaction")}],
        "Aider commit message": [
            {"role": "system", "content": prompt("aider", "commit_system").format(
                language_instruction="")},
            {"role": "user", "content": "# Diffs:\n--- a/src/api.ts\n+++ b/src/api.ts\n"}],
    }
