"""Applying the I/O threads' results on the engine's loop thread (TieredCache.collect): an
L3 write that came back, a load that was read (or stopped at a bad entry), a load abandoned
at its read deadline. Only these and the cache's own hooks change the index and the pins.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from moed.kvcache.tiers.records import TIERS, Entry, LoadJob, LoadRecord, LoadResult

if TYPE_CHECKING:
    from moed.kvcache.tiers.cache import TieredCache

log = structlog.get_logger(__name__)

WRITE_FAIL_LOG_S = 10.0         # at most one kv_tier_write_failed line this often


def written(cache: TieredCache, key: int, e: Entry, reason: str | None) -> None:
    """An L3 write came back: the entry becomes readable, or is dropped (the medium refused)."""
    if cache._index.get(key) is not e:
        return      # evicted while being written: its delete was queued after the write
    if reason is None:
        e.ready = True
        cache.counters["disk"].stored += 1
        if cache.on_change is not None:
            cache.on_change("disk", key, True)
        return
    # the block is simply not cached below: a later request recomputes it
    del cache._index[key]
    cache.used["disk"] -= e.nbytes
    cache.counters["disk"].write_errors += 1
    # a full disk fails every write: one line per WRITE_FAIL_LOG_S, the rest counted
    now = time.monotonic()
    if now - cache._write_fail_logged < WRITE_FAIL_LOG_S:
        cache._write_fail_quiet += 1
        return
    log.warning("kv_tier_write_failed", tier="disk", reason=reason,
                not_logged=cache._write_fail_quiet,
                effect="block not cached; requests recompute it")
    cache._write_fail_logged, cache._write_fail_quiet = now, 0


def expired(cache: TieredCache, job: LoadJob) -> LoadResult:
    """Abandon a load at its read deadline: unpin its entries, drop the one the read is
    stuck on (the next request must not wait for it too), stand a spare thread in for the
    stuck one. The request recomputes every block."""
    assert job.fut is not None
    if not job.fut.cancel():        # running: its thread may never come back
        cache._loader.stuck(job.fut)
    for key, _ in job.where:
        e = cache._index.get(key)
        if e is not None:
            e.pins -= 1
    stuck_on = job.current
    tier = stuck_on[1] if stuck_on else (job.where[0][1] if job.where else "disk")
    cache.counters[tier].read_timeouts += 1
    if stuck_on is not None:
        e = cache._index.get(stuck_on[0])
        if e is not None and not e.pins:
            cache._remove(stuck_on[0], e)
    why = (f"{tier} block {stuck_on[0]:032x}: " if stuck_on else "queued: ") + \
        f"no progress in {cache.s.read_timeout_s:g} s"
    log.warning("kv_tier_read_timeout", request_id=job.request_id, tier=tier, reason=why,
                effect="load abandoned; the request recomputes")
    return LoadResult(job.request_id, tuple(k for k, _ in job.where), job.block_ids, (),
                      0.0, job.submitted, time.perf_counter() - job.submitted,
                      {t: 0 for t in TIERS}, job.predicted_recompute_s, why,
                      job.predicted_load_s, timed_out=True)


def loaded(cache: TieredCache, r: LoadResult) -> None:
    """A load came back: unpin, count, learn the tiers' bandwidth and the load latency."""
    now = time.monotonic()
    n_ok = len(r.payloads)
    # unpin every entry the load held; count the ones it read
    for i, key in enumerate(r.keys):
        e = cache._index.get(key)
        if e is None:
            continue
        e.pins -= 1
        if i < n_ok:
            e.hits += 1
            e.last_use = now
            c = cache.counters[e.tier]
            c.loads += 1
            c.load_bytes += e.nbytes
        elif i == n_ok and r.failed is not None:
            if r.not_regular:
                _drop_not_regular(cache, key, e, r.failed)
            else:
                _drop_corrupt(cache, key, e, r.failed)
    total = sum(r.bytes_by_tier.values())
    for t, n in r.bytes_by_tier.items():
        if n:   # the read time split by bytes: each tier's share of this load
            cache.bandwidth[t].observe(n, r.seconds * n / total)
    # the latency term learns the load's fixed cost: queued behind other loads, handed
    # to the thread, read and verified, beyond its bytes at the tiers' bandwidth
    if n_ok:
        cache.latency.observe(r.submitted_to_read_s - sum(
            cache.bandwidth[t].seconds(n) for t, n in r.bytes_by_tier.items() if n))
    # slower than recomputing? What the request waited for the blocks (queued until
    # collected here, at the step boundary where it may run) against recomputing them. A
    # recompute would have run in the step in flight and the load's request runs in the
    # next one, so the wait for that boundary is part of the load's cost (and of its
    # prediction: TieredCache.plan's step term), not something to leave out
    took = time.perf_counter() - r.submitted
    if n_ok:
        cache.recent_loads.append(LoadRecord(r.request_id, n_ok, took, r.submitted_to_read_s,
                                            r.predicted_load_s, r.predicted_recompute_s))
    if n_ok and took > r.predicted_recompute_s:
        cache.slower_than_recompute += 1
        log.info("kv_tier_load_slower_than_recompute", request_id=r.request_id,
                 load_s=round(took, 6), read_s=round(r.submitted_to_read_s, 6),
                 predicted_load_s=round(r.predicted_load_s, 6),
                 predicted_recompute_s=round(r.predicted_recompute_s, 6), blocks=n_ok)


def _drop_not_regular(cache: TieredCache, key: int, e: Entry, why: str) -> None:
    """Something other than a regular file sits under the block's name (a FIFO, a
    directory, a link): forgotten, left alone, never opened; the request recomputes."""
    if e.pins:
        return
    del cache._index[key]
    cache.used[e.tier] -= e.nbytes
    if cache.on_change is not None and e.ready:
        cache.on_change(e.tier, key, False)
    cache.counters[e.tier].ignored += 1
    log.warning("kv_tier_file_ignored", tier=e.tier, reason=why,
                effect="not a regular file: left in place, never read; recomputed")


def _drop_corrupt(cache: TieredCache, key: int, e: Entry, why: str) -> None:
    """A payload failed its checks: never served again; the request recomputes it."""
    if e.pins:
        return      # another load holds it; the last reader drops it
    cache._remove(key, e)
    cache.counters[e.tier].corrupt += 1
    log.warning("kv_tier_block_corrupt", tier=e.tier, reason=why,
                effect="block skipped and removed; recomputed")
