"""Expert load balancer (EPLB): which logical expert each physical expert slot holds, so that the
ranks of an expert-parallel group do about the same work. Pure functions on CPU tensors; nothing
here touches weights, processes or clocks.

Glossary
- *layer*: one MoE layer. Every function works on all L layers at once (one row each).
- *logical* expert: what the router picks (E per layer).
- *slot*: a physical expert, one copy of one logical expert's weights on one rank. P slots per
  layer (E + redundant slots); slot s lives on rank s // (P // G).
- *replicas* of an expert: the slots holding it. Its tokens are split evenly over them
  (`model.experts_route.split_over_replicas`), so each carries load / replicas.
- *rank*: one process of the EP group (G), P // G slots each. *node*: one machine, ranks
  [n·G/N, (n+1)·G/N) (N nodes). *group*: experts [k·E/K, (k+1)·E/K) (K groups, default E).
- *load* [L, E]: tokens routed to each logical expert over a window (the engine's expert-load
  window). *rank load*: the sum over a rank's slots of load[expert] / replicas[expert].
- *balancedness* (per layer) = mean rank load / max rank load: 1.0 is perfect (an idle layer
  counts as 1.0); the step waits for the busiest rank, so 1/balancedness is the MoE slowdown.
- *moved* slots: slots whose logical expert differs between two maps; each loads new weights,
  so moved × expert bytes is what a rebalance transfers.

Map format (`ExpertMap`), the three tensors DeepSeek's EPLB returns:
    physical_to_logical [L, P] int64     slot → logical expert
    logical_to_physical [L, E, R] int64  expert → its slots, ascending, padded with -1 (R = the
                                         most replicas of any expert): the Router's table
    replicas            [L, E] int64     slots per expert (>= 1)
Every map built here has: each expert on >= 1 slot, no two replicas of one expert on one rank
(they would split its tokens without spreading its work), P // G slots on every rank.

`rebalance_from_scratch` (the peer) is DeepSeek's published algorithm, written anew: replicate
the expert with the highest load per replica until the slots are filled, then pack slots onto
ranks heaviest first, each onto the least-loaded rank with room; hierarchical (N > 1): pack
expert groups onto nodes the same way, then replicate and pack within each node. One deviation:
a rank that already holds an expert is skipped for its other replicas (DeepSeek's can co-locate
them), with a one-swap repair when only such ranks have room.

`rebalance` (the default) is migration-aware: it solves against the current map. Replica counts
come from the same rule; then every slot whose expert is still wanted keeps it (an expert with
fewer replicas than before keeps those on the lightest ranks; in the hierarchical variant a group
stays on the node holding most of it), only the freed slots are filled (the same greedy), and
pair swaps off the busiest rank (each moves two slots) run only until the layer is within
`min_gain` of the balancedness the from-scratch packing reaches. A layer changes only if its
predicted gain (balancedness of the new map minus the current one's, both under the window's
load) exceeds `min_gain`: one threshold for "not worth moving weights for", both ways.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

_NEG = float("-inf")


@dataclass(frozen=True)
class ExpertMap:
    """Which logical expert every slot holds, in all three forms (see the module docstring)."""
    physical_to_logical: torch.Tensor   # [L, P] int64
    logical_to_physical: torch.Tensor   # [L, E, R] int64, -1 padded
    replicas: torch.Tensor              # [L, E] int64
    num_ranks: int

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_logical(self) -> int:
        return self.replicas.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @classmethod
    def from_physical(cls, physical_to_logical: torch.Tensor, num_logical: int,
                      num_ranks: int) -> ExpertMap:
        """physical_to_logical [L, P] → the map; every expert in [0, num_logical) must have a slot."""
        p2l = physical_to_logical.to(torch.long)
        if p2l.dim() != 2 or num_ranks < 1 or p2l.shape[1] % num_ranks:
            raise ValueError(f"physical_to_logical must be [layers, slots] with slots a multiple "
                             f"of the {num_ranks} ranks, got {list(p2l.shape)}")
        n_layers, n_phys = p2l.shape
        if int(p2l.min()) < 0 or int(p2l.max()) >= num_logical:
            raise ValueError(f"physical_to_logical holds ids outside [0, {num_logical})")
        replicas = torch.zeros(n_layers, num_logical, dtype=torch.long)
        replicas.scatter_add_(1, p2l, torch.ones_like(p2l))
        if bool((replicas == 0).any()):
            raise ValueError("some logical expert has no slot")
        # slots ordered by (expert, slot): each expert's slots are then contiguous and ascending
        order = torch.argsort(p2l * n_phys + torch.arange(n_phys), dim=1)
        expert = p2l.gather(1, order)
        starts = replicas.cumsum(1) - replicas                         # [L, E]
        within = torch.arange(n_phys).expand(n_layers, -1) - starts.gather(1, expert)
        l2p = torch.full((n_layers, num_logical, int(replicas.max())), -1, dtype=torch.long)
        l2p[torch.arange(n_layers).unsqueeze(1), expert, within] = order
        return cls(p2l.contiguous(), l2p, replicas, num_ranks)

    @classmethod
    def identity(cls, num_layers: int, num_logical: int, num_ranks: int) -> ExpertMap:
        """Slot e holds expert e (P = E, no replicas): the layout a checkpoint loads with."""
        p2l = torch.arange(num_logical).expand(num_layers, -1)
        return cls.from_physical(p2l, num_logical, num_ranks)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's router table: (logical_to_physical [E, R], replicas [E])."""
        return self.logical_to_physical[i], self.replicas[i]


