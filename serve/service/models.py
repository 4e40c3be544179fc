"""The containers one server answers for, and which of them answers a request.

One container (the usual case): it answers every request, whatever `model` the
request names, because clients send model names of their own (Claude Code its
`claude-...` ids, Open-WebUI whatever its user picked) and a server with one
model has nothing else to give them. Replies name the container's own id.

Several (the main model and a chores model, `--chores-model`), each with its
own engine, engine queue and service: a request naming one of their ids goes
to it; any other name goes to the main model. A background request (a chore:
docs/chores.md says how one is known) goes to the chores model unless it names another
model than the main one: clients name their chat model in their chores by
default (Open-WebUI's task model is "the current model" until its user sets
one), so a chore that names the main model, or no model serve knows, still
never touches the main model's engine.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from serve.core.work_classes import BACKGROUND
from serve.core.request import ChatRequest, CompletionRequest

from serve.service import metrics
from serve.core.activity import Activity
from serve.service.facade import Service
from serve.service.jobs import Jobs


class Models:
    """The services of one server, the main model's first."""

    def __init__(self, services: Sequence[Service], chores: Optional[Service] = None):
        ids = [s.options.model_id for s in services]
        if not services or len(set(ids)) != len(ids):
            raise ValueError(f"the models need distinct ids, not {ids}")
        if chores is not None and chores not in services:
            raise ValueError("the chores model must be one of the models")
        self.services = list(services)
        self.chores = chores
        main = self.services[0].options
        self.jobs = Jobs(attach=main.attach)   # every model's: an id names one server-wide

    @property
    def main(self) -> Service:
        return self.services[0]

    def named(self, model_id: Any) -> Optional[Service]:
        return next((s for s in self.services if s.options.model_id == model_id), None)

    def pick(self, name: Any, request: ChatRequest | CompletionRequest) -> Service:
        """The service that answers a request naming `name` (anything a body holds), its class
        already decided (serve/core/work.py, at the edge: docs/chores.md)."""
        named = self.named(name) if isinstance(name, str) else None
        if self.chores is not None and named in (None, self.main) and request.work == BACKGROUND:
            return self.chores
        return named or self.main

    # -- what the server reports ------------------------------------------------------

    def listing(self) -> list[dict]:
        return [s.model() for s in self.services]

    def health(self) -> dict:
        """/health: the whole server's activity (idle only when every engine is), and with
        several models each one's own under `models`."""
        states = [s.activity() for s in self.services]
        if len(states) == 1:
            return {"status": "ok", "warming": self.main.warming, **states[0].as_json()}
        whole = Activity(any(a.busy for a in states), sum(a.queue for a in states),
                         any(a.deferred for a in states), any(a.warming for a in states))
        return {"status": "ok", "warming": self.main.warming, **whole.as_json(),
                "models": {s.options.model_id: a.as_json() for s, a in zip(self.services, states)}}

    def render_metrics(self) -> bytes:
        """/metrics: one model's as they always were; several with a `model` label on each
        engine's families (HTTP requests are counted once, by the main model's)."""
        if len(self.services) == 1:
            return self.main.metrics.render()
        return metrics.render_models(self.main.metrics,
                                     [(s.options.model_id, s.metrics) for s in self.services])

    # -- shutdown, each service as serve/service/facade.py's --------------------------

    def stop(self) -> None:
        for service in self.services:
            service.stop()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """True once no engine is in use; `timeout` is for each in turn."""
        return all([service.wait_idle(timeout) for service in self.services])

    def close(self) -> None:
        for service in self.services:
            service.close()
