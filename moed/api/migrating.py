"""The router's relay of a migratable stream (the I/O half of moed.api.migrate).

Lifecycle of one relayed stream (the ledger's phases, moed.api.migrate.StreamPhase):
  RELAYING: events are read whole from the node, recorded and rewritten (token ids stripped
    unless the client asked, the first chunk's id kept) and written to the client
  a failure — the connection drops or the stream ends without [DONE] (connection), the node's
    own server-side error event (error_event; drain: a draining node handed it back), or no
    byte for POLL_S while membership no longer lists the node (node_dead) → MIGRATING: the
    node is marked failed (not a draining one), the next one is placed (never a node this
    request already failed on) and gets the continuation, signed with the cluster key (or the
    original request when the client has no event yet) → RELAYING again
  [DONE] → DONE. A finish already relayed when the node died: the router closes the stream
    itself (usage when asked, [DONE]). router.migration_limit resubmissions spent, no node left,
    or a node refusing the continuation → FAILED: one server_error event, no [DONE].
  n > 1: the failure moves the lowest unfinished choice (one migration, counted); when its
    continuation's [DONE] comes, the next unfinished choice goes the same way (not counted:
    it is the same failure's), on any node it has not failed on; after the last one the
    router closes the stream (usage of every choice when asked, [DONE]).
A hung node (SIGSTOP) keeps its sockets open: only "silent while no longer listed" sees it,
so every wait on a node here — headers, first bytes, the next bytes — goes through that check
(`unless_silent`, and the relay's own poll).
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Awaitable, TypeVar

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from moed.api.migrate import EventSplitter, Ledger, Reason, StreamPhase, error_event
from moed.obs import metrics

if TYPE_CHECKING:
    from moed.api.proxy import Proxy
    from moed.balance.candidate import Candidate

log = structlog.get_logger(__name__)

POLL_S = 1.0          # how long a silent node goes before membership is asked about it
T = TypeVar("T")
CONTINUE = "/internal/continue"


async def unless_silent(proxy: Proxy, backend: Candidate, aw: Awaitable[T]) -> T | None:
    """`aw`'s result, or None once it has waited POLL_S while membership no longer lists the
    node (a hung node: its socket stays open, so only that tells). For a migratable stream's
    response headers and first bytes: a stream queued there sends nothing until its first
    token, and without this would wait for the total timeout. Errors propagate."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if not proxy.is_listed(backend.name):
                return None
    finally:
        if not task.done():
            task.cancel()


async def _send(out: web.StreamResponse, data: bytes) -> None:
    await out.write(b"data: " + data + b"\n\n")


async def _relay_one(proxy: Proxy, out: web.StreamResponse, resp: aiohttp.ClientResponse,
                     first: bytes, ledger: Ledger, backend: Candidate, t0: float
                     ) -> Reason | None:
    """Relay one node's stream until [DONE] (None) or a failure (its reason)."""
    split = EventSplitter()            # a new node: an event cut by the old one is dropped
    timing = proxy.timing(backend, t0)
    chunk: bytes | None = first
    read: asyncio.Future[bytes] | None = None
    try:
        while True:
            if chunk is not None:
                timing.chunk(chunk, time.monotonic())
                for data in split.feed(chunk):
                    client, failed = ledger.relay(data)
                    if failed:
                        return Reason.DRAIN if ledger.handed_off else Reason.ERROR_EVENT
                    if client is not None:
                        await _send(out, client)
                    if ledger.phase is StreamPhase.DONE or ledger.ended:
                        proxy.record(backend, "ok", *timing.figures())
                        return None
                if not chunk:
                    return Reason.CONNECTION          # the body ended without [DONE]
            read = read or asyncio.ensure_future(resp.content.readany())
            done, _ = await asyncio.wait({read}, timeout=POLL_S)
            if not done:
                chunk = None
                if not proxy.is_listed(backend.name):
                    return Reason.NODE_DEAD
                continue
            try:
                chunk, read = read.result(), None
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                read = None
                return Reason.CONNECTION
    finally:
        if read is not None and not read.done():
            read.cancel()