@dataclass(frozen=True)
class Rebalance:
    """What `rebalance` decided, per layer."""
    map: ExpertMap           # the map to install (the current one in layers not changed)
    changed: torch.Tensor    # [L] bool: this layer's map changes
    before: torch.Tensor     # [L] balancedness of the current map under the window's load (nan: none)
    after: torch.Tensor      # [L] balancedness of `map` under the window's load
    gain: torch.Tensor       # [L] predicted gain of the candidate map (also where skipped)
    moved: torch.Tensor      # [L] int64 slots whose expert changes (new weights to load)


def rank_loads(load: torch.Tensor, emap: ExpertMap) -> torch.Tensor:
    """load [L, E] → [L, G]: tokens each rank serves when replicas split their expert's evenly."""
    p2l = emap.physical_to_logical
    per_slot = load.double().gather(1, p2l) / emap.replicas.gather(1, p2l).double()
    return per_slot.view(p2l.shape[0], emap.num_ranks, -1).sum(-1)


def balancedness(load: torch.Tensor, emap: ExpertMap) -> torch.Tensor:
    """[L] mean rank load / max rank load (1.0 for a layer with no load)."""
    rl = rank_loads(load, emap)
    top = rl.max(1).values
    return torch.where(top > 0, rl.mean(1) / top.clamp_min(1e-300), torch.ones_like(top))


def moved_slots(old: ExpertMap, new: ExpertMap) -> torch.Tensor:
    """[L] slots whose logical expert differs between the two maps."""
    return (old.physical_to_logical != new.physical_to_logical).sum(1)


def replicate(load: torch.Tensor, num_slots: int, max_replicas: int) -> torch.Tensor:
    """load [X, n] → replicas [X, n] summing to num_slots per row: one each, then each extra slot
    to the expert with the highest load per replica (ties: lowest id), at most max_replicas."""
    x, n = load.shape
    if not n <= num_slots <= n * max_replicas:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts at <= {max_replicas} replicas each")
    reps = torch.ones(x, n, dtype=torch.long)
    rows, w = torch.arange(x), load.double()
    for _ in range(num_slots - n):
        score = (w / reps).masked_fill(reps >= max_replicas, _NEG)
        reps[rows, score.argmax(1)] += 1
    return reps


