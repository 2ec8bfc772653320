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
"""
from __future__ import annotations

import errno
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from moed.kvcache.tiers import fileio
from moed.kvcache.tiers.iopool import IOPool, Watchdog
from moed.kvcache.tiers.policy import (Bandwidth, EvictionCandidate, Latency, LoadPlan, benefit, plan_load,
                                       victims)
from moed.kvcache.tiers.store import BlockStore, CorruptBlock, DiskStore, HostStore, NotRegular

log = structlog.get_logger(__name__)

TIERS = ("host", "disk")
PROBE_KEY = (1 << 128) - 1      # the warm-up probe's key: not a key the pool's hashes produce
PROBE_READS = 5                 # warm-up reads per tier; the first (thread and agent set-up) unused
MAX_IGNORED_LOGGED = 20         # start-up log lines for entries that are not block files
WRITE_FAIL_LOG_S = 10.0         # at most one kv_tier_write_failed line this often


class BlockIO(Protocol):
    """The engine's KV tensor seen as payloads: one block across all layers (tiers/kvio.py)."""

    block_bytes: int

    def read(self, block_id: int) -> bytes: ...

    def write(self, block_id: int, data: bytes) -> None: ...


@dataclass(frozen=True)
class TierSettings:
    """What the cache needs from `[tiers]` (moed.config.TiersConfig.settings())."""

    host_bytes: int = 0
    disk_bytes: int = 0
    disk_dir: str = ""
    disk_io: str = "auto"                # fileio.IO_KINDS
    write_through: bool = False
    host_bandwidth: float = 5e9          # bytes/s, until measured
    disk_bandwidth: float = 5e8
    half_life_s: float = 60.0
    load_overhead_s: float = 0.0
    calibrate: bool = True               # measure each tier's read path at start (_calibrate)
    load_threads: int = 2                # loader threads (and as many spares for stuck ones)
    read_timeout_s: float = 5.0          # a block read stalled this long abandons its load


@dataclass
class _Entry:
    tier: str
    nbytes: int
    hits: int = 0
    last_use: float = field(default_factory=time.monotonic)
    pins: int = 0
    ready: bool = True          # False while its L3 file is being written


@dataclass(frozen=True)
class TierMatch:
    keys: tuple[int, ...]       # the leading run of the queried keys held below L1
    tiers: tuple[str, ...]      # where each one is
    nbytes: tuple[int, ...]
    num_queried: int


@dataclass(frozen=True)
class LoadResult:
    request_id: str
    keys: tuple[int, ...]               # every entry the load pinned, in prompt order
    block_ids: tuple[int, ...]          # the L1 blocks the payloads go to
    payloads: tuple[bytes, ...]         # the leading blocks read and verified (maybe fewer)
    seconds: float                      # the I/O thread's read time
    submitted: float                    # perf_counter() when the load was queued
    submitted_to_read_s: float          # queued + read + verified
    bytes_by_tier: dict[str, int]
    predicted_recompute_s: float
    failed: str | None = None           # why the read stopped early
    predicted_load_s: float = 0.0
    not_regular: bool = False           # it stopped at an entry that is not a regular file
    timed_out: bool = False             # abandoned at its read deadline (payloads empty)


@dataclass(eq=False)
class _Load:
    """One load in flight. The loader thread writes `current`, `progress` and `finished`;
    the loop thread `settled` (whichever of the result and the deadline it applies first)."""

    request_id: str
    where: list[tuple[int, str]]
    block_ids: tuple[int, ...]
    predicted_recompute_s: float
    predicted_load_s: float
    submitted: float                    # perf_counter()
    progress: float = field(default_factory=time.monotonic)     # the last block read (or queued)
    current: tuple[int, str] | None = None      # the entry being read now
    fut: Future | None = None
    finished: bool = False
    settled: bool = False
    posted: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class LoadRecord:
    """One finished load as the request saw it (TieredCache.recent_loads; bench/kv_tiers.py)."""

    request_id: str
    blocks: int
    load_s: float                   # queued -> collected at a step boundary (usable then)
    read_s: float                   # queued -> read and verified on the I/O thread
    predicted_load_s: float         # what the decision predicted
    predicted_recompute_s: float    # recomputing the same blocks, as the decision predicted


