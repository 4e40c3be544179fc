"""The two classes of work a request can be: what the neutral request types carry.

`interactive`: a person or an agent waits on it (the default). `background`:
a chore (a title, tags, follow-up suggestions). How a request's class is
decided is serve/core/work.py; what it changes is serve/engine/queue.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

INTERACTIVE = "interactive"
BACKGROUND = "background"
CLASSES = (INTERACTIVE, BACKGROUND)


@dataclass(frozen=True)
class Hints:
    """What a request's body says that bears on its class, read by its dialect."""
    model: str = ""                  # the model the client named
    priority: Optional[int] = None   # vLLM's `priority` (lower is earlier; 0 its default)
