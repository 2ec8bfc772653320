"""Tier policies, pure: which blocks a full tier gives up, and load-or-recompute per request.

Glossary
- *entry*: one full KV block held below L1 (the engine's KV tensor), keyed by its chained
  prefix hash (moed.kvcache.pool.hash_block) within one KV layout.
- *benefit* of keeping an entry: how much recompute time it is expected to save, per byte it
  occupies — (1 + reuse count), decayed by the time since its last use, times the time it would
  take to recompute per byte. The lowest benefit leaves first; a *pinned* entry (a load is
  reading it) never leaves.
- *plan*: a request whose next `m` prompt blocks sit below L1 loads the first `k` of them and
  recomputes the rest; `k` minimises predicted load time (bytes / the tier's measured bandwidth)
  plus predicted recompute time (the cost model). k = 0 is "recompute".
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


def benefit(hits: int, age_s: float, recompute_s_per_byte: float,
            half_life_s: float = 60.0) -> float:
    """Expected recompute time saved per byte kept: reuse count and recency x recompute cost."""
    return (1 + hits) * recompute_s_per_byte / (1.0 + max(age_s, 0.0) / half_life_s)


@dataclass(frozen=True)
class EvictionCandidate:
    """A stored entry as eviction sees it (not a node: that is balance.candidate.Candidate)."""
    key: int
    nbytes: int
    benefit: float
    pinned: bool = False


def victims(entries: Iterable[EvictionCandidate], need_bytes: int) -> list[int] | None:
    """Keys to evict, lowest benefit first, until `need_bytes` are freed; None when even every
    unpinned entry would not free enough (the caller then does not store)."""
    if need_bytes <= 0:
        return []
    out, freed = [], 0
    for c in sorted((c for c in entries if not c.pinned), key=lambda c: (c.benefit, c.key)):
        out.append(c.key)
        freed += c.nbytes
        if freed >= need_bytes:
            return out
    return None


@dataclass(frozen=True)
class LoadPlan:
    num_load: int          # leading blocks to load (0: recompute all)
    load_s: float          # predicted time to load those blocks
    recompute_s: float     # predicted time to recompute the prompt's rest with no load
    total_s: float         # predicted load_s + recompute of the rest

    @property
    def decision(self) -> str:
        return "load" if self.num_load else "recompute"


def plan_load(block_seconds: Sequence[float], recompute_after: Callable[[int], float],
              overhead_s: float = 0.0) -> LoadPlan:
    """block_seconds[i]: predicted time to load block i (its bytes / its tier's bandwidth);
    recompute_after(k): predicted time to recompute the blocks from k on (k = 0: all). A load
    costs `overhead_s` once (the request waits for the next step to learn it finished)."""
    m = len(block_seconds)
    full = recompute_after(0)
    best = LoadPlan(0, 0.0, full, full)
    acc = 0.0
    for k in range(1, m + 1):
        acc += block_seconds[k - 1]
        total = overhead_s + acc + recompute_after(k)
        if total < best.total_s:
            best = LoadPlan(k, overhead_s + acc, full, total)
    return best


class Bandwidth:
    """A tier's measured read bandwidth (bytes/s): an exponential average of observed loads,
    seeded from config so the first decision has a figure."""

    def __init__(self, seed_bytes_per_s: float, weight: float = 0.2) -> None:
        self.value = float(seed_bytes_per_s)
        self.weight = weight
        self.samples = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        self.value += self.weight * (nbytes / seconds - self.value)
        self.samples += 1

    def seconds(self, nbytes: int) -> float:
        return nbytes / self.value if self.value > 0 else float("inf")


class Latency:
    """A load's fixed cost beyond its bytes (queue, thread hand-off, file opens, round trips),
    in seconds, estimated cautiously: the first measurement replaces the seed (a warm-up probe
    or 0) when it is higher, later ones move the estimate fast up and slowly down. Predicting
    a load too fast is the costly mistake (the request waits longer than recomputing would
    have taken); too slow only recomputes a little more."""

    def __init__(self, seed_s: float = 0.0, rise: float = 0.5, fall: float = 0.1) -> None:
        self.value = max(float(seed_s), 0.0)
        self.rise, self.fall = rise, fall
        self.samples = 0

    def observe(self, seconds: float) -> None:
        s = max(float(seconds), 0.0)
        if self.samples == 0:
            self.value = max(self.value, s)
        else:
            self.value += (self.rise if s > self.value else self.fall) * (s - self.value)
        self.samples += 1
