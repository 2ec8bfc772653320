"""MoE layer = a router (which experts, with what weight) + an expert executor (run them, combine).

Router: softmax top-k over the router logits (renormalised where the spec says), then logical
expert -> physical slot through `logical_to_physical` ([E, R] table, `num_replicas` [E]): one
replica each in one process (identity); expert parallelism and EPLB replicas change only the
table. A replicated expert's tokens are numbered per expert and split modulo its replicas,
offset by the call count (model/experts_route.py; the CPU kernel does the same). It also
counts tokens per logical expert (the runner's expert-load counter). The expert balancer
swaps a slot's weights in place (`LocalExperts.load_slot`) before the layer's map switches.

ExpertExecutor: given each token's physical experts and weights, runs the experts and returns
the weighted sum. `LocalExperts` holds every physical expert in this process: tokens sorted by
physical expert, each touched expert runs one gate_up and one down matmul on its contiguous
slice, results scattered back with index_add_ (no per-token Python loop); one or two tokens
skip the sort and the scatter (each touched expert in turn: decode, a batch-1 verify step).
Expert parallelism (an `ExpertPlacement`, moed/parallel) wraps the rank's LocalExperts into an
executor that dispatches tokens to the ranks holding their slots and combines the results; the router then
maps logical experts to the group's physical slots, and the fused kernel's two halves run on
either side of the exchange (MoELayer._parallel).

On CPU bf16 with local experts, every batch (decode and prefill alike) takes the native kernel
(moed/model/kernels) instead: router, map, load count and expert math in one call that reads
each touched expert once per chunk of its tokens, instead of ~60 small torch ops (the grouped
path's sort, gathers, per-expert calls, activation and scatter cost ~30% of a prefill step's
MoE time beside its matmuls). Where the measured kernel choice (kernels/choice.py) says oneDNN
multiplies an expert's rows faster at the batch's rows per expert (many tokens on an AMX CPU),
the grouped path serves instead, each expert's gate_up and down one oneDNN matmul over its
tokens (fused_serves).

Quantized experts (QuantWeight slots) with the kernels loaded: batches of up to 64 tokens run
the experts and the weighted sum in one native call (moed_moe_q, kernels/quant.py;
LocalExperts.qfused_serves; bf16 models routed in the same call by the bf16 kernel's router,
fp32 ones by the torch Router first), the experts bf16 bitwise equal to the per-expert path (one
native quantized matmul per expert matrix, torch between them). Larger bf16 batches (prefill)
take the same call blocked (LocalExperts.qblocked_serves): each touched expert's weights
dequantized once to bf16 and all its rows through the bf16 prefill kernel, bitwise equal to the
per-expert path on the blocked matmul; fp32 ones and expert parallelism the per-expert path.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import structlog
import torch
import torch.nn.functional as F

from moed.model.context import ComputeContext, ExpertPlacement
from moed.model.executor import ExpertExecutor, MoEMode, Routing
from moed.model.kernels import BLOCK as PACK_BLOCK
from moed.model.kernels import CpuKernels
from moed.model.kernels import quant as kq
from moed.model.kernels.choice import ONEDNN_ROWS_HINT, LinearChoice
from moed.model.kernels.pack import pack_copy, pack_into
from moed.model.layers import Linear
from moed.model.quant.quantize import quantize
from moed.model.quant.weight import QuantWeight, cat_rows
from moed.model.router import Router
from moed.model.spec import ModelSpec

log = structlog.get_logger(__name__)

def fused_serves(tokens: int, top_k: int, num_physical: int, expert_choice: LinearChoice | None) -> bool:
    """Whether the fused kernel serves a batch: unless the expert matmuls at this batch's rows
    per expert (tokens * top_k spread over the experts, even routing assumed) are a row class
    that oneDNN serves faster (kernels/choice.py; an AMX CPU): then the grouped path runs each
    expert's rows as one oneDNN matmul."""
    rows = max(1, -(-tokens * top_k // max(num_physical, 1)))
    return expert_choice is None or not expert_choice.use_onednn(rows)


class OnednnSide(Protocol):
    """Where a slot's oneDNN copies are restored from instead of packed (cold/onednn.py)."""
    def restore(self, slot: int, copies: list[torch.Tensor]) -> bool: ...
    def keep(self, slot: int, copies: list[torch.Tensor]) -> None: ...


class LocalExperts(ExpertExecutor):
    """Every physical expert in this process, as slices of the fused weights."""

    def __init__(self, gate_up: torch.Tensor | QuantWeight, down: torch.Tensor | QuantWeight, pack: bool,
                 kernels: CpuKernels | None, packed: tuple[torch.Tensor, torch.Tensor] | None,
                 quant_kernels: CpuKernels | None = None) -> None:
        """gate_up [P, 2I, H] (gate half first); down [P, H, I]; packed: the kernels' copies of
        both (then the only ones kept: the plain tensors are held by nothing and freed).
        Quantized (QuantWeight): each expert's Linear is a view of its slot, with quant_kernels
        the native quantized matmul per expert call (layers.Linear), else the reference path."""
        self.num_physical, self.intermediate = gate_up.shape[0], down.shape[2]
        self.quant = (gate_up, down) if isinstance(gate_up, QuantWeight) else None
        self.kernels = kernels if packed is not None else None   # FUSED mode needs their copies
        self.gate_up_p: torch.Tensor | None = None
        self.down_p: torch.Tensor | None = None
        if packed is not None:
            self.gate_up_p, self.down_p = packed
            self.experts = [(Linear(gate_up[e], pack=pack, kernels=kernels, kpacked=self.gate_up_p[e]),
                             Linear(down[e], pack=pack, kernels=kernels, kpacked=self.down_p[e]))
                            for e in range(self.num_physical)]
        else:
            self.experts = [(Linear(gate_up[e], pack=pack, kernels=quant_kernels),
                             Linear(down[e], pack=pack, kernels=quant_kernels)) for e in range(self.num_physical)]
        # slots loaded without their oneDNN copies re-packed (load_slot(repack=False)): packed
        # again the first time a call would read those copies
        self.stale: set[int] = set()
        # the cold-expert store's side file of packed copies (cold/onednn.py): a re-pack
        # restores a slot's copies from it when it can, and keeps a fresh pack there
        self.onednn_side: OnednnSide | None = None
        # Quantized experts the native kernels read: the whole layer in one call (moed_moe_q)
        # for batches whose every expert call the per-expert path serves natively (qrows:
        # QUANT_MAX_ROWS; prefill keeps the per-expert path). Not under batch invariance (qrows
        # unbounded there): fp32 SiLU differs from torch's by an ulp, so a row's bits would
        # depend on whether its batch is past MAX_ROWS.
        self.qkernels = None
        self.qrows = 0
        if self.quant is not None and quant_kernels is not None and not kq.experts_unserved(*self.quant) \
                and all(lin.qpath == "native" for lin in self.experts[0]) \
                and self.experts[0][0].qrows <= kq.MAX_ROWS:
            self.qkernels = quant_kernels
            self.qrows = self.experts[0][0].qrows
        # bf16 batches past qrows (prefill): moed_moe_q blocked, each touched expert's weights
        # dequantized once per call to bf16 (the per-expert path's numerics past MAX_ROWS)
        self.qblocked = self.qkernels is not None and self.experts[0][0].qblocked \
            and not kq.experts_blocked_unserved(*self.quant)

    def __call__(self, x: torch.Tensor, routing: Routing, mode: MoEMode = MoEMode.TORCH) -> torch.Tensor:
        """The torch path, or for quantized experts one moed_moe_q call where qfused_serves
        (mode is for EP executors; the bf16 fused path is MoELayer's one call)."""
        t, k = routing.physical.shape
        if self.qfused_serves(x) or self.qblocked_serves(x):
            return kq.moe_q(self.qkernels, x, routing.physical, routing.weights, *self.quant,
                            t == 1 and not routing.replicated, t > self.qrows)
        # a few tokens on the kernels: one moed_experts_bf16 call below (an expert's at most t
        # rows are native classes), not one pass per touched expert
        few = t <= 2 and self.native_serves(range(1, t + 1))
        if t == 1 and not routing.replicated and not few:
            return self._single_token(x, routing)
        if t == 2 and k <= 2 and not routing.replicated and not few:
            return self._two_tokens(x, routing)
        phys = routing.physical.reshape(-1)
        order = torch.argsort(phys, stable=True)
        per_slot = torch.bincount(phys, minlength=self.num_physical)
        token = order // k
        if few:
            ys = self.kernels.experts_bf16(x.index_select(0, token), per_slot, self.gate_up_p, self.down_p,
                                           self.intermediate)
        else:
            ys = self._grouped(x.index_select(0, token), per_slot.tolist())     # one host sync
        ws = routing.weights.reshape(-1).index_select(0, order).unsqueeze(1)
        out = torch.zeros((t, x.shape[1]), dtype=x.dtype, device=x.device)
        return out.index_add_(0, token, ys * ws)

    def run_grouped(self, xs: torch.Tensor, per_slot: torch.Tensor | list[int], mode: MoEMode) -> torch.Tensor:
        """executor.SlotExperts: rows grouped by slot (per_slot rows each) -> their expert outputs,
        as EP=1's path for `mode` computes them (what an expert-parallel rank runs for its sources)."""
        if mode == MoEMode.FUSED:
            if self.kernels is None:
                raise RuntimeError("a peer ran the fused CPU kernel path and this rank cannot")
            return self.kernels.experts_bf16(xs, per_slot, self.gate_up_p, self.down_p, self.intermediate)
        if mode == MoEMode.QFUSED:       # each row its own token, weight 1: its unweighted output
            if self.qkernels is None:
                raise RuntimeError("a peer ran the fused quantized MoE kernel and this rank cannot")
            if xs.shape[0] == 0:
                return xs
            slots = torch.repeat_interleave(torch.arange(self.num_physical), torch.as_tensor(per_slot).cpu()).unsqueeze(1)
            return kq.moe_q(self.qkernels, xs, slots, torch.ones_like(slots, dtype=xs.dtype), *self.quant, True)
        return self._grouped(xs, per_slot if isinstance(per_slot, list) else per_slot.tolist())

    def qfused_serves(self, x: torch.Tensor) -> bool:
        """Whether moed_moe_q serves a batch x [T, H] (the mode EP=1 runs it in: QFUSED)."""
        return self.qkernels is not None and 0 < x.shape[0] <= self.qrows \
            and x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"

    def qblocked_serves(self, x: torch.Tensor) -> bool:
        """Whether moed_moe_q's blocked mode serves x [T, H]: bf16 past qrows, EP=1 only (an
        expert-parallel rank's rows are not the batch's, so it keeps the per-expert path)."""
        return self.qkernels is not None and self.qblocked and x.shape[0] > self.qrows and x.dtype == torch.bfloat16 and x.device.type == "cpu"

    def native_serves(self, counts: Iterable[int]) -> bool:
        """Whether moed_experts_bf16 serves expert calls of these row counts: the kernels'
        packed copies are kept and the measured choice gives none of those row classes to
        oneDNN. Its numbers are the per-expert Linears' on the kernels bit for bit (gate/up,
        silu, the product and down each rounded to bf16 as torch rounds them), so an expert's
        rows get the same bits in one call for the layer as in a call of their own."""
        if self.kernels is None:
            return False
        gate_up, down = self.experts[0]
        return not any(gate_up.uses_onednn(n) or down.uses_onednn(n) for n in set(counts) if n)

    def _grouped(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by expert (counts[e] rows each) -> unweighted outputs, same order: one
        kernel call for them all where it serves every count (~10x fewer torch ops per layer),
        else one pass per touched expert."""
        if xs.shape[0] and self.native_serves(counts):
            return self.kernels.experts_bf16(xs, counts, self.gate_up_p,
                                             self.down_p, self.intermediate)
        ys, start = [], 0
        for e, n in enumerate(counts):           # one pass per touched expert, never per token
            if n == 0:
                continue
            ys.append(self.expert_rows(e, xs[start:start + n]))
            start += n
        return torch.cat(ys)

    def expert_rows(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """Slot `slot`'s unweighted output for its rows x [n, H] (one call of its Linears: the
        grouped torch path's, which the cold-expert store calls slot by slot)."""
        if x.shape[0] and self.native_serves([x.shape[0]]):     # the bits the all-slot call gives
            return self.kernels.experts_bf16(x, torch.tensor([x.shape[0]]), self.gate_up_p[slot:slot + 1],
                                             self.down_p[slot:slot + 1], self.intermediate)
        gate_up, down = self._expert(slot, x.shape[0])
        g, u = gate_up(x).chunk(2, dim=-1)
        return down(F.silu(g) * u)

    def slot_weights(self, slot: int) -> list[torch.Tensor]:
        """The tensors that hold physical slot `slot` (what the expert balancer moves between
        ranks): the kernels' packed gate_up and down when kept, else the plain weights."""
        if self.gate_up_p is not None and self.down_p is not None:
            return [self.gate_up_p[slot], self.down_p[slot]]
        if self.quant is not None:      # data, scales (and zeros) of both: moved whole
            return [t for w in self.quant for t in w[slot].tensors()]
        return [lin.weight for lin in self.experts[slot]]

    def slot_format(self, gate_up: torch.Tensor, down: torch.Tensor) -> list[torch.Tensor]:
        """One expert's plain weights (gate_up [2I, H] gate half first, down [H, I], the compute
        dtype; quantized slots: the checkpoint's dtype) in this executor's slot layout, what
        load_slot takes: the kernels' packing where they are kept, or the quantized parts
        (pure: the cold-expert store calls it off the step thread)."""
        if self.quant is not None:      # quantized as the loader quantizes: each checkpoint matrix
            half = gate_up.shape[0] // 2
            gu, dn = self.quant
            parts = [quantize(gate_up[:half], gu.fmt, gu.group), quantize(gate_up[half:], gu.fmt, gu.group)]
            return cat_rows(parts).tensors() + quantize(down, dn.fmt, dn.group).tensors()
        if self.gate_up_p is not None:
            return [pack_copy(gate_up, self.kernels), pack_copy(down, self.kernels)]
        return [gate_up, down]

    def plain_slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Slot `slot`'s own (gate_up, down) when it holds the plain weights (a read can land in
        them: then mark_stale), or None (packed or quantized: fill_slot)."""
        if self.gate_up_p is not None or self.quant is not None:
            return None
        gate_up, down = (lin.weight for lin in self.experts[slot])
        return (gate_up, down) if gate_up.is_contiguous() and down.is_contiguous() else None

    def mark_stale(self, slot: int) -> None:
        """The slot's plain weights were overwritten in place: its oneDNN copies are packed again
        the first time a call reads them (load_slot's repack=False)."""
        self.stale.add(slot)

    def fill_slot(self, slot: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """load_slot(slot, slot_format(gate_up, down), repack=False) with the kernels' packing
        written straight into the slot (one copy, no packed buffer between)."""
        if self.gate_up_p is None or any(w.shape[-2] % PACK_BLOCK for w in (gate_up, down)):
            self.load_slot(slot, self.slot_format(gate_up, down), repack=False)
            return
        for dst, w in ((self.gate_up_p[slot], gate_up), (self.down_p[slot], down)):
            pack_into(w, dst, self.kernels)
        self.stale.add(slot)

    def load_slot(self, slot: int, weights: list[torch.Tensor], repack: bool = True) -> None:
        """Overwrite slot `slot` with another expert's weights (slot_weights' shapes), in place,
        at a step boundary; oneDNN copies are re-packed from the new plain weights now, or with
        repack=False the first time a call reads them (the cold-expert store's misses: most of
        their calls are 1-2 rows, which never read them; the re-pack is ~2/3 of a miss)."""
        if self.quant is not None:      # the experts' Linears are views of these slots
            for dst, src in zip(self.slot_weights(slot), weights, strict=True):
                dst.copy_(src)
            return
        for dst, src in zip(self.slot_weights(slot), weights, strict=True):
            dst.copy_(src)
        self.stale.add(slot)
        if repack:
            self._repack(slot)

    def _repack(self, slot: int) -> None:
        side = self.onednn_side
        if side is None or not side.restore(slot, self.onednn_copies(slot)):
            for dst, lin in zip(self.slot_weights(slot), self.experts[slot], strict=True):
                if lin.packed is not None:   # with kernels, the plain weight comes back from dst
                    plain = lin.weight if lin.weight is not None else lin.kernels.unpack(dst, lin.out_features)
                    lin.packed = torch.ops.mkldnn._reorder_linear_weight(plain, ONEDNN_ROWS_HINT)
            if side is not None:
                side.keep(slot, self.onednn_copies(slot))
        self.stale.discard(slot)

    def onednn_copies(self, slot: int) -> list[torch.Tensor]:
        """Slot `slot`'s oneDNN-packed copies (none on the kernels-only and quantized paths)."""
        return [lin.packed for lin in self.experts[slot] if lin.packed is not None]

    def _expert(self, e: int, rows: int) -> tuple[Linear, Linear]:
        """Slot e's two Linears for a call of `rows` rows, its oneDNN copies fresh if it reads them."""
        pair = self.experts[e]
        if self.stale and e in self.stale and (pair[0].uses_onednn(rows) or pair[1].uses_onednn(rows)):
            self._repack(e)
        return pair

    def _single_token(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Batch-1 decode: no sort/scatter, just the k experts in turn (~10% less MoE time)."""
        weights, out = routing.weights, None
        for j, e in enumerate(routing.physical[0].tolist()):
            gate_up, down = self._expert(e, 1)
            g, u = gate_up(x).chunk(2, dim=-1)
            y = down(F.silu(g) * u) * weights[:, j:j + 1]
            out = y if out is None else out + y
        return out

    def _two_tokens(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Two tokens (batch 1 verifying one draft, batch-2 decode): each touched expert in turn
        on its rows, no sort or scatter: ~15% less expert time than the sorted path on the demo
        model (from 3 tokens on that path is as fast or faster). Its numbers: an expert's rows
        in one call, a token's two weighted terms added (the sorted path's index_add_ sums a
        token's terms in fp32 from a zero: the same sum for two, not for three; and an exact -0
        may come out +0 there)."""
        k, x = routing.physical.shape[1], x.contiguous()
        by: dict[int, list[int]] = {}           # expert -> its (token * k + j), ascending
        for n, e in enumerate(routing.physical.reshape(-1).tolist()):
            by.setdefault(e, []).append(n)
        xs, ws = x.split(1), routing.weights.reshape(-1, 1).split(1)
        out: list[torch.Tensor | None] = [None, None]
        for e in sorted(by):
            ns = by[e]
            gate_up, down = self._expert(e, len(ns))
            g, u = gate_up(xs[ns[0] // k] if len(ns) == 1 else x).chunk(2, dim=-1)   # both: x's order
            ys = down(F.silu(g) * u)
            for m, n in enumerate(ns):
                y = (ys if len(ns) == 1 else ys[m:m + 1]) * ws[n]
                i = n // k
                out[i] = y if out[i] is None else out[i] + y
        return torch.cat(out)


_logged_quantized = False


def _log_quantized_experts(fmt: str, native: bool) -> None:
    global _logged_quantized
    if not _logged_quantized:
        per_call = (f"moed_moe_q (one native call per layer), past {kq.MAX_ROWS} bf16 tokens blocked (each "
                    "expert dequantized once to bf16)" if native
                    else "the reference path dequantizes per expert call")
        log.info("moe_quantized_path", reason=f"{fmt} experts: {per_call}")
        _logged_quantized = True


class MoELayer:
    def __init__(self, spec: ModelSpec, router: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, load: torch.Tensor, ctx: ComputeContext,
                 placement: ExpertPlacement | None = None, fused: bool = True) -> None:
        """router [E, H]; gate_up [P, 2I, H] (gate half first); down [P, H, I]; load [E] int64
        (this layer's row of the runner's expert-load counter, updated in place). ctx.pack: plus
        oneDNN copies per expert (CPU bf16); ctx.kernels: the native CPU kernels, which serve a
        batch in one fused call (fused_serves). placement: expert parallelism (then
        gate_up/down hold only this rank's slots, [S, ...]). fused=False: the native kernels
        serve the router's and each expert's matmuls, never the fused call (a router the fused
        kernel does not compute: deepseek_v3's grouped sigmoid)."""
        h, i = router.shape[1], down.shape[2]
        self.hidden = h
        k = ctx.kernels if ctx.kernels is not None and h % 2 == 0 and i % 2 == 0 else None
        qk = ctx.for_weight(gate_up) if isinstance(gate_up, QuantWeight) else None
        if isinstance(gate_up, QuantWeight) and ctx.device.type == "cpu":
            _log_quantized_experts(gate_up.fmt, qk is not None)
            k = None
        self.kernels = k if fused else None     # the fused fast path; None: router then executor
        if k is not None:
            # The kernels' packed copies serve the fused path and the experts' skinny matmuls.
            self.router_p, gate_up_p, down_p = (k.pack(w) for w in (router, gate_up, down))
            linear = Linear(router, pack=ctx.pack, kernels=k, kpacked=self.router_p)
            self.experts = LocalExperts(gate_up, down, ctx.pack, k, (gate_up_p, down_p))
        else:
            linear = Linear(router, pack=ctx.pack)
            self.experts = LocalExperts(gate_up, down, ctx.pack, None, None, qk)
        # bf16 quantized experts on moed_moe_q: routed in the same call by the bf16 MoE kernel's
        # router (moed_moe_q_routed), its packed copy beside the torch Router's weight
        self.qroute = None
        if self.experts.qkernels is not None and ctx.kernels is not None and router.dtype == torch.bfloat16 \
                and h % 2 == 0:
            self.qroute = ctx.kernels
            self.router_p = ctx.kernels.pack(router)
        self.placement = placement
        if placement is None:
            self.router = Router(router, spec, gate_up.shape[0], load, linear)
        else:
            self.router = Router(router, spec, placement.num_physical, load, linear)
            self.router.set_expert_map(*placement.expert_map())
            self.dist = placement.executor(self.experts)

    def resident_bytes(self) -> int:
        """Bytes of the expert weights this process holds for this layer (tensors, not config)."""
        e = self.experts
        if e.gate_up_p is not None and e.down_p is not None:
            return e.gate_up_p.nbytes + e.down_p.nbytes
        if e.quant is not None:
            return sum(w.nbytes for w in e.quant)
        return sum(lin.weight.nbytes for pair in e.experts for lin in pair if lin.weight is not None)

    def set_expert_map(self, logical_to_physical: torch.Tensor, num_replicas: torch.Tensor) -> None:
        self.router.set_expert_map(logical_to_physical, num_replicas)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.placement is not None:
            return self._parallel(x)
        if self.fused(x.shape[0]):
            r, e = self.router, self.experts
            return self.kernels.moe_bf16(x, self.router_p, r.num_experts, r.top_k, r.norm_topk,
                                         r.logical_to_physical, r.num_replicas, r.load,
                                         e.gate_up_p, e.down_p, e.intermediate, r.next_offset())
        if self.qroute is not None and (self.experts.qfused_serves(x) or self.experts.qblocked_serves(x)):
            return kq.moe_q_routed(self.experts.qkernels, x, self.router_p, self.router, *self.experts.quant,
                                   x.shape[0] > self.experts.qrows)
        return self.experts(x, self.router(x))

    def fused(self, tokens: int) -> bool:
        """Whether the fused kernel serves a batch of this many tokens (fused_serves)."""
        return self.kernels is not None and fused_serves(tokens, self.router.top_k, self.router.num_physical,
                                                         self.experts.experts[0][0].choice)

    def _parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: route here as EP=1 would (the fused kernel's router half where
        the fused kernel serves, else the torch router), then dispatch/compute/combine over the
        group."""
        from_kernel = self.fused(x.shape[0])
        qfused = not from_kernel and self.experts.qfused_serves(x)
        r = self.router
        rk = self.kernels if from_kernel else self.qroute if qfused else None    # moed_moe_q_routed's router
        if rk is not None:
            phys, w = rk.route_bf16(x, self.router_p, r.num_experts, r.top_k, r.norm_topk,
                                    r.logical_to_physical, r.num_replicas, r.load, r.num_physical, r.next_offset())
            routing = Routing(w, phys, r.logical_to_physical.shape[1] > 1)
        else:
            routing = r(x)
        mode = MoEMode.FUSED if from_kernel else MoEMode.QFUSED if qfused else MoEMode.TORCH
        return self.dist(x, routing, mode)

    def empty_step(self, dtype: torch.dtype) -> None:
        """Take part in this layer's exchange with no tokens (a rank with no work this step)."""
        if self.placement is None:
            return
        dev = self.router.logical_to_physical.device
        x = torch.empty((0, self.hidden), dtype=dtype, device=dev)
        empty = torch.empty((0, self.router.top_k), dtype=torch.long, device=dev)
        self.dist(x, Routing(empty.to(dtype), empty, False),
                  MoEMode.FUSED if self.kernels is not None else MoEMode.TORCH)
