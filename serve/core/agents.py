"""The chores of the agents people use, known by the whole of each one's own prompt.

Each agent below sends side requests of its own beside the person's turn. Those
the person does not wait on are chores, and each is known by its skeleton: the
agent's fixed text, whole, in the place the agent puts it (the system message,
or a user message of its own), with only the slots the agent fills left open.
serve keeps each fixed text as its opening words and the SHA-256 of the whole
(the texts are the agents' own, in tests/fixtures/agents/prompts.json): a
request that changes a word of it, adds to it, or quotes it inside a message of
its own is not the chore. tests/server/test_agent_chores.py checks the real
prompts and those near misses.

Side requests the person waits on stay interactive and are not listed:
opencode's and Codex's compaction, Claude Code's /rename, /btw, WebFetch,
auto-mode and start-up checks, Aider's commit message (behind a spinner).

- opencode 1.18 (npm opencode-ai): the title agent: its prompt is the system
  message, then "Generate a title for this conversation:" and the person's
  first message.
- Claude Code 2.1 (npm @anthropic-ai/claude-code): the session title, the
  tool-use label and a background agent's progress label (a system prompt of
  their own, after Claude Code's one-line identity); the prompt suggestion and
  the away recap (a fork of the conversation, the fixed text its last message).
- Codex 0.171 (npm @openai/codex): the thread title, a user message of its own
  ("User prompt:" and the person's message), followed only by Codex's context.
- Aider 0.86 (PyPI aider-chat): the chat-history summary, run in a thread of
  its own while the person goes on.
- Continue 1.5 (npm @continuedev/cli): the session title, one user message.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


@dataclass(frozen=True)
class Fixed:
    """One fixed text of an agent's: its opening words and the digest of the whole."""
    opening: str
    digests: frozenset[str]   # SHA-256 of the whole text, stripped (a release or two)

    def whole(self, text: str) -> bool:
        text = text.strip()
        return text.startswith(self.opening) and \
            hashlib.sha256(text.encode()).hexdigest() in self.digests


def fixed(opening: str, *digests: str) -> Fixed:
    return Fixed(opening, frozenset(digests))


OPENCODE_TITLE = fixed("You are a title generator. You output ONLY a thread title.",
                       "15c7f5a8a4321150d93a9c4c22cb75eee4d9c3d83ba7460f4a9cdb39bd765190",
                       "d2f45520a3d99f523c139cde9409420ed6662514b506ca4aba76df659bfe5997")
OPENCODE_TITLE_ASK = "Generate a title for this conversation:"
# Claude Code's identity, the system block before a side request's own (sent unless the
# request skips it): the CLI's, the Agent SDK's and an SDK agent's.
CLAUDE_IDENTITY = fixed("You are ", "2719b7a469d904b3281d8488976f33103944211279bddf04c05bca44d184dae6",
                        "6c1afcd9232947a1d8f7c44a79316f8fe08d06dcdc6e7453f09e2d78fa858e5e",
                        "0d7062851dd7bd7e66d4be4f12ac4951e3d2f587ec408295333a49963bd3f6b7")
CLAUDE_PROGRESS_ASK = "\nDescribe the agent's most recent action in 3-5 words using present tense"
CLAUDE_SUGGESTION = fixed("[SUGGESTION MODE: Suggest what the user might naturally type next",
                          "848ab6d7d37cb9e01ff58d81467438a21ff26e5287bbf510e76d387df592fb0d")
CLAUDE_AWAY = fixed("The user stepped away and is coming back. Recap in under 40 words",
                    "88a7beafce38addd857334e2a0c65bb94c6ac5e12d44db62dd88dfa528fd0e0b")
# Codex's title instructions, their one slot (the longest title) written as {max}.
CODEX_TITLE = fixed("Generate a concise, single-line task title of at most {max} characters",
                    "f429ff141d9d5611a18c8b5ce3ce39b09dc019f3ade6a1cc22089a2cad4516a3")
CODEX_TITLE_SLOT = re.compile(r"(?<=^Generate a concise, single-line task title of at most )\d+"
                              r"(?= characters)")
CODEX_PROMPT = "\n\nUser prompt:\n"
CODEX_CONTEXT = ("<environment_context>", "</environment_context>")
AIDER_SUMMARY = fixed("*Briefly* summarize this partial conversation about programming.",
                      "7b25de9566ab463373936d0a4ca51a6d2e6536e579dc239752ca1fe8b3ceb6e0")
AIDER_HISTORY = ("# USER\n", "# ASSISTANT\n")
CONTINUE_TITLE = fixed("Given the following... please reply with a title for the chat",
                       "200a97794033739aa2c2ee5d56b5908ead0a7e8aa16a5ae9fb0309ed31eda214")


