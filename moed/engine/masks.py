"""Structured outputs' token masks, computed beside the forward pass, each with a deadline.

A grammar's mask is known from the request's matcher alone (the loop advanced it with the last
token before this step began), so it need not wait for the logits: the step thread hands the
step's grammar rows to `workers` mask threads, runs the forward pass (llguidance and torch both
drop the GIL), then collects. A mask still computing `timeout_s` after it began fails its
request alone (its row is sampled unmasked and the token dropped); the batch, and an
expert-parallel group's collectives, never wait longer on any one request's grammar. A matcher that
hits one of llguidance's limits while computing (it is then in error and allows only EOS) fails
its request the same way. Before this, masks were filled after the forward pass on the step
thread: four `a{1000}{1000}` requests made one rank's step outlast the group's 5 s
collective timeout, and the whole group exited.

A late mask's thread cannot be interrupted (llguidance's step fuel bounds it); its request is
finished, so nothing else touches that matcher, and a row queued behind it that never started is
computed on the step thread instead (and fails, once, if it alone outlasts the deadline there).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch


class MaskPool:
    def __init__(self, workers: int = 2, timeout_s: float = 0.1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moed-mask")
        self.timeout_s = timeout_s

    def start(self, matchers: Sequence[Any]) -> PendingMasks:
        """Begin the masks of `matchers` (moed.model.grammar.GrammarMatcher), one row each."""
        started: list[float | None] = [None] * len(matchers)

        def one(i: int) -> torch.Tensor:
            started[i] = time.monotonic()
            return _one(matchers[i])

        futures = [self._pool.submit(one, i) for i in range(len(matchers))]
        return PendingMasks(futures, list(matchers), started, self.timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PendingMasks:
    def __init__(self, futures: list[Future], matchers: list[Any],
                 started: list[float | None], timeout_s: float) -> None:
        self._futures = futures
        self._matchers = matchers
        self._started = started
        self._timeout_s = timeout_s

    def collect(self) -> tuple[list[torch.Tensor], dict[int, str]]:
        """(one int32 [words] mask per row, {row: why it failed}); a failed row's mask allows
        every token (its request is failed and its token dropped). A row fails for time only
        when its own mask has run `timeout_s` (one waiting for a worker is not its fault: it
        is computed here instead)."""
        masks: list[torch.Tensor] = []
        failed: dict[int, str] = {}
        for i, (fut, m) in enumerate(zip(self._futures, self._matchers)):
            mask: torch.Tensor | None = None
            if not fut.done() and fut.cancel():     # never started (workers busy): here
                t0 = time.monotonic()
                mask = _one(m)
                if time.monotonic() - t0 > self._timeout_s:
                    # it held the step past the budget once: its request ends, so it cannot
                    # again while the workers are tied up by late masks
                    failed[i] = "mask_timeout"
            else:
                now = time.monotonic()
                t0 = self._started[i] or now        # None: it is starting right now
                left = t0 + self._timeout_s - now
                try:
                    mask = fut.result(timeout=max(0.0, left))
                except FutureTimeout:
                    failed[i] = "mask_timeout"
            if mask is not None and m.too_complex:
                failed[i] = "limit"
            if mask is None or i in failed:
                mask = torch.full((m.words,), -1, dtype=torch.int32)
            masks.append(mask)
        return masks, failed


def _one(m: Any) -> torch.Tensor:
    bm = torch.empty((1, m.words), dtype=torch.int32)
    m.fill(bm, 0)
    return bm[0]
