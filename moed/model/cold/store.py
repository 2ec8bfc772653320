"""ExpertStore: routed experts kept resident by heat, the others read from disk when routed to.

The store is the model's ExpertPlacement (moed/model/context.py, the seam expert parallelism
uses too). Its *units* are the experts this process serves: every expert of the model alone,
or under expert parallelism the rank's S physical slots (the inner RankPlacement's
local_slots, replicas included), each naming the logical expert the disk tier reads for it.
The router's map stays the placement's own (an identity map alone, the group's slot map under
EP, so the order in which a token's k outputs are summed is the all-resident one); the loader
loads only `local_slots` (the first R units of each MoE layer), and each MoE layer's
`ColdExperts` runs rows grouped by unit through its R resident slots (executor.SlotExperts):

  the units with rows -> their misses of few rows run straight from the page cache where
  packread serves (the hotter of them installed as they are read: policy.installs), the
  others read into the coldest slots that hold none of the layer's
  hottest units nor one the call runs (from the page cache on the step thread, by the kernels'
  team where packread serves; else on the miss thread; the step waits, counted, timed), then
  every unit's rows through its slot (one round unless the misses outnumber those slots:
  policy.rounds), with the kernels EP=1 uses.

Alone, `ColdExecutor` groups a layer's routed rows by expert, calls it, and combines each
token's k outputs as the all-resident path does (executor.combine_sorted); under EP the group's
DistributedExperts calls it with the rows this rank received, between its exchanges: a miss
read is local and changes no collective. A row's expert output does not depend on which other
rows share its call (what makes an EP group equal one process bit for bit), and every unit's
rows still go through one call, so the output equals the all-resident run's.

Between steps (`between_steps`, called by the runner before each forward and each empty EP
step, on the step thread, so no layer reads a slot while it changes): every layer's heat
decays and takes the step's counts (the rows each unit received: under EP from every rank, a
replica's share counted for its own slot); then the mover (mover.py), under
`move_bytes_per_step`, puts finished read-aheads and the hottest non-resident units into the
coldest slots: the page-cached ones at once (packread), the others read ahead on a background
thread into private buffers (a slot is only written on the step thread). Misses the page cache
lacks are read on their own thread, waited for with a timeout.

Layer-ahead prefetch (prefetch.py, alone only): a layer call first predicts the next MoE
layer's experts from its input and starts reading them; a miss that a prefetch staged is
installed from its buffer instead of read (ready, or waited for while in flight), into the
victim slot a miss read would take. The staging is within the budget (policy.split_budget).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from moed.model.cold import direct, onednn, packread, policy
from moed.model.cold.executor import ColdExecutor
from moed.model.cold.mover import Mover
from moed.model.cold.prefetch import Prefetcher
from moed.model.cold.reader import ExpertIndex, ExpertReadError
from moed.model.cold.stats import ColdStats, LayerFetch
from moed.model.context import ExpertPlacement
from moed.model.executor import ExpertExecutor, MoEMode, SlotExperts
from moed.model.kernels import rows as kernel_rows
from moed.model.moe import LocalExperts, MoELayer
from moed.model.spec import ModelSpec
from moed.obs import metrics

if TYPE_CHECKING:
    from moed.model.decoder import MoEDecoder

log = structlog.get_logger(__name__)

READ_TIMEOUT_S = 30.0       # a miss read longer than this fails its step (a hung disk)


@dataclass(frozen=True)
class ColdSettings:
    resident_bytes: int             # experts.resident_bytes (> 0 here)
    move_bytes_per_step: int        # experts.move_bytes_per_step
    heat_half_life_steps: float     # experts.heat_half_life_steps
    prefetch_experts: int = 0       # experts.prefetch_experts (-1 auto: policy.split_budget)


class ExpertStore:
    """The model's cold-expert placement: one ColdExperts per MoE layer, the shared reader,
    heat and mover (see the module docstring)."""

    def __init__(self, spec: ModelSpec, index: ExpertIndex, settings: ColdSettings,
                 expert_bytes: int | None = None, inner: ExpertPlacement | None = None) -> None:
        """expert_bytes: one expert's bytes in a slot (quantized experts); default the index's.
        inner: expert parallelism's placement of this rank (its slots are the units tiered
        here; its executor exchanges rows with the group); None: this process serves every
        expert."""
        self.spec, self.index, self.settings, self.inner = spec, index, settings, inner
        self.units: tuple[int, ...] = tuple(range(spec.num_experts)) if inner is None \
            else tuple(inner.local_slots)
        self.num_physical = spec.num_experts if inner is None else inner.num_physical
        self.name = "cold experts" if inner is None else f"{inner.name} with cold experts"
        self.moe_layers = [i for i in range(spec.num_layers) if i not in spec.dense_layers]
        self.expert_bytes = expert_bytes or index.expert_bytes()
        if inner is not None and settings.prefetch_experts > 0:
            raise ValueError("experts.prefetch_experts under expert parallelism is not built yet "
                             "(set it to 0 or -1, auto, which is off there)")
        asked = settings.prefetch_experts if inner is None else 0     # auto: off under EP
        self.slots, staging = policy.split_budget(settings.resident_bytes, self.expert_bytes,
                                                  len(self.moe_layers), len(self.units), asked)
        self.prefetch = Prefetcher(self, staging, self.read_ahead) if staging else None
        self.decay = 0.5 ** (1.0 / settings.heat_half_life_steps)
        # each MoE layer's heat and this step's routed-token counts, a row per layer (views in
        # ColdExperts): decayed and ranked in a few tensor ops a step, not a few per layer
        self.heat = torch.zeros((len(self.moe_layers), len(self.units)), dtype=torch.float64)
        self.window = torch.zeros((len(self.moe_layers), len(self.units)), dtype=torch.long)
        self.layers: list[ColdExperts] = []
        self.stats = ColdStats()
        self.onednn: onednn.OnednnFile | None = None      # refilled slots' oneDNN copies
        self.onednn_off = "unused"          # "": on, else why off
        self._miss_pool = ThreadPoolExecutor(1, thread_name_prefix="moed-expert-miss")
        self.mover = Mover(self)

    # ---- ExpertPlacement ------------------------------------------------------------------
    @property
    def local_slots(self) -> tuple[int, ...]:
        """The logical experts the loader loads: the first R units'."""
        return self.units[:self.slots]

    def expert_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inner is not None:
            return self.inner.expert_map()
        e = self.spec.num_experts
        return torch.arange(e, dtype=torch.long).unsqueeze(1), torch.ones(e, dtype=torch.long)

    def executor(self, local: SlotExperts) -> ExpertExecutor:
        """The next MoE layer's executor (the model builds its layers in order)."""
        if not isinstance(local, LocalExperts):
            raise TypeError(f"cold experts load slots of LocalExperts, not {type(local).__name__}")
        layer = ColdExperts(self, len(self.layers), self.moe_layers[len(self.layers)], local)
        self.layers.append(layer)
        if self.onednn is None and local.onednn_copies(0) and self.onednn_off == "unused":
            off = self.onednn_off = onednn.unavailable() or ""
            self.onednn = None if off else onednn.OnednnFile(self.stats, self.settings.resident_bytes)
            log.info("cold_experts_onednn_file", state=self.onednn_off or "on")
        if self.onednn is not None:
            local.onednn_side = onednn.LayerOnednn(self.onednn, layer.pos, layer.expert_in)
        return ColdExecutor(layer) if self.inner is None else self.inner.executor(layer)

    # ---- reads ----------------------------------------------------------------------------
    def read_slots(self, pos: int, reads: list[tuple[int, int]]) -> None:
        """A round's misses (unit, slot), read straight into their emptied slots (the plain
        weights in place, else packed or quantized into the slot: no private buffer, no second
        copy). What the page cache holds is copied here, on the step thread (read_into with cached:
        it never waits for the disk); only the rest is handed to the miss thread, in one
        hand-off, the step waiting at most READ_TIMEOUT_S (a read the disk must serve can hang; a
        copy from the page cache cannot; handing cached reads off too cost 5% of a cold step:
        docs/cold-experts.md). A read that times out may still write: its slots are lost (never
        used again) rather than reused under it. A read the disk serves wakes the prediction."""
        layer = self.layers[pos]
        local, index, n = layer.local, self.index, layer.layer

        def read(unit: int, slot: int, cached: bool) -> bool:
            e, dst = self.units[unit], local.plain_slot(slot)
            if dst is not None:
                if not index.read_into(n, e, *dst, cached=cached):
                    return False
                local.mark_stale(slot)
                return True
            weights = index.read(n, e, cached, reuse=True)     # fill_slot copies it out
            if weights is None:
                return False
            local.fill_slot(slot, *weights)
            return True

        left = packread.read_packed(index, local, n, [(self.units[u], s) for u, s in reads]) \
            if layer.packread else None     # by the kernels' team, in one call
        rest = [r for r in reads if (self.units[r[0]], r[1]) in left] if left is not None \
            else [(u, s) for u, s in reads if not read(u, s, True)]
        self.stats.cached_reads += len(reads) - len(rest)
        if not rest:
            return
        if self.prefetch is not None:
            self.prefetch.uncached()
        try:
            self._miss_pool.submit(lambda: [read(u, s, False) for u, s in rest]).result(
                timeout=READ_TIMEOUT_S)
        except FutureTimeout:
            for _, slot in rest:
                layer.expert_in[slot] = policy.LOST
            raise ExpertReadError(f"expert weights could not be read from disk within "
                                  f"{READ_TIMEOUT_S:.0f} s (layer {n})") from None

    def attach(self, model: MoEDecoder) -> None:
        """Layer-ahead prediction's hooks into the built model (prefetch.py): its MoE layers'
        routers, and the first layer's input norm for the start-of-step prediction."""
        if self.prefetch is None:
            return
        routers = [ly.mlp.router for ly in model.layers if isinstance(ly.mlp, MoELayer)]
        first = model.layers[0]
        self.prefetch.attach(routers, (first.input_norm, first.eps))
        model.before_layers = self.prefetch.first

    def read_ahead(self, pos: int, unit: int) -> list[torch.Tensor]:
        """One unit's weights in its layer's slot format, in private tensors (a read-ahead)."""
        local = self.layers[pos].local      # slot_format copies packed and quantized slots' reads
        reuse = local.gate_up_p is not None or local.quant is not None
        return local.slot_format(*self.index.read(self.layers[pos].layer, self.units[unit], reuse=reuse))

    # ---- between steps --------------------------------------------------------------------
    def between_steps(self) -> None:
        """Heat, then the mover's installs and read-aheads (mover.py), on the step thread."""
        if self.prefetch is not None:
            self.prefetch.reset()
        self.heat.mul_(self.decay).add_(self.window)       # every layer at once
        self.window.zero_()
        ranks = torch.argsort(self.heat, dim=1, descending=True, stable=True).tolist()
        for layer, heat, rank in zip(self.layers, self.heat.tolist(), ranks):
            layer.cooled(heat, rank)
        self.mover.step()
        self.publish()

    # ---- accounting -----------------------------------------------------------------------
    def resident_bytes(self) -> int:
        return self.slots * len(self.moe_layers) * self.expert_bytes

    def publish(self) -> None:
        total = len(self.units) * len(self.moe_layers) * self.expert_bytes
        staged = (self.mover.staged()
                  + (self.prefetch.held() if self.prefetch is not None else 0)) * self.expert_bytes
        metrics.EXPERT_WEIGHT_RESIDENT_BYTES.labels("resident").set(self.resident_bytes())
        metrics.EXPERT_WEIGHT_RESIDENT_BYTES.labels("staged").set(staged)
        metrics.EXPERT_WEIGHT_RESIDENT_BYTES.labels("disk").set(total - self.resident_bytes())

    def describe(self) -> dict[str, object]:
        """For the start log line."""
        return {"slots_per_layer": self.slots, "experts": len(self.units),
                "placement": self.name, "moe_layers": len(self.moe_layers),
                "expert_bytes": self.expert_bytes, "resident_bytes": self.resident_bytes(),
                "resident_share": round(self.slots / max(len(self.units), 1), 3),
                "move_experts_per_step": self.mover.per_step,
                "prefetch_experts": self.prefetch.capacity if self.prefetch is not None else 0,
                "prefetch": "on" if self.prefetch is not None else
                "off: expert parallelism" if self.inner is not None else "off",
                "heat_half_life_steps": self.settings.heat_half_life_steps}

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        self._miss_pool.shutdown(wait=False, cancel_futures=True)
        self.mover.close()
        self.index.close()
        if self.onednn is not None:
            self.onednn.close()


