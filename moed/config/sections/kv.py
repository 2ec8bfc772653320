"""[tiers] and [kv_events]: the KV tiers below the engine's cache and vLLM's KV-events stream."""
from __future__ import annotations

from dataclasses import dataclass

from moed.config.schema import ConfigError, _check_bounds, _choice, _f, _short

@dataclass(frozen=True)
class TiersConfig:
    """KV tiers below the engine's KV tensor (moed/kvcache/tiers, docs/kv-tiers.md): L2 host
    memory and L3 local disk, each with a capacity in bytes; 0 turns a tier off."""
    host_bytes: int = _f(0, bounds=(0, 1 << 50), doc="L2 host-memory tier capacity; 0 = off")
    disk_bytes: int = _f(0, bounds=(0, 1 << 56), doc="L3 disk tier capacity; 0 = off")
    disk_dir: str = _f("", doc="directory of the L3 block files (a subdirectory per KV "
                       "layout and checkpoint); required with disk_bytes; kept across restarts")
    disk_io: str = _f("auto", doc="how L3 payloads are read and written: nixl (NIXL's POSIX "
                      "backend) | file (pread/pwrite) | auto (nixl when it loads, else file)")
    write_through: bool = _f(False, doc="also copy each block below when it is first "
                             "completed (hot data), not only when L1 evicts it")
    load_threads: int = _f(2, bounds=(1, 64), doc="threads that read L2/L3 payloads for "
                           "loads (as many spares stand in for threads stuck in a read)")
    read_timeout_s: float = _f(5.0, bounds=(0.001, 3600.0), doc="a load whose block read "
                               "makes no progress this long is abandoned: the request "
                               "recomputes")
    host_bandwidth_mbps: float = _f(5000.0, bounds=(0.001, 1e9),
                                    doc="L2 read bandwidth assumed until measured (MB/s)")
    disk_bandwidth_mbps: float = _f(500.0, bounds=(0.001, 1e9),
                                    doc="L3 read bandwidth assumed until measured (MB/s)")
    recompute_us_per_token: float = _f(100.0, bounds=(0.0, 1e9),
                                       doc="prefill time per token assumed by load-or-recompute "
                                       "until the cost model is fitted (microseconds)")
    reuse_half_life_s: float = _f(60.0, bounds=(0.001, 1e9),
                                  doc="eviction: a block's reuse count counts half after this "
                                  "long unused")
    peer_reuse: bool = _f(False, doc="cluster prefix reuse (colocated and prefill nodes): a "
                          "prompt prefix another colocated or prefill node caches (its gossip "
                          "digest) is READ from it over NIXL when that is predicted faster than "
                          "recomputing; this node also lends its cached blocks to peers "
                          "(POST /internal/kv/lease)")
    peer_bandwidth_mbps: float = _f(1000.0, bounds=(0.001, 1e9),
                                    doc="peer READ bandwidth (MB/s) assumed until "
                                    "measured")

    def __post_init__(self) -> None:
        # across fields (disk_bytes needs disk_dir): moed/config/rules.py tiers_disk; a
        # writable one: moed/preflight.py tiers
        _check_bounds("tiers", self)
        _choice("tiers.disk_io", self.disk_io, ("auto", "nixl", "file"))

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0


KV_EVENT_PUBLISHERS = ("zmq", "null")
KV_EVENT_FORMATS = ("map", "array")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KV-events stream (moed/kvcache/events.py, docs/kv-events.md): the blocks this
    node's KV tiers store and drop, published over ZMQ in vLLM's wire format for prefix-aware
    routers (llm-d's precise prefix-cache scorer, Dynamo's KV router). The field names are
    vLLM's `--kv-events-config` keys; that flag takes the same JSON."""
    enable_kv_cache_events: bool = _f(False, doc="publish KV block events")
    publisher: str = _f("", doc="zmq | null; empty: zmq when enable_kv_cache_events, else null")
    endpoint: str = _f("tcp://*:5557", doc="the PUB socket: bound when it holds * or :: (or "
                       "is ipc:// or inproc://), else connected (vLLM's rule); on an "
                       "expert-parallel rank the port is offset by the rank")
    replay_endpoint: str = _f("", doc="the ROUTER socket that replays buffered batches from "
                              "a sequence number (always bound); empty = no replay")
    buffer_steps: int = _f(10_000, bounds=(1, 10_000_000),
                           doc="batches kept for replay (one batch per engine step at most)")
    hwm: int = _f(100_000, bounds=(1, 1 << 31), doc="the PUB socket's send high-water mark")
    max_queue_size: int = _f(100_000, bounds=(1, 10_000_000),
                             doc="batches waiting for the publisher thread; beyond it a batch "
                             "is dropped and counted (moed_kv_event_batches_total)")
    topic: str = _f("", doc="the first frame of every message (subscribers filter on it)")
    event_format: str = _f("map", doc="moed's addition to vLLM's keys: map (each event a map "
                           "tagged by type, as vLLM sends since its PR #42892) | array (the "
                           "positional arrays earlier vLLM sent, for consumers not yet updated)")

    def __post_init__(self) -> None:
        _check_bounds("kv_events", self)
        _choice("kv_events.event_format", self.event_format, KV_EVENT_FORMATS)
        if self.publisher:
            _choice("kv_events.publisher", self.publisher, KV_EVENT_PUBLISHERS)
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            if v and not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"kv_events.{name}: {_short(v)} is not a tcp://, ipc:// or "
                                  f"inproc:// ZMQ endpoint")
        if self.active and not self.endpoint:
            raise ConfigError("kv_events.endpoint: publishing needs an endpoint")

    @property
    def active(self) -> bool:
        """Events are published (vLLM: enabled and the publisher is not null)."""
        return self.enable_kv_cache_events and self.publisher in ("", "zmq")
