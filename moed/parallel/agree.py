"""Step agreement: the ranks of a group step together, and an idle group blocks.

Each step every rank calls `agree(has_work, leaving, rebalance)`: one all_reduce of three int64
(ranks with work, ranks leaving, and rank 0's word to the expert balancer, moed.parallel.rebalance:
collect the load / publish the new map, acted on after a step that has work). Then either
  - somebody has work: every rank runs one forward pass, an empty one where it has none
    (runner.forward_empty: only the MoE layers' exchanges), so every collective on one rank
    is matched on every other, in the same order;
  - nobody has work: every rank goes idle in `idle()` with the same epoch number (they all
    saw the same verdicts), blocking on its own wake event (a new request, a command) or the
    group's wake key `wake/<epoch>` in the TCPStore, in bounded waits (POLL_S). The first rank
    with work sets that key, then agrees; the others wake on it and agree too. An idle group
    makes no collective and burns no CPU;
  - somebody is leaving (SIGTERM ended its engine): the group is over (moed.parallel.group).
"""
from __future__ import annotations

import asyncio
import datetime
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moed.parallel.dispatch import EPStats
from moed.parallel.group import EPGroup, GroupFailed

POLL_S = 1.0        # an idle rank's longest single wait on the store (then it checks its stop)


@dataclass(frozen=True)
class Verdict:
    working: int        # ranks with work this step
    leaving: int        # ranks leaving the group
    rebalance: int = 0  # the expert balancer's signal (rank 0's; moed.parallel.rebalance)


class StepAgreement:
    def __init__(self, group: EPGroup, stats: EPStats | None = None) -> None:
        self.group = group
        self.stats = stats if stats is not None else EPStats()
        self.epoch = 0
        self._waiter = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moed-ep-wake")
        self._stop: threading.Event | None = None

    def agree(self, has_work: bool, leaving: bool, rebalance: int = 0) -> Verdict:
        """On the step thread: the one small collective per step."""
        t = torch.tensor([int(has_work), int(leaving), int(rebalance)], dtype=torch.long,
                         device=self.group.device)
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            raise self.group.fail(f"step agreement failed: {_first_line(e)}") from None
        self.stats.collective_s += time.perf_counter() - t0
        w, lv, rb = t.tolist()
        return Verdict(int(w), int(lv), int(rb))

    async def idle(self, wake: asyncio.Event, step_executor: Executor) -> None:
        """Block until this rank has work (`wake` set) or a peer does (the epoch's key)."""
        key = f"wake/{self.epoch}"
        self.epoch += 1
        loop = asyncio.get_running_loop()
        stop = self._stop = threading.Event()
        if self.group.rank == 0 and self.epoch > 2:      # keys of finished epochs
            await loop.run_in_executor(step_executor, self._delete, f"wake/{self.epoch - 3}")
        peer = loop.run_in_executor(self._waiter, self._wait_key, key, stop)
        local = asyncio.ensure_future(wake.wait())
        try:
            done, _ = await asyncio.wait({peer, local}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            local.cancel()
        if peer in done:
            peer.result()           # GroupFailed when the store went away
            return
        stop.set()
        await loop.run_in_executor(step_executor, self._set, key)

    def wake_peers(self) -> None:
        """On the step thread: wake ranks idle in the current epoch (this rank is leaving)."""
        self._set(f"wake/{self.epoch}")

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        self._waiter.shutdown(wait=False)

    def _wait_key(self, key: str, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.group.store.wait([key], datetime.timedelta(seconds=POLL_S))
                return
            except dist.DistStoreError:      # this wait's timeout: wait again
                continue
            except RuntimeError as e:        # DistNetworkError: rank 0 (the store) is gone
                raise self.group.fail(f"lost the group's store: {_first_line(e)}") from None

    def _set(self, key: str) -> None:
        try:
            self.group.store.set(key, b"1")
        except RuntimeError as e:
            raise self.group.fail(f"lost the group's store: {_first_line(e)}") from None

    def _delete(self, key: str) -> None:
        try:
            self.group.store.delete_key(key)
        except RuntimeError as e:
            raise self.group.fail(f"lost the group's store: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


__all__ = ["GroupFailed", "StepAgreement", "Verdict"]
