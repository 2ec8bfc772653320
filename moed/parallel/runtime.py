"""EPRuntime: what one rank's engine holds of its expert-parallel group.

Built in two halves around the weight load: `plan` (from config alone: the layout and this
rank's placement, which tell the loader which experts to read) and `join` (after the load: the
rendezvous, so a rank that loads slowly does not eat into the collective timeout of the
others). The engine's EP step loop (moed.engine.engine: `_steps_ep`) calls `agreement` and
runs every forward on its one step thread under `watchdog_s`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch

from moed.config import ParallelConfig
from moed.obs import metrics
from moed.parallel.agree import StepAgreement
from moed.parallel.dispatch import EPStats, RankPlacement
from moed.parallel.group import EPGroup, GroupFailed, GroupSpec
from moed.parallel.layout import EPLayout

if TYPE_CHECKING:
    from moed.parallel.rebalance import Rebalancer

log = structlog.get_logger(__name__)


class EPRuntime:
    def __init__(self, cfg: ParallelConfig, placement: RankPlacement) -> None:
        self.cfg, self.placement = cfg, placement
        self.spec = GroupSpec(cfg.ep_size, cfg.ep_rank, cfg.ep_init, cfg.collective_timeout_s,
                              cfg.rendezvous_timeout_s)
        self.group: EPGroup | None = None
        self.agreement: StepAgreement | None = None
        self.rebalancer: Rebalancer | None = None
        # backstop for a step thread stuck past gloo's own timeout (it should never be)
        self.watchdog_s = 2 * cfg.collective_timeout_s + 5.0

    @classmethod
    def plan(cls, cfg: ParallelConfig, num_experts: int, device: torch.device) -> EPRuntime:
        layout = EPLayout.contiguous(num_experts, cfg.ep_size, cfg.redundant_experts)
        return cls(cfg, RankPlacement(layout, cfg.ep_rank, device))

    def attach(self, model: Any) -> None:
        """After the load: the expert balancer over the model's MoE layers (when
        parallel.eplb_interval_s asks for one; else the initial layout stays)."""
        from moed.model.moe import MoELayer
        from moed.parallel.rebalance import Rebalancer

        if self.cfg.eplb_interval_s <= 0:
            return
        if model.ctx.placement is not self.placement:     # the cold-expert store wraps it
            raise ValueError(f"parallel.eplb_interval_s with {model.ctx.placement.name} is not built "
                             f"(the expert balancer moves slot weights from resident slots)")
        layers = [(i, layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoELayer)]
        self.rebalancer = Rebalancer(layers, self.layout, self.cfg.ep_rank, self.cfg.eplb_interval_s,
                                     self.cfg.eplb_min_gain, self.cfg.eplb_layers_per_step,
                                     self.cfg.collective_timeout_s, self.placement.device,
                                     step_bytes=int(self.cfg.eplb_step_mb * 2**20))

    def request_rebalance(self) -> tuple[int, dict[str, object]]:
        """An operator's "rebalance now" (on the loop): (HTTP status, body)."""
        def refuse(message: str, code: str) -> tuple[int, dict[str, object]]:
            return 409, {"error": {"message": message, "code": code}}
        rb = self.rebalancer
        if rb is None:
            return refuse("The expert balancer is off (parallel.eplb_interval_s = 0 keeps the "
                          "initial layout).", "eplb_off")
        if self.cfg.ep_rank != 0:
            return refuse("Rank 0 of the group decides when to rebalance: send this to its "
                          "node.", "not_rank_0")
        state = rb.request()
        return 202, {"status": state, "rebalances": rb.rebalances, "decisions": rb.decisions}

    def rebalance_wanted(self) -> int:
        """This rank's word to the expert balancer, for the step agreement (0: nothing)."""
        return 0 if self.rebalancer is None else self.rebalancer.wanted()

    def rebalance_due(self, agreed: int) -> bool:
        """After a working step: whether every rank runs `rebalance_step` now (the same answer
        on every rank: the agreement's count and the balancer's shared state)."""
        return self.rebalancer is not None and (agreed > 0 or self.rebalancer.busy)

    def rebalance_step(self, agreed: int) -> None:
        assert self.rebalancer is not None
        self.rebalancer.step(agreed)

    @property
    def layout(self) -> EPLayout:
        return self.placement.layout

    @property
    def stats(self) -> EPStats:
        return self.placement.stats

    def join(self) -> None:
        """Rendezvous with the other ranks (blocking: call from a thread)."""
        self.group = EPGroup.open(self.spec, self.layout, self.placement.device)
        self.agreement = StepAgreement(self.group, self.stats)

    def fail(self, reason: str) -> GroupFailed:
        if self.group is None:
            return GroupFailed(reason)
        return self.group.fail(reason)

    def close(self) -> None:
        if self.rebalancer is not None:
            self.rebalancer.close()
        if self.agreement is not None:
            self.agreement.close()
        if self.group is not None:
            self.group.close()

    def publish_metrics(self, resident_expert_bytes: int) -> None:
        lay, r = self.layout, self.cfg.ep_rank
        metrics.EP_INFO.labels(self.cfg.ep_init, str(r), str(lay.ep_size)).set(1)
        metrics.EP_RESIDENT_EXPERT_BYTES.set(resident_expert_bytes)
        metrics.EP_EXPERT_SLOTS.labels("held").set(lay.slots_per_rank)
        metrics.EP_EXPERT_SLOTS.labels("redundant").set(lay.redundant_slots(r))

    def observe_step(self) -> None:
        """After a step (on the loop; the step thread is done with the counters)."""
        st = self.stats.take()
        metrics.EP_ROWS_SENT.inc(st.rows_sent)
        metrics.EP_ROWS_RECEIVED.inc(st.rows_received)
        metrics.EP_COLLECTIVE_TIME.observe(st.collective_s)

    def describe(self) -> dict[str, object]:
        lay, r = self.layout, self.cfg.ep_rank
        return {"ep_size": lay.ep_size, "ep_rank": r, "ep_group": self.cfg.ep_init,
                "slots": lay.slots_per_rank, "redundant_slots": lay.redundant_slots(r),
                "experts": list(lay.local_experts(r)),
                "rebalances": 0 if self.rebalancer is None else self.rebalancer.rebalances}
