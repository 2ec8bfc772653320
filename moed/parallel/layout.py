"""EPLayout: which physical expert slots each rank of an expert-parallel group holds. Pure.

Glossary
  E        logical experts of a layer (the checkpoint's)
  N        ranks in the group (parallel.ep_size)
  S        slots per rank; every rank holds exactly S (the all-to-all needs no per-rank shapes)
  P        physical slots = N * S; slot p lives on rank p // S, as local slot p % S
  slot_expert[p]   the logical expert slot p holds; P > E means redundant slots (replicas)

The default layout is contiguous: rank r holds experts [r*S, (r+1)*S) with S = ceil(E / N);
when N does not divide E, the last rank's spare slots hold replicas of the first experts
(placed on another rank than the original where there is one), so no slot sits empty. EPLB
(moed/balance/experts.py) produces other slot_expert maps of the same shape; `from_slots`
checks and installs them. Every layer uses the same layout today.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EPLayout:
    num_experts: int                 # E
    ep_size: int                     # N
    slot_expert: tuple[int, ...]     # [P]: logical expert per physical slot

    def __post_init__(self) -> None:
        e, n, p = self.num_experts, self.ep_size, len(self.slot_expert)
        if e < 1 or n < 1:
            raise ValueError(f"an expert layout needs experts and ranks, got E={e}, N={n}")
        if p % n or p < e:
            raise ValueError(f"{p} physical slots do not split evenly over {n} ranks or hold "
                             f"fewer than the {e} experts")
        bad = [x for x in self.slot_expert if not 0 <= x < e]
        if bad:
            raise ValueError(f"slots name experts outside [0, {e}): {bad[:6]}")
        missing = sorted(set(range(e)) - set(self.slot_expert))
        if missing:
            raise ValueError(f"experts {missing[:6]} have no slot")

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int, redundant: int = 0) -> EPLayout:
        """Experts in order, S = ceil(E / N) + redundant slots per rank; each spare slot holds
        a replica of the next expert (cycling) its rank does not hold yet."""
        if ep_size < 1 or num_experts < 1 or redundant < 0:
            raise ValueError(f"an expert layout needs experts and ranks, got E={num_experts}, "
                             f"N={ep_size}, redundant={redundant}")
        s = -(-num_experts // ep_size) + redundant
        if s > num_experts:     # a rank would hold two copies of one expert
            raise ValueError(f"{s} slots per rank ({redundant} redundant) exceed the "
                             f"{num_experts} experts: at most {num_experts - (-(-num_experts // ep_size))} "
                             f"redundant slots per rank")
        slots = list(range(num_experts))
        j = 0
        while len(slots) < ep_size * s:                  # spare slots: replicas, not holes
            held = set(slots[len(slots) // s * s:])
            while j % num_experts in held:
                j += 1
            slots.append(j % num_experts)
            j += 1
        return cls(num_experts, ep_size, tuple(slots))

    @classmethod
    def from_slots(cls, num_experts: int, ep_size: int, slot_expert: list[int] | tuple[int, ...]) -> EPLayout:
        return cls(num_experts, ep_size, tuple(int(x) for x in slot_expert))

    @property
    def num_physical(self) -> int:
        return len(self.slot_expert)

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def rank_of(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """The logical expert of each of rank's S local slots, in slot order (what it loads)."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank {rank} outside [0, {self.ep_size})")
        s = self.slots_per_rank
        return self.slot_expert[rank * s:(rank + 1) * s]

    def replicas(self) -> list[list[int]]:
        """Physical slots of each logical expert [E][r], ascending (the router's map)."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for p, e in enumerate(self.slot_expert):
            out[e].append(p)
        return out

    def redundant_slots(self, rank: int) -> int:
        """Slots of `rank` holding an expert that also has a slot earlier in the layout."""
        first = {e: ps[0] for e, ps in enumerate(self.replicas())}
        s = self.slots_per_rank
        return sum(1 for p in range(rank * s, (rank + 1) * s) if first[self.slot_expert[p]] != p)
