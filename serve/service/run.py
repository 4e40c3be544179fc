"""One request as it runs: the one object the service and its generation loop speak to.

A `Run` holds
- cancellation: the client left (its `client_gone` says so) or the server is
  shutting down (`cut` then tells the two apart);
- the engine turn (serve/engine/queue.py's `Turn`), once the request holds it;
- the observer its events go to (a `ReplySink`, or none for a request that
  sends nothing until its end), and the logprobs waiting for the answer text
  they belong to (serve/service/logprobs.py).
The loop never reaches past it: the observer is the service's own Protocol,
which the HTTP layer implements.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

from serve.core.reply import Delta
from serve.engine.queue import Turn
from serve.service.logprobs import LogprobLedger
from serve.service.replies import ReplySink


class Run:
    def __init__(self, observer: Optional[ReplySink], client_gone: Callable[[], bool],
                 stopping: threading.Event):
        self.observer = observer
        self._client_gone = client_gone
        self._stopping = stopping
        self.cut = False                        # gone() said yes because of shutdown
        self.turn: Optional[Turn] = None        # the hold on the engine, once the request has it
        self.logprobs: Optional[LogprobLedger] = None   # when the request asks for logprobs

    # -- cancellation ---------------------------------------------------------------------

    def gone(self) -> bool:
        """Stop at the next token or prefill chunk: the client left, or shutdown began."""
        if self._stopping.is_set():
            self.cut = True
            return True
        return self._client_gone()

    # -- events, to the observer -----------------------------------------------------------

    def accepted(self, thinking: bool) -> None:
        if self.observer is not None:
            self.observer.accepted(thinking)

    def queued(self, ahead: int) -> None:
        if self.observer is not None:
            self.observer.queued(ahead)

    def start(self) -> None:
        if self.observer is not None:
            self.observer.start()

    def prefilling(self, prompt_tokens: int, cached_tokens: int) -> None:
        if self.observer is not None:
            self.observer.prefilling(prompt_tokens, cached_tokens)

    def progress(self, done: int, total: int) -> None:
        if self.observer is not None:
            self.observer.progress(done, total)

    def emit(self, delta: Delta) -> None:
        if self.logprobs is not None:
            delta = self.logprobs.attach(delta)
        if self.observer is not None:
            self.observer.emit(delta)
