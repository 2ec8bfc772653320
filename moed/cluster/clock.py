"""Time for the protocol core: one small interface, two drivers.

`AsyncioScheduler` runs the protocol in the daemon's event loop on real time;
`SimScheduler` is a discrete-event simulator with a virtual clock, so hundreds of nodes run
minutes of protocol time in seconds of real time with the very same protocol code.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from abc import ABC, abstractmethod
from typing import Callable


class Timer(ABC):
    @abstractmethod
    def cancel(self) -> None: ...


class TimerScheduler(ABC):
    """Clocks and timers for the membership protocol (not the engine's request scheduler)."""

    @abstractmethod
    def now(self) -> float:
        """Monotonic seconds, for timeouts."""

    @abstractmethod
    def wall_ms(self) -> int:
        """Wall-clock milliseconds, stamped on packets (replay window)."""

    @abstractmethod
    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer: ...


class _AsyncioTimer(Timer):
    __slots__ = ("_h",)

    def __init__(self, h: asyncio.TimerHandle) -> None:
        self._h = h

    def cancel(self) -> None:
        self._h.cancel()


class AsyncioScheduler(TimerScheduler):
    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()

    def now(self) -> float:
        return self._loop.time()

    def wall_ms(self) -> int:
        return int(time.time() * 1000)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        return _AsyncioTimer(self._loop.call_later(max(0.0, delay_s), fn))


class _SimTimer(Timer):
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimScheduler(TimerScheduler):
    """Events run in (time, insertion) order; `run_until` advances the virtual clock."""

    def __init__(self, start_wall_ms: int = 1_700_000_000_000) -> None:
        self._now = 0.0
        self._wall0 = start_wall_ms
        self._heap: list[tuple[float, int, _SimTimer, Callable[[], None]]] = []
        self._ids = itertools.count()
        self.events_run = 0

    def now(self) -> float:
        return self._now

    def wall_ms(self) -> int:
        return self._wall0 + int(self._now * 1000)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        t = _SimTimer()
        heapq.heappush(self._heap, (self._now + max(0.0, delay_s), next(self._ids), t, fn))
        return t

    def run_until(self, t_end: float, stop: Callable[[], bool] | None = None) -> float:
        """Run events up to virtual time t_end (or until stop() is true); returns now."""
        heap = self._heap
        while heap and heap[0][0] <= t_end:
            at, _, timer, fn = heapq.heappop(heap)
            if timer.cancelled:
                continue
            self._now = at
            self.events_run += 1
            fn()
            if stop is not None and stop():
                return self._now
        self._now = max(self._now, t_end)
        return self._now

    def run_for(self, seconds: float, stop: Callable[[], bool] | None = None) -> float:
        return self.run_until(self._now + seconds, stop)