async def relay(proxy: Proxy, request: web.Request, out: web.StreamResponse,
                resp: aiohttp.ClientResponse, first: bytes, ledger: Ledger,
                backend: Candidate, headers: CIMultiDict[str],
                timeout: aiohttp.ClientTimeout, t0: float) -> None:
    """Relay the stream, migrating it on a node's failure (see the module docstring). `resp`
    is the caller's (it closes it); every response opened here is closed here."""
    limit = proxy.migration_limit()
    tried = [backend.name]
    own: aiohttp.ClientResponse | None = None
    try:
        while True:
            reason = await _relay_one(proxy, out, resp, first, ledger, backend, t0)
            count = True
            if reason is None and ledger.current is not None:    # one choice's continuation
                ledger.ended = False                    # ended: close, or the next choice
                if ledger.current not in ledger.done:
                    reason = Reason.CONNECTION          # [DONE] before its finish
                else:                                   # not a migration; the node is fine
                    count = False
                    tried = [t for t in tried if t != backend.name]
            if reason is None and count:
                await out.write_eof()
                return
            if count:
                proxy.record(backend, "error")
            if count and reason not in (Reason.ERROR_EVENT, Reason.DRAIN):
                proxy.mark_failed(backend.name)
            if own is not None:
                own.close()
                own = None
            if ledger.finished:           # every token is out: end it here
                for data in ledger.closing():
                    await _send(out, data)
                ledger.to(StreamPhase.DONE)
                await out.write_eof()
                return
            ledger.to(StreamPhase.MIGRATING)
            moved = await _resubmit(proxy, request, ledger, tried, headers, timeout,
                                    limit if count else None, backend.name, reason)
            if moved is None:
                ledger.to(StreamPhase.FAILED)
                metrics.ROUTER_REQUESTS.labels(result="failed_mid_stream").inc()
                await _send(out, error_event(
                    "The serving node failed mid-stream and the stream could not be moved to "
                    "another node.", "backend_failed"))
                return
            backend, own, first, t0 = moved
            resp = own
            ledger.to(StreamPhase.RELAYING)
    finally:
        if own is not None:
            own.close()


async def _resubmit(proxy: Proxy, request: web.Request, ledger: Ledger, tried: list[str],
                    headers: CIMultiDict[str], timeout: aiohttp.ClientTimeout,
                    limit: int | None, failed: str, reason: Reason | None
                    ) -> tuple[Candidate, aiohttp.ClientResponse, bytes, float] | None:
    """The next node streaming this request's continuation, or None (limit, no node, or every
    node refused it). Each attempt counts against router.migration_limit; limit None: the
    next choice of an n > 1 stream after one finished (not a migration: its attempts are
    bounded by the nodes not yet tried)."""
    signer = proxy.signer()
    rid = headers.get("X-Request-Id", "")
    while limit is None or ledger.migrations < limit:
        kind, body = ledger.resubmission(proxy.replay())
        if kind == "continue" and signer is None:
            log.error("router_migration_unsigned", request_id=rid,
                      why="no cluster key on the router: a continuation must be signed")
            return None
        backend = proxy.pick(tried)
        if backend is None:
            return None
        tried.append(backend.name)
        ledger.migrations += limit is not None
        path = (CONTINUE + request.path) if kind == "continue" else request.path
        h = CIMultiDict(headers)
        if kind == "continue":
            # signed by this router; the tenant's Authorization still goes along (as to /v1):
            # the node salts the prompt's cache blocks by it (server.prefix_cache_isolation)
            h.update(signer.sign("POST", path, body))
        h["Content-Type"] = "application/json"
        t0 = time.monotonic()
        try:
            resp = await unless_silent(proxy, backend, proxy.session().post(
                backend.url + path, data=body, headers=h, timeout=timeout,
                allow_redirects=False))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            resp, why = None, repr(e)
        else:
            why = "silent while no longer listed"
        if resp is None:
            log.warning("router_migration_unreachable", request_id=rid, to=backend.name,
                        error=why)
            proxy.mark_failed(backend.name)
            continue
        try:
            first = (await unless_silent(proxy, backend, resp.content.readany()) or b"") \
                if resp.status == 200 else b""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            first = b""
        if resp.status != 200 or not first:
            log.warning("router_migration_refused", request_id=rid, to=backend.name,
                        status=resp.status)
            resp.close()
            continue
        if reason is not None and limit is not None:
            metrics.ROUTER_MIGRATIONS.labels(reason=reason.value).inc()
        log.info("router_stream_migrated", request_id=rid, from_node=failed, to_node=backend.name,
                 reason=reason.value if reason is not None else "next_choice", tokens_sent=len(ledger.output_ids), kind=kind,
                 choice=ledger.current, migration=ledger.migrations,
                 connect_s=round(time.monotonic() - t0, 3))
        return backend, resp, first, t0
    return None
