"""The tier cache's start: a restart finds its L3 again, and each tier's read path is
measured before the first decision (TieredCache.__init__ calls both, before any I/O).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from moed.kvcache.tiers.policy import Latency
from moed.kvcache.tiers.records import TIERS, Entry
from moed.kvcache.tiers.store import BlockStore, CorruptBlock

if TYPE_CHECKING:
    from moed.kvcache.tiers.cache import TieredCache

log = structlog.get_logger(__name__)

PROBE_KEY = (1 << 128) - 1      # the warm-up probe's key: not a key the pool's hashes produce
PROBE_READS = 5                 # warm-up reads per tier; the first (thread and agent set-up) unused
MAX_IGNORED_LOGGED = 20         # start-up log lines for entries that are not block files


def restore(cache: TieredCache) -> None:
    """A restart finds its L3 again: the index from the files (checked); bad ones counted.
    Files beyond the capacity (it shrank) are dropped, least useful (any) first."""
    assert cache.disk is not None
    scan = cache.disk.scan()
    cache.counters["disk"].corrupt += scan.skipped
    cache.counters["disk"].ignored += len(scan.ignored)
    for name, kind in scan.ignored[:MAX_IGNORED_LOGGED]:
        log.warning("kv_tier_file_ignored", tier="disk", dir=str(cache.disk.dir), name=name,
                    kind=kind, effect="not a regular file: left in place, never read")
    for key, n in scan.entries.items():
        if cache.used["disk"] + n > cache.capacity["disk"]:
            cache.disk.delete(key)
            continue
        cache._index[key] = Entry("disk", n)
        cache.used["disk"] += n
    cache.restored = len(cache._index)
    log.info("kv_tier_restored", tier="disk", blocks=cache.restored, skipped=scan.skipped,
             ignored=len(scan.ignored), bytes=cache.used["disk"], dir=str(cache.disk.dir),
             io=cache.disk.fileio.name)


def calibrate(cache: TieredCache) -> None:
    """Measure each tier's read path before the first decision: a probe block written
    (L3: through the writer thread, as write-back does) and read PROBE_READS times through
    the load thread, as a load is. The first read also starts the thread (and its NIXL
    agent) and is not counted; the others seed the tier's bandwidth (median read) and the
    load latency (the slowest hand-off: queue + wake-up beyond the read). Without it the
    first loads were predicted from config seeds and a zero latency, and some came out
    slower than recomputing (docs/kv-tiers.md). A tier whose probe fails keeps its seed."""
    probe = bytes(cache.io.block_bytes)
    handoff: list[float] = []
    for tier, store in (("host", cache.host), ("disk", cache.disk)):
        if store is None:
            continue
        try:
            if tier == "disk":
                cache._writer.submit(store.put, PROBE_KEY, probe).result(timeout=10.0)
            else:
                store.put(PROBE_KEY, probe)
            reads = []
            for _ in range(PROBE_READS):
                t0 = time.perf_counter()
                read_s = cache._loader.submit(_probe_read, store).result(timeout=10.0)
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
            cache.bandwidth[tier].value = len(probe) / median
        handoff += [max(total - r, 0.0) for r, total in reads[1:]]
    if handoff:
        cache.latency = Latency(max(handoff))
    log.info("kv_tier_calibrated", latency_s=round(cache.latency.value, 6),
             **{f"{t}_bandwidth_bytes_per_s": round(cache.bandwidth[t].value)
                for t in TIERS if cache.capacity[t]})


def _probe_read(store: BlockStore) -> float:
    t0 = time.perf_counter()
    store.get(PROBE_KEY)
    return time.perf_counter() - t0
