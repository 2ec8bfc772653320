"""Grammar compilation off the event loop, apart from the parse/tokenize pool (moed.api.offload).

A grammar can take seconds to compile where a prompt takes milliseconds to tokenize; when
both shared one 2-thread pool, sixteen 90 KB schemas made an unrelated 2-token request wait
11-13 s. Here compilation has its own `workers` threads, and each call has two deadlines:
  - to start: at most `max_queued` calls wait for a worker and none waits longer than
    `queue_timeout_s`; past either, 429 `grammar_busy` with Retry-After (a flood queues or
    is refused; it never delays other requests' tokenization);
  - to finish: `compile_timeout_s` from its start; past it, 400 `grammar_too_complex` naming
    the field. llguidance cannot be interrupted, so the worker finishes the compile (its
    limits bound it). Refusals for a limit are cached (the same grammar again is refused at
    once); one for time is not (it depends on the load of the moment).
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from moed.api.errors import APIError
from moed.api.structured import refusal
from moed.obs import metrics
from moed.types import GrammarSpec


class GrammarPool:
    def __init__(self, workers: int = 2, max_queued: int = 32, queue_timeout_s: float = 10.0,
                 compile_timeout_s: float = 2.0) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moed-grammar")
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.compile_timeout_s = compile_timeout_s
        self.queued = 0         # submitted and not started (a started call holds a worker)

    async def compile(self, tokenizer: Any, spec: GrammarSpec, retry_after_s: int = 1) -> None:
        """Compile `spec` into the tokenizer's grammar cache, or raise the APIError for it."""
        from moed.model.grammar import (GrammarError, GrammarTooComplex, built_compiler,
                                        compiler_for)

        comp = built_compiler(tokenizer)
        hit = None if comp is None else comp.peek(spec)
        if isinstance(hit, GrammarError):       # a cached refusal: at once, no queue
            _refused(hit)
            raise refusal(spec, hit) from None
        if hit is not None:
            return
        if self.queued >= self.max_queued:
            raise _busy("compilations waiting", retry_after_s)
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        t_start: list[float] = []
        cancelled = threading.Event()

        def work() -> None:
            if cancelled.is_set():
                return
            t_start.append(time.monotonic())
            loop.call_soon_threadsafe(started.set)
            compiler_for(tokenizer).compile(spec)

        self.queued += 1
        counted = True
        fut = asyncio.wrap_future(self._pool.submit(work))
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())   # seen if abandoned
        try:
            try:
                await asyncio.wait_for(started.wait(), self.queue_timeout_s)
            except asyncio.TimeoutError:
                if not started.is_set():
                    raise _busy("a compile worker", retry_after_s) from None
            self.queued -= 1
            counted = False
            left = self.compile_timeout_s - (time.monotonic() - t_start[0]) if t_start else \
                self.compile_timeout_s
            try:
                await asyncio.wait_for(asyncio.shield(fut), max(0.0, left) + 0.05)
            except asyncio.TimeoutError:
                metrics.GRAMMAR_REFUSED.labels("timeout").inc()
                raise refusal(spec, GrammarTooComplex(
                    f"compiling it took over the budget of {self.compile_timeout_s:g} s",
                    timed_out=True)) from None
            except GrammarError as e:
                _refused(e)
                raise refusal(spec, e) from None
        finally:
            if counted:             # refused, or the client left, before it started
                self.queued -= 1
                cancelled.set()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _refused(e: Exception) -> None:
    from moed.model.grammar import GrammarTooComplex

    reason = "invalid"
    if isinstance(e, GrammarTooComplex):
        reason = "timeout" if e.timed_out else "too_complex"
    metrics.GRAMMAR_REFUSED.labels(reason).inc()


def _busy(what: str, retry_after_s: int) -> APIError:
    metrics.ADMISSION_REJECTED.labels("grammar_busy").inc()
    return APIError(429, f"Server is busy compiling other requests' grammars (waited for "
                         f"{what}); retry shortly.", code="grammar_busy",
                    headers={"Retry-After": str(retry_after_s)})