def align(new: ExpertMap, current: ExpertMap) -> ExpertMap:
    """`new` with each rank's slots permuted so that an expert the rank already holds keeps its
    slot: same work per rank, fewest moved slots. (A from-scratch map ignores slot order.)"""
    _check_same_shape(new, current)
    spr, out = new.slots_per_rank, new.physical_to_logical.clone()
    for layer in range(new.num_layers):
        cur, nxt = current.physical_to_logical[layer].tolist(), out[layer].tolist()
        for base in range(0, new.num_physical, spr):
            row = _align_rank(nxt[base:base + spr], cur[base:base + spr])
            out[layer, base:base + spr] = torch.tensor(row)
    return ExpertMap.from_physical(out, new.num_logical, new.num_ranks)


def rebalance_from_scratch(load: torch.Tensor, num_physical: int, num_ranks: int,
                           num_nodes: int = 1, num_groups: int | None = None) -> ExpertMap:
    """DeepSeek's EPLB (the peer): load [L, E] → a new map, ignoring any current placement.
    num_groups (default E) must be a multiple of num_nodes when num_nodes > 1."""
    p2l = _balance(load, None, num_physical, num_ranks, num_nodes, num_groups)
    return ExpertMap.from_physical(p2l, load.shape[1], num_ranks)


def rebalance(load: torch.Tensor, current: ExpertMap | None, *, num_physical: int | None = None,
              num_ranks: int | None = None, num_nodes: int = 1, num_groups: int | None = None,
              min_gain: float = 0.0) -> Rebalance:
    """Migration-aware EPLB: load [L, E] and the current map → the map to install. Without a
    current map it places from scratch (num_physical and num_ranks then required). min_gain: a
    layer whose predicted gain in balancedness does not exceed it keeps its current map (unless
    that map puts two replicas of an expert on one rank), and swaps stop this close to the
    from-scratch packing's balancedness."""
    if current is not None:
        num_physical = current.num_physical if num_physical is None else num_physical
        num_ranks = current.num_ranks if num_ranks is None else num_ranks
        if (num_physical, num_ranks) != (current.num_physical, current.num_ranks):
            raise ValueError("num_physical/num_ranks differ from the current map's")
        if current.physical_to_logical.shape[0] != load.shape[0] or current.num_logical != load.shape[1]:
            raise ValueError("load [layers, experts] does not match the current map")
    if num_physical is None or num_ranks is None:
        raise ValueError("num_physical and num_ranks are required without a current map")
    if min_gain < 0:
        raise ValueError("min_gain must be >= 0")
    n_layers, n_logical = load.shape
    cur = None if current is None else current.physical_to_logical
    cand = ExpertMap.from_physical(_balance(load, cur, num_physical, num_ranks, num_nodes, num_groups,
                                            slack=min_gain), n_logical, num_ranks)
    cand_b = balancedness(load, cand)
    if current is None:
        ones = torch.ones(n_layers, dtype=torch.bool)
        nan = torch.full((n_layers,), float("nan"), dtype=torch.float64)
        return Rebalance(cand, ones, nan, cand_b, nan, torch.full((n_layers,), num_physical))
    before = balancedness(load, current)
    gain = cand_b - before
    changed = (gain > min_gain) | _colocated(current)
    p2l = torch.where(changed.unsqueeze(1), cand.physical_to_logical, current.physical_to_logical)
    out = ExpertMap.from_physical(p2l, n_logical, num_ranks)
    return Rebalance(out, changed, before, torch.where(changed, cand_b, before), gain,
                     moved_slots(current, out))


# ---- internals ------------------------------------------------------------------------------

def _check_same_shape(a: ExpertMap, b: ExpertMap) -> None:
    if a.physical_to_logical.shape != b.physical_to_logical.shape or a.num_ranks != b.num_ranks:
        raise ValueError("the two maps differ in layers, slots or ranks")


