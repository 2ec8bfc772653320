"""The membership component of the daemon: the SWIM core on asyncio + UDP, its keys, its
metadata and load, its logs and metrics, and GET /cluster.

Lifecycle: start (bind UDP/TCP, resolve seeds, join: seeds are retried until one answers)
→ every load_update_interval: copy the engine's load into the gossip → drain: graceful leave
(peers mark us LEFT at once) → stop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Mapping

import structlog
from aiohttp import web

from moed import __version__
from moed.config import Config, ConfigError
from moed.safefile import FileRefused, read_regular_file

if TYPE_CHECKING:
    from moed.balance.capacity import Capacity
    from moed.balance.cost import AdvertisedCost
    from moed.engine.client import EngineClient
    from moed.kvcache.manager import KVCacheManager

from .clock import AsyncioScheduler
from .members import SwimConfig
from .state import (MAX_BUCKETS, MAX_DIGEST, MAX_QUEUED, PROTOCOL, ClusterView, LoadVector,
                    MemberEvent, NodeMeta, digest_key, fold_priorities, incompatible_counts)
from .swim import Membership
from .udp import UdpTransport, split_addr
from .wire import Keyring, WireCodec

log = structlog.get_logger(__name__)


class ClusterError(ConfigError):
    """The membership cannot start (message fit for an operator)."""


MAX_KEY_BYTES = 4096     # a key is 32 bytes (64 hex digits); a big file is not a key file


def parse_key(raw: bytes, source: str) -> bytes:
    """A key file/variable holds hex (whitespace ignored) or raw bytes; at least 16 bytes.
    Raw bytes may be anything (head -c 32 /dev/urandom): a key need not be text."""
    text = raw.strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = text
    if len(key) < 16:
        raise ClusterError(f"{source}: cluster key must be at least 16 bytes (32 hex digits)")
    return key


def _read_key(path: str, what: str) -> bytes:
    # Only a small regular file, read without blocking: a FIFO here would hang the event loop
    # (the key is read again on every SIGHUP), /dev/zero would fill memory.
    try:
        raw = read_regular_file(path, MAX_KEY_BYTES)
    except FileRefused as e:
        raise ClusterError(f"{what} {path}: {e}") from None
    except OSError as e:
        raise ClusterError(f"{what} {path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:              # a NUL in the path
        raise ClusterError(f"{what} {path}: cannot read: {e}") from None
    return parse_key(raw, f"{what} {path}")


def load_keyring(cc: Any, environ: Mapping[str, str] = os.environ) -> Keyring:
    """Primary key from cluster.key_file or cluster.key_env; cluster.secondary_key_file is
    also accepted (rotation). No key → refuse, unless cluster.insecure says otherwise."""
    primary: bytes | None = None
    if cc.key_file:
        primary = _read_key(cc.key_file, "cluster.key_file")
    elif cc.key_env:
        value = environ.get(cc.key_env, "")
        if not value:
            raise ClusterError(f"cluster.key_env: environment variable {cc.key_env} is unset "
                               f"or empty")
        # os.fsencode: the variable's own bytes, also when they are not UTF-8 (str.encode
        # would raise on the surrogates Python decoded them to)
        primary = parse_key(os.fsencode(value), f"cluster.key_env {cc.key_env}")
    secondary = ((_read_key(cc.secondary_key_file, "cluster.secondary_key_file"),)
                 if cc.secondary_key_file else ())
    if primary is None:
        if not cc.insecure:
            raise ClusterError("cluster: no cluster key; set cluster.key_file or "
                               "cluster.key_env (hex, >= 16 bytes), or cluster.insecure = true "
                               "for a test cluster")
        log.warning("cluster_insecure", detail="gossip packets are not authenticated")
        return Keyring(b"", secondary)
    return Keyring(primary, secondary)


async def resolve(addrs: tuple[str, ...]) -> tuple[str, ...]:
    """host:port → ip:port (once at start: the protocol never blocks on DNS)."""
    loop = asyncio.get_running_loop()
    out = []
    for a in addrs:
        host, port = split_addr(a)
        try:
            infos = await loop.getaddrinfo(host, port, family=socket.AF_INET,
                                           type=socket.SOCK_DGRAM)
            out.append(f"{infos[0][4][0]}:{port}")
        except OSError as e:
            log.warning("cluster_seed_unresolved", seed=a, error=str(e))
    return tuple(out)


class MembershipComponent:
    """App component (see moed.app): `view()` is what the rest of the daemon reads."""

    name = "cluster"

    def __init__(self, cfg: Config, *, environ: Mapping[str, str] = os.environ) -> None:
        self.cfg = cfg
        self.keyring = load_keyring(cfg.cluster, environ)   # fail before binding anything
        self.core: Membership | None = None
        self.transport: UdpTransport | None = None
        self._app: Any = None
        self._tasks: list[asyncio.Task] = []
        self._synced: dict[str, int] = {}

    # ---- API for the rest of the daemon ----

    def view(self) -> ClusterView | None:
        return self.core.view() if self.core is not None else None

    def subscribe(self, fn: Callable[[MemberEvent], None]) -> Callable[[], None]:
        if self.core is None:
            raise RuntimeError("membership not started")
        return self.core.subscribe(fn)

    def update_meta(self, **fields: str) -> None:
        """Change some of our metadata (e.g. transfer="host:port"); gossiped at once."""
        if self.core is None:
            raise RuntimeError("membership not started")
        me = self.core.view().get(self.core.name)
        assert me is not None
        self.core.set_meta(dataclasses.replace(me.meta, **fields))

    def set_load(self, load: LoadVector) -> None:
        if self.core is not None:
            self.core.set_load(load)

    # ---- component protocol ----

    def add_routes(self, web_app: web.Application) -> None:
        async def cluster(request: web.Request) -> web.Response:
            view = self.view()
            if view is None:
                return web.json_response({"error": {"message": "membership is starting",
                                                    "code": "not_ready"}}, status=503)
            return web.json_response(view.to_json())
        web_app.router.add_get("/cluster", cluster)

    async def start(self, app: Any) -> None:
        self._app = app
        cc = self.cfg.cluster
        self.transport = UdpTransport(cc.bind_host, cc.bind_port, cc.advertise_host,
                                      keyring=self.keyring,
                                      replay_window_s=cc.replay_window_ms / 1000)
        try:
            await self.transport.start()
        except OSError as e:
            raise ClusterError(f"cluster: cannot bind {cc.bind_host}:{cc.bind_port}: "
                               f"{e.strerror}") from None
        if split_addr(self.transport.local_address())[0] in ("0.0.0.0", "::", ""):
            self.transport.shutdown()
            raise ClusterError("cluster.advertise_host: required when bind_host is a "
                               "wildcard (peers need an address they can reach)")
        seeds = await resolve(cc.seeds)
        meta = node_meta(self.cfg, app)
        self.core = Membership(
            app.node, self.transport, AsyncioScheduler(), SwimConfig.from_cluster(cc),
            WireCodec(self.keyring), meta=meta, seeds=seeds,
            # a restarted node must outrank its previous life: time-based incarnation (and
            # if that is not enough, it refutes what peers tell it about itself)
            incarnation=int(time.time()))
        self.core.subscribe(self._on_event)
        joined: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

        waiting = [True]                 # start is still holding for the first answer

        def on_join(err: Exception | None) -> None:
            if waiting[0]:
                if not joined.done():
                    joined.set_result(err)
            elif err is not None:      # refused after the start: a seed that came up late
                app.fail(str(err))
        self.core.on_join = on_join
        self.core.start()
        log.info("cluster_started", node=app.node, addr=self.transport.local_address(),
                 seeds=list(seeds), incarnation=self.core.incarnation)
        if self.core.seeds:
            # Hold the start until a seed answers, so that a duplicate name fails it (exit 1);
            # not for long: seeds may come up after us, and the join goes on in the background.
            try:
                await asyncio.wait([joined], timeout=max(1.0, 3 * cc.join_retry_ms / 1000))
            except asyncio.CancelledError:     # stopped while starting: leave no core behind
                self.core.stop()
                raise
        waiting[0] = False
        if joined.done() and joined.result() is not None:
            raise ClusterError(str(joined.result()))
        self._tasks.append(app.spawn(self._load_loop(), "cluster-load"))
        self._tasks.append(app.spawn(self._metrics_loop(), "cluster-metrics"))

    async def drain(self) -> None:
        await self.leave(timeout=1.0)

    async def leave(self, timeout: float) -> None:
        """Tell peers we are leaving and give the news a moment to spread."""
        if self.core is None:
            return
        self.core.leave()
        log.info("cluster_leaving", node=self.core.name)
        await asyncio.sleep(min(timeout, self.core.cfg.gossip_interval_s * 2))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.core is not None:
            self._sync_metrics()
            self.core.stop()

    def prepare_reload(self, old: Config, new: Config) -> Callable[[], None] | None:
        """SIGHUP (see moed.ops.reload): validate now, apply on commit. Timings, seeds and
        keys (rotation without a restart) are live; bind address and insecure are not."""
        if old.cluster == new.cluster or self.core is None:
            return None
        keyring = load_keyring(new.cluster)        # ClusterError: the reload is refused
        swim_cfg = SwimConfig.from_cluster(new.cluster)
        core = self.core

        def commit() -> None:
            self.cfg, self.keyring = new, keyring
            core.cfg, core.codec = swim_cfg, WireCodec(keyring)
            if self.transport is not None:      # stream headers follow the same keys
                self.transport.keyring = keyring
                self.transport.replay_window_s = new.cluster.replay_window_ms / 1000
            core.seeds = tuple(s for s in new.cluster.seeds if s != core.addr)
            log.info("cluster_reloaded", seeds=list(core.seeds),
                     secondary_keys=len(keyring.secondary))
        return commit

    # ---- background ----

    def _on_event(self, ev: MemberEvent) -> None:
        from moed.obs import metrics
        metrics.CLUSTER_MEMBER_EVENTS.labels(ev.new.value).inc()
        if ev.old is ev.new:
            log.debug("member_updated", member=ev.name, incarnation=ev.incarnation)
            return
        log.info("member_state", member=ev.name, old=ev.old.value if ev.old else None,
                 new=ev.new.value, incarnation=ev.incarnation)

    async def _load_loop(self) -> None:
        digest = PrefixDigest()
        while True:
            engine = getattr(self._app.state, "engine", None)
            if engine is not None and self.core is not None:
                try:
                    # the app's config: balance.prefix_digest_size is live on SIGHUP
                    size = getattr(self._app, "config", self.cfg).balance.prefix_digest_size
                    signals = getattr(self._app.state, "capacity", None)   # moed.app wires it
                    self.core.set_load(load_of(engine, digest, size,
                                               signals() if signals is not None else None,
                                               kv=engine.kv, adv=engine.advertised()))
                except Exception as e:          # load is advisory; never kill the loop
                    log.warning("cluster_load_failed", error=repr(e))
            await asyncio.sleep(self.cfg.cluster.load_update_interval_ms / 1000.0)

    async def _metrics_loop(self) -> None:
        while True:
            self._sync_metrics()
            await asyncio.sleep(1.0)

    def _sync_metrics(self) -> None:
        from moed.obs import metrics
        if self.core is None:
            return
        for state, n in self.core.view().counts().items():
            metrics.CLUSTER_MEMBERS.labels(state).set(n)
        metrics.CLUSTER_LOCAL_HEALTH.set(self.core.awareness)
        view = self.core.view()
        me = view.get(view.self_name)
        if me is not None:       # the compatibility rule every placement policy applies
            others = [m.meta for m in view.alive() if m.name != view.self_name]
            for reason, n in incompatible_counts(me.meta, others).items():
                metrics.CLUSTER_INCOMPATIBLE.labels(reason).set(n)
        stats = dict(self.core.stats)
        if self.transport is not None:
            stats.update({f"transport.{k}": v for k, v in self.transport.stats.items()})
        for key, value in stats.items():
            delta = value - self._synced.get(key, 0)
            if delta <= 0:
                continue
            self._synced[key] = value
            if key.startswith("dropped."):
                metrics.CLUSTER_DROPPED.labels(key[8:]).inc(delta)
            elif key in _MESSAGE_KEYS:
                metrics.CLUSTER_MESSAGES.labels(*_MESSAGE_KEYS[key]).inc(delta)
            elif key in _PROTOCOL_KEYS or key.startswith("transport."):
                metrics.CLUSTER_PROTOCOL.labels(key.replace("transport.", "")).inc(delta)


class PrefixDigest:
    """The node's cached leading blocks, most recent first (what LoadVector.prefix_digest
    carries): each load tick adds the hashes at depths 1, 2, 4, ... of every live block table
    and of the tables freed since the last tick, and drops those the pool no longer holds. A
    read of the KV manager on the event loop's thread (the step loop's one writer runs there
    too): O(tables · log depth + entries), once a second."""

    MAX_TRACKED = 4 * MAX_DIGEST       # remembered beyond what is advertised (LRU)

    def __init__(self) -> None:
        self._recent: OrderedDict[int, None] = OrderedDict()     # full hash → (LRU order)
        self._seen = 0                                           # kv.freed_since cursor

    def update(self, kv: Any, size: int) -> tuple[int, ...]:
        if size <= 0 or kv is None or not getattr(kv, "enable_prefix_caching", False):
            self._recent.clear()
            return ()
        self._seen, freed = kv.freed_since(self._seen)
        for lead in [*freed, *kv.leading_hashes()]:       # live tables last: the most recent
            for h in lead:
                self._recent[h] = None
                self._recent.move_to_end(h)
        for h in [h for h in self._recent if not kv.is_cached(h)]:
            del self._recent[h]
        while len(self._recent) > self.MAX_TRACKED:
            self._recent.popitem(last=False)
        newest = list(reversed(self._recent))[:min(size, MAX_DIGEST)]
        return tuple(digest_key(h) for h in newest)


def _sig(x: float) -> float:
    """4 significant digits: the coefficients' noise is larger, and the Alive stays small."""
    return float(f"{x:.4g}")


