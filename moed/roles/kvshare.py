"""Cluster prefix reuse (`tiers.peer_reuse`, colocated and prefill nodes): READ a peer's cached
prompt blocks over NIXL instead of recomputing them, and lend ours to peers.

A request's way through the reader (KVShareComponent.prefetch, before the scheduler sees it: a
colocated node's client requests through the PeerReuse prompt source, parked meanwhile; a
prefill node's jobs through moed.roles.prefill, which then pushes the whole prompt's KV to the
decode node as always):

    prompt hashes ──best_peer (gossip digests of live, same-checkpoint, same-layout peers)──▶
    at a step boundary: what we hold (L1 + tiers) and the predicted recompute ──plan_load──▶
    recompute: submit as is │ load: POST /internal/kv/lease (signed) ──▶ reserve fresh L1
    blocks ──▶ NIXL READ (peer's blocks → ours) ──▶ at a boundary: adopt them as cached blocks
    ──▶ DELETE the lease ──▶ submit: the engine finds a prefix hit

The lender (POST /internal/kv/lease): at a step boundary it pins the leading run of the hashes
it still caches (moed.kvcache.manager.pin_cached), answers their block ids, its transfer
metadata and the lease's TTL; DELETE or the TTL unpins them (moed.kvcache.tiers.peer.LeaseTable).

Any failure (peer gone, lease refused or expired, no room, a failed or slow read) recomputes:
logged `kv_peer_reuse_failed` with the reason and counted, never an error to the client. The
reserved blocks are released whatever happens: a cancelled request does not interrupt a read in
flight (NIXL is writing them), a timed-out read's blocks wait one more timeout (a stalled
peer's data might still land). A lease we could not DELETE ends at its TTL on the lender.

Peers: live colocated and prefill members (LENDER_ROLES) of the same checkpoint, KV layout and
block size. A decode node neither reads nor lends here: its prompt KV comes from prefill nodes,
which read peers themselves (moed.config refuses the role). One transfer worker per process: on
a prefill node the reader and the lender use the prefill component's.
"""
from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import structlog
from aiohttp import web

from moed.api.errors import APIError
from moed.api.internal import require_signed
from moed.cluster.state import layout_compatible, protocol_compatible
from moed.config import Config
from moed.engine.client import EngineClient
from moed.kvcache.pool import salt_root
from moed.kvcache.tiers.peer import (FAILURE_REASONS, LeaseGrant, LeaseRequest, LeaseTable,
                                     PeerOffer, best_peer, prompt_hashes)
from moed.kvcache.tiers.policy import Bandwidth, Latency, plan_load
from moed.obs import metrics
from moed.obs.coarse import CoarseTotals
from moed.roles.common import advertise_transfer, new_incarnation, start_worker
from moed.roles.sources import PeerReuse
from moed.transfer import TransferState
from moed.transfer.worker import TransferWorker

if TYPE_CHECKING:
    from moed.api.internal import InternalAuth
    from moed.app import App
    from moed.cluster.service import MembershipComponent
    from moed.roles.prefill import PrefillComponent

T = TypeVar("T")

log = structlog.get_logger(__name__)

LEASE_TTL_S = 10.0          # a reader that never says DELETE holds blocks this long at most
LEASE_CALL_S = 2.0          # the lease round trip; a peer slower than this is not worth it
READ_TIMEOUT_S = 5.0        # the NIXL READ; a stalled peer never fails by itself (transfer/)
BOUNDARY_S = 5.0            # waiting for the engine's next step boundary (a step is ms to s)
MAX_HASHES = 1 << 14        # moed.api.affinity.MAX_PREFIX_BLOCKS
LENDER_ROLES = ("colocated", "prefill")     # the roles that run this component


