"""Rebalancer: the expert balancer (EPLB, moed.balance.experts) on a running expert-parallel group.

A rebalance, as every rank lives it (the collectives on the step thread, between two forward
passes, in the same step on every rank, so each one is matched):
  window    the engine's expert-load windows (`subscribe_expert_load`) add up here, per rank
  collect   rank 0's clock says parallel.eplb_interval_s passed (only rank 0's clock counts); it
            says COLLECT in the step agreement (one more integer), so every rank learns it in
            the same step, and after that step's forward one all_reduce(SUM) of the windows
            [L, E] gives every rank the group's load; rank 0 runs the migration-aware
            `rebalance` (min_gain = parallel.eplb_min_gain) against the maps in use on a worker
            thread, so the steps go on meanwhile
  publish   once it is done rank 0 says PUBLISH; after that step every rank receives the new
            physical -> logical map [L, P] (one broadcast); layers whose map does not change
            are left alone
  apply     in layer order, in chunks: each slot whose expert changes gets the new expert's
            weights from a slot that holds it under the old map (on its own rank: a local copy;
            else one peer, batched isend/irecv). A layer's moves are cut into chunks of at most
            parallel.eplb_step_mb per rank (sent + received + copied; one move at least), and
            each step posts chunks up to that budget (of at most eplb_layers_per_step layers):
            the transfers are posted after one step and run during the next forward (which only
            reads the slots); after that step they are waited for and kept aside. Once a
            layer's last chunk is in, its slots are written (and the CPU kernels' packed
            copies), then its router table and dispatch layout switch. Tokens see a layer's old
            map or its new one, never half of one, and no step moves more than the budget:
            the transfers share the forward's cores and links, so a step during a rebalance
            stays as long as one outside it
  idle      until the next interval
The old map always holds every expert (EPLayout refuses one that does not), so some rank always
has the weights: the checkpoint is not read again.
"""
from __future__ import annotations

import datetime
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
import torch.distributed as dist

from moed.balance.experts import ExpertMap, Rebalance, balancedness, rebalance
from moed.obs import metrics
from moed.parallel.group import GroupFailed
from moed.parallel.layout import EPLayout

log = structlog.get_logger(__name__)

COLLECT, PUBLISH = 1, 2     # rank 0's word in the step agreement (moed.parallel.agree)


@dataclass(frozen=True)
class Move:
    """Slot `slot` (new map) takes its expert's weights from slot `source` (old map)."""
    slot: int
    source: int


def plan_moves(old: EPLayout, new: EPLayout) -> list[Move]:
    """The weight copies that turn old into new (one layer), the same on every rank. Only slots
    whose expert changes move; the source is a slot of the same rank when one holds the expert
    under the old map (no network), else the holder that has sent the fewest so far (spreads
    the sends over replicas), lowest slot first."""
    if (old.num_experts, old.num_physical, old.ep_size) != (new.num_experts, new.num_physical, new.ep_size):
        raise ValueError("layouts of different shapes")
    holders = old.replicas()
    sends = [0] * old.num_physical
    moves = []
    for p, (was, now) in enumerate(zip(old.slot_expert, new.slot_expert)):
        if was == now:
            continue
        rank = new.rank_of(p)
        local = [q for q in holders[now] if old.rank_of(q) == rank]
        src = local[0] if local else min(holders[now], key=lambda q: (sends[q], q))
        sends[src] += 1
        moves.append(Move(p, src))
    return moves


@dataclass(frozen=True)
class Chunk:
    """Some of one layer's moves, posted in one step; `last`: the layer switches after it."""
    layer: int
    moves: tuple[tuple[int, Move], ...]     # (index of the move in the layer's plan, move)
    cost: tuple[int, ...]                   # bytes each rank sends + receives + copies
    last: bool


