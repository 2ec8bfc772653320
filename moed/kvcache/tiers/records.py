"""The tier cache's records: its settings, the engine's KV seen as payloads, an index entry,
a lookup's match, a load in flight and its result, and the per-tier counters.

Who writes what: `Entry` and `TierCounters` change on the engine's loop thread only; a
`LoadJob` is shared with its loader thread (see its docstring); the rest are frozen.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

TIERS = ("host", "disk")


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
    calibrate: bool = True               # measure each tier's read path at start (startup.calibrate)
    load_threads: int = 2                # loader threads (and as many spares for stuck ones)
    read_timeout_s: float = 5.0          # a block read stalled this long abandons its load


@dataclass
class Entry:
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
class LoadJob:
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
