"""Step agreement: the ranks of a group step together, and an idle group blocks.

Each step every rank calls `agree(has_work, leaving, rebalance, mtp)`: one all_reduce of four
int64 (ranks with work, ranks leaving, rank 0's word to the expert balancer,
moed.parallel.rebalance: collect the load / publish the new map, acted on after a step that has
work; and ranks whose step runs the MTP layer in full, speculative decoding's `mtp`). Then either
  - somebody has work: every rank runs one forward pass, an empty one where it has none
    (runner.forward_empty: only the MoE layers' exchanges), so every collective on one rank
    is matched on every other, in the same order. Drafts change only how many rows a rank's
    forward has (the exchange sends per-rank counts first), never which exchanges it makes;
    the MTP layer's MoE is the one exchange a rank may or may not make (the per-step switch
    runs it in full or writes its KV entries only, moed.engine.drafts.gate), so when any rank
    runs it in full (`Verdict.mtp` > 0), every other joins it with no rows (`Verdict.join_mtp`);
  - nobody has work: every rank goes idle in `idle()` with the same epoch number (they all
    saw the same verdicts), blocking on its own wake event (a new request, a command) or the
    group's wake key `wake/<epoch>` in the TCPStore, in bounded waits (POLL_S). The first rank
    with work sets that key, then agrees; the others wake on it and agree too. An idle group
    makes no collective and burns no CPU. Idle ranks still watch each other (a dead rank
    would otherwise go unnoticed until work arrives): each poll a rank bumps its heartbeat
    `hb/<rank>` and reads the next rank's (a ring: O(1) store calls per rank); one that stood
    still for the collective timeout fails the group, which the watcher writes to `failed`
    and announces with the wake key, so every rank fails at once, not one timeout apart;
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
FAILED = "failed"   # the store key an idle rank that saw a peer die writes the reason to


class Heartbeat:
    """When an idle peer's heartbeat counter last moved, on this rank's clock (pure: the
    counter values come from the store; no clocks compared across machines)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._value: int | None = None
        self._since = 0.0

    def silent_for(self, value: int, now: float) -> float:
        """Seconds the counter has not moved (0 when it just did): call once per poll."""
        if value != self._value:
            self._value, self._since = value, now
            return 0.0
        return now - self._since

    def dead(self, value: int, now: float) -> bool:
        return self.silent_for(value, now) > self.timeout_s


@dataclass(frozen=True)
class Verdict:
    working: int        # ranks with work this step
    leaving: int        # ranks leaving the group
    rebalance: int = 0  # the expert balancer's signal (rank 0's; moed.parallel.rebalance)
    mtp: int = 0        # ranks whose step runs the MTP layer's MoE (speculative decoding, mtp)

    def join_mtp(self, runs_mtp_moe: bool) -> bool:
        """Whether this rank joins the MTP layer's MoE exchange with no rows after its forward
        pass: a peer runs the layer in full this step and this rank does not (its MTP pass
        writes KV entries only, or it has no rows at all)."""
        return not runs_mtp_moe and self.mtp > 0


class StepAgreement:
    def __init__(self, group: EPGroup, stats: EPStats | None = None) -> None:
        self.group = group
        self.stats = stats if stats is not None else EPStats()
        self.epoch = 0
        self._waiter = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moed-ep-wake")
        self._stop: threading.Event | None = None

    def agree(self, has_work: bool, leaving: bool, rebalance: int = 0,
              mtp: bool = False) -> Verdict:
        """On the step thread: the one small collective per step. mtp: this rank's step runs
        the MTP layer's MoE (its MTP pass is in full)."""
        t = torch.tensor([int(has_work), int(leaving), int(rebalance), int(mtp)],
                         dtype=torch.long, device=self.group.device)
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            raise self.group.fail(f"step agreement failed: {_first_line(e)}") from None
        self.stats.collective_s += time.perf_counter() - t0
        w, lv, rb, mtp_n = t.tolist()
        return Verdict(int(w), int(lv), int(rb), int(mtp_n))

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
        g = self.group
        peer = (g.rank + 1) % g.size
        # at least a few polls: a peer's first beat of this idle period may come a poll late
        watch = Heartbeat(max(g.spec.timeout_s, 3 * POLL_S))
        while not stop.is_set():
            try:
                g.store.add(f"hb/{g.rank}", 1)
                self._raise_if_reported()
                if g.size > 1 and watch.dead(g.store.add(f"hb/{peer}", 0), time.monotonic()):
                    reason = (f"rank {peer} silent for {watch.timeout_s:g} s while the group "
                              f"was idle (dead or stalled)")
                    g.store.set(FAILED, reason)
                    g.store.set(key, b"1")       # wake the others: they read FAILED
                    raise g.fail(reason)
                g.store.wait([key], datetime.timedelta(seconds=POLL_S))
                self._raise_if_reported()
                return
            except dist.DistStoreError:      # this wait's timeout: wait again
                continue
            except GroupFailed:
                raise
            except RuntimeError as e:        # DistNetworkError: rank 0 (the store) is gone
                raise g.fail(f"lost the group's store: {_first_line(e)}") from None

    def _raise_if_reported(self) -> None:
        """GroupFailed when another idle rank wrote that a peer died (the FAILED key)."""
        store = self.group.store
        if store.check([FAILED]):
            raise self.group.fail(f"rank reported: {store.get(FAILED).decode()[:300]}")

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
