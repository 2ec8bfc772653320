"""The cold-expert store's decisions, pure (lists and numbers in, lists and numbers out).

Glossary: a *slot* holds one expert's weights in the resident tier; `expert_in[slot]` is the
expert it holds (-1 = empty); `heat[e]` is expert e's routed-token count, decayed per step
(an exponential moving sum); a *miss* is an expert a step needs that no slot holds.
"""
from __future__ import annotations

from collections.abc import Sequence


def slots_per_layer(resident_bytes: int, expert_bytes: int, moe_layers: int, num_experts: int) -> int:
    """Resident slots in each MoE layer for a budget of resident_bytes (split evenly: every
    MoE layer's experts have the same size). 0 or a budget of every expert = all of them;
    below one expert per layer: ValueError naming the minimum."""
    if resident_bytes <= 0:
        return num_experts
    need = expert_bytes * moe_layers
    if resident_bytes < need:
        raise ValueError(f"experts.resident_bytes {resident_bytes} holds less than one expert per "
                         f"MoE layer: the minimum is {need} ({moe_layers} layers x {expert_bytes} "
                         f"bytes an expert)")
    return min(num_experts, resident_bytes // need)


def stream_slots(slots: int) -> int:
    """Slots a layer's misses cycle through (a quarter, at least one): a miss never evicts one of
    the other, hottest residents, so a step whose tail of rarely routed experts outnumbers the
    cold slots (a large batch, a prefill) streams it through a few slots instead of pushing the
    hot set out. At batch 8 on bench/cold_experts.py's Zipf trace it changes nothing measurable
    (rows hit 78.7% without it, 79.0% with it: a step's misses fit the cold slots anyway)."""
    return max(1, slots // 4)


def hottest(expert_in: Sequence[int], heat: Sequence[float], n: int) -> set[int]:
    """The n hottest resident experts (those a miss may not evict)."""
    held = sorted((e for e in expert_in if e >= 0), key=lambda e: (-heat[e], e))
    return set(held[:max(0, n)])


def rounds(needed: Sequence[int], resident: Sequence[bool], stream: int) -> list[list[int]]:
    """The experts a layer call needs, in groups run one after the other: the resident ones
    first (no read), then the misses, `stream` per group (each group is read into the stream
    slots, see stream_slots)."""
    hit = [e for e in needed if resident[e]]
    miss = [e for e in needed if not resident[e]]
    return ([hit] if hit else []) + [miss[i:i + stream] for i in range(0, len(miss), stream)]


def victim(expert_in: Sequence[int], heat: Sequence[float], keep: set[int]) -> int:
    """The slot to overwrite: an empty one first, else the one whose expert is coldest and not
    in `keep` (the experts the current group runs); -1 when every slot is kept."""
    best, best_heat = -1, 0.0
    for slot, e in enumerate(expert_in):
        if e < 0:
            return slot
        if e in keep:
            continue
        if best < 0 or heat[e] < best_heat:
            best, best_heat = slot, heat[e]
    return best


def coldest(expert_in: Sequence[int], heat: Sequence[float]) -> float:
    """The heat of the coldest resident expert (0 with an empty slot)."""
    return min((heat[e] if e >= 0 else 0.0) for e in expert_in)


def promotions(layers_heat: Sequence[Sequence[float]], layers_expert_in: Sequence[Sequence[int]],
               busy: set[tuple[int, int]], limit: int, margin: float = 1.25) -> list[tuple[int, int]]:
    """Which (layer position, expert) to read ahead, at most `limit`, hottest gain first: a
    non-resident expert whose heat exceeds `margin` x the coldest resident expert's of its layer
    (the margin keeps two experts of near-equal heat from swapping places every step), not
    already being read or staged (`busy`)."""
    if limit <= 0:
        return []
    cands: list[tuple[float, int, int]] = []
    for li, (heat, expert_in) in enumerate(zip(layers_heat, layers_expert_in)):
        floor = coldest(expert_in, heat)
        held = set(expert_in)
        for e, h in enumerate(heat):
            if e not in held and h > 0 and h > margin * floor and (li, e) not in busy:
                cands.append((h - floor, li, e))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(li, e) for _, li, e in cands[:limit]]
