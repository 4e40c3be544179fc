"""The server's Prometheus metrics, and their text exposition (format 0.0.4) for GET /metrics.

Counters and histograms are updated where their event happens: the HTTP
layer counts requests, the service counts each reply's tokens and timings
and each prefix-cache lookup.  What only exists as current state (the queue,
the prefix cache's size, the engine's expert counters) is read when scraped,
through the callables given at construction.
"""
from __future__ import annotations

import bisect
import math
import threading
from typing import Callable, NamedTuple, Optional, Sequence

from serve.core.activity import Activity
from serve.core.owner import person_name
from serve.core.reply import Usage
from serve.engine.queue import ClassCounts
from serve.engine.types import Stats
from serve.snapshots.cache import PrefixCache
from serve.snapshots.shared_dir import Counters, SharedDir
from serve.snapshots.policy import KINDS, SnapshotPolicy

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# From a fast local model (tens of ms) to an expert-streaming one (minutes).
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# From under a token per second (K3 off an SSD) to the demo model's thousands.
RATE_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    escaped = (value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
               for _, value in pairs)
    return "{" + ",".join(f'{name}="{value}"' for (name, _), value in zip(pairs, escaped)) + "}"


Sample = tuple[str, Sequence[tuple[str, str]], float]   # (name suffix, labels, value)


class Family(NamedTuple):
    """One metric family: kept as values until rendered, so that several engines' families
    can be merged under one name (render_models)."""
    name: str
    kind: str
    help_text: str
    samples: list[Sample]

    def text(self) -> str:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{self.name}{suffix}{_labels(labels)} {_number(value)}"
                  for suffix, labels, value in self.samples]
        return "\n".join(lines) + "\n"


def _family(name: str, kind: str, help_text: str, samples: list[Sample]) -> Family:
    return Family(name, kind, help_text, samples)


class _Histogram:
    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds) + (math.inf,)
        self.counts = [0] * len(self.bounds)   # per bucket, not cumulative
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.total += value

    def samples(self) -> list[tuple[str, Sequence, float]]:
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            le = "+Inf" if bound == math.inf else repr(float(bound))  # as Prometheus' own clients write it
            out.append(("_bucket", [("le", le)], running))
        return out + [("_sum", [], self.total), ("_count", [], running)]


def _class_families(now: Activity) -> list[Family]:
    """The queue by class of work (interactive, background) and the chores' preemptions."""
    classes = sorted(now.classes.items())

    def by_class(name: str, kind: str, what: str, value) -> Family:
        return _family(name, kind, what, [("", [("class", work)], value(c)) for work, c in classes])
    return [
        by_class("serve_queue_waiting", "gauge", "Requests waiting for the engine, by class",
                 lambda c: c.waiting),
        by_class("serve_queue_longest_wait_seconds", "gauge",
                 "How long the longest-waiting request of the class has waited so far",
                 lambda c: c.longest_wait),
        by_class("serve_queue_wait_seconds_total", "counter", "Time requests of the class "
                 "waited before they were handed the engine (each wait, a chore's after it "
                 "stepped aside too)", lambda c: c.wait_seconds),
        by_class("serve_queue_waits_total", "counter",
                 "Times a request of the class was handed the engine", lambda c: c.waits),
        by_class("serve_engine_seconds_total", "counter",
                 "Time requests of the class held the engine (background: time spent on chores)",
                 lambda c: c.engine_seconds),
        _family("serve_engine_running", "gauge", "1 for the class of the request holding the "
                "engine", [("", [("class", work)], int(now.holder == work)) for work, _ in classes]),
        _family("serve_preemptions_total", "counter",
                "Chores that saved their state and stepped aside for a person",
                [("", [], now.preemptions)]),
    ]


PERSON_TOKENS = (("prefilled", "Prompt positions evaluated"),
                 ("restored", "Prompt positions restored from a prefix snapshot"),
                 ("generated", "Tokens generated"))