def plan_chunks(layer: int, old: EPLayout, new: EPLayout, slot_bytes: int,
                budget: int) -> list[Chunk]:
    """Layer `layer`'s moves (plan_moves, in order) cut into chunks whose cost on every rank is
    at most `budget` bytes (a single move over it is a chunk of its own; 0 = one chunk): the
    same cut on every rank, as it depends only on the maps."""
    moves = plan_moves(old, new)
    chunks: list[Chunk] = []
    cur: list[tuple[int, Move]] = []
    cost = [0] * new.ep_size
    for n, m in enumerate(moves):
        add = [0] * new.ep_size
        dst, src = new.rank_of(m.slot), old.rank_of(m.source)
        add[dst] += slot_bytes
        if src != dst:
            add[src] += slot_bytes
        if cur and budget > 0 and max(c + a for c, a in zip(cost, add)) > budget:
            chunks.append(Chunk(layer, tuple(cur), tuple(cost), False))
            cur, cost = [], [0] * new.ep_size
        cur.append((n, m))
        cost = [c + a for c, a in zip(cost, add)]
    # the last chunk switches the layer (one with no moves: a map whose slots only reorder
    # the router's replica table still switches)
    chunks.append(Chunk(layer, tuple(cur), tuple(cost), True))
    return chunks


