"""What a request's work may still do once nobody follows it: the rule, in one place.

Asked between prefill chunks and before each generated token (serve/service/generation.py).
Shutdown and an explicit stop end the work at once. Work that nobody follows
(its client left, and no identical request came back for it: serve/service/jobs.py)
becomes idle-time work: it no longer counts as a request holding the engine,
and it steps aside at its next engine call once a request waits. Until then it
goes on
- while its client may still come back for it: attaching is on, and fewer than
  `keep_seconds` have passed since its last reader left;
- through a prefill, to its end, when the prefix cache can keep it for a retry
  (`finish_prefill`), as it did before requests were jobs.
A reader that comes back while the work still runs makes it a request again
(Turn.reclaim): it no longer steps aside for later arrivals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from serve.service.journal import Journal

DEFAULT_KEEP_SECONDS = 1800.0   # a detached job's work goes on this long for its client to return


@dataclass(frozen=True)
class DetachRule:
    attach: bool = True             # an identical request may come back for the work
    keep_seconds: float = DEFAULT_KEEP_SECONDS
    finish_prefill: bool = True     # a prefill goes on to its end for the prefix cache


class StopCheck:
    """One journal's answers to "stop now?", by the rule."""

    def __init__(self, journal: Journal, rule: DetachRule, between: Callable[[], None],
                 log: Optional[Callable[[str], None]] = None, label: str = ""):
        self._journal, self._rule, self._between = journal, rule, between
        self._log, self._label = log, label
        self._told = False

    def prefill_stop(self) -> bool:
        """Between prefill chunks: stop now?"""
        self._between()   # between chunks: tokenizing waits no longer than one
        return self._stop(prefill=True)

    def decode_stop(self) -> bool:
        """Before the next generated token: stop now?"""
        return self._stop(prefill=False)

    def _stop(self, prefill: bool) -> bool:
        journal = self._journal
        turn = journal.turn
        if not journal.should_stop():
            if turn is not None and turn.idle:
                turn.reclaim()   # its client came back: a request again
            return False
        if journal.cut or journal.stopped:
            return True
        away = journal.detached_for()
        kept = (self._rule.attach and away is not None and away < self._rule.keep_seconds) \
            or (prefill and self._rule.finish_prefill)
        if not kept or turn is None:
            return True
        if not turn.idle:
            turn.to_idle()
            if self._log is not None and not self._told:
                self._told = True
                self._log(f"{self._label} client left: its work goes on while no one waits, "
                          "for its return")
        return turn.requested()
