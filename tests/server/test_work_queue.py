"""serve/engine/queue.py with classes of work: the person first, FIFO within a class, a chore
stepping aside for a person, and the rule that keeps chores from starving."""
from __future__ import annotations

import threading
import time

from serve.core.errors import ApiError
from serve.core.work_classes import BACKGROUND, INTERACTIVE
from serve.engine.queue import ClientLeft, EngineQueue, LostTurn

from test_engine_queue import WAIT, Waiter, wait_until


class Requests:
    """Requests of either class on one queue; each holds the engine until told to go."""

    def __init__(self, queue: EngineQueue):
        self.queue = queue
        self.order: list[str] = []
        self.errors: list = []
        self.turns: dict[str, object] = {}
        self.go: dict[str, threading.Event] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, work: str, waiter: Waiter = None, inside=None) -> None:
        """A request that holds the engine, or waits in line for it, by the time this returns."""
        self.go[name] = threading.Event()
        holding = threading.Event()
        before = len(self.queue)

        def run() -> None:
            try:
                with self.queue.turn(waiter or Waiter(), work) as turn:
                    self.turns[name] = turn
                    self.order.append(name)
                    holding.set()
                    if inside is not None:
                        inside(turn)
                    self.go[name].wait(WAIT)
            except (ApiError, ClientLeft) as e:
                self.errors.append((name, e))
        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)
        wait_until(lambda: holding.is_set() or len(self.queue) == before + 1,
                   f"{name} neither holds the engine nor waits")

    def finish(self, name: str) -> None:
        self.go[name].set()

    def join(self) -> None:
        for go in self.go.values():
            go.set()
        for thread in self.threads:
            thread.join(WAIT)
        assert not self.errors


def test_a_waiting_person_goes_ahead_of_every_waiting_chore_and_each_class_is_fifo():
    r = Requests(EngineQueue(8))
    r.start("running", INTERACTIVE)
    r.start("chore 1", BACKGROUND)
    r.start("chore 2", BACKGROUND)
    r.start("person 1", INTERACTIVE)
    r.start("person 2", INTERACTIVE)
    waiting = r.queue.waiting()
    assert (waiting[INTERACTIVE][0], waiting[BACKGROUND][0]) == (2, 2)
    assert waiting[BACKGROUND][1] >= waiting[INTERACTIVE][1] > 0   # the chores came first
    for name in ("running", "person 1", "person 2", "chore 1"):
        r.finish(name)
        wait_until(lambda: len(r.order) == ["running", "person 1", "person 2", "chore 1",
                                            "chore 2"].index(name) + 2, f"after {name}")
    r.join()
    assert r.order == ["running", "person 1", "person 2", "chore 1", "chore 2"]


def test_a_person_behind_chores_hears_only_what_is_ahead_of_it():
    r = Requests(EngineQueue(8))
    r.start("running", BACKGROUND)
    r.start("chore", BACKGROUND)
    person = Waiter()
    r.start("person", INTERACTIVE, person)
    wait_until(lambda: person.told, "the person was not told its place")
    assert person.told[-1] == 1    # the running chore; the waiting one is behind it
    r.join()


def test_without_classes_the_line_is_arrival_order_and_nothing_is_preempted():
    r = Requests(EngineQueue(8, classes=False))
    asked = []
    r.start("chore", BACKGROUND, inside=lambda turn: asked.append(turn))
    r.start("chore 2", BACKGROUND)
    r.start("person", INTERACTIVE)
    assert not asked[0].preempt_due()
    r.join()
    assert r.order == ["chore", "chore 2", "person"]


