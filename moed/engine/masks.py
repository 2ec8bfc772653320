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

Speculation (docs/speculative.md): a grammar row with drafts d_0..d_{k-1} (cut to the
grammar-valid prefix when proposed, moed.engine.drafts.propose) needs k + 1 masks, mask i after
d_0..d_{i-1}: its job fills mask 0 from the request's matcher, then advances a `copy` through the
drafts (the request's own matcher moves only by emitted tokens, on the loop thread, and a late
job never touches it), one mask per draft. The deadline is the row's, as above: only mask 0 late
fails the request; draft masks not done by then (or a draft the copy refuses, or a limit the
copy hits) cut the row's draft to the masks done, so the step waits no longer than without
speculation and the verification stays exact (a shorter draft verified).

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

    def start(self, matchers: Sequence[Any],
              drafts: Sequence[Sequence[int]] | None = None) -> PendingMasks:
        """Begin the masks of `matchers` (moed.model.grammar.GrammarMatcher), one row each:
        1 + len(drafts[i]) masks for row i (mask j after its drafts 0..j-1)."""
        n = len(matchers)
        started: list[float | None] = [None] * n
        jobs = [_Job(m, tuple(drafts[i]) if drafts else ()) for i, m in enumerate(matchers)]

        def one(i: int) -> None:
            started[i] = time.monotonic()
            jobs[i].run(started[i] + self.timeout_s)

        futures = [self._pool.submit(one, i) for i in range(n)]
        return PendingMasks(futures, jobs, started, self.timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PendingMasks:
    def __init__(self, futures: list[Future], jobs: list[_Job],
                 started: list[float | None], timeout_s: float) -> None:
        self._futures = futures
        self._jobs = jobs
        self._started = started
        self._timeout_s = timeout_s

    def collect(self) -> tuple[list[torch.Tensor], dict[int, str]]:
        """(one int32 [n, words] block per row: masks 0..n-1, n - 1 <= its drafts, {row: why it
        failed}); a failed row's one mask allows every token (its request is failed and its
        token dropped). A row fails for time only when its own mask 0 has run `timeout_s` (one
        waiting for a worker is not its fault: it is computed here instead)."""
        masks: list[torch.Tensor] = []
        failed: dict[int, str] = {}
        for i, (fut, job) in enumerate(zip(self._futures, self._jobs)):
            m = job.matcher
            if not fut.done() and fut.cancel():     # never started (workers busy): here
                t0 = time.monotonic()
                job.run(t0 + self._timeout_s)
            else:
                now = time.monotonic()
                t0 = self._started[i] or now        # None: it is starting right now
                try:
                    fut.result(timeout=max(0.0, t0 + self._timeout_s - now))
                except FutureTimeout:
                    pass                # late draft masks cut the draft, below
            done = job.done         # read once: a late job may still be adding draft masks
            if not done or job.first_at - t0 > self._timeout_s:
                # mask 0 late (here: it held the step past the budget once; its request ends,
                # so it cannot again while the workers are tied up by late masks)
                failed[i] = "mask_timeout"
            if done and m.too_complex:
                failed[i] = "limit"
            if i in failed:
                masks.append(torch.full((1, m.words), -1, dtype=torch.int32))
            else:
                masks.append(job.out[:done].clone())
        return masks, failed


class _Job:
    """One row's masks: mask 0 from the request's matcher, mask j + 1 from a copy advanced
    through drafts 0..j; `done` counts the masks written (a reader takes out[:done])."""

    def __init__(self, matcher: Any, draft: tuple[int, ...]) -> None:
        self.matcher, self.draft, self.done = matcher, draft, 0
        self.out = torch.empty((len(draft) + 1, matcher.words), dtype=torch.int32)
        self.first_at = 0.0         # when mask 0 was done

    def run(self, deadline: float) -> None:
        m = self.matcher
        # the copy is taken, and the matcher read, before mask 0 is marked done: once it is,
        # a collect past the deadline returns and the loop may advance the request's matcher
        c = m.copy() if self.draft else None
        m.fill(self.out, 0)
        self.first_at = time.monotonic()
        if c is None or m.failed or m.stopped:
            self.done = 1
            return
        self.done = 1
        for j, t in enumerate(self.draft):
            # past the deadline, refused (validated when proposed: should not be) or a limit
            # hit on a drafted path: the draft ends here, the request does not
            if time.monotonic() > deadline or not c.accept(t):
                return
            c.fill(self.out, j + 1)
            if c.failed:
                return
            self.done = j + 2
