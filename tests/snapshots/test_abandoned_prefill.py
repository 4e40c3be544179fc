"""No prefill work is lost when a client hangs up: at a scaled K3 clock, on the reference engine.

An agent gives up on a silent stream and sends the same request again. The
prefill its first request started goes on while no one waits and is
snapshotted at the end of the prompt, so the retry restores it; a retry that
arrives while it still runs makes it stop at its next chunk (snapshotting what
it has) and restores that; a request that waits for the engine gets it at the
next chunk. What the engine evaluated is counted by the binding
(Engine.evaluated): every prompt position is evaluated once. These servers run
with attaching off (--no-attach), the rule for a prefill alone: with it on, the
retry attaches to the job itself (tests/e2e/test_jobs.py).
"""
from __future__ import annotations

import threading

import pytest

from scripted import call, post_open, real_service, scrape, serving, wait_idle
from serve.snapshots.cache import PrefixCache
from serve.snapshots.policy import SnapshotPolicy

CHAT = "/v1/chat/completions"
DELAY_MS = "5"    # per evaluated token: a 64-position chunk lasts about a third of a second
CHUNK = 64
SENTENCE = "The harbour master kept a ledger of every ship that passed the breakwater. "
ANSWER = {"temperature": 0, "max_tokens": 4, "reasoning_effort": "none"}


def long_request(sentences: int = 30, topic: str = "ships") -> dict:
    """About 33 positions a sentence on the test container: 30 make about 1,000."""
    return {"messages": [{"role": "user", "content": f"On {topic}: " + SENTENCE * sentences}], **ANSWER}


class Progress:
    """The server's log of prefill progress: wait until a request is this far in."""

    def __init__(self):
        self._cond = threading.Condition()
        self.done: dict[str, tuple[int, int]] = {}   # request id -> (positions, of total)

    def log(self, line: str) -> None:
        words = line.split()
        if len(words) == 3 and words[1] == "prefill":
            done, total = map(int, words[2].split("/"))
            with self._cond:
                self.done[words[0]] = (done, total)
                self._cond.notify_all()

    def wait_for(self, fraction: float) -> tuple[str, int, int]:
        """(request id, positions, total) once some request has prefilled `fraction` of its prompt."""
        def reached():
            return next(((rid, d, t) for rid, (d, t) in self.done.items() if d >= fraction * t), None)
        with self._cond:
            assert self._cond.wait_for(reached, 120), self.done
            return reached()

    def now(self, rid: str) -> int:
        """Positions request `rid` has prefilled, as logged so far."""
        with self._cond:
            return self.done[rid][0]


@pytest.fixture
def slow_clock(monkeypatch):
    monkeypatch.setenv("WASTE_DELAY_MS", DELAY_MS)   # read by waste_open


@pytest.fixture
def cache(tmp_path):
    c = PrefixCache(256 << 20, parent_dir=str(tmp_path))
    yield c
    c.close()


def served(lib_path, container, cache, progress: Progress, **options):
    """The real engine at the slow clock, its snapshot policy measuring the real costs."""
    options.setdefault("snapshot_policy", SnapshotPolicy())
    options.setdefault("attach", False)
    return real_service(lib_path, container, prefix_cache=cache, prefill_chunk=CHUNK,
                        log=progress.log, thinking=False, **options)


def hang_up_at(port: int, body: dict, progress: Progress, fraction: float) -> tuple[int, int]:
    """Stream `body`, and close the connection once its prefill is `fraction` through;
    (positions prefilled when the client left, the prompt's total)."""
    sock = post_open(port, {**body, "stream": True})
    rid, _, total = progress.wait_for(fraction)
    done = progress.now(rid)   # read last: the server may have gone on while the test woke
    sock.close()
    return done, total


