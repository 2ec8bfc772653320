"""Layer-ahead prediction and prefetch: read the experts a layer will route to before it runs.

The residual stream changes little from one layer to the next, so the next MoE layer's router
applied to the hidden rows available now ranks first most of the experts it will pick on its
own input ("pre-gating"); each token's top WIDEN x k of that ranking is the prediction. When MoE layer L's call starts (after L's attention, before its experts
run), `predict(L + 1, x)` routes L's MoE input x through layer L+1's router and starts reading
the predicted experts that are not resident, on this module's own reader thread, into private
buffers in the slot layout; they are read while L's experts and L+1's attention compute. The
first MoE layer has no layer before it: it is predicted at the start of the step from the
normed embeddings (the first layer's attention input). Predicting before L's experts, not
after, gives the reads L's expert compute as well as L+1's attention to hide behind; the
prediction from L's input is measured on bench/cold_experts.py (docs/cold-experts.md).

A prediction only warms memory: layer L+1's real routing decides which experts run. When its
call needs a non-resident expert, the store `take`s the staged read (if any) and installs it
into a slot as it would a miss read (the same victim, the same bytes, so output is unchanged);
a read still in flight is waited for; one that failed falls back to a miss read (which fails
the step as a miss does if the file is still bad). What the layer did not use is dropped when
its call ends (`finish`): staged buffers are freed, reads not started are cancelled.

Memory: at most `capacity` experts (experts.prefetch_experts) are staged or being read at any
time, dropped reads still running included; the store takes their bytes out of the resident
budget (policy.split_budget). Glossary: a *unit* is what the store tiers (alone: an expert);
*pos* is an MoE layer's position among the MoE layers.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

import torch

from moed.model.cold import policy
from moed.obs import metrics

if TYPE_CHECKING:
    from moed.model.cold.store import ExpertStore
    from moed.model.moe import Router


# Experts predicted per token: WIDEN x top_k. On bench/cold_experts.py's 16-layer model the
# next layer's top-k from the current layer's MoE input names 75-82% of the experts the next
# layer runs (layers 2-15; 41% from layer 0 to 1, whose hidden state changes most); its top 2k
# name 90-96% for ~1.9x the experts (docs/cold-experts.md). The reads are bounded by capacity.
WIDEN = 2
# While every checked expert is page-cached, predict one step in this many (policy.prediction_rest)
PROBE_EVERY = 8


class Prefetcher:
    """The store's layer-ahead reads (see the module docstring); step thread only, apart from
    the reads themselves."""

    def __init__(self, store: ExpertStore, capacity: int, read: Callable[[int, int], list[torch.Tensor]]) -> None:
        """read(pos, unit): the unit's weights in its layer's slot layout (the reader thread)."""
        self.store, self.capacity, self.read = store, capacity, read
        self.routers: list[Router] = []
        self.first_norm: tuple[torch.Tensor, float] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moed-expert-prefetch")
        self._staged: dict[tuple[int, int], Future] = {}
        self._dropped: list[Future] = []        # unused reads still running: their buffers count
        self._predicted: dict[int, set[int]] = {}
        # this step: predicted at all, experts checked, one found not cached (a check on the
        # reader thread, or a miss that needed the disk: uncached()); steps rested so far
        self._did, self._checked, self._uncached, self.rested = False, 0, False, 0

    def attach(self, routers: list[Router], first_norm: tuple[torch.Tensor, float]) -> None:
        """The MoE layers' routers in order, and the first layer's input norm (weight, eps)."""
        if len(routers) != len(self.store.layers):
            raise ValueError(f"{len(routers)} routers for {len(self.store.layers)} MoE layers")
        self.routers, self.first_norm = routers, first_norm

    def held(self) -> int:
        """Experts staged or being read (what the capacity bounds)."""
        self._dropped = [f for f in self._dropped if not f.done()]
        return len(self._staged) + len(self._dropped)

    def first(self, h: torch.Tensor) -> None:
        """The step's embeddings h [T, H]: predict the first MoE layer from them, normed."""
        if self.first_norm is None:
            return
        w, eps = self.first_norm
        x = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)
        self.predict(0, (x * w.float()).to(h.dtype))

    def predict(self, pos: int, x: torch.Tensor) -> None:
        """Route x [T, H] through MoE layer `pos`'s router; start reading its predicted
        non-resident units, within the capacity."""
        if pos >= len(self.routers) or x.shape[0] == 0 or self.rested:
            return
        self._did = True
        router = self.routers[pos]
        n = len(self.store.units)
        top = router.choice_scores(x).topk(min(WIDEN * router.top_k, n), dim=-1).indices
        units = router.logical_to_physical[top, 0]                      # alone: the identity
        # a token's top k count twice, its next (WIDEN - 1) x k once: read in that order
        rows = (torch.bincount(units.reshape(-1), minlength=n)
                + torch.bincount(units[:, :router.top_k].reshape(-1), minlength=n)).tolist()
        self._predicted[pos] = {u for u, c in enumerate(rows) if c}
        resident = [s >= 0 for s in self.store.layers[pos].slot_of]
        busy = {u for p, u in self._staged if p == pos}
        st = self.store.stats
        for u in policy.prefetch_picks(rows, resident, busy, self.capacity - self.held()):
            self._staged[(pos, u)] = self._pool.submit(self._read_uncached, pos, u)
            st.prefetch_reads += 1

    def _read_uncached(self, pos: int, unit: int) -> list[torch.Tensor] | None:
        """The read (reader thread), or None when the page cache holds the expert: its miss is
        then one copy on the step thread, where a staged read costs two (here, then into the
        slot), both beside the matmuls on the same cores (docs/cold-experts.md)."""
        layer = self.store.layers[pos].layer
        self._checked += 1
        if self.store.index.cached(layer, self.store.units[unit]):
            return None
        self._uncached = True
        return self.read(pos, unit)

    def uncached(self) -> None:
        """A miss needed the disk: predict again from the next step."""
        self._uncached = True

    def cached_after_all(self) -> None:
        """A staged read found its expert page-cached (None): counted as such, not as a read."""
        self.store.stats.prefetch_reads -= 1
        self.store.stats.prefetch_cached += 1
        metrics.EXPERT_WEIGHT_PREFETCHES.labels("cached").inc()

    def take(self, pos: int, unit: int) -> Future | None:
        """The staged or in-flight read of `unit` for layer `pos` (now the caller's), or None
        (none, or one that found the expert page-cached: a miss reads it). An in-flight read
        may still end in None: the caller reads a miss then."""
        fut = self._staged.pop((pos, unit), None)
        if fut is not None and _cached(fut):
            self.cached_after_all()
            return None
        return fut

    def state(self, pos: int, unit: int) -> int:
        """0: staged and complete, 1: being read, 2: no prefetch (the order a layer's misses run)."""
        fut = self._staged.get((pos, unit))
        return 2 if fut is None else 0 if fut.done() else 1

    def finish(self, pos: int, needed: set[int]) -> None:
        """Layer `pos`'s call ended needing `needed`: count the prediction, drop what is unused."""
        st = self.store.stats
        predicted = self._predicted.pop(pos, None)
        if predicted is not None and needed:
            st.predicted += len(predicted)
            st.predicted_needed += len(needed)
            st.predicted_right += len(predicted & needed)
        for key in [k for k in self._staged if k[0] == pos]:
            fut = self._staged.pop(key)
            if fut.cancel():
                st.prefetch_reads -= 1          # never read
                continue
            if _cached(fut):
                self.cached_after_all()
                continue
            self._dropped.append(fut)
            st.prefetch_unused += 1
            metrics.EXPERT_WEIGHT_PREFETCHES.labels("unused").inc()

    def reset(self) -> None:
        """Between steps: drop whatever a step left (its last layer, a failed step)."""
        for pos in sorted({p for p, _ in self._staged} | set(self._predicted)):
            self.finish(pos, set())
        self.rested = policy.prediction_rest(self._did, self._checked, self._uncached,
                                             self.rested, PROBE_EVERY)
        self._did, self._checked, self._uncached = False, 0, False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _cached(fut: Future) -> bool:
    """A finished read that found its expert page-cached (and so read nothing)."""
    return fut.done() and not fut.cancelled() and fut.exception() is None and fut.result() is None
