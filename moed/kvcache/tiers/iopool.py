"""The tiers' I/O threads: a small pool of daemon threads and a deadline watchdog.

Not concurrent.futures.ThreadPoolExecutor: its workers are joined at interpreter exit, so one
read stuck in the kernel (a FIFO, a hung file system) kept a stopped node from ever exiting.
These are daemon threads; nothing joins them. A task that overran its deadline may leave its
thread blocked for good: `stuck()` starts a spare thread in its place (up to `spares`), and a
thread that comes back while spares are running retires, so the pool returns to its size.
"""
from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class IOPool:
    def __init__(self, threads: int, name: str, spares: int = 0) -> None:
        if threads < 1:
            raise ValueError("an I/O pool needs at least one thread")
        self.name = name
        self.size = threads
        self.spares = spares
        self._q: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._extra = 0         # spare threads running beyond `size`
        self._stuck = 0         # tasks marked stuck that have not returned
        self._closed = False
        for _ in range(threads):
            self._start()

    def _start(self) -> None:
        self._started += 1
        threading.Thread(target=self._work, name=f"{self.name}-{self._started}",
                         daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._closed:
            raise RuntimeError(f"{self.name}: closed")
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def stuck(self, fut: Future) -> None:
        """The task behind `fut` overran its deadline and may never return: a spare thread
        takes its place (while spares are left)."""
        with self._lock:
            if self._closed or getattr(fut, "stuck", False) or not fut.running():
                return      # a task still queued is cancelled by the caller instead
            fut.stuck = True        # type: ignore[attr-defined]
            self._stuck += 1
            if self._extra < self.spares:
                self._extra += 1
                self._start()

    @property
    def saturated(self) -> bool:
        """Every thread, spares included, is blocked in a task that overran its deadline:
        new work would wait behind them."""
        return self._stuck >= self.size + self.spares

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                    fut.set_exception(e)
            with self._lock:
                if getattr(fut, "stuck", False):
                    self._stuck -= 1
                    if self._extra > 0:     # a spare stood in for this thread: one retires
                        self._extra -= 1
                        return

    def close(self) -> None:
        """Stop taking work; idle threads end. A thread blocked in a task is left behind (a
        daemon: it does not hold the process's exit)."""
        with self._lock:
            self._closed = True
            n = self._started
        for _ in range(n):
            self._q.put(None)


class Watchdog:
    """One daemon thread that calls `fire(item)` once for every armed item whose deadline has
    passed (an item that finished in time says so itself: `fire` checks it)."""

    def __init__(self, name: str, fire: Callable[[Any], None]) -> None:
        self._fire = fire
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def arm(self, item: Any, deadline: float) -> None:
        """Call `fire(item)` at `deadline` (time.monotonic())."""
        with self._cv:
            heapq.heappush(self._heap, (deadline, next(self._seq), item))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            due: list[Any] = []
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
                if not due:
                    self._cv.wait(None if not self._heap else self._heap[0][0] - now)
                    continue
            for item in due:
                self._fire(item)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
