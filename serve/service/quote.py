"""What a chat request would cost before its first token, asked without the engine.

The prompt is built as the request would build it (serve's own tokenizer), its longest
snapshot is looked up in the local tier and in the team's shared tier (an index read:
nothing is copied or counted), and the time to the first token is figured from the
measured costs (serve/snapshots/policy.py): a restore, plus the positions left to
prefill at the measured rate. The time spent waiting for the engine is not in it: the
quote says how many requests are ahead instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from serve.core.request import ChatRequest
from serve.service.facade import Service
from serve.service.images import StagedImages
from serve.service.prompt import Prompt
from serve.snapshots.cache import PrefixCache
from serve.snapshots.policy import SnapshotPolicy


@dataclass(frozen=True)
class Quote:
    positions: int                  # the prompt's, images expanded
    restorable_local: int           # positions the local tier's longest snapshot holds
    restorable_shared: int          # the shared tier's (--shared-cache)
    ahead: int                      # requests holding or waiting for the engine
    prefill_seconds_per_position: Optional[float]   # measured; None until a prefill ran
    restore_seconds: Optional[float]                 # a snapshot's restore, measured

    @property
    def restorable(self) -> int:
        return max(self.restorable_local, self.restorable_shared)

    @property
    def to_prefill(self) -> int:
        return self.positions - self.restorable

    def first_token_seconds(self) -> Optional[float]:
        """The engine time to the first token, once it holds the engine (None: unmeasured)."""
        rate = self.prefill_seconds_per_position
        if rate is None:
            return None
        return self.to_prefill * rate + ((self.restore_seconds or 0.0) if self.restorable else 0.0)

    def body(self) -> dict:
        rate = self.prefill_seconds_per_position
        eta = self.first_token_seconds()
        return {"positions": self.positions, "restorable": self.restorable,
                "restorable_local": self.restorable_local,
                "restorable_shared": self.restorable_shared, "to_prefill": self.to_prefill,
                "prefill_positions_per_second": round(1.0 / rate, 3) if rate else None,
                "first_token_seconds": None if eta is None else round(eta, 3),
                "ahead": self.ahead}


def quote(prompt: Prompt, positions: int, cache: Optional[PrefixCache], policy: SnapshotPolicy,
          ahead: int) -> Quote:
    """The quote of a built prompt that takes `positions` (its images expanded)."""
    local = shared = 0
    if cache is not None:
        tokens, limit = prompt.restorable
        found = cache.find(tokens, limit).found
        local = found.n_tokens if found is not None else 0
        if cache.shared is not None:
            published = cache.shared.longest(tokens, limit, beyond=local)
            shared = published[0] if published is not None else 0
    costs = policy.costs
    restore = costs.load_seconds
    if shared > local and restore is not None:
        restore += costs.fetch_seconds or 0.0
    return Quote(positions, local, shared, ahead, costs.token_seconds, restore)


def quote_chat(service: Service, req: ChatRequest) -> Quote:
    """A chat request's quote, its prompt checked and built as `Service.chat` builds it (the
    same 400s), on the caller's thread. A prompt whose images serve cannot figure counts
    their placeholders only (its `positions` are then a floor)."""
    check = service.prompts.check(req)
    with StagedImages(service.options.allow_local_images) as staged:
        prompt = service.prompts.of_chat(req, check, staged)
    expanded = prompt.expanded_length
    queue = service.queue
    return quote(prompt, len(prompt.ids) if expanded is None else expanded,
                 service.options.prefix_cache, service.policy, len(queue) + int(queue.busy))