def _people_families(tokens: dict[str, dict[str, int]],
                     turns: dict[tuple[str, str], ClassCounts]) -> list[Family]:
    """Per named person (--api-keys; the label is the name, never the key): tokens, and the
    engine's time and waits by class."""
    named = sorted((person_name(owner), work, c) for (owner, work), c in turns.items()
                   if person_name(owner))

    def by_turn(name: str, what: str, value: Callable[[ClassCounts], float]) -> Family:
        return _family(name, "counter", what, [("", [("person", person), ("class", work)], value(c))
                                               for person, work, c in named])
    return [
        *(_family(f"serve_person_{kind}_tokens_total", "counter", f"{what}, by person",
                  [("", [("person", person)], counts[kind])
                   for person, counts in sorted(tokens.items())])
          for kind, what in PERSON_TOKENS),
        by_turn("serve_person_engine_seconds_total", "Time the person's requests held the "
                "engine, by class", lambda c: c.engine_seconds),
        by_turn("serve_person_wait_seconds_total", "Time the person's requests waited before "
                "they were handed the engine, by class", lambda c: c.wait_seconds),
        by_turn("serve_person_waits_total", "Times a request of the person's was handed the "
                "engine, by class", lambda c: c.waits),
    ]


class Metrics:
    """Every metric of one server. Thread-safe: request threads update it while it is scraped."""

    def __init__(self, engine_stats: Stats, activity: Callable[[], Activity],
                 prefix_cache: Optional[PrefixCache] = None,
                 policy: Optional[SnapshotPolicy] = None,
                 evaluated: Callable[[], int] = lambda: 0,
                 shared: Optional[dict[str, SharedDir]] = None,
                 turns: Callable[[], dict[tuple[str, str], ClassCounts]] = dict):
        """`turns`: the queue's counts by (owner, class)."""
        self._activity = activity
        self._turns = turns
        self._people: dict[str, dict[str, int]] = {}   # person -> PERSON_TOKENS kind -> count
        self._shared = shared or {}                # the shared tier's directories, by what they hold
        self._cache = prefix_cache                 # None when it is off
        self._policy = policy
        self._evaluated = evaluated                # positions the engine evaluated, so far
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._tokens = {"prompt": 0, "cached": 0, "completion": 0}
        self._prefix = {"hits": 0, "misses": 0}
        self._ttft = _Histogram(TTFT_BUCKETS)
        self._rate = _Histogram(RATE_BUCKETS)
        # The engine's counters as of its last finished request: a waste_ctx must not be
        # called while another thread generates on it, and a generation can take minutes.
        self._engine = engine_stats

    # -- updates --------------------------------------------------------------------------

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self._requests[key] = self._requests.get(key, 0) + 1

    def reply(self, prompt: int, cached: int, completion: int, ttft: Optional[float],
              rate: Optional[float]) -> None:
        """One finished (or cancelled) generation; ttft and rate are None when not measured."""
        with self._lock:
            self._tokens["prompt"] += prompt
            self._tokens["cached"] += cached
            self._tokens["completion"] += completion
            if ttft is not None:
                self._ttft.observe(ttft)
            if rate is not None:
                self._rate.observe(rate)

    def person_reply(self, owner: str, usage: Usage) -> None:
        """One generation's tokens, for its sender when a named person."""
        person = person_name(owner)
        if not person:
            return
        with self._lock:
            counts = self._people.setdefault(person, {kind: 0 for kind, _ in PERSON_TOKENS})
            counts["prefilled"] += usage.prompt_tokens - usage.cached_tokens
            counts["restored"] += usage.cached_tokens
            counts["generated"] += usage.completion_tokens

    def prefix_lookup(self, hit: bool) -> None:
        with self._lock:
            self._prefix["hits" if hit else "misses"] += 1

    def engine_stats(self, stats: Stats) -> None:
        """The engine's cumulative counters, read by the thread that holds the engine."""
        with self._lock:
            self._engine = stats

    # -- exposition -----------------------------------------------------------------------

    def render(self) -> bytes:
        return "".join(f.text() for f in [self.requests_family(), *self.engine_families()]).encode()

    def requests_family(self) -> Family:
        """What the HTTP side counts: one per server, whatever the number of models."""
        with self._lock:
            requests = sorted(self._requests.items())
        return _family("serve_requests_total", "counter", "HTTP requests answered, by endpoint and "
                       "status (499: the client left before its answer)",
                       [("", [("endpoint", e), ("status", s)], n) for (e, s), n in requests])

    def engine_families(self) -> list[Family]:
        """What one engine and its service did and hold."""
        now = self._activity()
        cache = self._cache
        with self._lock:
            tokens, prefix, engine = dict(self._tokens), dict(self._prefix), self._engine
            ttft, rate = self._ttft.samples(), self._rate.samples()
        parts: list[Family] = []
        for kind, what in (("prompt", "Prompt tokens of finished generations"),
                           ("cached", "Prompt tokens restored from a prefix snapshot, not prefilled"),
                           ("completion", "Tokens generated")):
            parts.append(_family(f"serve_{kind}_tokens_total", "counter", what, [("", [], tokens[kind])]))
        parts += [
            _family("serve_time_to_first_token_seconds", "histogram",
                    "From the start of prefill (after any queue wait) to the first generated token",
                    ttft),
            _family("serve_decode_tokens_per_second", "histogram",
                    "Decode rate of each generation of two tokens or more", rate),
            _family("serve_queue_length", "gauge", "Requests waiting for the engine",
                    [("", [], now.queue)]),
            _family("serve_busy", "gauge", "1 while a request holds the engine",
                    [("", [], int(now.busy))]),
            _family("serve_idle", "gauge", "1 when nothing runs or waits, idle-time work included",
                    [("", [], int(now.idle))]),
        ]
        parts += _class_families(now)
        with self._lock:
            people = {person: dict(counts) for person, counts in self._people.items()}
        parts += _people_families(people, self._turns())
        parts.append(_family("serve_engine_evaluated_tokens_total", "counter",
                             "Positions the engine evaluated: prompts prefilled, tokens generated, "
                             "idle-time work (positions restored from snapshots are not)",
                             [("", [], self._evaluated())]))
        for name, what, value in (
                ("expert_hits", "Expert lookups served from the expert cache", engine.experts_hit),
                ("expert_misses", "Expert lookups read from disk", engine.experts_missed),
                ("bytes_read", "Bytes of expert weights read from disk", engine.bytes_read)):
            parts.append(_family(f"serve_engine_{name}_total", "counter",
                                 f"{what} (waste_get_stats, as of the last finished request)",
                                 [("", [], value)]))
        if cache is not None:
            parts += [
                _family("serve_prefix_cache_entries", "gauge", "Prefix snapshots held",
                        [("", [], len(cache))]),
                _family("serve_prefix_cache_bytes", "gauge", "Disk bytes held by prefix snapshots",
                        [("", [], cache.used_bytes)]),
                _family("serve_prefix_cache_hits_total", "counter",
                        "Prompts that restored a prefix snapshot", [("", [], prefix["hits"])]),
                _family("serve_prefix_cache_misses_total", "counter",
                        "Prompts prefilled without a snapshot", [("", [], prefix["misses"])]),
                _family("serve_prefix_cache_restored_tokens_total", "counter",
                        "Positions restored from persistent prefix snapshots (requests, "
                        "--warm and idle-time work) instead of prefilled",
                        [("", [], cache.stats()["restored_tokens"])]),
            ]
            if self._policy is not None:
                parts += self._policy_families(self._policy)
        if self._shared:
            parts += self._shared_families(cache)
        return parts

    def _shared_families(self, cache: Optional[PrefixCache]) -> list[Family]:
        """The shared tier (--shared-cache): what each of its directories did, and holds."""
        events = [name for name in Counters.__dataclass_fields__]
        counted = {what: Counters(**vars(d.counters)) for what, d in self._shared.items()}
        usage = {what: d.usage() for what, d in self._shared.items()}
        tier = cache.shared if cache is not None else None
        return [
            _family("serve_shared_files_total", "counter", "Shared-tier files, by what they hold "
                    "and what happened: published, publish_failed (nothing left behind), read, "
                    "missing (gone when opened), damaged and foreign (never used), evicted",
                    [("", [("what", what), ("event", event)], getattr(c, event))
                     for what, c in counted.items() for event in events]),
            _family("serve_shared_files", "gauge", "Files in the shared tier, by what they hold",
                    [("", [("what", what)], files) for what, (files, _) in usage.items()]),
            _family("serve_shared_bytes", "gauge", "Bytes in the shared tier, by what they hold",
                    [("", [("what", what)], used) for what, (_, used) in usage.items()]),
            *([_family("serve_shared_fetched_tokens_total", "counter", "Positions of snapshots "
                       "copied from the shared tier into the local one",
                       [("", [], tier.fetched_tokens)])] if tier is not None else []),
        ]

    @staticmethod
    def _policy_families(policy: SnapshotPolicy) -> list[Family]:
        """The snapshot policy's measured costs and what they imply (docs/snapshots.md)."""
        costs = policy.costs
        spacing = policy.spacing or costs.spacing()
        gauges = [
            ("prefill_seconds_per_token", "Prefill cost of one position (moving average over chunks)",
             costs.token_seconds),
            ("snapshot_save_seconds", "Cost of saving one snapshot (moving average)", costs.save_seconds),
            ("snapshot_load_seconds", "Cost of checking and restoring one snapshot (moving average)",
             costs.load_seconds),
            ("snapshot_bytes", "Size of one snapshot (moving average)", costs.snapshot_bytes),
            ("snapshot_spacing_tokens", "Positions of prefill between progress snapshots: what ten "
             "saves cost, or --prefix-cache-spacing", spacing),
            ("snapshot_break_even_tokens", "Positions of prefill a save and a load cost: a "
             "checkpoint that spares fewer is not saved (but a conversation's first)",
             costs.break_even()),
            ("snapshot_publish_seconds", "Cost of publishing one snapshot to the shared tier "
             "(moving average)", costs.publish_seconds),
            ("snapshot_fetch_seconds", "Cost of copying one snapshot from the shared tier into the "
             "local one (moving average)", costs.fetch_seconds),
            ("snapshot_publish_break_even_tokens", "Positions of prefill a publish, a fetch and a "
             "load cost: a snapshot that spares another host fewer is not published",
             costs.publish_break_even() if costs.publish_seconds is not None else None),
        ]
        parts = [_family(f"serve_{name}", "gauge", what, [("", [], value)])
                 for name, what, value in gauges if value is not None]
        with policy.lock:
            saved, skipped = dict(policy.saved), dict(policy.skipped)
        parts += [
            _family("serve_snapshots_total", "counter", "Snapshots saved, by why: checkpoint, progress, "
                    "stopped (where a prefill stopped), reply (the state a reply leaves), preempted (where "
                    "a chore stepped aside for a person)",
                    [("", [("kind", kind)], saved[kind]) for kind in KINDS]),
            _family("serve_snapshots_skipped_total", "counter", "Snapshots considered and not saved "
                    "(not worth their cost, or the save failed), by why",
                    [("", [("kind", kind)], skipped[kind]) for kind in KINDS if kind != "progress"]),
        ]
        return parts


def render_models(http: Metrics, models: Sequence[tuple[str, Metrics]]) -> bytes:
    """Several engines in one server: HTTP requests once (from `http`), and each family of
    the engines' once, its samples labelled with their model's id."""
    merged: dict[str, Family] = {}
    for model_id, each in models:
        for family in each.engine_families():
            labelled = [(suffix, [("model", model_id), *labels], value)
                        for suffix, labels, value in family.samples]
            merged.setdefault(family.name, family._replace(samples=[])).samples.extend(labelled)
    return "".join(f.text() for f in [http.requests_family(), *merged.values()]).encode()
