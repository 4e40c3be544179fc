"""Names for JSON as a client sent it, before anything is checked.

Python's type system cannot say "a JSON value" usefully (every read would need
isinstance first), so these are `Any` under a name that says what they hold:
client JSON at the edge, checked by the code that reads it (dialects/
validating a body, formats/ rendering the messages and schemas it was given).
Anything else typed `Any` in serve/ is a library's (ctypes, socketserver).
"""
from __future__ import annotations

from typing import Any, Mapping

Json = Any                       # one value of a client's JSON, not yet checked
JsonObject = Mapping[str, Any]   # an object of a client's JSON, its values not yet checked
