"""The cold-expert store's decisions, pure (lists, numbers and heat tensors in; lists and numbers out).

Glossary: a *slot* holds one expert's weights in the resident tier; `expert_in[slot]` is the
expert it holds (-1 = empty); `heat[e]` is expert e's routed-token count, decayed per step
(an exponential moving sum); a *miss* is an expert a step needs that no slot holds.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


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


# A miss of at most this many rows in a layer call runs straight from the page cache (cold/direct.py):
# a decode step's misses are one or two rows, a prefill's many of its misses a few. Each 32-row
# block is packed once in L1 for all of a miss's rows; past this many, the slot the miss is read
# into is worth it. Bench model at 30%, AVX2 EPYC (docs/cold-experts.md): prefill 815-828 tok/s
# at 8, 844-856 at 32, 836-864 at 64; decode the same at each.
DIRECT_ROWS = 32


def installs(expert_in: Sequence[int], heat: Sequence[float], keep: set[int], units: Sequence[int],
             n_rows: Sequence[int]) -> list[int]:
    """The slot each of `units` (misses run straight from the page cache) is installed into as
    it is read, or -1: the hottest of them (heat plus this call's rows) take the coldest slots
    that hold none of `keep` (victims), each only if hotter than the expert it evicts (an
    empty slot: always). A miss installed costs one more write of its bytes; one that is not
    costs nothing more, and the mover can still promote it between steps."""
    order = sorted(range(len(units)), key=lambda i: (-(heat[units[i]] + n_rows[units[i]]), units[i]))
    free = victims(expert_in, heat, keep, len(units))
    out = [-1] * len(units)
    for i, slot in zip(order, free):
        old = expert_in[slot]
        if old < 0 or heat[units[i]] + n_rows[units[i]] > heat[old]:
            out[i] = slot
    return out


def hottest(expert_in: Sequence[int], heat: Sequence[float], n: int) -> set[int]:
    """The n hottest resident experts (those a miss may not evict)."""
    held = sorted((e for e in expert_in if e >= 0), key=lambda e: (-heat[e], e))
    return set(held[:max(0, n)])


def hottest_ranked(rank: Sequence[int], slot_of: Sequence[int], n: int) -> set[int]:
    """hottest() from a ranking of every expert, hottest first (ties: the lower expert), made
    once when the heat changes: the first n of it that are resident."""
    out: set[int] = set()
    if n <= 0:
        return out
    for e in rank:
        if slot_of[e] >= 0:
            out.add(e)
            if len(out) == n:
                break
    return out


def rounds(needed: Sequence[int], resident: Sequence[bool], stream: int, room: int = 0) -> list[list[int]]:
    """The experts a layer call needs, in groups run one after the other: the resident ones
    first (no read), then the misses, `stream` per group (each group is read into the stream
    slots, see stream_slots). When the misses fit `room` (the slots a miss may take while every
    resident expert of the call is kept) they are read first and one group runs them all:
    one compute pass over the layer's rows instead of two or more (docs/cold-experts.md)."""
    hit = [e for e in needed if resident[e]]
    miss = [e for e in needed if not resident[e]]
    if miss and hit and len(miss) <= room:
        return [list(needed)]
    return ([hit] if hit else []) + [miss[i:i + stream] for i in range(0, len(miss), stream)]


def room(expert_in: Sequence[int], keep: set[int]) -> int:
    """Slots a miss may be read into while `keep` stays resident (victims' candidates)."""
    return sum(1 for e in expert_in if e != LOST and e not in keep)


LOST = -2       # expert_in of a slot a timed-out read may still write into: never used again


def victim(expert_in: Sequence[int], heat: Sequence[float], keep: set[int]) -> int:
    """The slot to overwrite: an empty one first, else the one whose expert is coldest and not
    in `keep` (the experts the current group runs); -1 when every slot is kept."""
    best, best_heat = -1, 0.0
    for slot, e in enumerate(expert_in):
        if e == LOST or e in keep:
            continue
        if e < 0:
            return slot
        if best < 0 or heat[e] < best_heat:
            best, best_heat = slot, heat[e]
    return best


def victims(expert_in: Sequence[int], heat: Sequence[float], keep: set[int], n: int) -> list[int]:
    """n distinct slots for n misses, chosen before any is read (so each read can land straight
    in its slot): the slots `victim` would pick one after the other, each filled slot then
    holding one of the round's experts (kept): the empty ones in slot order, then the others
    coldest first (ties: the lower slot), in one sort."""
    empty = [slot for slot, e in enumerate(expert_in) if e < 0 and e != LOST and e not in keep]
    if len(empty) >= n:
        return empty[:n]
    held = sorted((heat[e], slot) for slot, e in enumerate(expert_in) if e >= 0 and e not in keep)
    return empty + [slot for _, slot in held[:n - len(empty)]]


def coldest(expert_in: Sequence[int], heat: Sequence[float]) -> float:
    """The heat of the coldest resident expert (0 with an empty slot)."""
    return min(((heat[e] if e >= 0 else 0.0) for e in expert_in if e != LOST), default=0.0)


def promotions(layers_heat: Sequence[Sequence[float] | torch.Tensor] | torch.Tensor, layers_expert_in: Sequence[Sequence[int]],
               busy: set[tuple[int, int]], limit: int, margin: float = 1.25) -> list[tuple[int, int]]:
    """Which (layer position, expert) to read ahead, at most `limit`, hottest gain first (ties:
    lower layer, then lower expert), from each layer's heat (a row each, or the store's [L, E]):
    a non-resident expert whose heat exceeds `margin` x the
    coldest resident expert's of its layer (coldest: the margin keeps two experts of near-equal
    heat from swapping places every step), not already being read or staged (`busy`). Whole
    layers at once in float64 tensor ops (a Python loop over every expert of 16 layers cost
    ~1 ms a step); the same comparisons and order as one would make expert by expert."""
    if limit <= 0 or len(layers_heat) == 0:
        return []
    heat = layers_heat.to(torch.float64) if isinstance(layers_heat, torch.Tensor) \
        else torch.stack([torch.as_tensor(h, dtype=torch.float64) for h in layers_heat])    # [L, E]
    n_layers, n_experts = heat.shape
    slots = torch.tensor([list(ei) for ei in layers_expert_in], dtype=torch.long).view(n_layers, -1)
    held = torch.zeros((n_layers, n_experts + 1), dtype=torch.bool)       # the last column: no expert
    held.scatter_(1, torch.where(slots >= 0, slots, n_experts), True)
    held = held[:, :n_experts]
    of_slot = torch.where(slots == -1, 0.0, heat.gather(1, slots.clamp(min=0)))   # empty: 0
    of_slot[slots == LOST] = float("inf")                                          # lost: ignored
    floor = of_slot.min(1).values if slots.shape[1] else torch.zeros(n_layers, dtype=torch.float64)
    floor = torch.where(torch.isinf(floor), 0.0, floor).unsqueeze(1)               # coldest()
    ok = ~held & (heat > margin * floor) & (heat > 0)
    for li, e in busy:
        ok[li, e] = False
    where, gain = ok.nonzero(), (heat - floor)[ok]          # row-major: (layer, expert) ascending
    pick = torch.sort(-gain, stable=True).indices[:limit]
    return [(li, e) for li, e in where[pick].tolist()]


# experts.prefetch_experts -1: at most this many, and an eighth of the budget. More staging buys
# hit rate with CPU: on bench/cold_experts.py (16 MoE layers, 30% resident, batch 8, 2 threads
# on 2 cores, 2026-12-05, docs/cold-experts.md) expert reads in memory in steady state were
# 72% / 82% / 94% with 0 / 16 / 48 staged, and decode 0.53x / 0.43x / 0.31x all-resident: the
# unused reads take the cores the experts compute on. 16 keeps the loss small. Re-measured with
# the one-thread packing (coldmiss, staging page-cached experts too): 48 staged 92.9% in memory,
# decode 0.40x; none 73.0%, 0.63x (2nd halves).
AUTO_STAGING = 16


def split_budget(resident_bytes: int, expert_bytes: int, moe_layers: int, num_units: int,
                 staging: int) -> tuple[int, int]:
    """(slots per layer, prefetch staging in experts) for a resident budget: the staging's bytes
    (`staging` experts; -1 = auto, min(AUTO_STAGING, an eighth of the budget's experts)) come
    out of the budget, so slots + staging stay within resident_bytes. A budget that holds every
    unit needs no staging (0); one whose remainder after an explicit staging holds less than one
    expert per MoE layer: ValueError naming the minimum."""
    slots = slots_per_layer(resident_bytes, expert_bytes, moe_layers, num_units)
    if staging < 0:
        staging = min(AUTO_STAGING, resident_bytes // expert_bytes // 8,
                      resident_bytes // expert_bytes - moe_layers)
    if slots >= num_units or staging <= 0:
        return slots, 0
    need = expert_bytes * (moe_layers + staging)
    if resident_bytes < need:
        raise ValueError(f"experts.resident_bytes {resident_bytes} holds less than one expert per "
                         f"MoE layer beside the prefetch staging: the minimum is {need} "
                         f"({moe_layers} layers + experts.prefetch_experts {staging}, x "
                         f"{expert_bytes} bytes an expert; or set experts.prefetch_experts = 0)")
    return slots_per_layer(resident_bytes - staging * expert_bytes, expert_bytes, moe_layers,
                           num_units), staging


def prefetch_setting(setting: int, ep_size: int) -> int:
    """experts.prefetch_experts as the store takes it: -1 (auto, sized by split_budget) in one
    process, 0 under expert parallelism (prediction is not built there; the config rules refuse
    an explicit value > 0 there), else the setting."""
    return 0 if setting < 0 and ep_size > 1 else setting


def prefetch_picks(predicted_rows: Sequence[int], resident: Sequence[bool], busy: set[int],
                   limit: int) -> list[int]:
    """Which predicted units to read ahead, at most `limit`: those a layer's prediction routes
    rows to (predicted_rows[u] > 0) that are not resident nor already being read (`busy`), the
    most predicted rows first (ties: lower unit)."""
    if limit <= 0:
        return []
    cands = [u for u, n in enumerate(predicted_rows) if n > 0 and not resident[u] and u not in busy]
    cands.sort(key=lambda u: (-predicted_rows[u], u))
    return cands[:limit]



def prediction_rest(predicted: bool, checked: int, uncached: bool, rested: int, probe_every: int) -> int:
    """Steps layer-ahead prediction has rested after this step (0: it predicts in the next).
    Prediction pays only for experts the page cache lacks (a cached one is left to its miss)
    and costs a router pass per MoE layer on the step thread, so after a step whose `checked`
    (> 0) experts were all page-cached it rests, and predicts one step in every `probe_every`
    to look again. A step that needed the disk (`uncached`: a check or a miss) ends a rest."""
    if uncached:
        return 0
    if rested:
        return 0 if rested + 1 >= probe_every else rested + 1
    return 1 if predicted and checked else 0