@dataclass(frozen=True)
class Chat:
    """What a chat's skeleton is read from: its system text and its user messages' texts."""
    system: str             # the system messages' text (Anthropic's blocks joined by a blank line)
    users: list[str]        # each user message's text, in order
    others: int             # how many messages are neither system nor user


def read_chat(messages: Sequence[Any]) -> Chat:
    system, users, others = [], [], 0
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role == "system":
            system.append(message_text(content))
        elif role == "user":
            users.append(message_text(content))
        else:
            others += 1
    return Chat("\n\n".join(system), users, others)


def message_text(content: object) -> str:
    """A message's text: its string, or its text parts one to a line."""
    return "\n".join(text_parts(content))


def text_parts(content: object) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part["text"] for part in content if isinstance(part, dict)
                and part.get("type") in ("text", "input_text") and isinstance(part.get("text"), str)]
    return []


def after_identity(system: str) -> str:
    """Claude Code's system text past its identity block, if it opens with one."""
    head, gap, rest = system.strip().partition("\n\n")
    return rest if gap and CLAUDE_IDENTITY.whole(head) else system


def opencode_title(chat: Chat) -> bool:
    return OPENCODE_TITLE.whole(chat.system) and len(chat.users) >= 2 and \
        chat.users[0].strip() == OPENCODE_TITLE_ASK and chat.others == 0


def claude_side(prompt: Fixed, asks: Callable[[str], bool]) -> Callable[[Chat], bool]:
    """A side request of its own: its system prompt, and one user message it `asks`."""
    return lambda chat: len(chat.users) == 1 and asks(chat.users[0]) and \
        prompt.whole(after_identity(chat.system))


# Claude Code's side requests with a system prompt of their own: what serve calls each, its
# prompt, and the shape of its one user message.
CLAUDE_SIDE: tuple[tuple[str, Fixed, Callable[[str], bool]], ...] = (
    ("session title", fixed("You are naming a coding session so the user can pick it out",
                            "765b5ba2fa0a315a3c749c7e54bf5cef450084a745eb01e66371b8b6359d4752"),
     lambda ask: ask.startswith("<session>\n") and "\n</session>\n\n" in ask),
    ("tool-use label", fixed("Write a short summary label describing what these tool calls",
                             "470c1e371d7c79267ee021ec823a7d774f3ea00cb0521d2e1488db7fcad73ab6"),
     lambda ask: "Tools completed:\n\n" in ask and ask.rstrip().endswith("\n\nLabel:")),
    # the notes, then the ask, then the language to write in
    ("agent progress label", fixed("You write a 3-5 word progress label for a background agent",
                                   "981473216732bee5bc279e29cb3804914849a80e2a7bcfe86596642dda3a2cf4"),
     lambda ask: CLAUDE_PROGRESS_ASK in ask and
     ask.rstrip().rpartition("\n")[2].startswith("Write the label in ")),
)


def claude_fork(fixed_text: Fixed) -> Callable[[Chat], bool]:
    """A fork of the conversation whose last message is the fixed text alone."""
    return lambda chat: bool(chat.users) and fixed_text.whole(chat.users[-1])


def codex_title(chat: Chat) -> bool:
    # The title's message, then only Codex's own context blocks.
    rest = list(chat.users)
    while rest and rest[-1].strip().startswith(CODEX_CONTEXT[0]) and \
            rest[-1].strip().endswith(CODEX_CONTEXT[1]):
        rest.pop()
    instructions, gap, prompt = (rest[-1] if rest else "").partition(CODEX_PROMPT)
    return bool(gap and prompt.strip()) and \
        CODEX_TITLE.whole(CODEX_TITLE_SLOT.sub("{max}", instructions.strip()))


def aider_summary(chat: Chat) -> bool:
    return AIDER_SUMMARY.whole(chat.system) and len(chat.users) == 1 and \
        chat.users[0].startswith(AIDER_HISTORY) and chat.others == 0


def continue_title(chat: Chat) -> bool:
    prompt, gap, message = (chat.users[0] if len(chat.users) == 1 else "").partition("\n\n")
    return not chat.system and chat.others == 0 and bool(gap and message.strip()) and \
        CONTINUE_TITLE.whole(prompt)


CHORES: tuple[tuple[str, Callable[[Chat], bool]], ...] = (
    ("opencode title", opencode_title),
    *((f"Claude Code {name}", claude_side(prompt, asks)) for name, prompt, asks in CLAUDE_SIDE),
    ("Claude Code prompt suggestion", claude_fork(CLAUDE_SUGGESTION)),
    ("Claude Code away recap", claude_fork(CLAUDE_AWAY)),
    ("Codex thread title", codex_title),
    ("Aider history summary", aider_summary),
    ("Continue session title", continue_title),
)


def agent_chore(messages: Sequence[Any]) -> Optional[str]:
    """Which agent's chore a chat's messages are ("opencode title", ...), or None."""
    chat = read_chat(messages)
    return next((name for name, known in CHORES if known(chat)), None)
