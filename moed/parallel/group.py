"""An expert-parallel group: rendezvous, the collective timeout, and how it fails.

A group's life, as one rank sees it:
  forming    rank 0 listens on parallel.ep_init (torch.distributed.TCPStore) and every rank
             joins it within parallel.rendezvous_timeout_s, then the process group is made
             (gloo on CPU, NCCL on GPU) with parallel.collective_timeout_s on every collective
  stepping   every step: one agreement (moed.parallel.agree), then one forward pass per rank,
             an empty one where a rank has no tokens; each MoE layer exchanges tokens
             (moed.parallel.dispatch)
  idle       nobody has work: every rank blocks on its own work or a peer's wake key
  failed     a peer died (gloo: connection closed, at once) or stalled (the collective
             timeout, or this rank's watchdog): the engine ends every request 503, the node
             leaves membership and exits 1; systemd restarts each rank and the group re-forms
  left       a rank stopped on purpose (SIGTERM): it says so in its last agreement; the others
             treat it as a failure (a group without one rank cannot serve its experts)

No home-made collective: everything goes through torch.distributed; the TCPStore is also the
wake channel of idle ranks (moed.parallel.agree).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from moed.parallel.layout import EPLayout

log = structlog.get_logger(__name__)


class GroupFailed(RuntimeError):
    """The group cannot step any more (a peer died, stalled or left)."""


@dataclass(frozen=True)
class GroupSpec:
    size: int
    rank: int
    init: str                      # tcp://host:port
    timeout_s: float
    rendezvous_timeout_s: float

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.init.removeprefix("tcp://").rpartition(":")
        return host.strip("[]"), int(port)


class EPGroup:
    def __init__(self, spec: GroupSpec, layout: EPLayout, store: dist.Store, device: torch.device) -> None:
        self.spec, self.layout, self.store, self.device = spec, layout, store, device
        self.rank, self.size = spec.rank, spec.size
        self.failed: str | None = None

    @classmethod
    def open(cls, spec: GroupSpec, layout: EPLayout, device: torch.device) -> EPGroup:
        """Rendezvous with the other ranks (blocks up to spec.rendezvous_timeout_s)."""
        if layout.ep_size != spec.size:
            raise ValueError(f"layout for {layout.ep_size} ranks, group of {spec.size}")
        host, port = spec.host_port
        backend = "nccl" if device.type == "cuda" else "gloo"
        log.info("ep_group_forming", rank=spec.rank, size=spec.size, init=spec.init, backend=backend)
        try:
            store = dist.TCPStore(host, port, spec.size, is_master=spec.rank == 0,
                                  timeout=datetime.timedelta(seconds=spec.rendezvous_timeout_s),
                                  wait_for_workers=True)
            dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=spec.rank,
                                    world_size=spec.size,
                                    timeout=datetime.timedelta(seconds=spec.timeout_s))
        except (RuntimeError, ValueError, OSError) as e:     # DistError is a RuntimeError
            raise GroupFailed(f"expert-parallel group {spec.init}: rank {spec.rank} of "
                              f"{spec.size} could not join within {spec.rendezvous_timeout_s:g} s: "
                              f"{str(e).splitlines()[0][:300]}") from None
        log.info("ep_group_formed", rank=spec.rank, size=spec.size, backend=backend)
        return cls(spec, layout, store, device)

    def fail(self, reason: str) -> GroupFailed:
        if self.failed is None:
            self.failed = reason
            log.error("ep_group_failed", rank=self.rank, size=self.size, reason=reason)
        return GroupFailed(self.failed)

    def close(self) -> None:
        """Tear down after a clean leave. A failed group is left as is: destroying it may wait
        on the dead peer, and the process is exiting anyway."""
        if self.failed is None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError as e:
                log.warning("ep_group_teardown_failed", error=str(e)[:200])
