"""Ids and timestamps for requests and replies."""
from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
