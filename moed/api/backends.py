"""Where the router's backends come from (moed.api.proxy picks among them): the membership
view (alive members whose role is in router.backend_roles and whose node-to-node protocol
range overlaps ours, with their gossiped load) or, with membership off, router.backends
polled on /ready.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Protocol

import aiohttp

from moed.balance.candidate import Candidate, protocol_compatible
from moed.cluster.state import PROTOCOL, LoadVector
from moed.config import Config, RouterConfig
from moed.obs import metrics


class BackendSource(Protocol):
    def backends(self) -> list[Candidate]: ...
    def mark_failed(self, name: str) -> None: ...


class MembershipBackends:
    """Alive members of the cluster view with a serving role and an HTTP address."""

    def __init__(self, view: Callable[[], object | None], config: Callable[[], Config]) -> None:
        self._view = view
        self._config = config
        self._failed: dict[str, float] = {}   # name → until (a refused connect, before gossip knows)

    def backends(self) -> list[Candidate]:
        view = self._view()
        if view is None:
            return []
        roles = self._config().router.backend_roles
        now = time.monotonic()
        out = []
        for m in view.alive():  # type: ignore[attr-defined]
            if m.meta.role in roles and m.meta.http and self._failed.get(m.name, 0.0) < now \
                    and protocol_compatible(PROTOCOL, m.meta.protocol):
                out.append(Candidate.of_member(m.name, m.meta.http.rstrip("/"), m.meta, m.load))
        return out

    def mark_failed(self, name: str) -> None:
        self._failed[name] = time.monotonic() + 2.0


class StaticBackends:
    """router.backends, each up or down by its last /ready answer (or a failed connect)."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self._config = config
        self._up: dict[str, Candidate] = {}
        self._task: asyncio.Task[None] | None = None

    def backends(self) -> list[Candidate]:
        urls = {u.rstrip("/") for u in self._config().router.backends}
        return [b for u, b in self._up.items() if u in urls]

    def mark_failed(self, name: str) -> None:
        self._up.pop(name, None)   # until the next successful /ready

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll(session), name="router-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        rc = self._config().router
        urls = [u.rstrip("/") for u in rc.backends]
        results = await asyncio.gather(*(self._ready(session, u, rc) for u in urls))
        for url, load in zip(urls, results):
            if load is None:
                self._up.pop(url, None)
            else:
                waiting, running = load
                self._up[url] = Candidate(url, url, load=LoadVector(waiting=waiting,
                                                                    running=running))

    async def _ready(self, session: aiohttp.ClientSession, url: str, rc: RouterConfig
                     ) -> tuple[int, int] | None:
        """(waiting, running) from the node's /ready, or None when it cannot take work."""
        try:
            async with session.get(url + "/ready", timeout=aiohttp.ClientTimeout(
                    total=max(rc.health_interval_s, rc.connect_timeout_s))) as r:
                if r.status != 200:
                    return None
                body = await r.json(content_type=None)
                if not isinstance(body, dict):
                    return 0, 0
                return int(body.get("waiting", 0)), int(body.get("running", 0))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError):
            return None

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.poll_once(session)
            metrics.ROUTER_BACKENDS.set(len(self.backends()))
            await asyncio.sleep(self._config().router.health_interval_s)