def load_of(engine: EngineClient, digest: PrefixDigest, digest_size: int,
            capacity: Capacity | None = None, *, kv: KVCacheManager | None = None,
            adv: AdvertisedCost | None = None) -> LoadVector:
    """What this node gossips: queue and KV from engine.stats(); the prefill cost state
    (queued tokens per length bucket, fitted coefficients) when the cost policy runs with a
    fitted model; the prefix digest from the KV manager; the capacity signals when given
    (a moed.balance.capacity.Capacity)."""
    s = engine.stats()
    fields: dict[str, Any] = {}
    if adv is not None and len(adv.queued_tokens) <= MAX_BUCKETS:
        # clamped: the largest load must leave an Alive that fits a packet (cluster.state)
        fields = dict(bucket_edges=tuple(adv.bucket_edges),
                      queued_tokens=tuple(min(int(v), MAX_QUEUED) for v in adv.queued_tokens),
                      queued_requests=tuple(min(int(v), MAX_QUEUED)
                                            for v in adv.queued_requests),
                      cost=tuple(_sig(max(c, 0.0)) for c in adv.coefficients.as_tuple()),
                      prefill_share=_sig(min(max(adv.prefill_share, 0.0), 1.0)),
                      chunk_tokens=min(int(adv.chunk_tokens), 1 << 24))
    c = capacity
    if c is not None:
        def m(x: float) -> float:       # -1 = not measured; else 4 digits, within the wire's
            return -1.0 if x < 0 else _sig(min(x, 1e15))
        fields.update(prefill_tps=m(c.prefill_tps), decode_step_s=m(c.decode_step_s),
                      queue_s=m(c.queue_s), compute_s=m(c.compute_s),
                      predicted_ttft_s=m(c.predicted_ttft_s),
                      capacity_tokens=min(c.capacity_tokens, MAX_QUEUED))
    return LoadVector(waiting=s.waiting + s.waiting_remote_kv, running=s.running,
                      free_kv_blocks=s.kv_blocks_free,
                      queued_prefill_tokens=s.queued_prompt_tokens,
                      block_size=0 if kv is None else kv.block_size,
                      prefix_digest=digest.update(kv, digest_size),
                      waiting_by_priority=fold_priorities(
                          getattr(s, "waiting_by_priority", ())), **fields)


