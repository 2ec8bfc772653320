"""Admission control: bounded waiting requests and queued prompt tokens, never an unbounded queue.

A request is *pending* from admission until its first token arrives (or it ends): that is the
part of the queue that costs prefill work and memory without progress. `try_admit` is atomic
for the n engine requests of one HTTP request (all or none). Besides the pending bounds, the
total of live engine requests is capped at max_running + max_waiting so memory stays bounded
even when the engine preempts. Pure bookkeeping: no I/O, no engine calls, single-threaded.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(str, enum.Enum):
    ADMIT = "admit"
    TOO_MANY_WAITING = "too_many_waiting"
    TOO_MANY_TOKENS = "too_many_queued_tokens"
    TOO_MANY_LIVE = "too_many_live"


@dataclass
class Ticket:
    """One admitted engine request; release it at first token (`started`) and at the end."""

    prompt_tokens: int
    pending: bool = True
    live: bool = True


class Admission:
    def __init__(self, max_waiting: int, max_queued_tokens: int, max_running: int) -> None:
        self.max_waiting = max_waiting
        self.max_queued_tokens = max_queued_tokens
        self.max_running = max_running
        self.pending = 0
        self.pending_tokens = 0
        self.live = 0

    def reconfigure(self, max_waiting: int, max_queued_tokens: int, max_running: int) -> None:
        """New bounds apply to the next request; admitted ones keep their tickets."""
        self.max_waiting, self.max_queued_tokens = max_waiting, max_queued_tokens
        self.max_running = max_running

    def check(self, count: int, prompt_tokens: int) -> Verdict:
        """Could `count` requests with `prompt_tokens` in total be admitted now?"""
        if self.pending + count > self.max_waiting:
            return Verdict.TOO_MANY_WAITING
        # A lone request is always let in, however long, so a large prompt cannot starve.
        if self.pending and self.pending_tokens + prompt_tokens > self.max_queued_tokens:
            return Verdict.TOO_MANY_TOKENS
        if self.live + count > self.max_running + self.max_waiting:
            return Verdict.TOO_MANY_LIVE
        return Verdict.ADMIT

    def try_admit(self, prompt_lens: list[int]) -> tuple[Verdict, list[Ticket]]:
        verdict = self.check(len(prompt_lens), sum(prompt_lens))
        if verdict is not Verdict.ADMIT:
            return verdict, []
        tickets = [Ticket(n) for n in prompt_lens]
        self.pending += len(tickets)
        self.pending_tokens += sum(prompt_lens)
        self.live += len(tickets)
        return verdict, tickets

    def started(self, t: Ticket) -> None:
        """First token arrived: the request no longer waits."""
        if t.pending:
            t.pending = False
            self.pending -= 1
            self.pending_tokens -= t.prompt_tokens

    def release(self, t: Ticket) -> None:
        """The request ended (finished, aborted or failed). Idempotent."""
        self.started(t)
        if t.live:
            t.live = False
            self.live -= 1