class KVShareComponent:
    """Both sides of cluster prefix reuse on a colocated or prefill node (a moed.app
    Component, started after the prefill component on a prefill node)."""

    name = "kvshare"

    def __init__(self, cfg: Config, node: str) -> None:
        self.cfg = cfg
        self.node = node
        self.incarnation = new_incarnation()
        self.engine: EngineClient | None = None
        self.worker: TransferWorker | None = None
        self.session: aiohttp.ClientSession | None = None
        self.leases = LeaseTable()
        self.bandwidth = Bandwidth(cfg.tiers.peer_bandwidth_mbps * 1e6)
        # a read's fixed cost beyond its bytes (the lease round trip, three step boundaries):
        # learnt from what measured reads took beyond their READ (policy.Latency: cautious)
        self.latency = Latency()
        self._owns_worker = True
        self._prefill: PrefillComponent | None = None   # a prefill node's (its jobs ask us)
        self.block_bytes = 0
        self.model_id = ""
        self._membership: MembershipComponent | None = None
        self._auth: InternalAuth | None = None
        self._expiry: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        # the peer counters as running totals, released to /metrics in batches of requests
        # (prefetches and lease calls): one guess's read is not observable (moed.obs.coarse)
        self._tally: dict[str, float] = {f"failures:{r}": 0.0 for r in FAILURE_REASONS}
        self._requests = 0
        self._gate = CoarseTotals(cfg.server.cache_metrics_batch)

    def _count(self, added: dict[str, float] | None = None, requests: int = 0) -> None:
        """Add to the running totals (keys as metrics.observe_peer names them) and release
        them when a batch of requests is complete."""
        self._requests += requests
        for key, n in (added or {}).items():
            self._tally[key] = self._tally.get(key, 0.0) + n
        metrics.observe_peer(self._gate.update(self._requests, self._tally))

    def add_routes(self, web_app: web.Application) -> None:
        web_app.router.add_post("/internal/kv/lease", self.handle_lease)
        web_app.router.add_delete("/internal/kv/lease/{lease}", self.handle_release)

    async def start(self, app: App) -> None:
        from moed.cluster.service import MembershipComponent
        from moed.roles.prefill import PrefillComponent

        self._membership = next((c for c in app.components

                                 if isinstance(c, MembershipComponent)), None)
        self._auth = app.state.internal_auth
        self.model_id = getattr(app.state, "model_id", "")
        self.engine = app.state.engine
        prefill = next((c for c in app.components if isinstance(c, PrefillComponent)), None)
        if prefill is not None and prefill.worker is not None:
            # a prefill node: its worker (one per process) reads and lends, and its jobs ask
            # this reader first (moed.roles.prefill.PrefillComponent.reuse)
            self.worker, self.incarnation, self._owns_worker = prefill.worker, \
                prefill.incarnation, False
            self._prefill, prefill.reuse = prefill, self
        else:
            self.worker = await start_worker(self.cfg.transfer.backend, self.node, self.engine)
            advertise_transfer(app, self.worker)
        layout = self.engine.kv_region().layout
        self.block_bytes = layout.block_bytes * layout.num_layers
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._expiry = asyncio.create_task(self._expire_loop(), name="kv-lease-expiry")
        for reason in FAILURE_REASONS:      # every reason exported from the start, at 0
            metrics.PEER_FAILURES.labels(reason)
        self._count()
        self.engine.use_prompt_source(PeerReuse(self))

    async def drain(self) -> None:
        pass

    async def stop(self) -> None:
        if self._prefill is not None:
            self._prefill.reuse = None      # jobs still running compute their prompts
        if self._expiry is not None:
            self._expiry.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        pinned = self.leases.drain()
        if pinned and self.engine is not None and self.engine.alive:
            try:
                await asyncio.wait_for(self.engine.at_step_boundary(
                    lambda: [self.engine.kv.unpin(ids) for ids in pinned]), 5.0)
            except (asyncio.TimeoutError, RuntimeError):
                pass    # the engine is stopping: its blocks go with it
        metrics.PEER_LENT_BLOCKS.set(0)
        if self.session is not None:
            await self.session.close()
            self.session = None             # prefetch: not started (or stopped)
        if self.worker is not None and self._owns_worker:
            await self.worker.close()

    # ---- the lender ----------------------------------------------------------------------
    async def handle_lease(self, request: web.Request) -> web.Response:
        body = await request.read()
        reader = require_signed(request, body)
        self._count(requests=1)
        if self.worker is None:
            raise APIError(503, "Node is starting.", code="not_ready")
        try:
            req = LeaseRequest.from_json(json.loads(body), MAX_HASHES)
        except ValueError as e:   # json.JSONDecodeError is a ValueError
            raise APIError(400, f"Bad lease request: {e}", code="bad_lease") from None
        if req.layout_id != self.engine.kv_layout_id or \
                (self.model_id and req.model_id != self.model_id):
            raise APIError(409, "KV layout or checkpoint differs from this node's.",
                           code="incompatible")
        if not self.leases.can_add():
            raise APIError(503, "Too many leases held.", code="busy")
        pinning = self.engine.at_step_boundary(lambda: self.engine.kv.pin_cached(req.hashes))
        try:
            ids = await asyncio.wait_for(asyncio.shield(pinning), LEASE_CALL_S)
        except asyncio.TimeoutError:
            # the reader has given up by now; what the boundary pins later is unpinned then
            pinning.add_done_callback(self._unpin_late)
            raise APIError(503, "The engine did not reach a step boundary in time.",
                           code="busy") from None
        lease = uuid.uuid4().hex
        if ids:
            self.leases.add(lease, reader, ids, time.monotonic() + LEASE_TTL_S)
            self._count({"leases": 1})
            metrics.PEER_LENT_BLOCKS.set(self.leases.pinned())
        md = base64.b64encode(await self.worker.local_metadata()).decode("ascii")
        grant = LeaseGrant(lease, tuple(ids), md, self.incarnation, LEASE_TTL_S)
        log.info("kv_peer_lease_granted", reader=reader, lease=lease, blocks=len(ids),
                 asked=len(req.hashes))
        return web.json_response(grant.to_json())

    async def handle_release(self, request: web.Request) -> web.Response:
        reader = require_signed(request)
        if self.engine is None:
            raise APIError(503, "Node is starting.", code="not_ready")
        ids = self.leases.release(request.match_info["lease"], reader)
        if ids is None:
            return web.json_response({"released": 0}, status=404)
        await self._unpin(ids)
        return web.json_response({"released": len(ids)})

    def _unpin_late(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result():
            self._spawn(self._unpin(fut.result()))

    async def _unpin(self, ids: Sequence[int]) -> None:
        # shielded: the unpin runs at the boundary even if this wait gives up
        try:
            await self._boundary(lambda: self.engine.kv.unpin(ids))
        except asyncio.TimeoutError:
            log.warning("kv_peer_unpin_late", blocks=len(ids),
                        effect="unpinned when the engine reaches its next step boundary")
        metrics.PEER_LENT_BLOCKS.set(self.leases.pinned())

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for lease, ids in self.leases.expired(time.monotonic()):
                log.info("kv_peer_lease_expired", lease=lease, blocks=len(ids))
                await self._unpin(ids)

    # ---- the reader ----------------------------------------------------------------------
    def _peers(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, URL, prefix digest) of the live colocated and prefill peers we may read from:
        the same checkpoint, KV layout and block size, a common protocol, a transfer agent up."""
        view = self._membership.view() if self._membership is not None else None
        if view is None:
            return []
        me = view.get(view.self_name)
        if me is None:
            return []
        peers = []
        for m in (m for role in LENDER_ROLES for m in view.alive(role)):
            if m.name == view.self_name or not m.meta.http or not m.meta.transfer:
                continue
            if not protocol_compatible(me.meta.protocol, m.meta.protocol) or \
                    not layout_compatible(me.meta.layout, m.meta.layout) or \
                    not (me.meta.model_id and me.meta.model_id == m.meta.model_id) or \
                    m.load.block_size != self.engine.block_size:
                continue
            if m.load.prefix_digest:
                peers.append((m.name, m.meta.http, m.load.prefix_digest))
        return peers

    async def _offer(self, tokens: Sequence[int], root: int | None
                     ) -> tuple[list[int], PeerOffer | None]:
        peers = self._peers()
        if not peers:
            return [], None
        # O(prompt) hashing: off the event loop (a long prompt is milliseconds)
        hashes = await asyncio.to_thread(prompt_hashes, tokens, self.engine.block_size, root)
        return hashes, best_peer(hashes, peers) if hashes else None

    async def prefetch(self, request_id: str, tokens: Sequence[int], salt: str = "") -> None:
        """Bring the prompt's leading blocks from a peer when that is predicted faster than
        recomputing them. Never raises (but a cancellation); every path frees what it took."""
        if self.session is None:
            return      # not started yet (or stopped): the prompt is computed as usual
        self._count(requests=1)
        bs = self.engine.block_size
        root = salt_root(salt)      # a salted prompt only matches blocks cached with its salt
        hashes, offer = await self._offer(tokens, root)
        if offer is None:
            return
        eng = self.engine

        def local_state() -> tuple[int, list[float]]:
            """(leading blocks held here: L1, then the tiers below; the predicted recompute
            after loading k more, k = 0 .. what the peer advertises beyond them)."""
            hit = eng.kv.prefix_hit(tokens, root)
            held = len(hit.block_ids)
            tiers = eng.tiers
            if tiers is not None:
                held += len(tiers.match(hashes[held:]).keys)
            return held, [eng.predict_prefill_s(len(tokens) - (held + k) * bs, (held + k) * bs)
                          for k in range(max(len(hashes) - held, 0) + 1)]

        try:
            held, recompute = await self._boundary(local_state)
        except asyncio.TimeoutError:
            return      # an engine this slow to reach a boundary gains nothing from a read
        if held >= offer.depth:
            return      # what the peer advertises we hold already (here or below L1)
        # the digest is a lower bound (depths 1, 2, 4, ...): plan for every block after ours,
        # read what the lease says the peer holds
        per_block = self.bandwidth.seconds(self.block_bytes)
        plan = plan_load([per_block] * (len(hashes) - held), recompute.__getitem__,
                         self.latency.value)
        self._count({f"lookups:{plan.decision}": 1})
        log.info("kv_peer_decision", request_id=request_id, peer=offer.name,
                 decision=plan.decision, predicted_load_s=round(plan.load_s, 6),
                 predicted_recompute_s=round(plan.recompute_s, 6), blocks_held=held,
                 blocks_advertised=offer.depth)
        if not plan.num_load:
            return
        # shielded: a client that goes away mid-read must not free blocks NIXL is writing;
        # the fetch finishes (or fails) and cleans up on its own
        await asyncio.shield(self._spawn(
            self._fetch_logged(request_id, offer, hashes, held, held + plan.num_load)))

    async def _fetch_logged(self, request_id: str, offer: PeerOffer, hashes: Sequence[int],
                            held: int, upto: int) -> None:
        t0 = time.perf_counter()
        reason = await self._fetch(request_id, offer, hashes, held, upto)
        if reason is None:
            return
        self._count({f"failures:{reason.split(':')[0]}": 1})
        log.warning("kv_peer_reuse_failed", request_id=request_id, peer=offer.name,
                    reason=reason, effect="prompt recomputed",
                    after_s=round(time.perf_counter() - t0, 4))

    async def _fetch(self, request_id: str, offer: PeerOffer, hashes: Sequence[int],
                     held: int, upto: int) -> str | None:
        """The lease, the read, the adoption; -> None on success, else the failure reason."""
        assert self.session is not None
        t0 = time.perf_counter()
        req = LeaseRequest(tuple(hashes), self.engine.kv_layout_id, self.model_id)
        data = json.dumps(req.to_json()).encode()
        headers = {**self._auth.sign("POST", "/internal/kv/lease", data),
                   "Content-Type": "application/json"}
        try:
            async with self.session.post(f"{offer.url}/internal/kv/lease", data=data,
                                         headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=LEASE_CALL_S)) as r:
                if r.status != 200:
                    return f"lease_refused: HTTP {r.status}"
                grant = LeaseGrant.from_json(await r.json(), len(hashes))
        except ValueError as e:
            return f"mismatch: {e}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return f"lease_unreachable: {type(e).__name__}"
        try:
            return await self._read(request_id, offer, grant, hashes, held, upto, t0)
        finally:
            if grant.block_ids:
                self._spawn(self._release(offer.url, grant.lease))

    async def _read(self, request_id: str, offer: PeerOffer, grant: LeaseGrant,
                    hashes: Sequence[int], held: int, upto: int, t0: float) -> str | None:
        want = list(range(held, min(len(grant.block_ids), upto)))
        if not want:
            return "nothing_held: the peer has evicted them since its digest"
        eng = self.engine
        reserving = eng.at_step_boundary(lambda: eng.kv.reserve(len(want)))
        try:
            mine = await asyncio.wait_for(asyncio.shield(reserving), BOUNDARY_S)
        except asyncio.TimeoutError:
            reserving.add_done_callback(self._unpin_late)    # released once it has run
            return "engine_busy: no step boundary in time"
        if mine is None:
            return "no_room: no free KV blocks for the read"
        handed_off = False   # adopt (or the quarantine) owns the blocks from then on
        try:
            a0 = time.perf_counter()
            try:
                md = base64.b64decode(grant.metadata, validate=True)
                first_contact = await self.worker.add_peer(offer.name, md, grant.incarnation)
            except Exception as e:      # BadMetadata, IncompatibleLayout, StalePeer, binascii
                return f"mismatch: {type(e).__name__}: {e}"
            src = [grant.block_ids[i] for i in want]
            r0 = time.perf_counter()
            try:
                h = await self.worker.read_blocks(offer.name, src, mine)
            except ValueError as e:     # a block id outside the peer's region
                return f"mismatch: {e}"
            st = await self.worker.wait(h, READ_TIMEOUT_S)
            read_s = time.perf_counter() - r0
            if st.state is not TransferState.DONE:
                if st.reason == "timeout":
                    # aborted, but a stalled peer's data might still land: the blocks go
                    # back only after a second timeout
                    handed_off = True
                    self._spawn(self._unreserve(mine, delay=READ_TIMEOUT_S))
                if st.reason == "peer_disconnected":
                    await self.worker.remove_peer(offer.name)
                kind = "read_timeout" if st.reason == "timeout" else "read_failed"
                return f"{kind}: {st.reason or st.state.value}"
            got = [hashes[i] for i in want]
            handed_off = True   # adopt frees the blocks itself, however late it runs
            try:
                n = await self._boundary(lambda: eng.kv.adopt(mine, got))
            except asyncio.TimeoutError:
                return "engine_busy: no step boundary in time"
            took = time.perf_counter() - t0
            if not first_contact:   # a first READ also sets up the connection (UCX wire-up:
                #                     tens of ms here), a cost paid once per peer incarnation
                self.bandwidth.observe(h.nbytes, read_s)
            # the fixed cost: lease round trip and step boundaries (not a first contact's
            # add_peer, paid once per peer incarnation)
            self.latency.observe(took - read_s - (r0 - a0 if first_contact else 0.0))
            self._count({"hits": 1, "read_blocks": len(want), "read_bytes": h.nbytes})
            log.info("kv_peer_read", request_id=request_id, peer=offer.name, blocks=len(want),
                     cached=n, bytes=h.nbytes, seconds=round(took, 6))
            return None
        finally:
            if not handed_off:
                self._spawn(self._unreserve(mine))

    async def _unreserve(self, ids: list[int], delay: float = 0.0) -> None:
        if delay:
            await asyncio.sleep(delay)
        await self._unpin(ids)

    async def _boundary(self, fn: Callable[[], T]) -> T:
        """fn() between two steps; TimeoutError past BOUNDARY_S (fn still runs then: callers
        whose fn takes something pass its late result to `_unpin_late`)."""
        return await asyncio.wait_for(asyncio.shield(self.engine.at_step_boundary(fn)),
                                      BOUNDARY_S)

    async def _release(self, url: str, lease: str) -> None:
        assert self.session is not None
        path = f"/internal/kv/lease/{lease}"
        try:
            async with self.session.delete(f"{url}{path}", headers=self._auth.sign("DELETE", path),
                                           timeout=aiohttp.ClientTimeout(total=LEASE_CALL_S)):
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.info("kv_peer_release_failed", lease=lease, error=type(e).__name__,
                     effect="the lender unpins at the lease's expiry")

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """Work that must finish even when the request that started it is cancelled."""
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t