@dataclass
class TierCounters:
    hits: int = 0           # blocks found in this tier by a request's lookup
    misses: int = 0         # blocks looked up here and not found
    loads: int = 0          # blocks loaded from this tier into L1
    load_bytes: int = 0
    stored: int = 0         # blocks written into this tier
    evicted: int = 0
    corrupt: int = 0        # payloads that failed their checks (skipped, removed)
    write_errors: int = 0   # writes the medium refused (e.g. disk full)
    ignored: int = 0        # entries that are not regular files (left alone, never read)
    read_timeouts: int = 0  # loads abandoned at their read deadline (the request recomputed)


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
        self._index: dict[int, _Entry] = {}
        self._done: deque[tuple[str, Any]] = deque()    # (kind, result) from the I/O threads
        self._inflight: set[Future] = set()         # writes and deletes
        self._loads: set[_Load] = set()             # loads not yet posted by a thread
        self._loader = IOPool(s.load_threads, "moed-kv-load", spares=s.load_threads)
        self._writer = IOPool(1, "moed-kv-write")
        self._watchdog = Watchdog("moed-kv-deadline", self._deadline)
        self._suspended_logged = False
        self._write_fail_logged = -WRITE_FAIL_LOG_S
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
            self._restore()
        if s.calibrate:
            self._calibrate()

    @property
    def latency_s(self) -> float:
        return self.latency.value

    # ---- restart -------------------------------------------------------------------------
    def _restore(self) -> None:
        """A restart finds its L3 again: the index from the files (checked); bad ones counted.
        Files beyond the capacity (it shrank) are dropped, least useful (any) first."""
        assert self.disk is not None
        scan = self.disk.scan()
        self.counters["disk"].corrupt += scan.skipped
        self.counters["disk"].ignored += len(scan.ignored)
        for name, kind in scan.ignored[:MAX_IGNORED_LOGGED]:
            log.warning("kv_tier_file_ignored", tier="disk", dir=str(self.disk.dir), name=name,
                        kind=kind, effect="not a regular file: left in place, never read")
        for key, n in scan.entries.items():
            if self.used["disk"] + n > self.capacity["disk"]:
                self.disk.delete(key)
                continue
            self._index[key] = _Entry("disk", n)
            self.used["disk"] += n
        self.restored = len(self._index)
        log.info("kv_tier_restored", tier="disk", blocks=self.restored, skipped=scan.skipped,
                 ignored=len(scan.ignored), bytes=self.used["disk"], dir=str(self.disk.dir),
                 io=self.disk.fileio.name)

    def _calibrate(self) -> None:
        """Measure each tier's read path before the first decision: a probe block written
        (L3: through the writer thread, as write-back does) and read PROBE_READS times through
        the load thread, as a load is. The first read also starts the thread (and its NIXL
        agent) and is not counted; the others seed the tier's bandwidth (median read) and the
        load latency (the slowest hand-off: queue + wake-up beyond the read). Without it the
        first loads were predicted from config seeds and a zero latency, and some came out
        slower than recomputing (docs/kv-tiers.md). A tier whose probe fails keeps its seed."""
        probe = bytes(self.io.block_bytes)
        handoff: list[float] = []
        for tier, store in (("host", self.host), ("disk", self.disk)):
            if store is None:
                continue
            try:
                if tier == "disk":
                    self._writer.submit(store.put, PROBE_KEY, probe).result(timeout=10.0)
                else:
                    store.put(PROBE_KEY, probe)
                reads = []
                for _ in range(PROBE_READS):
                    t0 = time.perf_counter()
                    read_s = self._loader.submit(self._probe_read, store).result(timeout=10.0)
                    reads.append((read_s, time.perf_counter() - t0))
            except (OSError, CorruptBlock, KeyError, TimeoutError) as e:
                log.warning("kv_tier_calibration_failed", tier=tier,
                            error=f"{type(e).__name__}: {e}",
                            effect="the configured bandwidth is assumed until loads are measured")
                continue
            finally:
                try:
                    store.delete(PROBE_KEY)
                except OSError:
                    pass
            counted = sorted(r for r, _ in reads[1:])
            median = counted[len(counted) // 2]
            if median > 0:
                self.bandwidth[tier].value = len(probe) / median
            handoff += [max(total - r, 0.0) for r, total in reads[1:]]
        if handoff:
            self.latency = Latency(max(handoff))
        log.info("kv_tier_calibrated", latency_s=round(self.latency.value, 6),
                 **{f"{t}_bandwidth_bytes_per_s": round(self.bandwidth[t].value)
                    for t in TIERS if self.capacity[t]})

    @staticmethod
    def _probe_read(store: BlockStore) -> float:
        t0 = time.perf_counter()
        store.get(PROBE_KEY)
        return time.perf_counter() - t0

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
        job = _Load(request_id, [(k, self._index[k].tier) for k in keys], tuple(block_ids),
                    predicted_recompute_s, predicted_load_s, time.perf_counter())
        self._loads.add(job)
        job.fut = self._loader.submit(self._read, job)
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
                    self._loaded(r)
                    loads.append(r)
            elif kind == "expired":
                self._loads.discard(res)
                if not res.settled:
                    res.settled = True
                    loads.append(self._expired(res))
            elif kind == "write":
                self._written(*res)
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
            self._track(self._writer.submit(self._delete, key), "delete")

    def _put_host(self, key: int, data: bytes) -> None:
        assert self.host is not None
        if len(data) > self.capacity["host"] or not self._make_room("host", len(data)):
            if self.disk is not None:
                self._put_disk(key, data)
            return
        self.host.put(key, data)
        self._index[key] = _Entry("host", len(data))
        self.used["host"] += len(data)
        self.counters["host"].stored += 1
        if self.on_change is not None:
            self.on_change("host", key, True)

    def _put_disk(self, key: int, data: bytes, hits: int = 0) -> None:
        if self.disk is None or key in self._index:
            return
        if len(data) > self.capacity["disk"] or not self._make_room("disk", len(data)):
            return
        e = self._index[key] = _Entry("disk", len(data), hits=hits, ready=False)
        self.used["disk"] += len(data)
        self._track(self._writer.submit(self._write, key, data, e), "write")

    # ---- the I/O threads ----------------------------------------------------------------------
    def _track(self, fut: Future, kind: str) -> None:
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)

    def _write(self, key: int, data: bytes, entry: _Entry) -> None:
        assert self.disk is not None
        try:
            self.disk.put(key, data)
            self._done.append(("write", (key, entry, None)))
        except Exception as e:  # noqa: BLE001 - any failure: the entry must not stay unwritten
            reason = "disk full" if getattr(e, "errno", None) == errno.ENOSPC \
                else f"{type(e).__name__}: {e}"
            self._done.append(("write", (key, entry, reason)))
        self._wake()

    def _delete(self, key: int) -> None:
        assert self.disk is not None
        try:
            self.disk.delete(key)
        except OSError as e:
            log.warning("kv_tier_delete_failed", tier="disk", key=f"{key:032x}",
                        reason=f"{type(e).__name__}: {e}", effect="the file stays on disk")

    def _read(self, job: _Load) -> None:
        t0 = time.perf_counter()
        job.progress = time.monotonic()
        payloads: list[bytes] = []
        by_tier = {t: 0 for t in TIERS}
        failed, not_regular = None, False
        for key, tier in job.where:
            job.current = (key, tier)
            store: BlockStore | None = self.host if tier == "host" else self.disk
            try:
                assert store is not None
                data = store.get(key)
                if len(data) != self.io.block_bytes:
                    raise CorruptBlock(f"{len(data)} bytes, a block is {self.io.block_bytes}")
            except Exception as e:  # noqa: BLE001 - any failure ends the load: the rest recomputes
                failed = f"{tier} block {key:032x}: {e}"
                not_regular = isinstance(e, NotRegular)
                break
            payloads.append(data)
            by_tier[tier] += len(data)
            job.progress = time.monotonic()
        job.finished = True
        self._done.append(("load", (job, LoadResult(
            job.request_id, tuple(k for k, _ in job.where), job.block_ids, tuple(payloads),
            time.perf_counter() - t0, job.submitted, time.perf_counter() - job.submitted, by_tier,
            job.predicted_recompute_s, failed, job.predicted_load_s, not_regular))))
        job.posted.set()
        self._wake()

    def _deadline(self, job: _Load) -> None:
        """The watchdog thread: a load's read deadline passed. Progress since (a block read)
        moves the deadline on; otherwise the loop thread abandons the load (`_expired`)."""
        if job.finished:
            return
        due = job.progress + self.s.read_timeout_s
        if due > time.monotonic():
            self._watchdog.arm(job, due)
            return
        self._done.append(("expired", job))
        job.posted.set()
        self._wake()

    def _wake(self) -> None:
        if self._waker is not None:
            try:
                self._waker()
            except RuntimeError:        # the loop has closed (shutdown)
                pass

    # ---- applying results (loop thread) --------------------------------------------------------
    def _written(self, key: int, e: _Entry, reason: str | None) -> None:
        if self._index.get(key) is not e:
            return      # evicted while being written: its delete was queued after the write
        if reason is None:
            e.ready = True
            self.counters["disk"].stored += 1
            if self.on_change is not None:
                self.on_change("disk", key, True)
            return
        # the block is simply not cached below: a later request recomputes it
        del self._index[key]
        self.used["disk"] -= e.nbytes
        self.counters["disk"].write_errors += 1
        # a full disk fails every write: one line per WRITE_FAIL_LOG_S, the rest counted
        now = time.monotonic()
        if now - self._write_fail_logged < WRITE_FAIL_LOG_S:
            self._write_fail_quiet += 1
            return
        log.warning("kv_tier_write_failed", tier="disk", reason=reason,
                    not_logged=self._write_fail_quiet,
                    effect="block not cached; requests recompute it")
        self._write_fail_logged, self._write_fail_quiet = now, 0

    def _expired(self, job: _Load) -> LoadResult:
        """Abandon a load at its read deadline: unpin its entries, drop the one the read is
        stuck on (the next request must not wait for it too), stand a spare thread in for the
        stuck one. The request recomputes every block."""
        assert job.fut is not None
        if not job.fut.cancel():        # running: its thread may never come back
            self._loader.stuck(job.fut)
        for key, _ in job.where:
            e = self._index.get(key)
            if e is not None:
                e.pins -= 1
        stuck_on = job.current
        tier = stuck_on[1] if stuck_on else (job.where[0][1] if job.where else "disk")
        self.counters[tier].read_timeouts += 1
        if stuck_on is not None:
            e = self._index.get(stuck_on[0])
            if e is not None and not e.pins:
                self._remove(stuck_on[0], e)
        why = (f"{tier} block {stuck_on[0]:032x}: " if stuck_on else "queued: ") + \
            f"no progress in {self.s.read_timeout_s:g} s"
        log.warning("kv_tier_read_timeout", request_id=job.request_id, tier=tier, reason=why,
                    effect="load abandoned; the request recomputes")
        return LoadResult(job.request_id, tuple(k for k, _ in job.where), job.block_ids, (),
                          0.0, job.submitted, time.perf_counter() - job.submitted,
                          {t: 0 for t in TIERS}, job.predicted_recompute_s, why,
                          job.predicted_load_s, timed_out=True)

    def _remove(self, key: int, e: _Entry) -> None:
        """Drop an entry from the index and its store (a disk file: queued on the writer)."""
        del self._index[key]
        self.used[e.tier] -= e.nbytes
        if self.on_change is not None and e.ready:      # KV events: the block is gone
            self.on_change(e.tier, key, False)
        if e.tier == "host":
            assert self.host is not None
            self.host.delete(key)
        else:
            self._track(self._writer.submit(self._delete, key), "delete")

    def _loaded(self, r: LoadResult) -> None:
        now = time.monotonic()
        n_ok = len(r.payloads)
        # unpin every entry the load held; count the ones it read
        for i, key in enumerate(r.keys):
            e = self._index.get(key)
            if e is None:
                continue
            e.pins -= 1
            if i < n_ok:
                e.hits += 1
                e.last_use = now
                c = self.counters[e.tier]
                c.loads += 1
                c.load_bytes += e.nbytes
            elif i == n_ok and r.failed is not None:
                if r.not_regular:
                    self._drop_not_regular(key, e, r.failed)
                else:
                    self._drop_corrupt(key, e, r.failed)
        total = sum(r.bytes_by_tier.values())
        for t, n in r.bytes_by_tier.items():
            if n:   # the read time split by bytes: each tier's share of this load
                self.bandwidth[t].observe(n, r.seconds * n / total)
        # the latency term learns the load's fixed cost: queued behind other loads, handed
        # to the thread, read and verified, beyond its bytes at the tiers' bandwidth
        if n_ok:
            self.latency.observe(r.submitted_to_read_s - sum(
                self.bandwidth[t].seconds(n) for t, n in r.bytes_by_tier.items() if n))
        # slower than recomputing? What the request waited for the blocks (queued until
        # collected here, at the step boundary where it may run) against recomputing them. A
        # recompute would have run in the step in flight and the load's request runs in the
        # next one, so the wait for that boundary is part of the load's cost (and of its
        # prediction: TieredCache.plan's step term), not something to leave out
        took = time.perf_counter() - r.submitted
        if n_ok:
            self.recent_loads.append(LoadRecord(r.request_id, n_ok, took, r.submitted_to_read_s,
                                                r.predicted_load_s, r.predicted_recompute_s))
        if n_ok and took > r.predicted_recompute_s:
            self.slower_than_recompute += 1
            log.info("kv_tier_load_slower_than_recompute", request_id=r.request_id,
                     load_s=round(took, 6), read_s=round(r.submitted_to_read_s, 6),
                     predicted_load_s=round(r.predicted_load_s, 6),
                     predicted_recompute_s=round(r.predicted_recompute_s, 6), blocks=n_ok)

    def _drop_not_regular(self, key: int, e: _Entry, why: str) -> None:
        """Something other than a regular file sits under the block's name (a FIFO, a
        directory, a link): forgotten, left alone, never opened; the request recomputes."""
        if e.pins:
            return
        del self._index[key]
        self.used[e.tier] -= e.nbytes
        if self.on_change is not None and e.ready:
            self.on_change(e.tier, key, False)
        self.counters[e.tier].ignored += 1
        log.warning("kv_tier_file_ignored", tier=e.tier, reason=why,
                    effect="not a regular file: left in place, never read; recomputed")

    def _drop_corrupt(self, key: int, e: _Entry, why: str) -> None:
        """A payload failed its checks: never served again; the request recomputes it."""
        if e.pins:
            return      # another load holds it; the last reader drops it
        self._remove(key, e)
        self.counters[e.tier].corrupt += 1
        log.warning("kv_tier_block_corrupt", tier=e.tier, reason=why,
                    effect="block skipped and removed; recomputed")
