"""The cold-expert store's mover: between two steps, on the step thread, the hottest non-resident
experts go into the coldest slots, at most experts.move_bytes_per_step a step.

Each step: read-aheads that finished are installed first (ColdExperts.promote: still hotter than
the coldest resident); then policy.promotions picks the next experts. Where packread serves a
layer (packed bf16 slots), the picks within what is left of the step's budget are read from the
page cache into their victim slots at once by the kernels' team, one call per layer
(ColdExperts.promote_cached): a read-ahead thread copying from the page cache beside the step's
matmuls took the GIL and a core from them (~4 ms of a 30% step on 2 cores, docs/cold-experts.md).
That layer's later picks wait for the next step (picked again if still hot). A pick the page
cache lacked has emptied its victim slot, so after one every pick goes to the read-ahead thread
for UNCACHED_BACKOFF steps (a page cache under a memory cap, where a read may wait for the
disk). Other layers' picks are read ahead on that thread into private buffers, at most twice the
per-step budget in flight or staged: a slot is only written on the step thread.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from moed.model.cold import policy
from moed.model.cold.reader import ExpertReadError

if TYPE_CHECKING:
    from moed.model.cold.store import ExpertStore

UNCACHED_BACKOFF = 16       # steps of read-ahead-only installs after one the page cache lacked


class Mover:
    """The store's between-steps installs (module docstring); per_step experts a step."""

    def __init__(self, store: ExpertStore) -> None:
        self.store = store
        settings = store.settings
        self.per_step = max(1, settings.move_bytes_per_step // store.expert_bytes) \
            if settings.move_bytes_per_step else 0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="moed-expert-ahead")
        self.ahead: dict[tuple[int, int], Future] = {}      # (layer position, unit) -> read
        self.backoff = 0        # steps left whose picks all go to the read-ahead thread

    def step(self) -> None:
        """One step's installs and new read-aheads (the store's between_steps)."""
        budget = self._install_ready()
        if not self.per_step:
            return
        layers = self.store.layers
        limit = 2 * self.per_step - len(self.ahead)     # in flight + staged, bounded
        picks = policy.promotions(self.store.heat, [ly.expert_in for ly in layers],
                                  set(self.ahead), limit)
        for pos, e in self._install_cached(picks, budget):
            self.ahead[(pos, e)] = self.pool.submit(self.store.read_ahead, pos, e)

    def _install_cached(self, picks: list[tuple[int, int]], budget: int) -> list[tuple[int, int]]:
        """The first `budget` picks of packread layers installed from the page cache now ->
        the read-ahead thread's: what the page cache lacked, other layers' picks."""
        if self.backoff > 0:
            self.backoff -= 1
            return picks
        store, now = self.store, {}
        for pos, e in picks[:max(budget, 0)]:
            if store.layers[pos].packread:
                now.setdefault(pos, []).append(e)
        left = [(pos, e) for pos, e in picks if not store.layers[pos].packread]
        for pos, units in now.items():
            missed = store.layers[pos].promote_cached(units)
            left += [(pos, e) for e in missed]
            store.stats.promoted((len(units) - len(missed)) * store.expert_bytes)
            self.backoff = UNCACHED_BACKOFF if missed else self.backoff
        return left

    def _install_ready(self) -> int:
        """Finished read-aheads installed, at most per_step -> what is left of that budget."""
        budget, store = self.per_step, self.store
        for key in [k for k, f in self.ahead.items() if f.done()]:
            if budget <= 0:
                break
            fut = self.ahead.pop(key)
            pos, e = key
            try:
                weights = fut.result(timeout=0)
            except ExpertReadError:
                store.stats.read_failed("promote")
                continue
            if store.layers[pos].promote(e, weights):
                budget -= 1
                store.stats.promoted(store.expert_bytes)
        return budget

    def staged(self) -> int:
        """Read-aheads done and waiting for their install."""
        return sum(1 for f in self.ahead.values() if f.done())

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