def usage(resp) -> tuple[int, int, int]:
    """(prompt_tokens, cached_tokens, completion_tokens) of a blocking reply."""
    assert resp.status == 200, resp.body
    u = resp.json()["usage"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"]


def test_a_hang_up_mid_prefill_is_finished_for_the_retry(slow_clock, lib_path, k3_container, cache):
    progress = Progress()
    with served(lib_path, k3_container, cache, progress) as service, serving(service) as srv:
        body = long_request()
        left_at, total = hang_up_at(srv.port, body, progress, 0.3)
        assert left_at < total / 2
        # Idle-time work until the prefill would have ended: /health says when it has.
        wait_idle(srv.port)
        assert progress.done[next(iter(progress.done))][0] == total - 1   # it ran to the end
        prompt, cached, completion = usage(call(srv.port, "POST", CHAT, body, timeout=120))
        assert prompt == total and cached >= 0.9 * prompt
        assert cached == total - 1   # everything but the token generate needs
        wait_idle(srv.port)
        # Each position evaluated once, across the abandoned request and its retry.
        assert service.engine.evaluated == prompt + completion


@pytest.mark.parametrize("spacing", [None, 10 ** 6], ids=["measured", "no-progress-snapshots"])
def test_a_retry_the_moment_after_the_hang_up_takes_the_prefill_over(spacing, slow_clock, lib_path,
                                                                       k3_container, cache):
    # Measured, this clock makes a progress snapshot at every chunk; with a spacing no prompt
    # reaches there are none, and the snapshot made where the prefill stops does the work.
    progress = Progress()
    with served(lib_path, k3_container, cache, progress,
                snapshot_policy=SnapshotPolicy(spacing=spacing)) as service, serving(service) as srv:
        body = long_request()
        left_at, total = hang_up_at(srv.port, body, progress, 0.3)
        retry = call(srv.port, "POST", CHAT, body, timeout=120)   # at once, as an agent does
        prompt, cached, completion = usage(retry)
        wait_idle(srv.port)
        # The abandoned prefill stopped at a chunk boundary once the retry waited, snapshotted
        # there, and the retry restored it: no position was evaluated twice.
        assert left_at <= cached < total - 1 and cached % CHUNK == 0
        assert service.engine.evaluated == prompt + completion


def test_a_hang_up_while_another_request_waits_hands_it_the_engine_at_the_next_chunk(
        slow_clock, lib_path, k3_container, cache):
    progress = Progress()
    with served(lib_path, k3_container, cache, progress) as service, serving(service) as srv:
        body = long_request(topic="tides")
        sock = post_open(srv.port, {**body, "stream": True})
        progress.wait_for(0.2)
        waiting: list = []
        other = {"messages": [{"role": "user", "content": "Is the harbour open?"}], **ANSWER}
        thread = threading.Thread(target=lambda: waiting.append(call(srv.port, "POST", CHAT, other,
                                                                     timeout=120)))
        thread.start()
        while not len(service.queue):
            thread.join(0.01)
        rid, _, total = progress.wait_for(0.3)
        left_at = progress.now(rid)
        sock.close()
        thread.join(120)
        prompt, cached, completion = usage(waiting[0])
        wait_idle(srv.port)
        # The abandoned prefill went on for at most the chunk in hand (and the one it may have
        # begun before the hang-up reached it), then snapshotted where it stopped.
        abandoned = service.engine.evaluated - prompt - completion
        assert left_at <= abandoned <= left_at + 2 * CHUNK < total - 1
        # The first request's retry restores where it stopped.
        _, cached, _ = usage(call(srv.port, "POST", CHAT, body, timeout=120))
        assert cached == abandoned


def test_no_finish_abandoned_stops_at_the_next_chunk_and_keeps_what_it_has(
        slow_clock, lib_path, k3_container, cache):
    progress = Progress()
    with served(lib_path, k3_container, cache, progress, finish_abandoned=False) as service, \
            serving(service) as srv:
        body = long_request(topic="gulls")
        left_at, total = hang_up_at(srv.port, body, progress, 0.3)
        wait_idle(srv.port)
        abandoned = service.engine.evaluated
        assert left_at <= abandoned <= left_at + 2 * CHUNK < total - 1
        _, cached, _ = usage(call(srv.port, "POST", CHAT, body, timeout=120))
        assert cached == abandoned


def test_the_metrics_count_what_the_engine_evaluated(slow_clock, lib_path, k3_container, cache):
    progress = Progress()
    with served(lib_path, k3_container, cache, progress) as service, serving(service) as srv:
        prompt, _, completion = usage(call(srv.port, "POST", CHAT, long_request(3), timeout=120))
        wait_idle(srv.port)
        now = scrape(srv.port)
        assert now[("serve_engine_evaluated_tokens_total", ())] == prompt + completion
        assert now[("serve_prefill_seconds_per_token", ())] >= float(DELAY_MS) / 1e3
        saved = {labels: v for (name, labels), v in now.items() if name == "serve_snapshots_total"}
        assert saved[(("kind", "checkpoint"),)] >= 1
