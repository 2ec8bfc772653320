"""TransferWorker: the asyncio face of a TransferBackend.

Every backend call runs on ONE dedicated thread (backends are not thread-safe, and NIXL's
synchronous cma copy in write_blocks must not stall the event loop). A poll task drives progress
from that thread: fast while transfers or expected notifications are outstanding, slow when
idle, so nothing spins a core. Notifications are never dropped: they go to `on_notif` or, if
none is set, to the `notifs` queue.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import structlog

from moed.transfer.base import (TransferBackend, TransferHandle, TransferState,
                                TransferStatus)

log = structlog.get_logger(__name__)

NotifHandler = Callable[[str, bytes], None]
Observer = Callable[[TransferHandle, TransferStatus, float], None]


class TransferWorker:
    def __init__(self, factory: Callable[[], TransferBackend], *, busy_poll_s: float = 0.001,
                 idle_poll_s: float = 0.02, on_notif: NotifHandler | None = None,
                 observer: Observer | None = None) -> None:
        self._factory = factory
        self._busy_poll_s = busy_poll_s
        self._idle_poll_s = idle_poll_s
        self.on_notif = on_notif
        self.observer = observer
        self.notifs: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._ex: ThreadPoolExecutor | None = None
        self._backend: TransferBackend | None = None
        self._waiters: dict[int, tuple[TransferHandle, asyncio.Future[TransferStatus], float]] = {}
        self._busy = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.name = ""

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")
        self._backend = await self._run(self._factory)
        self.name = self._backend.name
        self._task = asyncio.create_task(self._poll_loop(), name="kv-transfer-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._backend is not None:
            await self._run(self._backend.close)
            self._backend = None
        for _, fut, _ in self._waiters.values():
            if not fut.done():
                fut.set_result(TransferStatus(TransferState.ABORTED, "closed"))
        self._waiters.clear()
        if self._ex is not None:
            self._ex.shutdown(wait=True)
            self._ex = None

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._ex is None:
            raise RuntimeError("TransferWorker is not started")
        return await asyncio.get_running_loop().run_in_executor(self._ex, fn, *args)

    @property
    def backend(self) -> TransferBackend:
        """For calls from the worker thread only (e.g. inside `call`)."""
        assert self._backend is not None
        return self._backend

    async def call(self, fn: Callable[[TransferBackend], Any]) -> Any:
        """Run fn(backend) on the transfer thread."""
        return await self._run(fn, self.backend)

    # ---- the interface, async ------------------------------------------------------------

    async def register_kv(self, kv: Any, layout: Any = None) -> Any:
        return await self._run(self.backend.register_kv, kv, layout)

    async def local_metadata(self) -> bytes:
        return await self._run(self.backend.local_metadata)

    async def add_peer(self, name: str, metadata: bytes, incarnation: int) -> bool:
        return await self._run(self.backend.add_peer, name, metadata, incarnation)

    async def remove_peer(self, name: str) -> None:
        await self._run(self.backend.remove_peer, name)
        self._wake.set()

    async def has_peer(self, name: str) -> int | None:
        return await self._run(self.backend.has_peer, name)

    async def send_notif(self, peer: str, msg: bytes) -> None:
        await self._run(self.backend.send_notif, peer, msg)

    async def write_blocks(self, peer: str, src: Sequence[int], dst: Sequence[int],
                           notif: bytes = b"") -> TransferHandle:
        t0 = time.monotonic()
        handle = await self._run(self.backend.write_blocks, peer, list(src), list(dst), notif)
        fut: asyncio.Future[TransferStatus] = asyncio.get_running_loop().create_future()
        self._waiters[handle.id] = (handle, fut, t0)
        self._wake.set()
        return handle

    async def wait(self, handle: TransferHandle, timeout_s: float) -> TransferStatus:
        """The terminal status; past timeout_s the transfer is aborted (reason "timeout")."""
        entry = self._waiters.get(handle.id)
        if entry is None:
            return await self._run(self.backend.poll, handle)
        try:
            return await asyncio.wait_for(asyncio.shield(entry[1]), timeout_s)
        except asyncio.TimeoutError:
            await self.abort(handle)
            return TransferStatus(TransferState.ABORTED, "timeout")

    async def abort(self, handle: TransferHandle) -> TransferStatus:
        status = await self._run(self.backend.abort, handle)
        self._resolve(handle.id, status)
        return status

    @contextlib.contextmanager
    def expecting(self) -> Iterator[None]:
        """Poll fast while the caller waits for a notification (e.g. remote KV arriving)."""
        self._busy += 1
        self._wake.set()
        try:
            yield
        finally:
            self._busy -= 1

    @property
    def in_flight(self) -> int:
        return len(self._waiters)

    # ---- progress ------------------------------------------------------------------------

    def _tick(self, handles: list[TransferHandle]) -> tuple[list[tuple[int, TransferStatus]],
                                                             list[tuple[str, bytes]]]:
        b = self.backend
        done = []
        for h in handles:
            st = b.poll(h)
            if st.terminal:
                done.append((h.id, st))
        return done, b.get_notifs()

    def _resolve(self, hid: int, status: TransferStatus) -> None:
        entry = self._waiters.pop(hid, None)
        if entry is None:
            return
        handle, fut, t0 = entry
        if not fut.done():
            fut.set_result(status)
        if self.observer is not None:
            self.observer(handle, status, time.monotonic() - t0)

    async def _poll_loop(self) -> None:
        while True:
            try:
                handles = [h for h, _, _ in self._waiters.values()]
                done, notifs = await self._run(self._tick, handles)
                for hid, st in done:
                    self._resolve(hid, st)
                for agent, msg in notifs:
                    if self.on_notif is not None:
                        try:
                            self.on_notif(agent, msg)
                        except Exception:  # a bad message must not stop progress
                            log.exception("transfer_notif_handler_failed", agent=agent)
                    else:
                        self.notifs.put_nowait((agent, msg))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("transfer_poll_failed")
            busy = bool(self._waiters) or self._busy > 0
            self._wake.clear()
            if busy:
                await asyncio.sleep(self._busy_poll_s)
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._idle_poll_s)
