"""Work that grows with the prompt (JSON parsing, chat templates, tokenization) runs here, in
a small bounded thread pool, never on the event loop: a 4 MB prompt tokenized inline froze every
other stream on the node for 2-5 s.

The pool has `workers` threads; at most `max_queued` calls wait for one, beyond that a request
is answered 429 at once rather than queued without bound (each waiting call holds its body).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from moed.api.errors import APIError
from moed.obs import metrics

T = TypeVar("T")


class Offload:
    def __init__(self, workers: int = 2, max_queued: int = 64) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moed-prep")
        self.max_queued = max_queued
        self.queued = 0

    async def run(self, fn: Callable[..., T], *args: object, retry_after_s: int = 1) -> T:
        if self.queued >= self.max_queued:
            metrics.ADMISSION_REJECTED.labels("tokenizer_busy").inc()
            raise APIError(429, "Server is busy preparing other prompts; retry shortly.",
                           code="tokenizer_busy", headers={"Retry-After": str(retry_after_s)})
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.queued -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
