"""Where a snapshot pays: prefill and snapshot costs measured as they happen, and the rule.

The same server drives engines 100,000 times apart: the reference engine
prefills a token in a fraction of a millisecond, K3 in about two seconds,
while saving a state costs milliseconds on one and a fraction of a second on
the other. Constants fitted to one are wrong on the other (a 512-token
minimum and a 4,096-token spacing are a second of work on the first and 2.3
hours on the second), so the policy measures instead:

- a prefilled token's cost: a moving average over the chunks evaluated;
- a snapshot's save and load costs (seconds and bytes): moving averages
  over the saves and loads made.

and weighs the prefill a snapshot would spare (the positions since the last
snapshot of the same prefix, at the measured cost) against them:

- a snapshot some later request is expected to restore (a checkpoint: the
  end of the tools, of the system prompt, of the conversation; the state a
  reply leaves; where a stopped prefill stopped) pays back on its first
  reuse, so it is saved when the prefill it spares costs more than a save
  and a load. And a checkpoint with no snapshot before it is always saved:
  it is what lets the next turn reuse the prefix at all, and when it is
  cheap so is its save.
- a progress snapshot, inside a long prefill, only insures the work in
  flight against a hang-up or a shutdown. It is saved when the prefill since
  the last snapshot cost more than PROGRESS_FACTOR saves: the saves then add
  at most a tenth to a prefill's time, and at most ten saves' worth of work
  (plus the chunk being evaluated) is ever at risk. The prefill keeps only
  its latest progress snapshot: the next snapshot of the same prompt holds
  all it does.

With a shared tier (--shared-cache, serve/snapshots/shared_tier.py), a snapshot
saved locally is also published when the prefill it would spare another host
(the positions past the longest snapshot of it published already) costs
more than the publish plus that host's fetch and load, all measured; and a
shared snapshot longer than the local tier's is fetched when the positions
it adds cost more to prefill than the fetch and the load.

Until a save has been measured there is nothing to weigh, and the first
snapshot is saved (and measured). On K3 every checkpoint and every chunk
boundary passes; on the reference engine a conversation's first checkpoint
and the longer stretches do.

`--prefix-cache-min` and `--prefix-cache-spacing` override the rule with the
fixed thresholds serve used before it: no snapshot at all for a prompt
shorter than the minimum that restored nothing, and progress snapshots at
every multiple of the spacing (all kept, so that prompts sharing a long
prefix find the same ones).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

# A progress snapshot when the prefill since the last snapshot cost this many saves.
PROGRESS_FACTOR = 10
# The weight of the newest measurement in each moving average.
ALPHA = 0.3

KINDS = ("checkpoint", "progress", "stopped", "reply", "preempted")   # why a snapshot was considered


@dataclass(frozen=True)
class Costs:
    """The moving averages, None until measured."""
    token_seconds: Optional[float] = None   # one prefilled position
    save_seconds: Optional[float] = None    # one snapshot written, checksummed and published
    load_seconds: Optional[float] = None    # one snapshot checked and restored
    snapshot_bytes: Optional[float] = None
    publish_seconds: Optional[float] = None  # one snapshot written to the shared tier
    fetch_seconds: Optional[float] = None    # one copied from the shared tier into the local one

    def spacing(self) -> Optional[int]:
        """The positions of prefill a progress snapshot waits for, as measured now."""
        return self._positions(PROGRESS_FACTOR * (self.save_seconds or 0.0))

    def break_even(self) -> Optional[int]:
        """The positions of prefill that cost a save and a load, as measured now."""
        return self._positions((self.save_seconds or 0.0) + (self.load_seconds or 0.0))

    def publish_break_even(self) -> Optional[int]:
        """The positions of prefill that cost a publish, and a fetch and a load on the host
        that restores it, as measured now."""
        return self._positions((self.publish_seconds or 0.0) + (self.fetch_seconds or 0.0)
                               + (self.load_seconds or 0.0))

    def fetch_break_even(self) -> Optional[int]:
        """The positions of prefill that cost a fetch and a load, as measured now."""
        return self._positions((self.fetch_seconds or 0.0) + (self.load_seconds or 0.0))

    def _positions(self, seconds: float) -> Optional[int]:
        """The positions of prefill that cost `seconds`; None until a save and a prefill
        have been measured."""
        if self.token_seconds is None or self.save_seconds is None or self.token_seconds <= 0:
            return None
        return max(1, round(seconds / self.token_seconds))


def _average(old: Optional[float], new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class SnapshotPolicy:
    """The measured costs and the decisions made from them. Thread-safe: /metrics reads it."""

    def __init__(self, min_tokens: Optional[int] = None, spacing: Optional[int] = None,
                 log: Optional[Callable[[str], None]] = None):
        if spacing is not None and spacing < 1:
            raise ValueError("the snapshot spacing must be at least 1")
        self.min_tokens = min_tokens   # --prefix-cache-min: None follows the rule
        self.spacing = spacing         # --prefix-cache-spacing: None follows the rule
        self._log = log
        self.lock = threading.Lock()   # the counters below, and the costs' updates
        self._costs = Costs()
        self._logged_spacing: Optional[int] = None
        self.saved = dict.fromkeys(KINDS, 0)     # snapshots written, by why
        self.skipped = dict.fromkeys(KINDS, 0)   # considered and not worth it

    # -- measurements -----------------------------------------------------------------

    @property
    def costs(self) -> Costs:
        return self._costs

    def prefilled(self, positions: int, seconds: float) -> None:
        """`positions` were evaluated in `seconds` (one chunk)."""
        if positions > 0 and seconds >= 0:
            self._update(token_seconds=seconds / positions)

    def saved_state(self, nbytes: int, seconds: float) -> None:
        self._update(save_seconds=seconds, snapshot_bytes=nbytes)

    def loaded_state(self, seconds: float) -> None:
        self._update(load_seconds=seconds)

    def _update(self, **measured: float) -> None:
        with self.lock:
            c = self._costs
            self._costs = Costs(**{name: _average(getattr(c, name), measured[name])
                                   if name in measured else getattr(c, name)
                                   for name in ("token_seconds", "save_seconds", "load_seconds",
                                                "snapshot_bytes", "publish_seconds",
                                                "fetch_seconds")})
        self._say_when_the_spacing_moves()

    def _say_when_the_spacing_moves(self) -> None:
        """A log line whenever the progress spacing the costs imply halves or doubles."""
        costs, spacing = self._costs, self._costs.spacing()
        if self._log is None or spacing is None or self.spacing is not None:
            return
        last = self._logged_spacing
        if last is not None and last / 2 < spacing < last * 2:
            return
        self._logged_spacing = spacing
        self._log(f"snapshots: a prefilled position costs {(costs.token_seconds or 0) * 1e3:.3g} ms, a save "
                  f"{(costs.save_seconds or 0) * 1e3:.3g} ms ({(costs.snapshot_bytes or 0) / 1e6:.3g} MB): "
                  f"a progress snapshot every {spacing:,} positions of prefill, a checkpoint when it "
                  f"spares more than {costs.break_even():,}")

    def published(self, seconds: float) -> None:
        self._update(publish_seconds=seconds)

    def fetched(self, seconds: float) -> None:
        self._update(fetch_seconds=seconds)

    # -- decisions --------------------------------------------------------------------

    def worth(self, kind: str, unsaved: int, first: bool = False) -> bool:
        """Whether a snapshot of `kind` pays, `unsaved` positions after the last snapshot of
        the same prefix; `first`: no snapshot of it exists yet."""
        if unsaved <= 0:
            return False
        if kind == "progress" and self.spacing is not None:
            return True      # the caller placed it at a multiple of the spacing
        if kind == "checkpoint" and first:
            return True
        # The same figures the banner and /metrics show; None: nothing measured yet, save.
        costs = self._costs
        threshold = costs.spacing() if kind == "progress" else costs.break_even()
        return threshold is None or unsaved >= threshold

    def worth_publishing(self, spared: int) -> bool:
        """Whether publishing a snapshot to the shared tier pays: the prefill it spares
        another host (`spared` positions past what is published already) costs more than
        the publish, and that host's fetch and load. Until measured, it is published."""
        if spared <= 0:
            return False
        threshold = self._costs.publish_break_even()
        return threshold is None or spared >= threshold

    def worth_fetching(self, gained: int) -> bool:
        """Whether copying a shared snapshot holding `gained` positions more than the
        local tier's pays: their prefill costs more than the fetch and the load."""
        if gained <= 0:
            return False
        threshold = self._costs.fetch_break_even()
        return threshold is None or gained >= threshold

    def count(self, kind: str, saved: bool) -> None:
        """A snapshot of `kind` considered: written, or not (not worth it, or it failed)."""
        with self.lock:
            (self.saved if saved else self.skipped)[kind] += 1

    def snapshots_at_all(self, restored: int, upto: int) -> bool:
        """--prefix-cache-min: a prompt shorter than it that restored nothing saves nothing."""
        return self.min_tokens is None or restored > 0 or upto >= self.min_tokens

    def describe(self) -> str:
        """The rule in force, for the banner."""
        progress = (f"every {self.spacing:,} positions (--prefix-cache-spacing)"
                    if self.spacing is not None else
                    f"a progress snapshot when the prefill since the last cost {PROGRESS_FACTOR} saves")
        minimum = ("" if self.min_tokens is None else
                   f"; none for a prompt under {self.min_tokens:,} positions that restored nothing "
                   "(--prefix-cache-min)")
        return (f"by measured cost: a checkpoint when it spares more than a save and a load (a "
                f"conversation's first always), {progress}{minimum}; costs are measured as "
                f"prompts run (see /metrics)")
