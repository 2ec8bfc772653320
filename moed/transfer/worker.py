"""TransferWorker: the asyncio face of a TransferBackend.

Every backend call runs on ONE dedicated thread (backends are not thread-safe, and NIXL's
synchronous cma copy in write_blocks must not stall the event loop). Between calls that thread
drives progress itself (poll pending transfers, collect notifications): every `busy_poll_s`
while transfers or expected notifications are outstanding, every `idle_poll_s` otherwise, and
it only wakes the event loop when something happened, so nothing spins a core. Notifications
are never dropped: they go to `on_notif` or, if none is set, to the `notifs` queue.
"""
from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import structlog

from moed.transfer.base import (TransferBackend, TransferHandle, TransferState,
                                TransferStatus)

log = structlog.get_logger(__name__)

NotifHandler = Callable[[str, bytes], None]
Observer = Callable[[TransferHandle, TransferStatus, float], None]
_STOP = object()
_WAKE = object()


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
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._backend: TransferBackend | None = None
        # loop side: transfers someone may wait for; thread side: transfers it polls
        self._waiters: dict[int, tuple[TransferHandle, asyncio.Future[TransferStatus], float]] = {}
        self._pending: dict[int, TransferHandle] = {}
        # finished before write_blocks registered its waiter (the tick can beat the wake-up)
        self._early: dict[int, TransferStatus] = {}
        self._busy = 0
        self.name = ""

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="kv-transfer", daemon=True)
        self._thread.start()
        try:
            self._backend = await self._run(self._factory)
        except BaseException:
            await self._stop_thread()
            raise
        self.name = self._backend.name

    async def close(self) -> None:
        if self._backend is not None:
            with contextlib.suppress(Exception):
                await self._run(self._close_backend)
        await self._stop_thread()
        for _, fut, _ in self._waiters.values():
            if not fut.done():
                fut.set_result(TransferStatus(TransferState.ABORTED, "closed"))
        self._waiters.clear()

    async def _stop_thread(self) -> None:
        if self._thread is not None:
            self._calls.put(_STOP)
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._thread is None or self._loop is None:
            raise RuntimeError("TransferWorker is not started")
        fut = self._loop.create_future()
        self._calls.put((fut, fn, args))
        return await fut

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

    async def has_peer(self, name: str) -> int | None:
        return await self._run(self.backend.has_peer, name)

    async def send_notif(self, peer: str, msg: bytes) -> None:
        await self._run(self.backend.send_notif, peer, msg)

    async def write_blocks(self, peer: str, src: Sequence[int], dst: Sequence[int],
                           notif: bytes = b"") -> TransferHandle:
        return await self._start(self.backend.write_blocks, peer, src, dst, notif)

    async def read_blocks(self, peer: str, src: Sequence[int], dst: Sequence[int],
                          notif: bytes = b"") -> TransferHandle:
        """The peer's blocks src → local dst (cluster prefix reuse); waited on like a write."""
        return await self._start(self.backend.read_blocks, peer, src, dst, notif)

    async def _start(self, op: Callable[..., TransferHandle], peer: str, src: Sequence[int],
                     dst: Sequence[int], notif: bytes) -> TransferHandle:
        t0 = time.monotonic()
        handle = await self._run(self._post, op, peer, list(src), list(dst), notif)
        assert self._loop is not None
        fut: asyncio.Future[TransferStatus] = self._loop.create_future()
        self._waiters[handle.id] = (handle, fut, t0)
        early = self._early.pop(handle.id, None)
        if early is not None:
            self._resolve(handle.id, early)
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
        status = await self._run(self._abort, handle)
        self._resolve(handle.id, status)
        return status

    @contextlib.contextmanager
    def expecting(self) -> Iterator[None]:
        """Poll fast while the caller waits for a notification (e.g. remote KV arriving)."""
        self._busy += 1
        self._calls.put(_WAKE)
        try:
            yield
        finally:
            self._busy -= 1

    @property
    def in_flight(self) -> int:
        return len(self._waiters)

    # ---- the transfer thread -------------------------------------------------------------

    def _post(self, op: Callable[..., TransferHandle], peer: str, src: list[int], dst: list[int],
              notif: bytes) -> TransferHandle:
        handle = op(peer, src, dst, notif)
        self._pending[handle.id] = handle      # polled (and reported) by the next tick
        return handle

    def _close_backend(self) -> None:
        # on the transfer thread, so no tick polls a backend that is closing (it did, and
        # logged transfer_poll_failed on every clean stop)
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()

    def _abort(self, handle: TransferHandle) -> TransferStatus:
        self._pending.pop(handle.id, None)
        return self.backend.abort(handle)

    def _thread_main(self) -> None:
        next_tick = 0.0
        while True:
            busy = bool(self._pending) or self._busy > 0
            interval = self._busy_poll_s if busy else self._idle_poll_s
            try:
                item = self._calls.get(timeout=max(next_tick - time.monotonic(), 0.0))
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None and item is not _WAKE:
                self._call(*item)
            now = time.monotonic()
            if item is _WAKE or now >= next_tick:
                self._tick()
                next_tick = now + interval

    def _call(self, fut: asyncio.Future, fn: Callable[..., Any], args: tuple) -> None:
        try:
            res, exc = fn(*args), None
        except BaseException as e:  # handed to the awaiting coroutine
            res, exc = None, e
        self._to_loop(_settle, fut, res, exc)

    def _tick(self) -> None:
        b = self._backend
        if b is None:
            return
        try:
            done = []
            for h in list(self._pending.values()):
                st = b.poll(h)
                if st.terminal:
                    del self._pending[h.id]
                    done.append((h.id, st))
            notifs = b.get_notifs()
        except Exception as e:
            # transfers fail through their own status; this is worth a line, not a traceback
            log.warning("transfer_poll_failed", error=f"{type(e).__name__}: {e}"[:300])
            return
        if done or notifs:
            self._to_loop(self._deliver, done, notifs)

    def _to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:   # the loop is closed: nobody is left to tell
            pass

    # ---- back on the event loop ----------------------------------------------------------

    def _deliver(self, done: list[tuple[int, TransferStatus]],
                 notifs: list[tuple[str, bytes]]) -> None:
        for hid, st in done:
            if hid in self._waiters:
                self._resolve(hid, st)
            else:
                self._early[hid] = st
        for agent, msg in notifs:
            if self.on_notif is None:
                self.notifs.put_nowait((agent, msg))
                continue
            try:
                self.on_notif(agent, msg)
            except Exception:  # a bad message must not stop delivery
                log.exception("transfer_notif_handler_failed", agent=agent)

    def _resolve(self, hid: int, status: TransferStatus) -> None:
        entry = self._waiters.pop(hid, None)
        if entry is None:
            return
        handle, fut, t0 = entry
        if not fut.done():
            fut.set_result(status)
        if self.observer is not None:
            self.observer(handle, status, time.monotonic() - t0)


def _settle(fut: asyncio.Future, res: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)
