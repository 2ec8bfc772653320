"""TieredCache: L2 (host memory) and L3 (local disk) below the engine's KV tensor (L1).

A block's life below L1 (keys: the block pool's chained prefix hashes, within one KV layout):

    L1 evicts a cached block ──offer──▶ L2 (copied now, between steps) ──evicted──▶ L3 file
    (write-through: `on_cached` offers it when first completed, not only when evicted)
    a new request's next prompt blocks ──match──▶ plan (policy.plan_load) ──start_load──▶
    I/O thread reads + verifies ──▶ done queue ──collect (next step boundary)──▶ the engine
    copies the payloads into the request's fresh L1 blocks and the scheduler resumes it

One writer: the index, the pins and the stores' contents change only on the engine's loop
thread (in `offer`, `start_load`, `collect`). The I/O threads read payloads and write or
delete files; their results come back through `_done` and are applied by `collect`. A load
pins its entries, so eviction never takes a block a load is reading. L3 writes are queued
on their own thread, so a slow disk delays only the disk tier, never a step.

Loads run on `load_threads` loader threads. A block read (open, read, verify) that makes no
progress for `read_timeout_s` abandons its load: the request recomputes (never a wrong answer,
never a request timeout because of the tier), the entry it was stuck on is dropped, and a spare
thread takes the stuck one's place (tiers/iopool.py). The I/O threads are daemons: a read
blocked for good never holds the process's exit.

Its parts: records.py (settings, entries, load records), startup.py (restore L3, calibrate),
iothreads.py (what the I/O threads run), results.py (applying their results in `collect`).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import structlog

from moed.kvcache.tiers import fileio, iothreads, results, startup
from moed.kvcache.tiers.iopool import IOPool, Watchdog
from moed.kvcache.tiers.policy import (Bandwidth, EvictionCandidate, Latency, LoadPlan, benefit, plan_load,
                                       victims)
from moed.kvcache.tiers.records import (TIERS, BlockIO, Entry, LoadJob, LoadRecord, LoadResult,
                                        TierCounters, TierMatch, TierSettings)
from moed.kvcache.tiers.store import CorruptBlock, DiskStore, HostStore

log = structlog.get_logger(__name__)



class TieredCache:
    def __init__(self, s: TierSettings, io: BlockIO, layout_id: str) -> None:
        self.s = s
        self.io = io
        self.layout_id = layout_id
        self.host: HostStore | None = HostStore() if s.host_bytes > 0 else None
        self.disk: DiskStore | None = None
        if s.disk_bytes > 0:
            if not s.disk_dir:
                raise ValueError("tiers.disk_bytes > 0 needs tiers.disk_dir")
            self.disk = DiskStore(s.disk_dir, layout_id, fileio.make(s.disk_io))
        self.capacity = {"host": s.host_bytes if self.host else 0,
                         "disk": s.disk_bytes if self.disk else 0}
        self.used = {"host": 0, "disk": 0}
        self.counters = {t: TierCounters() for t in TIERS}
        self.bandwidth = {"host": Bandwidth(s.host_bandwidth), "disk": Bandwidth(s.disk_bandwidth)}
        self.decisions = {"load": 0, "recompute": 0}
        self.slower_than_recompute = 0
        self.recent_loads: deque[LoadRecord] = deque(maxlen=1024)
        self._holds: list[int] = []         # pinned until the next step boundary (hold)
        self.restored = 0
        self._index: dict[int, Entry] = {}
        self._done: deque[tuple[str, Any]] = deque()    # (kind, result) from the I/O threads
        self._inflight: set[Future] = set()         # writes and deletes
        self._loads: set[LoadJob] = set()             # loads not yet posted by a thread
        self._loader = IOPool(s.load_threads, "moed-kv-load", spares=s.load_threads)
        self._writer = IOPool(1, "moed-kv-write")
        self._watchdog = Watchdog("moed-kv-deadline", lambda job: iothreads.deadline(self, job))
        self._suspended_logged = False
        self._write_fail_logged = -results.WRITE_FAIL_LOG_S
        self._write_fail_quiet = 0          # write failures since the last logged one
        self._waker: Callable[[], None] | None = None
        # KV events (moed.kvcache.events): (tier, key, stored?) when a block becomes readable
        # in a tier or leaves it; loop thread only
        self.on_change: Callable[[str, int, bool], None] | None = None
        self.recompute_s_per_byte = 1e-9        # the engine refreshes it from its cost model
        # a load is learned at the step boundary after the step in flight: the loaded request
        # then waits about one step longer than if it had recomputed in that step
        self.step_s = 0.0
        # a load's fixed cost beyond bytes / bandwidth (the queue, the thread hand-off, opening
        # files): seeded by the warm-up probe, then learnt from what loads took beyond their bytes
        self.latency = Latency()
        if self.disk is not None:
            startup.restore(self)
        if s.calibrate:
            startup.calibrate(self)

    @property
    def latency_s(self) -> float:
        return self.latency.value

    # ---- the engine's hooks (loop thread) ----------------------------------------------------
    def set_waker(self, fn: Callable[[], None] | None) -> None:
        """Called from an I/O thread when a result is ready (the engine wakes its loop)."""
        self._waker = fn

    def offer(self, block_id: int, key: int) -> None:
        """L1 is about to reuse a cached block (write-back): keep its payload below."""
        e = self._index.get(key)
        if e is not None:
            e.last_use = time.monotonic()
            return
        if self.host is None and self.disk is None:
            return
        data = self.io.read(block_id)      # between steps: no forward pass is writing L1
        if self.host is not None:
            self._put_host(key, data)
        else:
            self._put_disk(key, data)

    def on_cached(self, block_id: int, key: int) -> None:
        """A block was completed and registered in L1 (write-through, when configured)."""
        if self.s.write_through:
            self.offer(block_id, key)

    def match(self, keys: Sequence[int]) -> TierMatch:
        """The leading run of `keys` held (and readable) below L1. Changes nothing (none while
        every loader thread is stuck in a read: a load would only wait for its deadline)."""
        got, tiers, sizes = [], [], []
        if self._loader.saturated:
            if not self._suspended_logged:
                self._suspended_logged = True
                log.warning("kv_tier_loads_suspended",
                            threads=self._loader.size + self._loader.spares,
                            effect="every loader thread is stuck in a read; requests recompute "
                            "until one comes back")
            return TierMatch((), (), (), len(keys))
        self._suspended_logged = False
        for k in keys:
            e = self._index.get(k)
            if e is None or not e.ready:
                break
            got.append(k)
            tiers.append(e.tier)
            sizes.append(e.nbytes)
        return TierMatch(tuple(got), tuple(tiers), tuple(sizes), len(keys))

    def plan(self, m: TierMatch, recompute_after: Callable[[int], float],
             busy: bool = True, step_s: float | None = None) -> LoadPlan:
        """busy: other requests run in the step being planned, so a loaded request resumes
        only after that step (`step_s`, the scheduler's prediction of it, else the measured
        average step); on an idle engine the load's end wakes the loop."""
        secs = [self.bandwidth[t].seconds(n) for t, n in zip(m.tiers, m.nbytes)]
        wait = (self.step_s if step_s is None else step_s) if busy else 0.0
        return plan_load(secs, recompute_after, self.s.load_overhead_s + self.latency.value
                         + wait)

    def observe_step(self, seconds: float) -> None:
        """The engine's measured step time (an exponential average: a load's overhead)."""
        self.step_s = seconds if self.step_s == 0.0 else self.step_s + 0.2 * (seconds - self.step_s)

    def record_lookup(self, m: TierMatch, plan: LoadPlan) -> None:
        """Count one admitted request's lookup: hits per tier up to the first miss."""
        self.decisions[plan.decision] += 1
        for t in m.tiers:
            self.counters[t].hits += 1
            if t == "disk" and self.host is not None:
                self.counters["host"].misses += 1
        if len(m.keys) < m.num_queried:         # the first block held nowhere
            for t in TIERS:
                if self.capacity[t]:
                    self.counters[t].misses += 1

    def pin(self, keys: Sequence[int]) -> None:
        """Hold entries a load is about to read: no eviction takes them (pin before the L1
        allocation for the load, whose own evictions may make room below)."""
        for k in keys:
            self._index[k].pins += 1

    def hold(self, keys: Sequence[int]) -> None:
        """Pin entries until the next step boundary (`collect` unpins them): a waiting prompt
        that a load's decision took to load them too must still find them at its own turn
        (tiers/admission.py)."""
        self.pin(keys)
        self._holds.extend(keys)

    def start_load(self, request_id: str, keys: Sequence[int], block_ids: Sequence[int],
                   predicted_recompute_s: float, predicted_load_s: float = 0.0) -> None:
        """Read pinned `keys` on the I/O thread into `block_ids` (applied by `collect`, which
        unpins them). The predictions are the decision's, for the load's record."""
        job = LoadJob(request_id, [(k, self._index[k].tier) for k in keys], tuple(block_ids),
                    predicted_recompute_s, predicted_load_s, time.perf_counter())
        self._loads.add(job)
        job.fut = self._loader.submit(iothreads.read, self, job)
        self._watchdog.arm(job, job.progress + self.s.read_timeout_s)

    def collect(self) -> list[LoadResult]:
        """Apply the I/O threads' finished work; -> the finished loads (engine: copy into L1).
        Releases the previous step's holds."""
        for k in self._holds:
            e = self._index.get(k)
            if e is not None and e.pins > 0:
                e.pins -= 1
        self._holds.clear()
        loads: list[LoadResult] = []
        while self._done:
            kind, res = self._done.popleft()
            if kind == "load":
                job, r = res
                self._loads.discard(job)
                if not job.settled:     # else: abandoned at its deadline; the late read is dropped
                    job.settled = True
                    results.loaded(self, r)
                    loads.append(r)
            elif kind == "expired":
                self._loads.discard(res)
                if not res.settled:
                    res.settled = True
                    loads.append(results.expired(self, res))
            elif kind == "write":
                results.written(self, *res)
        return loads

    def has_results(self) -> bool:
        return bool(self._done)

    def pending(self) -> int:
        return len(self._inflight) + len(self._loads)

    def wait(self, timeout: float, loads: bool = True) -> bool:
        """Block until every queued I/O has a result to collect (a load: read, or abandoned at
        its deadline) (tests, the sync generate(), shutdown); False on timeout. Results still
        need `collect`. loads=False: writes and deletes only."""
        deadline = time.monotonic() + timeout
        while loads and self._loads:
            job = next(iter(self._loads))
            if not job.posted.wait(max(deadline - time.monotonic(), 0.0)):
                return False
            self._loads.discard(job)
        while self._inflight:
            fut = next(iter(self._inflight))
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                fut.exception(timeout=left)
            except TimeoutError:
                return False
            self._inflight.discard(fut)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued writes (an L3 that survives a restart; at most `timeout`), then stop
        the threads. Loads are not waited for: their requests have ended, and a thread stuck
        in a read is a daemon that does not hold the process's exit."""
        self._watchdog.close()
        if not self.wait(timeout, loads=False):
            log.warning("kv_tier_close_timeout", timeout_s=timeout,
                        effect="queued L3 writes abandoned; a restart does not find them")
        self.collect()
        self._loader.close()
        self._writer.close()

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"tier_decisions_load": float(self.decisions["load"]),
                                 "tier_decisions_recompute": float(self.decisions["recompute"]),
                                 "tier_slower_than_recompute": float(self.slower_than_recompute)}
        for t in TIERS:
            if not self.capacity[t]:
                continue
            c = self.counters[t]
            out.update({f"tier_{t}_capacity_bytes": float(self.capacity[t]),
                        f"tier_{t}_used_bytes": float(self.used[t]),
                        f"tier_{t}_blocks": float(sum(e.tier == t for e in self._index.values())),
                        f"tier_{t}_hits": float(c.hits), f"tier_{t}_misses": float(c.misses),
                        f"tier_{t}_loads": float(c.loads), f"tier_{t}_load_bytes": float(c.load_bytes),
                        f"tier_{t}_corrupt": float(c.corrupt),
                        f"tier_{t}_write_errors": float(c.write_errors),
                        f"tier_{t}_ignored": float(c.ignored),
                        f"tier_{t}_read_timeouts": float(c.read_timeouts),
                        f"tier_{t}_bandwidth_bytes_per_s": self.bandwidth[t].value})
        return out

    def held(self) -> list[tuple[str, int]]:
        """(tier, key) of every readable block (KV events announce a restart's disk blocks)."""
        return [(e.tier, k) for k, e in self._index.items() if e.ready]

    def tier_of(self, key: int) -> str | None:
        e = self._index.get(key)
        return None if e is None else e.tier

    # ---- placement --------------------------------------------------------------------------
    def _candidates(self, tier: str) -> list[EvictionCandidate]:
        now = time.monotonic()
        return [EvictionCandidate(k, e.nbytes, benefit(e.hits, now - e.last_use, self.recompute_s_per_byte,
                                               self.s.half_life_s), e.pins > 0)
                for k, e in self._index.items() if e.tier == tier]

    def _make_room(self, tier: str, n: int) -> bool:
        need = self.used[tier] + n - self.capacity[tier]
        if need <= 0:
            return True
        out = victims(self._candidates(tier), need)
        if out is None:
            return False
        for k in out:
            self._evict(tier, k)
        return True

    def _evict(self, tier: str, key: int) -> None:
        e = self._index.pop(key)
        self.used[tier] -= e.nbytes
        self.counters[tier].evicted += 1
        if self.on_change is not None and e.ready:
            self.on_change(tier, key, False)
        if tier == "host":
            assert self.host is not None
            try:
                data: bytes | None = self.host.get(key)
            except CorruptBlock:
                data = None
                self.counters["host"].corrupt += 1
            self.host.delete(key)
            if self.disk is not None and data is not None:     # write-back to the tier below
                self._put_disk(key, data, hits=e.hits)
        else:
            assert self.disk is not None
            self._track(self._writer.submit(iothreads.delete, self, key), "delete")

    def _put_host(self, key: int, data: bytes) -> None:
        assert self.host is not None
        if len(data) > self.capacity["host"] or not self._make_room("host", len(data)):
            if self.disk is not None:
                self._put_disk(key, data)
            return
        self.host.put(key, data)
        self._index[key] = Entry("host", len(data))
        self.used["host"] += len(data)
        self.counters["host"].stored += 1
        if self.on_change is not None:
            self.on_change("host", key, True)

    def _put_disk(self, key: int, data: bytes, hits: int = 0) -> None:
        if self.disk is None or key in self._index:
            return
        if len(data) > self.capacity["disk"] or not self._make_room("disk", len(data)):
            return
        e = self._index[key] = Entry("disk", len(data), hits=hits, ready=False)
        self.used["disk"] += len(data)
        self._track(self._writer.submit(iothreads.write, self, key, data, e), "write")

    def _remove(self, key: int, e: Entry) -> None:
        """Drop an entry from the index and its store (a disk file: queued on the writer)."""
        del self._index[key]
        self.used[e.tier] -= e.nbytes
        if self.on_change is not None and e.ready:      # KV events: the block is gone
            self.on_change(e.tier, key, False)
        if e.tier == "host":
            assert self.host is not None
            self.host.delete(key)
        else:
            self._track(self._writer.submit(iothreads.delete, self, key), "delete")

    # ---- the I/O threads ----------------------------------------------------------------------
    def _track(self, fut: Future, kind: str) -> None:
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)

    def _wake(self) -> None:
        if self._waker is not None:
            try:
                self._waker()
            except RuntimeError:        # the loop has closed (shutdown)
                pass