def test_a_chore_steps_aside_for_a_person_and_comes_back_before_later_chores():
    queue = EngineQueue(8)
    r = Requests(queue)
    stepped, back = threading.Event(), threading.Event()
    person_arrived = threading.Event()

    def chore(turn) -> None:
        assert not turn.preempt_due()         # nobody waits
        assert person_arrived.wait(WAIT)
        assert turn.preempt_due()             # a person waits now
        stepped.set()
        turn.step_aside(Waiter())
        back.set()
        assert turn.holding and not turn.preempt_due()

    r.start("chore", BACKGROUND, inside=chore)
    r.start("later chore", BACKGROUND)
    r.start("person", INTERACTIVE)
    person_arrived.set()
    assert stepped.wait(WAIT)
    wait_until(lambda: "person" in r.order, "the person did not get the engine")
    assert not back.is_set() and queue.holder() == INTERACTIVE
    r.finish("person")
    assert back.wait(WAIT)
    assert r.order == ["chore", "person"]   # the later chore still waits: the first came back
    r.join()
    assert r.order == ["chore", "person", "later chore"]
    assert queue.preemptions == 1
    counts = queue.snapshot_counts()
    assert counts[BACKGROUND].waits == 3 and counts[INTERACTIVE].waits == 1   # the chore twice


def test_a_person_is_never_preempted_and_a_chore_only_by_a_person():
    r = Requests(EngineQueue(8))
    seen = {}

    def person(turn) -> None:
        wait_until(lambda: len(r.queue) == 1, "the chore did not arrive")
        seen["person"] = turn.preempt_due()

    r.start("person", INTERACTIVE, inside=person)
    r.start("chore", BACKGROUND)
    wait_until(lambda: "person" in seen, "the person did not ask")
    r.finish("person")
    wait_until(lambda: "chore" in r.turns, "the chore did not get the engine")
    r.start("chore 2", BACKGROUND)
    assert not r.turns["chore"].preempt_due()    # another chore waiting does not preempt
    r.join()
    assert seen["person"] is False


def test_a_chore_waiting_past_the_limit_runs_one_step_ahead_of_people():
    queue = EngineQueue(8, starve_after=0.3)
    r = Requests(queue)
    dues = []

    def chore(turn) -> None:
        dues.append(turn.preempt_due())   # the step it is owed
        dues.append(turn.preempt_due())   # then people first again

    r.start("person 1", INTERACTIVE)
    r.start("chore", BACKGROUND, inside=chore)
    r.start("person 2", INTERACTIVE)
    time.sleep(0.5)   # the chore has now waited past the limit
    r.finish("person 1")
    wait_until(lambda: len(dues) == 2, "the starved chore did not get the engine")
    assert r.order == ["person 1", "chore"] and dues == [False, True]
    r.join()


def test_a_chore_that_stepped_aside_and_starves_comes_back_for_one_step():
    queue = EngineQueue(8, starve_after=0.3)
    r = Requests(queue)
    dues = []

    def chore(turn) -> None:
        wait_until(lambda: len(queue) == 1, "the person did not arrive")
        turn.step_aside(Waiter())   # back once it has waited 0.3 s, though a person waits
        dues.append(turn.preempt_due())   # after the step its caller runs on return

    r.start("chore", BACKGROUND, inside=chore)
    r.start("person 1", INTERACTIVE)
    wait_until(lambda: "person 1" in r.order, "the person did not get the engine")
    r.start("person 2", INTERACTIVE)
    time.sleep(0.5)
    r.finish("person 1")
    wait_until(lambda: dues, "the chore did not come back")
    assert dues == [True] and r.order == ["chore", "person 1"]
    r.join()
    assert r.order == ["chore", "person 1", "person 2"]


def test_a_chore_that_steps_aside_and_whose_client_leaves_lets_go_of_its_place():
    queue = EngineQueue(8)
    r = Requests(queue)
    waiter, raised = Waiter(), []

    def chore(turn) -> None:
        wait_until(lambda: len(queue) == 1, "the person did not arrive")
        waiter.left.set()
        try:
            turn.step_aside(waiter)
        except LostTurn as lost:   # nothing may touch the engine on the way out
            raised.append(isinstance(lost.cause, ClientLeft))

    r.start("chore", BACKGROUND, waiter, inside=chore)
    r.start("person", INTERACTIVE)
    wait_until(lambda: "person" in r.order, "the person did not get the engine")
    r.join()
    assert raised == [True] and len(queue) == 0 and not queue.busy
