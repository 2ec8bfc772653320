"""The step thread: the one thread an engine built from the config runs its OpenMP work on.

libgomp keeps one thread pool per thread that opens a parallel region. When the threads it
manages outnumber the CPUs the process may use, every pool spins only 100 times at a barrier
before it sleeps on a futex (GOMP_SPINCOUNT's throttled count; 300,000 otherwise), as
OMP_WAIT_POLICY=PASSIVE does. The native kernels and torch's ops cross a barrier many times a
step, so a step that sleeps and wakes at each costs 1.5-1.75x one that spins (bench
checkpoint, 2 threads on 2 cores: batch-8 decode step 47.5 vs 32.5 ms, batch 1 15.2 vs 8.7 ms,
the same process with and without an idle second pool, docs/benchmarks.md). `moed serve` used
to build the engine (weights, the kernels' choice races, the cost model's calibration) on the
loader thread and step on a second one: two pools, 2 x (threads - 1) pool threads beside the
initial one, so with 2 or more torch threads the served engine always ran throttled, where
bench/peers.py's engine (one thread for everything) did not.

`Engine.from_config` therefore builds the engine on a StepThread and keeps it: calibration,
`generate` and the serving loop's forward passes run there too, so the process has one pool.
An engine built by hand (tests, bench/peers.py) has none and runs as before: `generate` on the
caller's thread, the loop's steps on an executor thread of its own.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class StepThread:
    """One long-lived worker thread (a one-thread executor, what the serving loop awaits)."""

    def __init__(self, name: str = "moed-step") -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._stopped = False
        self.ident = self.executor.submit(threading.get_ident).result()

    @property
    def here(self) -> bool:
        """Whether the caller is the step thread."""
        return threading.get_ident() == self.ident

    def run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """fn(*args, **kw) on the step thread, blocking the caller until it returns (or raises);
        called from the step thread itself it just runs."""
        if self.here:
            return fn(*args, **kw)
        if self._stopped:
            raise RuntimeError("the engine's step thread has stopped (after shutdown)")
        return self.executor.submit(fn, *args, **kw).result()

    def shutdown(self, wait: bool = True) -> None:
        self._stopped = True
        self.executor.shutdown(wait=wait)


def on_step_thread(thread: StepThread | None, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on `thread` at the caller's torch thread count (torch.set_num_threads sets the
    calling thread's OpenMP team size; a thread that has already run torch keeps its own), or on
    the caller's thread when there is none (an engine built by hand)."""
    if thread is None:
        return fn(*args)
    import torch

    n = torch.get_num_threads()

    def call() -> T:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return fn(*args)

    return thread.run(call)


def build_on_step_thread(build: Callable[..., T], *args: Any, **kw: Any) -> T:
    """build(*args, step_thread=<a new StepThread>, **kw) on that thread: the engine it returns
    keeps the thread (its pool is the one the weights, the kernel races and every step use).
    The thread is stopped if the build fails."""
    thread = StepThread()
    try:
        return thread.run(build, *args, step_thread=thread, **kw)
    except BaseException:
        thread.shutdown(wait=False)
        raise
