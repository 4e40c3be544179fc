"""--warm's work: prefill and checkpoint a request's conversation as chat() would, in idle time.

It answers nothing. It waits for an idle turn on its own thread (patient: for the
line to empty), and hands the prefill to the engine's worker (serve/engine/worker.py).
A request that starts waiting takes the engine at the next chunk (the warm
snapshots what it has), and the warm resumes from there once the engine is idle
again.
"""
from __future__ import annotations

from typing import Callable, Optional

from serve.core.errors import invalid
from serve.core.request import ChatRequest
from serve.service.facade import Service
from serve.service.images import image_parts, StagedImages
from serve.service.prefill import Prefill, PrefillCancelled, start_empty
from serve.service.prompt import ChatCheck


def warm(service: Service, req: ChatRequest, progress: Callable[[int, int], None],
         halted: Callable[[], bool]) -> tuple[int, int]:
    """Returns (positions the conversation holds, positions already cached when it began);
    raises PrefillCancelled when halted (or the service stops) first."""
    cache, prompts, engine = service.options.prefix_cache, service.prompts, service.engine
    if cache is None or service.chat_format.refusal is not None:
        raise invalid("messages", "warming needs the prefix cache and a chat format")
    if image_parts(req.messages):
        raise invalid("messages", "a conversation with images is not warmed")
    thinking = prompts.thinking(req)
    check = ChatCheck(thinking, [], prompts.reasoning(req, thinking))
    before: Optional[int] = None

    def stopping() -> bool:
        return halted() or service.stopping

    with StagedImages(service.options.allow_local_images) as no_images:
        prompt = prompts.of_chat(req, check, no_images)
    ids, held = prompt.ids, len(prompt.history)

    def prefill(yield_now: Callable[[], bool]) -> Optional[tuple[int, int]]:
        """On the worker: the conversation's prefill, or None when a request took the engine."""
        nonlocal before
        start_empty(engine)
        try:
            run = Prefill(engine, ids, cache=cache, policy=service.policy,
                          chunk=service.options.prefill_chunk, progress=progress,
                          stop=lambda: yield_now() or stopping(), scope=prompt.scope)
            cached = run.restore(held)
            before = cached if before is None else before
            run.evaluate(held, prompt.snapshot_at)
            return held, before
        except PrefillCancelled:
            if stopping():
                raise
            return None
        finally:
            engine.reset()

    while True:
        with service.queue.idle_turn(patient=True) as yield_now:
            if yield_now is None or stopping():
                raise PrefillCancelled()
            asked = yield_now
            done = service.worker.call(lambda: prefill(asked))
            if done is not None:
                return done
        # A request took the engine: wait until it is idle again, and resume.
