"""What the engine hands out: a per-request async stream of TokenEvents, and per-step stats."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from moed.types import TokenEvent


@dataclass(frozen=True)
class StepStats:
    """One engine step, for metrics (the engine calls `on_step(StepStats)`; no prometheus here)."""

    step: int
    batch_size: int              # sequences in the forward pass
    num_prefill_tokens: int      # prompt (or recompute) tokens computed this step
    num_decode_tokens: int       # one per decoding sequence (+ its drafts when it speculates)
    num_sampled: int             # sequences that produced a token
    num_finished: int
    num_preempted: int
    step_seconds: float          # schedule + forward + sample + update
    forward_seconds: float       # forward + sample in the executor thread
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int


class RequestStream:
    """Async iterator over one request's TokenEvents; the last has `finish_reason` set.

    Leaving the `async for` early (client gone) should be followed by `engine.abort(id)`;
    `aclose()` does exactly that.
    """

    def __init__(self, request_id: str, on_close: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._on_close = on_close
        self._done = False
        self.finished = False                     # the final event was published
        # Decode role (remote KV): resolved with (block_ids, num_cached_tokens) once allocated.
        self.kv_blocks: asyncio.Future[tuple[list[int], int]] | None = None

    def put(self, ev: TokenEvent) -> None:
        if self.finished:
            return
        self.finished = ev.finished
        self._queue.put_nowait(ev)

    def fail(self, ev: TokenEvent) -> None:
        """End the stream now with `ev` (a finish), whatever the engine still publishes for
        the request (ignored from here on): the decode role fails a request whose remote
        prefill failed. The caller still aborts the engine request, which frees its KV."""
        assert ev.finished, "fail() takes a finish event"
        self.put(ev)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        ev = await self._queue.get()
        self._done = ev.finished
        return ev

    async def aclose(self) -> None:
        if not self.finished:
            self._on_close(self.request_id)
        self._done = True
