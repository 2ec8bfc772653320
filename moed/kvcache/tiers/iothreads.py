"""What runs on the tier cache's I/O threads: an L3 write or delete (the writer thread), a
load's block reads (a loader thread) and a load's read deadline (the watchdog thread).

None of these changes the index, the pins or the stores' bookkeeping: each appends its
result to the cache's done queue and wakes the engine's loop, where TieredCache.collect
applies it (the one-writer rule, tiers/cache.py).
"""
from __future__ import annotations

import errno
import time
from typing import TYPE_CHECKING

import structlog

from moed.kvcache.tiers.records import TIERS, Entry, LoadJob, LoadResult
from moed.kvcache.tiers.store import BlockStore, CorruptBlock, NotRegular

if TYPE_CHECKING:
    from moed.kvcache.tiers.cache import TieredCache

log = structlog.get_logger(__name__)


def write(cache: TieredCache, key: int, data: bytes, entry: Entry) -> None:
    assert cache.disk is not None
    try:
        cache.disk.put(key, data)
        cache._done.append(("write", (key, entry, None)))
    except Exception as e:  # noqa: BLE001 - any failure: the entry must not stay unwritten
        reason = "disk full" if getattr(e, "errno", None) == errno.ENOSPC \
            else f"{type(e).__name__}: {e}"
        cache._done.append(("write", (key, entry, reason)))
    cache._wake()


def delete(cache: TieredCache, key: int) -> None:
    assert cache.disk is not None
    try:
        cache.disk.delete(key)
    except OSError as e:
        log.warning("kv_tier_delete_failed", tier="disk", key=f"{key:032x}",
                    reason=f"{type(e).__name__}: {e}", effect="the file stays on disk")


def read(cache: TieredCache, job: LoadJob) -> None:
    t0 = time.perf_counter()
    job.progress = time.monotonic()
    payloads: list[bytes] = []
    by_tier = {t: 0 for t in TIERS}
    failed, not_regular = None, False
    for key, tier in job.where:
        job.current = (key, tier)
        store: BlockStore | None = cache.host if tier == "host" else cache.disk
        try:
            assert store is not None
            data = store.get(key)
            if len(data) != cache.io.block_bytes:
                raise CorruptBlock(f"{len(data)} bytes, a block is {cache.io.block_bytes}")
        except Exception as e:  # noqa: BLE001 - any failure ends the load: the rest recomputes
            failed = f"{tier} block {key:032x}: {e}"
            not_regular = isinstance(e, NotRegular)
            break
        payloads.append(data)
        by_tier[tier] += len(data)
        job.progress = time.monotonic()
    job.finished = True
    cache._done.append(("load", (job, LoadResult(
        job.request_id, tuple(k for k, _ in job.where), job.block_ids, tuple(payloads),
        time.perf_counter() - t0, job.submitted, time.perf_counter() - job.submitted, by_tier,
        job.predicted_recompute_s, failed, job.predicted_load_s, not_regular))))
    job.posted.set()
    cache._wake()


def deadline(cache: TieredCache, job: LoadJob) -> None:
    """The watchdog thread: a load's read deadline passed. Progress since (a block read)
    moves the deadline on; otherwise the loop thread abandons the load (`results.expired`)."""
    if job.finished:
        return
    due = job.progress + cache.s.read_timeout_s
    if due > time.monotonic():
        cache._watchdog.arm(job, due)
        return
    cache._done.append(("expired", job))
    job.posted.set()
    cache._wake()