def router_map(layout: EPLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's table for layout: logical_to_physical [E, R] (padded with each expert's
    first slot) and num_replicas [E]."""
    reps = layout.replicas()
    width = max(len(r) for r in reps)
    table = [r + [r[0]] * (width - len(r)) for r in reps]
    return (torch.tensor(table, dtype=torch.long, device=device),
            torch.tensor([len(r) for r in reps], dtype=torch.long, device=device))


class Rebalancer:
    def __init__(self, layers: list[tuple[int, Any]], layout: EPLayout, rank: int, interval_s: float,
                 min_gain: float, layers_per_step: int, timeout_s: float,
                 device: torch.device, step_bytes: int = 0) -> None:
        """layers: (model layer index, its moed.model.moe.MoELayer) of every MoE layer, in
        order (a layer has `experts`, `dist`, `router` and `set_expert_map`); layout: the map
        they start with; device: the group's (collectives' tensors live there); step_bytes:
        the most expert-weight bytes a rank moves per step (0: whole layers)."""
        self.device = device
        self.index = [i for i, _ in layers]
        self.layers = [layer for _, layer in layers]
        self.rank = rank
        self.interval_s, self.min_gain, self.per_step = interval_s, min_gain, layers_per_step
        self.step_bytes = step_bytes
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.maps = [layout] * len(layers)            # the map each layer uses now
        self.window = torch.zeros((len(layers), layout.num_experts), dtype=torch.long)
        self.pending: list[Chunk] = []                  # decided, not posted yet
        self._inflight: list[_Transfer] = []            # posted, finished after the next step
        self._staged: dict[int, _Transfer] = {}         # layer -> chunks in, not switched yet
        self._new: dict[int, EPLayout] = {}             # layer -> the map it switches to
        self.last = time.monotonic()
        self.started = 0.0
        self.rebalances = 0             # applied (every changed layer switched)
        self.decisions = 0              # published, applied or not
        self.bytes_moved = {"peer": 0, "local": 0}
        self._load = self.window.clone()
        self._decision: Future[Rebalance] | None = None       # rank 0: the balancer running
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moed-eplb",
                                        initializer=_yield_to_steps)

    # ---- on the event loop, between steps --------------------------------------------------
    def add_load(self, load: torch.Tensor) -> None:
        """An expert-load window [model layers, E] from the engine: keep the MoE layers' rows."""
        self.window += load[self.index].to(torch.long)

    def wanted(self) -> int:
        """What this rank says in the step agreement (only rank 0 speaks, so the group's sum is
        rank 0's word): COLLECT when the interval passed, PUBLISH when its decision is ready."""
        if self.rank != 0 or self.busy or self.interval_s <= 0:
            return 0
        if self._decision is not None:
            return PUBLISH if self._decision.done() else 0
        return COLLECT if time.monotonic() - self.last >= self.interval_s else 0

    def request(self) -> str:
        """An operator's "now" (rank 0, on the loop): the next decision does not wait for the
        interval. "requested", or "under way" when one is being decided or applied."""
        if self.busy or self._decision is not None:
            return "under way"
        self.last = float("-inf")
        return "requested"

    @property
    def busy(self) -> bool:
        """A step of this rebalance runs after every working step (the same on every rank)."""
        return bool(self.pending or self._inflight)

    def _next_chunks(self) -> list[Chunk]:
        """This step's chunks, in order: while every rank's cost stays within step_bytes (one
        chunk at least) and they touch at most per_step layers; the same on every rank."""
        out: list[Chunk] = []
        cost: list[int] = []
        layers: set[int] = set()
        while self.pending:
            c = self.pending[0]
            total = [a + b for a, b in zip(cost, c.cost)] if cost else list(c.cost)
            over = self.step_bytes > 0 and max(total) > self.step_bytes
            if out and (over or (c.layer not in layers and len(layers) >= self.per_step)):
                break
            out.append(self.pending.pop(0))
            cost, layers = total, layers | {c.layer}
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- on the step thread, after a forward pass, in the same step on every rank ----------
    def step(self, signal: int) -> None:
        """signal: the agreement's (rank 0's) COLLECT, PUBLISH or 0 (then one step of the
        rebalance under way, if any)."""
        if signal == COLLECT and not self.busy:
            self._collect()
        elif signal == PUBLISH and not self.busy:
            self._publish()
        elif self.busy:
            for t in self._inflight:        # posted after the last step: finish (switch)
                self._finish(t)
            self._inflight = [self._post(c) for c in self._next_chunks()]
            metrics.EPLB_LAYERS_PENDING.set(len({c.layer for c in self.pending} |
                                                {t.layer for t in self._inflight}))
            if not self.busy:
                self.rebalances += 1
                metrics.EPLB_REBALANCES.labels("applied").inc()
                metrics.EPLB_DURATION.observe(time.monotonic() - self.started)
                log.info("eplb_rebalanced", seconds=round(time.monotonic() - self.started, 3),
                         bytes_moved=dict(self.bytes_moved))

    def _current(self) -> ExpertMap:
        lay = self.maps[0]
        p2l = torch.tensor([m.slot_expert for m in self.maps], dtype=torch.long)
        return ExpertMap.from_physical(p2l, lay.num_experts, lay.ep_size)

    def _collect(self) -> None:
        """Sum the group's windows; rank 0 starts the balancer off the step thread (it takes
        tens of ms at 8 layers x 16 experts: a whole decode step on the bench model)."""
        self.last, self.started = time.monotonic(), time.monotonic()
        load = self.window.to(self.device, copy=True)    # (on CPU .to() alone would alias it)
        self.window.zero_()
        try:
            dist.all_reduce(load)
        except RuntimeError as e:
            raise GroupFailed(f"expert rebalance failed: {_first_line(e)}") from None
        self._load = load.cpu()
        if self.rank == 0:          # rank 0 decides; a pure function of the summed load
            self._decision = self._pool.submit(rebalance, self._load, self._current(),
                                               min_gain=self.min_gain)

    def _publish(self) -> None:
        """Rank 0's decision to every rank; the changed layers become pending."""
        lay, current = self.maps[0], self._current()
        out = torch.zeros((len(self.layers), lay.num_physical + 1), dtype=torch.long)
        if self.rank == 0:
            assert self._decision is not None
            decision, self._decision = self._decision, None
            try:
                res = decision.result()
                out[:, 0] = res.changed.to(torch.long)
                out[:, 1:] = res.map.physical_to_logical
            except Exception:       # a balancer bug keeps the maps; it does not fail the group
                log.exception("eplb_decision_failed")
                out[:, 1:] = current.physical_to_logical
        try:
            sent = out.to(self.device)
            dist.broadcast(sent, src=0)
            out = sent.cpu()
        except RuntimeError as e:
            raise GroupFailed(f"expert rebalance failed: {_first_line(e)}") from None
        self.decisions += 1
        load, changed = self._load, out[:, 0].bool()
        new = ExpertMap.from_physical(out[:, 1:], lay.num_experts, lay.ep_size)
        before, after = balancedness(load, current), balancedness(load, new)
        for i in range(len(self.layers)):
            name = str(self.index[i])
            metrics.EPLB_BALANCEDNESS.labels(name, "before").set(float(before[i]))
            metrics.EPLB_BALANCEDNESS.labels(name, "after").set(float(after[i]))
        self._new = {i: EPLayout.from_slots(lay.num_experts, lay.ep_size, out[i, 1:].tolist())
                     for i in range(len(self.layers)) if bool(changed[i])}
        self.pending = [c for i, new_map in self._new.items()
                        for c in plan_chunks(i, self.maps[i], new_map, self._slot_bytes(i),
                                             self.step_bytes)]
        metrics.EPLB_LAYERS_PENDING.set(len(self._new))
        log.info("eplb_decided", tokens=int(load.sum()), layers_changed=len(self._new),
                 balancedness_before=round(float(before.mean()), 4),
                 balancedness_after=round(float(after.mean()), 4))
        if not self.pending:
            metrics.EPLB_REBALANCES.labels("unchanged").inc()

    def _slot_bytes(self, i: int) -> int:
        return _nbytes(self.layers[i].experts.slot_weights(0))

    def _post(self, chunk: Chunk) -> _Transfer:
        """A chunk of layer i's moves: start moving the weights of its slots (local copies now;
        peer transfers posted, not waited for: they run during the next forward, which only
        reads the slots they read; no slot of the layer is written before its last chunk)."""
        i = chunk.layer
        layer, old, new = self.layers[i], self.maps[i], self._new[i]
        experts, s, r = layer.experts, new.slots_per_rank, self.rank
        t = _Transfer(i, new, last=chunk.last)
        ops = []
        for n, m in chunk.moves:
            dst, src = new.rank_of(m.slot), old.rank_of(m.source)
            tag = 2 * (i * new.num_physical + n)       # unique among the layers in flight
            if dst == r and src == r:       # copied now: the source slot may be overwritten
                t.incoming[m.slot] = [w.clone() for w in experts.slot_weights(m.source % s)]
            elif dst == r:
                t.incoming[m.slot] = [torch.empty_like(w) for w in experts.slot_weights(m.slot % s)]
                t.from_peer.add(m.slot)
                ops += [dist.P2POp(dist.irecv, b, src, tag=tag + j) for j, b in enumerate(t.incoming[m.slot])]
            elif src == r:
                ops += [dist.P2POp(dist.isend, w.contiguous(), dst, tag=tag + j)
                        for j, w in enumerate(experts.slot_weights(m.source % s))]
        if ops:
            try:
                t.works = dist.batch_isend_irecv(ops)
            except RuntimeError as e:
                raise GroupFailed(f"expert weights transfer failed: {_first_line(e)}") from None
        return t

    def _finish(self, t: _Transfer) -> None:
        """Wait for a chunk's transfers; after the layer's last, write its slots and switch its
        map."""
        try:
            for work in t.works:
                work.wait(self.timeout)
        except RuntimeError as e:       # a peer died or stalled mid-move
            raise GroupFailed(f"expert weights transfer failed: {_first_line(e)}") from None
        staged = self._staged.setdefault(t.layer, _Transfer(t.layer, t.new))
        staged.incoming.update(t.incoming)
        staged.from_peer |= t.from_peer
        if not t.last:
            return
        del self._staged[t.layer], self._new[t.layer]
        layer, new, s = self.layers[t.layer], t.new, t.new.slots_per_rank
        for p, bufs in staged.incoming.items():     # every buffer is in: now the slots change
            layer.experts.load_slot(p % s, bufs)
            source = "peer" if p in staged.from_peer else "local"
            self.bytes_moved[source] += _nbytes(bufs)
            metrics.EPLB_BYTES_MOVED.labels(source).inc(_nbytes(bufs))
        layer.dist.set_layout(new)
        layer.set_expert_map(*router_map(new, layer.router.logical_to_physical.device))
        self.maps[t.layer] = new
        # replicas per rank now differ by layer: the gauge shows the mean over MoE layers
        metrics.EP_EXPERT_SLOTS.labels("redundant").set(
            sum(m.redundant_slots(self.rank) for m in self.maps) / len(self.maps))


@dataclass
class _Transfer:
    """A chunk of one layer's weight moves in flight (posted after one step, finished after the
    next), or a layer's chunks that are in (staged until its last)."""
    layer: int
    new: EPLayout
    last: bool = False
    incoming: dict[int, list[torch.Tensor]] = field(default_factory=dict)   # slot -> buffers
    from_peer: set[int] = field(default_factory=set)
    works: list[Any] = field(default_factory=list)


def _yield_to_steps() -> None:
    """The balancer's thread runs at the lowest priority (Linux nice values are per thread, and
    threads it starts inherit it): on busy cores it waits for the step's threads instead of
    stretching the steps it overlaps (it takes tens of ms, a whole decode step)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):       # not Linux, or not allowed: run as is
        pass


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.nbytes for t in ts)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
