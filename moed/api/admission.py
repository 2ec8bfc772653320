"""Admission control: bounded waiting requests and queued prompt tokens, never an unbounded queue.

A request is *pending* from admission until its first token arrives (or it ends): that is the
part of the queue that costs prefill work and memory without progress. `try_admit` is atomic
for the n engine requests of one HTTP request (all or none). Besides the pending bounds, the
total of live engine requests is capped at max_running + max_waiting so memory stays bounded
even when the engine preempts. Pure bookkeeping: no I/O, no engine calls, single-threaded.

Priority (vLLM's, lower first; moed/api/priority.py): when an arrival does not fit, it may
displace pending requests of a strictly less urgent priority (`displace`, pure): the least
urgent first, the newest first within a priority, each HTTP request (its n tickets) whole, and
only a request that gave an `on_displaced` (its response has not started: the caller says so)
none of whose choices has a first token (its client gets a 429, never a broken stream). Their tickets are released at once and their `on_displaced` is
called; the arrival is admitted. When displacing every eligible request would still not make
room, nothing is displaced and the arrival gets the 429.
"""
from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class Verdict(str, enum.Enum):
    ADMIT = "admit"
    TOO_MANY_WAITING = "too_many_waiting"
    TOO_MANY_TOKENS = "too_many_queued_tokens"
    TOO_MANY_LIVE = "too_many_live"


@dataclass(frozen=True)
class Limits:
    max_waiting: int
    max_queued_tokens: int
    max_running: int


@dataclass(frozen=True)
class Load:
    """What is admitted now: pending requests, their prompt tokens, live requests."""
    pending: int = 0
    pending_tokens: int = 0
    live: int = 0


def verdict(load: Load, count: int, prompt_tokens: int, limits: Limits) -> Verdict:
    """Could `count` requests with `prompt_tokens` in total be admitted on top of `load`?"""
    if load.pending + count > limits.max_waiting:
        return Verdict.TOO_MANY_WAITING
    # A lone request is always let in, however long, so a large prompt cannot starve.
    if load.pending and load.pending_tokens + prompt_tokens > limits.max_queued_tokens:
        return Verdict.TOO_MANY_TOKENS
    if load.live + count > limits.max_running + limits.max_waiting:
        return Verdict.TOO_MANY_LIVE
    return Verdict.ADMIT


@dataclass(frozen=True)
class Queued:
    """A pending HTTP request as `displace` sees it (seq: admission order)."""
    seq: int
    priority: int
    count: int
    prompt_tokens: int


def displace(queued: Sequence[Queued], load: Load, priority: int, count: int,
             prompt_tokens: int, limits: Limits) -> list[int] | None:
    """The seqs to displace so an arrival of `priority` with `count` requests and
    `prompt_tokens` fits: strictly less urgent ones only, least urgent first, newest first
    within a priority, as few as needed. None: it cannot fit that way (displace nothing)."""
    out: list[int] = []
    left = load
    for q in sorted((q for q in queued if q.priority > priority),
                    key=lambda q: (-q.priority, -q.seq)):
        out.append(q.seq)
        left = Load(left.pending - q.count, left.pending_tokens - q.prompt_tokens,
                    left.live - q.count)
        if verdict(left, count, prompt_tokens, limits) is Verdict.ADMIT:
            return out
    return None


@dataclass
class Ticket:
    """One admitted engine request; release it at first token (`started`) and at the end."""

    prompt_tokens: int
    pending: bool = True
    live: bool = True
    priority: int = 0
    group: int = 0            # its HTTP request's seq: displaced together


@dataclass
class _Group:
    """One HTTP request's tickets while all are pending (it may be displaced)."""
    priority: int
    tickets: list[Ticket]
    on_displaced: Callable[[], None] | None = field(default=None, repr=False)


class Admission:
    def __init__(self, max_waiting: int, max_queued_tokens: int, max_running: int) -> None:
        self.limits = Limits(max_waiting, max_queued_tokens, max_running)
        self.pending = 0
        self.pending_tokens = 0
        self.live = 0
        self.pending_by_priority: Counter[int] = Counter()
        self.displaced = 0                        # HTTP requests displaced, since start
        self._groups: dict[int, _Group] = {}      # seq -> group, every ticket still pending
        self._seq = itertools.count(1)

    @property
    def max_waiting(self) -> int:
        return self.limits.max_waiting

    def reconfigure(self, max_waiting: int, max_queued_tokens: int, max_running: int) -> None:
        """New bounds apply to the next request; admitted ones keep their tickets."""
        self.limits = Limits(max_waiting, max_queued_tokens, max_running)

    def _load(self) -> Load:
        return Load(self.pending, self.pending_tokens, self.live)

    def check(self, count: int, prompt_tokens: int) -> Verdict:
        """Could `count` requests with `prompt_tokens` in total be admitted now?"""
        return verdict(self._load(), count, prompt_tokens, self.limits)

    def try_admit(self, prompt_lens: list[int], priority: int = 0,
                  on_displaced: Callable[[], None] | None = None
                  ) -> tuple[Verdict, list[Ticket]]:
        """-> (verdict, the tickets). `on_displaced` is called if this request is displaced
        later (its tickets are released by then); None: it may not be displaced.
        `displaced` counts the displacements."""
        v = self.check(len(prompt_lens), sum(prompt_lens))
        if v is not Verdict.ADMIT:
            queued = [Queued(seq, g.priority, len(g.tickets),
                             sum(t.prompt_tokens for t in g.tickets))
                      for seq, g in self._groups.items() if g.on_displaced is not None]
            victims = displace(queued, self._load(), priority, len(prompt_lens),
                               sum(prompt_lens), self.limits)
            if victims is None:
                return v, []
            for seq in victims:
                self._displace(seq)
            v = Verdict.ADMIT
        seq = next(self._seq)
        tickets = [Ticket(n, priority=priority, group=seq) for n in prompt_lens]
        self._groups[seq] = _Group(priority, tickets, on_displaced)
        self.pending += len(tickets)
        self.pending_tokens += sum(prompt_lens)
        self.live += len(tickets)
        self.pending_by_priority[priority] += len(tickets)
        return v, tickets

    def _displace(self, seq: int) -> None:
        self.displaced += 1
        g = self._groups.pop(seq)
        for t in g.tickets:
            self.release(t)
        if g.on_displaced is not None:
            g.on_displaced()

    def started(self, t: Ticket) -> None:
        """First token arrived: the request no longer waits (nor may it be displaced)."""
        self._groups.pop(t.group, None)
        if t.pending:
            t.pending = False
            self.pending -= 1
            self.pending_tokens -= t.prompt_tokens
            self.pending_by_priority[t.priority] -= 1
            if not self.pending_by_priority[t.priority]:
                del self.pending_by_priority[t.priority]

    def release(self, t: Ticket) -> None:
        """The request ended (finished, aborted or failed). Idempotent."""
        self.started(t)
        if t.live:
            t.live = False
            self.live -= 1