class ColdExperts:
    """One MoE layer's resident slots (executor.SlotExperts over the store's units): which unit
    each slot holds, the units' heat, and the call that runs rows grouped by unit through the
    slots, reading misses first. Alone a unit is an expert; under EP, one of the rank's slots."""

    def __init__(self, store: ExpertStore, pos: int, layer: int, local: LocalExperts) -> None:
        self.store, self.pos, self.layer, self.local = store, pos, layer, local
        self.packread = packread.serves(store.index, local)
        self.direct = self.packread     # few-row misses run from the page cache (cold/direct.py)
        # the kernels' packed bf16 slots: a round's rows run where they are (kernels/rows.py)
        self.rowwise = local.kernels is not None and local.gate_up_p is not None and local.down_p is not None \
            and local.quant is None
        self.files: dict[int, packread.ExpertFiles | None] = {}     # unit -> its matrices' places
        n, s = len(store.units), store.slots
        self.num_physical = n                           # SlotExperts: the units
        self.expert_in = list(range(s))                 # slot -> unit (-1 empty)
        self.slot_of = list(range(s)) + [-1] * (n - s)  # unit -> slot (-1 not resident)
        self.heat = store.heat[pos]                     # views of the store's [layers, units]
        self.window = store.window[pos]                 # routed tokens since the last step
        self._heat, self.rank = [0.0] * n, list(range(n))   # heat as a list; units hottest first

    def heat_list(self) -> list[float]:
        """The heat as a list (read-only: the same list until the next step's cooled())."""
        return self._heat

    def cooled(self, heat: list[float], rank: list[int]) -> None:
        """Between steps, after the store decayed the heat and added the step's counts: its
        list, and the units hottest first (ties: the lower unit; a stable argsort)."""
        self._heat, self.rank = heat, rank

    def assign(self, slot: int, expert: int) -> None:
        """Slot `slot` holds `expert` (-1: empty) from now on."""
        old = self.expert_in[slot]
        if old >= 0:
            self.slot_of[old] = -1
        self.expert_in[slot] = expert
        if expert >= 0:
            self.slot_of[expert] = slot

    def promote(self, expert: int, weights: list[torch.Tensor]) -> bool:
        """Install a read-ahead expert into the coldest slot, if it is still worth it."""
        if self.slot_of[expert] >= 0:
            return False
        heat = self.heat_list()
        if heat[expert] <= policy.coldest(self.expert_in, heat):
            return False
        slot = policy.victim(self.expert_in, heat, set())
        self.assign(slot, -1)             # empty while written: a failure leaves no stale expert
        self.local.load_slot(slot, weights, repack=False)
        self.assign(slot, expert)
        return True

    def promote_cached(self, units: list[int]) -> list[int]:
        """Units (hottest first) installed from the page cache into the coldest slots now (packread),
        each only if hotter than the expert it evicts -> those the page cache lacked (their
        victim slots are left empty, for the next miss or install)."""
        heat = self.heat_list()
        slots = policy.victims(self.expert_in, heat, set(), len(units))
        pairs = [(u, s) for u, s in zip(units, slots) if self.expert_in[s] < 0 or heat[u] > heat[self.expert_in[s]]]
        for _, slot in pairs:
            self.assign(slot, -1)         # empty while written: a failed read leaves no stale expert
        units_of = self.store.units
        left = packread.read_packed(self.store.index, self.local, self.layer, [(units_of[u], s) for u, s in pairs])
        missed = [u for u, s in pairs if left is None or (units_of[u], s) in left]
        for u, slot in pairs:
            if u not in missed:
                self.assign(slot, u)
        return missed

    def _ensure(self, group: list[int], protect: set[int], n_rows: list[int],
                fetched: LayerFetch, heat: list[float]) -> tuple[int, float]:
        """Every expert of `group` resident, never evicting one of `protect` -> (misses read,
        seconds waited for them). A staged prefetch is installed instead of a read, counted in
        `fetched` as ready (complete when this round needed it) or waited for; one whose read
        failed is read again as a miss (which fails the step as a miss does)."""
        misses = [e for e in group if self.slot_of[e] < 0]
        if not misses:
            return 0, 0.0
        pf = self.store.prefetch
        futs = {e: f for e in misses if (f := pf.take(self.pos, e) if pf else None) is not None}
        done = {e for e, f in futs.items() if f.done()}
        # every miss's slot first, emptied (a failed read leaves no stale expert), so that the
        # reads land in them
        free = policy.victims(self.expert_in, heat, set(group) | protect, len(misses))
        if len(free) < len(misses):         # only after reads that hung lost every slot
            raise ExpertReadError(f"no expert slot left to read into (layer {self.layer})")
        slots = dict(zip(misses, free))
        for e in misses:
            self.assign(slots[e], -1)
        cold = [e for e in misses if e not in futs]
        t0 = time.perf_counter()
        if cold:
            self.store.read_slots(self.pos, [(e, slots[e]) for e in cold])
            for e in cold:
                self.assign(slots[e], e)
        stall = time.perf_counter() - t0
        for e, fut in futs.items():
            t1 = time.perf_counter()
            try:
                weights = fut.result(timeout=READ_TIMEOUT_S)
            except FutureTimeout:
                raise ExpertReadError(f"expert weights could not be read from disk within "
                                      f"{READ_TIMEOUT_S:.0f} s (layer {self.layer})") from None
            except ExpertReadError:
                self.store.stats.read_failed("prefetch")
                weights = []
            if not weights:                 # failed ([]), or page-cached (None): a miss read
                if weights is None:
                    pf.cached_after_all()
                self.store.read_slots(self.pos, [(e, slots[e])])
                self.assign(slots[e], e)
                cold.append(e)
                stall += time.perf_counter() - t1
                continue
            if e in done:
                fetched.ready += 1
                fetched.ready_rows += n_rows[e]
            else:
                fetched.waited += 1
                fetched.wait_s += time.perf_counter() - t1
            self.local.load_slot(slots[e], weights, repack=False)
            self.assign(slots[e], e)
        return len(cold), stall

    def run_grouped(self, xs: torch.Tensor, per_unit: torch.Tensor, mode: MoEMode) -> torch.Tensor:
        """executor.SlotExperts: rows grouped by unit (per_unit [U] rows each, in unit order) ->
        their expert outputs, unweighted, same order; each unit's rows in one call of the
        kernels, as the all-resident slots would run them. Usually one round: the misses read
        first, then every unit run (policy.rounds); the torch path runs each unit's rows in
        place (LocalExperts.expert_rows: no gather, no scatter) unless the kernels serve the
        call's row counts (then one call, as the fused modes)."""
        n_rows = per_unit.tolist()
        self.window += per_unit.to(torch.long)
        needed, start, acc = [u for u, c in enumerate(n_rows) if c], [0] * len(n_rows), 0
        pf = self.store.prefetch
        if xs.shape[0] == 0:
            if pf is not None:
                pf.finish(self.pos, set())
            return xs
        slot_of, heat = self.slot_of, self.heat_list()
        resident = [slot_of[u] >= 0 for u in range(len(n_rows))]
        hits, hit_rows = sum(1 for u in needed if resident[u]), sum(n_rows[u] for u in needed if resident[u])
        for u in needed:
            start[u], acc = acc, acc + n_rows[u]
        if pf is not None:      # misses with a prefetch done first, in flight next, the rest last
            needed.sort(key=lambda u: 0 if resident[u] else pf.state(self.pos, u))
        misses, stall, fetched = 0, 0.0, LayerFetch()
        usable = sum(1 for e in self.expert_in if e != policy.LOST)     # all, unless a read hung
        stream = policy.stream_slots(usable)
        protect, room = set(), 0        # only a call with misses chooses slots
        if hits < len(needed):
            protect = policy.hottest_ranked(self.rank, slot_of, usable - stream)
            room = policy.room(self.expert_in, protect | {u for u in needed if resident[u]})
        outs: dict[int, torch.Tensor] = {}
        # the fused modes, and the torch path where the kernels serve every row count: a round's
        # rows gathered in slot order, one kernel call (not one per expert), scattered back
        one_call = mode != MoEMode.TORCH or self.local.native_serves(n_rows[u] for u in needed)
        ys = torch.empty_like(xs) if one_call else None
        ran: set[int] = set()
        rowwise = one_call and self.rowwise and mode != MoEMode.QFUSED and xs.dtype == torch.bfloat16 \
            and xs.is_contiguous()
        try:
            if one_call and self.direct and xs.dtype == torch.bfloat16 and xs.is_contiguous():
                t0 = time.perf_counter()
                ran = direct.run_misses(self, xs, ys, [u for u in needed if not resident[u] and (
                    pf is None or pf.state(self.pos, u) == 2) and n_rows[u] <= policy.DIRECT_ROWS], n_rows, start,
                    protect | {u for u in needed if resident[u]}, heat)
                misses, stall = len(ran), time.perf_counter() - t0
            for group in policy.rounds([u for u in needed if u not in ran], resident, stream, room):
                m, w = self._ensure(group, protect, n_rows, fetched, heat)
                misses, stall = misses + m, stall + w
                if not one_call:
                    for u in group:
                        outs[u] = self.local.expert_rows(slot_of[u], xs[start[u]:start[u] + n_rows[u]])
                    continue
                by_slot, per_slot = sorted((slot_of[u], u) for u in group), [0] * self.store.slots
                for sl, u in by_slot:
                    per_slot[sl] = n_rows[u]
                order = [r for _, u in by_slot for r in range(start[u], start[u] + n_rows[u])]
                if rowwise:             # the kernels read and write the rows in place
                    lc = self.local
                    kernel_rows.experts_rows(lc.kernels, xs, order, per_slot, lc.gate_up_p, lc.down_p, lc.intermediate, ys)
                    continue
                rows = torch.tensor(order)
                ys[rows] = self.local.run_grouped(xs.index_select(0, rows), per_slot, mode)
        except ExpertReadError:
            self.store.stats.read_failed("miss")
            raise
        finally:
            self.store.stats.count(hits, misses, stall, hit_rows, xs.shape[0], fetched, self.store.expert_bytes)
            if pf is not None:
                pf.finish(self.pos, set(needed))
        return ys if one_call else torch.cat([outs[u] for u in sorted(outs)])