def _colocated(emap: ExpertMap) -> torch.Tensor:
    """[L] bool: some rank holds two replicas of one expert (such a layer is always replaced)."""
    p2l = emap.physical_to_logical
    key = (torch.arange(emap.num_physical) // emap.slots_per_rank) * emap.num_logical + p2l
    return (key.sort(1).values.diff(dim=1) == 0).any(1)


def _align_rank(new: list[int], cur: list[int]) -> list[int]:
    """new's experts, reordered so those also in cur sit where cur has them."""
    want = list(new)
    out = [-1] * len(new)
    for s, e in enumerate(cur):
        if e in want:
            out[s] = e
            want.remove(e)
    rest = iter(want)
    return [e if e >= 0 else next(rest) for e in out]


def _balance(load: torch.Tensor, current: torch.Tensor | None, num_physical: int, num_ranks: int,
             num_nodes: int, num_groups: int | None, slack: float = 0.0) -> torch.Tensor:
    """load [L, E], current [L, P] or None (from scratch) → physical_to_logical [L, P]. With a
    current map, swaps stop `slack` short of the from-scratch packing's balancedness."""
    if load.dim() != 2:
        raise ValueError("load must be [layers, experts]")
    n_layers, n_exp = load.shape
    groups = n_exp if num_groups is None else num_groups
    p, g, n = num_physical, num_ranks, num_nodes
    if min(p, g, n, groups) < 1 or p % g or g % n or groups % n or n_exp % groups:
        raise ValueError(f"need ranks | slots, nodes | ranks, nodes | groups, groups | experts; got "
                         f"{p} slots, {g} ranks, {n} nodes, {groups} groups, {n_exp} experts")
    spr, rpn, spn, epn = p // g, g // n, p // n, n_exp // n
    if not epn <= spn <= epn * rpn:
        raise ValueError(f"{spn} slots per node cannot hold its {epn} experts with at most one "
                         f"replica per rank ({rpn} ranks per node)")
    if bool((load < 0).any()):
        raise ValueError("load must be >= 0")
    w = load.double()
    node_experts = _assign_nodes(w, current, spn, n, groups, slack) if n > 1 else \
        torch.arange(n_exp).expand(n_layers, 1, n_exp)                            # [L, N, E/N]
    # one domain per (layer, node): the node's experts on the node's ranks
    experts = node_experts.reshape(n_layers * n, epn)
    dom_load = w.gather(1, node_experts.reshape(n_layers, -1)).view(n_layers * n, epn)
    reps = replicate(dom_load, spn, rpn)
    weights, counts = dom_load.tolist(), reps.tolist()
    currents = [_empty(rpn, spr)] * (n_layers * n)
    if current is not None:     # current slots in domain-local ids (-1: not this domain's expert)
        local = torch.full((n_layers * n, n_exp), -1, dtype=torch.long)
        local.scatter_(1, experts, torch.arange(epn).expand(n_layers * n, -1))
        currents = local.gather(1, current.reshape(n_layers * n, spn)).view(-1, rpn, spr).tolist()
    packed = _pack_all(weights, counts, currents, slack if current is not None else None)
    return experts.gather(1, packed.view(n_layers * n, spn)).view(n_layers, p)


def _assign_nodes(w: torch.Tensor, current: torch.Tensor | None, spn: int, n: int,
                  groups: int, slack: float) -> torch.Tensor:
    """Hierarchical step 1: groups → nodes, K/N groups each. → each node's experts [L, N, E/N]
    (ascending). With a current map a group starts on the node holding most of its slots."""
    n_layers, n_exp = w.shape
    gsize, gpn = n_exp // groups, groups // n
    gload = w.view(n_layers, groups, gsize).sum(-1)
    currents = [_empty(n, gpn)] * n_layers
    if current is not None:
        slot_node = torch.arange(current.shape[1]) // spn
        votes = torch.zeros(n_layers, groups * n, dtype=torch.long)
        votes.scatter_add_(1, (current // gsize) * n + slot_node, torch.ones_like(current))
        homes = votes.view(n_layers, groups, n).argmax(2).tolist()      # ties: the lowest node
        currents = []
        for home in homes:
            rows = [[k for k in range(groups) if home[k] == b][:gpn] for b in range(n)]
            currents.append([row + [-1] * (gpn - len(row)) for row in rows])
    nodes = _pack_all(gload.tolist(), [[1] * groups] * n_layers, currents,
                      slack if current is not None else None)                  # [L, N, K/N]
    members = nodes.unsqueeze(3) * gsize + torch.arange(gsize)                  # [L, N, K/N, gsize]
    return members.view(n_layers, n, -1).sort(2).values


def _empty(bins: int, cap: int) -> list[list[int]]:
    return [[-1] * cap for _ in range(bins)]


def _bins_balancedness(bins: list[list[int]], weight: list[float], count: list[int]) -> float:
    loads = [sum(weight[i] / count[i] for i in row) for row in bins]
    top = max(loads)
    return sum(loads) / len(loads) / top if top > 0 else 1.0


def _pack_all(weights: list[list[float]], counts: list[list[int]], currents: list[list[list[int]]],
              slack: float | None) -> torch.Tensor:
    """`_pack` for D same-shaped domains → items [D, B, C]. slack None: from scratch (greedy
    only); else keep what `currents` allow, then swap until each domain is within slack of the
    balancedness its from-scratch greedy reaches."""
    packed = [_pack(w, c, cur) for w, c, cur in zip(weights, counts, currents)]
    items = torch.tensor(packed, dtype=torch.long)
    if slack is None:
        return items
    n_bins, cap = items.shape[1:]
    target = torch.tensor([_bins_balancedness(_pack(w, c, _empty(n_bins, cap)), w, c) - slack
                           for w, c in zip(weights, counts)], dtype=torch.float64)
    u = torch.tensor(weights, dtype=torch.float64) / torch.tensor(counts, dtype=torch.float64)
    return _swap_toward(items, u, target)


def _pack(weight: list[float], count: list[int], current: list[list[int]]) -> list[list[int]]:
    """Place count[i] copies of item i into the bins (len(current) bins of len(current[0])
    slots; sum(count) slots in all), never two copies in one bin; each copy weighs
    weight[i] / count[i]. current[b][s]: the item bin b's slot s holds now (-1: none), kept
    where the counts allow. Then the free slots are filled heaviest copy first, each onto the
    least-loaded bin with room that lacks the item. → bins[b][s] = item."""
    n_bins, cap = len(current), len(current[0])
    u = [w / c for w, c in zip(weight, count)]
    bins = _empty(n_bins, cap)
    holds: list[set[int]] = [set() for _ in range(n_bins)]
    loads = [0.0] * n_bins
    # keep: an item with fewer copies than it has now stays in the bins that are lightest now
    holders: dict[int, list[tuple[int, int]]] = {}
    for b, row in enumerate(current):
        seen: set[int] = set()
        for s, i in enumerate(row):
            if i >= 0 and i not in seen:
                seen.add(i)
                holders.setdefault(i, []).append((b, s))
    now = [sum(u[i] for i in set(row) if i >= 0) for row in current]
    kept = [0] * len(weight)
    for i, places in holders.items():
        for b, s in sorted(places, key=lambda bs: (now[bs[0]], bs[0]))[:count[i]]:
            bins[b][s] = i
            holds[b].add(i)
            loads[b] += u[i]
            kept[i] += 1
    # fill the free slots
    todo = sorted(((i for i in range(len(weight)) for _ in range(count[i] - kept[i]))),
                  key=lambda i: (-u[i], i))
    free = [[s for s in range(cap - 1, -1, -1) if bins[b][s] < 0] for b in range(n_bins)]
    heap = [(loads[b], b) for b in range(n_bins) if free[b]]
    heapq.heapify(heap)
    for i in todo:      # the heap holds (load, bin) of every bin with a free slot, once each
        skipped = []
        while heap and i in holds[heap[0][1]]:
            skipped.append(heapq.heappop(heap))
        repaired = not heap
        if repaired:    # every bin with room holds i: make room in another bin
            b = _make_room(i, bins, holds, loads, free, u)
        else:
            b = heapq.heappop(heap)[1]
            for entry in skipped:
                heapq.heappush(heap, entry)
        bins[b][free[b].pop()] = i
        holds[b].add(i)
        loads[b] += u[i]
        if repaired:    # the repair changed other bins' loads: rebuild
            heap = [(loads[x], x) for x in range(n_bins) if free[x]]
            heapq.heapify(heap)
        elif free[b]:
            heapq.heappush(heap, (loads[b], b))
    return bins


def _make_room(i: int, bins: list[list[int]], holds: list[set[int]], loads: list[float],
               free: list[list[int]], u: list[float]) -> int:
    """Every bin with a free slot already holds i. Move some item f from a full bin h lacking i
    into such a bin g (g lacks f), freeing a slot of h for i; → h. One exists: h holds cap
    distinct items, g at most cap - 1, so some item of h is not in g (and f != i)."""
    rooms = sorted((b for b in range(len(bins)) if free[b]), key=lambda b: (loads[b], b))
    fulls = sorted((b for b in range(len(bins)) if i not in holds[b]), key=lambda b: (loads[b], b))
    for g in rooms:
        for h in fulls:
            for s, f in sorted(enumerate(bins[h]), key=lambda sf: (u[sf[1]], sf[0])):
                if f not in holds[g]:
                    bins[g][free[g].pop()] = f
                    holds[g].add(f)
                    loads[g] += u[f]
                    bins[h][s] = -1
                    holds[h].discard(f)
                    loads[h] -= u[f]
                    free[h].append(s)
                    return h
    raise AssertionError("no bin can make room (more copies of an item than bins?)")


def _swap_toward(items: torch.Tensor, u: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """items [D, B, C] (D domains of B bins × C slots), u [D, n] the weight of one copy of each
    item, target [D] → items after swaps. In every domain still short of its target, swap one
    slot of the busiest bin with one of another bin (neither gaining a second copy), the pair
    that lowers the larger of the two loads most; a domain stops at its target or when no swap
    helps. Each swap strictly lowers the domain's sum of squared loads, so this terminates.
    The domains still swapping step together, so the work is one small batch per swap round."""
    items = items.clone()
    n_dom, n_bins, cap = items.shape
    w = u.gather(1, items.view(n_dom, -1)).view(n_dom, n_bins, cap)
    loads = w.sum(2)
    holds = torch.zeros(n_dom, n_bins, u.shape[1], dtype=torch.bool)
    holds.scatter_(2, items, True)
    mean = loads.mean(1)                    # swaps move load between bins, never change it
    act = torch.arange(n_dom)
    bins = torch.arange(n_bins).view(1, n_bins, 1)
    for _ in range(n_bins * cap):
        top, a = loads[act].max(1)
        keep = (top > 0) & (mean[act] < target[act] * top)
        act, top, a = act[keep], top[keep], a[keep]
        if act.numel() == 0:
            break
        n_act, dom = act.numel(), act.view(-1, 1, 1)
        w_s, items_s = w[act], items[act]                                     # [A, B, C]
        d = w_s[torch.arange(n_act), a].view(n_act, cap, 1, 1) - w_s.unsqueeze(1)    # [A, C(a), B, C]
        worse = torch.maximum(top.view(-1, 1, 1, 1) - d, loads[act].view(n_act, 1, n_bins, 1) + d)
        item_a = items_s[torch.arange(n_act), a].unsqueeze(1)                 # [A, 1, C(a)]
        b_has_x = holds[dom, bins, item_a]                                    # [A, B, C(a)]
        a_has_y = holds[dom, a.view(-1, 1, 1), items_s]                       # [A, B, C]
        ok = (d > 0) & ~b_has_x.transpose(1, 2).unsqueeze(3) & ~a_has_y.unsqueeze(1)
        best_val, best = worse.masked_fill_(~ok, float("inf")).view(n_act, -1).min(1)
        go = best_val < top * (1 - 1e-12)
        act, best, a = act[go], best[go], a[go]
        if act.numel() == 0:
            break
        x, b, y = best // (n_bins * cap), best // cap % n_bins, best % cap
        ix, iy = items[act, a, x], items[act, b, y]
        items[act, a, x], items[act, b, y] = iy, ix
        w[act, a, x], w[act, b, y] = u[act, iy], u[act, ix]
        holds[act, a, ix], holds[act, b, iy] = False, False
        holds[act, a, iy], holds[act, b, ix] = True, True
        loads[act, a], loads[act, b] = w[act, a].sum(1), w[act, b].sum(1)
    return items
