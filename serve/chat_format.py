"""What every chat format shares: its errors, and the system role under its other name."""
from __future__ import annotations

from typing import Any, Mapping, Optional


class ChatFormatError(Exception):
    """A request the chat format cannot express; `field` names the request field."""

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field


class FormatRefused(Exception):
    """Why a format does not apply to this container (one line, for the banner and the 400)."""


def system_role(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """OpenAI's `developer` role is the system role under another name."""
    return {**message, "role": "system"} if message.get("role") == "developer" else message
