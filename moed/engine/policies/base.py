"""The step-policy seam: what a policy reads (`SchedulerView`), what it may do (`StepDraft`)
and what it is (`StepPolicy`).

A policy decides how many tokens of which requests a step holds. It reads the scheduler's
state through a read-only view and takes tokens through the step being drafted; every state
change (KV allocation, preemption, seating, remote-KV parking, tier loads, refusing a prompt
the pool can never hold) is the scheduler's, behind `StepDraft`, so a policy is a plain
decision procedure and cannot leave the queues inconsistent.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from moed.balance.cost import CostModel, ExpertShape
from moed.engine.request import Request
from moed.kvcache.manager import PrefixHit


class KVView(Protocol):
    """The KV pool's queries a policy asks (moed.kvcache.manager.KVCacheManager)."""
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    def blocks_for(self, num_tokens: int) -> int: ...
    def can_append(self, req_id: str, num_tokens: int) -> bool: ...
    def can_allocate_prompt(self, hit: PrefixHit, num_tokens: int) -> bool: ...


class SchedulerView(Protocol):
    """The scheduler's state, read-only (moed.engine.scheduler.Scheduler)."""
    @property
    def waiting(self) -> Sequence[Request]: ...   # priority, then arrival (preempted first)
    @property
    def running(self) -> Sequence[Request]: ...   # priority, then admission order
    @property
    def requests(self) -> Mapping[str, Request]: ...    # every live request by id
    @property
    def kv(self) -> KVView: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def num_speculative_tokens(self) -> int: ...        # k; 0 = no speculation
    @property
    def seated(self) -> int: ...        # requests holding a seat: running, parked, loading
    @property
    def cost(self) -> CostModel | None: ...             # fitted from measured steps
    @property
    def experts(self) -> ExpertShape | None: ...        # the model's MoE shape (cost features)
    def prefix_hit(self, req: Request) -> PrefixHit: ...    # what a waiting prompt may skip


class StepDraft(Protocol):
    """The step being planned: the only way a policy changes anything."""
    @property
    def num_chunks(self) -> int: ...                # chunks taken so far
    @property
    def preempted(self) -> bool: ...                # some request was preempted this step

    def extend(self, req: Request, n: int, *, preempt: bool) -> bool:
        """A running request's next `n` tokens. When the KV pool cannot hold them: with
        `preempt`, the last of RUNNING (the least urgent priority, most recently admitted
        first) go back to WAITING until it can (possibly `req` itself); without, nothing happens. -> whether `req` got them."""
        ...

    def speculate(self, req: Request, room: int) -> int:
        """After `extend` took a decoding request's one token this step: add up to `room` draft
        tokens to its chunk (moed.engine.drafts.propose: the request's own limits, and the KV
        blocks free now, may cut them; nothing is preempted for them). The policies call it
        last, with what the step has left. -> drafts added, 0 when speculation is off or the
        request does not draft (a prompt chunk, a grammar, a paused drafter, no guess)."""
        ...

    def admit(self, req: Request, hit: PrefixHit, n: int) -> bool:
        """Seat a waiting request: its prefix hit plus `n` new tokens. False: no room."""
        ...

    def park_remote(self, req: Request) -> bool:
        """A remote-KV waiting request takes its whole prompt's blocks and parks until its KV
        is written (WAITING_REMOTE_KV). False: no room."""
        ...

    def load_from_tiers(self, req: Request, hit: PrefixHit) -> bool:
        """True when the prompt's next blocks are loaded from the host/disk tiers instead of
        computed: it parks in WAITING_TIER_KV (moed.engine.tier_admission)."""
        ...

    def refuse_too_long(self, req: Request) -> bool:
        """A prompt the whole pool can never hold finishes with an error (True)."""
        ...


class StepPolicy(Protocol):
    def fill(self, view: SchedulerView, step: StepDraft) -> None:
        """Take this step's tokens (running requests' catch-ups, waiting prompts' chunks)."""
        ...
