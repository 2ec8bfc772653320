"""DistributedExperts: the ExpertExecutor of an expert-parallel rank.

One MoE layer on rank r of N, for its T tokens' k choices each ("rows"):
  1. header   all_to_all_single of [N, S+1] int64: per destination, rows per slot of that
              rank, and this rank's compute mode (equal splits) -> what every source sends us
  2. dispatch all_to_all_single of the rows' hidden states, grouped by slot (uneven splits;
              zero-length ones are fine: a rank with no tokens still serves its experts)
  3. compute  local experts on the received rows, grouped by slot across sources, with the
              kernels EP=1 uses (the fused CPU kernel's expert half, or the torch path)
  4. combine  all_to_all_single back, then each token's rows weighted and summed in the order
              EP=1 sums them, so outputs match one process bit for bit (see `combine`)
Every rank calls each layer once per step, in layer order, tokens or not (moed.parallel.agree).

Modes (moed.model.executor.MoEMode: what EP=1 would have run for this batch; travel in the
header, since the receiving rank computes for several sources): FUSED = the CPU bf16 kernel path
(moed.model.moe.fused_serves), TORCH = the router + LocalExperts torch path. The local experts
compute through their one method for this (SlotExperts.run_grouped); nothing here reaches into
their weights.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moed.model.executor import ExpertExecutor, MoEMode, Routing, SlotExperts, combine
from moed.parallel.group import GroupFailed
from moed.parallel.layout import EPLayout


@dataclass
class EPStats:
    """Per-step counters, written by the step thread, read and reset between steps."""
    rows_sent: int = 0             # token-choices sent to other ranks
    rows_received: int = 0         # token-choices received from other ranks
    collective_s: float = 0.0      # time inside collectives (waiting for peers included)
    layers: int = 0

    def take(self) -> EPStats:
        out = EPStats(self.rows_sent, self.rows_received, self.collective_s, self.layers)
        self.rows_sent = self.rows_received = self.layers = 0
        self.collective_s = 0.0
        return out


@dataclass
class RankPlacement:
    """moed.model.context.ExpertPlacement for one rank: the layout, this rank, the shared stats.
    The model builds each MoE layer's executor through it (model/ never imports parallel/)."""
    layout: EPLayout
    rank: int
    device: torch.device
    stats: EPStats = field(default_factory=EPStats)
    name: str = "expert parallelism"

    @property
    def num_physical(self) -> int:
        return self.layout.num_physical

    @property
    def local_slots(self) -> tuple[int, ...]:
        return self.layout.local_experts(self.rank)

    def expert_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """logical_to_physical [E, R] (padded with each expert's first slot), num_replicas [E]."""
        reps = self.layout.replicas()
        width = max(len(r) for r in reps)
        table = [r + [r[0]] * (width - len(r)) for r in reps]
        return (torch.tensor(table, dtype=torch.long, device=self.device),
                torch.tensor([len(r) for r in reps], dtype=torch.long, device=self.device))

    def executor(self, local: SlotExperts) -> DistributedExperts:
        return DistributedExperts(local, self.layout, self.rank, self.stats)


class DistributedExperts(ExpertExecutor):
    def __init__(self, local: SlotExperts, layout: EPLayout, rank: int,
                 stats: EPStats | None = None) -> None:
        """local: this rank's S slots (moe.LocalExperts over [S, ...] weights); it computes both
        modes' expert halves (FUSED only where it holds the CPU kernels' packed copies)."""
        if local.num_physical != layout.slots_per_rank:
            raise ValueError(f"rank holds {local.num_physical} slots, layout says {layout.slots_per_rank}")
        self.local, self.layout, self.rank = local, layout, rank
        self.n, self.s = layout.ep_size, layout.slots_per_rank
        self.stats = stats if stats is not None else EPStats()
        self.slot_expert = torch.tensor(layout.slot_expert, dtype=torch.long)

    def set_layout(self, layout: EPLayout) -> None:
        """Adopt a new slot map (EPLB) at a step boundary, on every rank at the same step; this
        rank's slot weights must already hold the new map's experts, and the router gets the
        matching RankPlacement.expert_map. The slot count per rank cannot change (tensor shapes)."""
        if (layout.ep_size, layout.slots_per_rank) != (self.n, self.s):
            raise ValueError(f"a layout of {layout.ep_size} x {layout.slots_per_rank} slots cannot "
                             f"replace {self.n} x {self.s}")
        self.layout = layout
        self.slot_expert = torch.tensor(layout.slot_expert, dtype=torch.long)

    def __call__(self, x: torch.Tensor, routing: Routing, mode: MoEMode = MoEMode.TORCH) -> torch.Tensor:
        n, s, st = self.n, self.s, self.stats
        t, k = routing.physical.shape
        h = x.shape[1]
        phys = routing.physical.reshape(-1)
        order = torch.argsort(phys, stable=True)          # rows grouped by slot, so by rank
        slot_counts = torch.bincount(phys, minlength=n * s).view(n, s)
        header = torch.cat([slot_counts, torch.full((n, 1), int(mode), dtype=torch.long, device=phys.device)], 1)
        recv_header = torch.empty_like(header)
        self._exchange(recv_header.view(-1), header.reshape(-1))
        send_rows = slot_counts.sum(1).tolist()
        recv_rows = recv_header[:, :s].sum(1).tolist()
        xs = x.index_select(0, order // k) if t else x.new_empty((0, h))
        xr = x.new_empty((sum(recv_rows), h))
        self._exchange(xr, xs, recv_rows, send_rows)
        ys = self._compute(xr, recv_header, recv_rows)
        back = x.new_empty((sum(send_rows), h))
        self._exchange(back, ys, send_rows, recv_rows)
        st.rows_sent += sum(send_rows) - send_rows[self.rank]
        st.rows_received += sum(recv_rows) - recv_rows[self.rank]
        st.layers += 1
        if t == 0:
            return x.new_empty((0, h))
        y = torch.empty_like(back).index_copy_(0, order, back).view(t, k, h)
        if self.slot_expert.device != phys.device:
            self.slot_expert = self.slot_expert.to(phys.device)
        logical = self.slot_expert.index_select(0, phys).view(t, k)
        return combine(y, routing.weights, logical, mode)

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                  in_splits: list[int] | None = None) -> None:
        t0 = time.perf_counter()
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits)
        except RuntimeError as e:       # a peer died (at once) or stalled (the timeout)
            line = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise GroupFailed(f"expert exchange failed: {line}") from None
        finally:
            self.stats.collective_s += time.perf_counter() - t0

    def _compute(self, xr: torch.Tensor, header: torch.Tensor, recv_rows: list[int]) -> torch.Tensor:
        """Expert outputs (unweighted) of the received rows, in received order."""
        n, s = self.n, self.s
        if xr.shape[0] == 0:
            return xr
        dev = xr.device
        counts = header[:, :s]                                     # [N sources, S slots]
        slot = torch.repeat_interleave(torch.arange(s, device=dev).repeat(n), counts.reshape(-1))
        rows_from = torch.tensor(recv_rows, device=dev)
        source_mode = torch.repeat_interleave(header[:, s], rows_from)
        out = torch.empty_like(xr)
        for mode in sorted(set(header[:, s][rows_from > 0].tolist())):
            rows = torch.nonzero(source_mode == mode).squeeze(1)
            order = rows[torch.argsort(slot[rows], stable=True)]   # grouped by slot
            per_slot = torch.bincount(slot[order], minlength=s)
            out[order] = self.local.run_grouped(xr.index_select(0, order), per_slot, MoEMode(mode))
        return out