_MESSAGE_KEYS = {"sent_packets": ("sent", "packet"), "recv_packets": ("received", "packet"),
                 "sent_streams": ("sent", "stream"), "recv_streams": ("received", "stream")}
_PROTOCOL_KEYS = {"probe_failures", "refutes", "suspicion_timeouts", "reprobes",
                  "last_chance_probes", "join_attempts", "stale_updates", "name_conflicts",
                  "name_taken"}


def node_meta(cfg: Config, app: Any) -> NodeMeta:
    """What this node says about itself (its metadata in the gossip, its /cluster entry)."""
    cc = cfg.cluster
    host = cfg.server.host if cfg.server.host not in ("0.0.0.0", "::") else (
        cc.advertise_host or cc.bind_host)
    return NodeMeta(role=cfg.server.role, http=f"http://{host}:{app.port}",
                    model=getattr(app.state, "model_name", "") or "",
                    # the transfer endpoint is added by the prefill/decode role once its
                    # transfer agent exists (moed.roles.common.advertise_transfer)
                    layout="" if app.state.engine is None else app.state.engine.kv_layout_id,
                    transfer="", version=__version__, label=cfg.release.label(),
                    model_id=getattr(app.state, "model_id", "") or "",
                    config=cfg.digest(), protocol=PROTOCOL, **_ep_fields(cfg))


def _ep_fields(cfg: Any) -> dict[str, str]:
    """An expert-parallel rank advertises its group and place in it (moed.parallel)."""
    p = cfg.parallel
    if p.ep_size <= 1:
        return {}
    return {"ep_group": p.ep_init, "ep_rank": str(p.ep_rank), "ep_size": str(p.ep_size)}
