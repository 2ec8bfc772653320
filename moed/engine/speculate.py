"""The speculative step's executor half: verify each drafting chunk, count it, say it at start.

A chunk with a draft (moed.engine.drafts.propose, taken by the scheduler's `speculate`) ran
its known token and its k drafts as k + 1 new tokens with every row's logits
(ForwardBatch.all_logits). `verify_rows` hands those rows to moed.model.spec_verify.verify with
the SampleRow the step would have sampled the next token from, so penalties, logit_bias,
min_tokens' bans, seeds and logprobs are exactly those of plain decoding; a grammar row's, with
the grammar's mask at each position (moed.engine.masks). The scheduler then appends the
emitted tokens through the normal stop checks (the matcher advances by those only) and rolls
back the KV of the rejected ones (Scheduler._apply_verified).

Whether a step may draft at all is the per-step switch's (moed.engine.drafts.gate, measured
per decoding row count); the step loop asks it before scheduling and tells it each decode step's
emitted tokens and seconds (`gate_rows`, `emitted`), and `STEPS` counts its decisions.

A step with drafts is not decode-only (k + 1 tokens in a row), so the runner's native decode
step (1-token rows only) steps aside for it and the layered path runs it; said once at start.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import structlog
import torch

from moed.engine.drafts.gate import spread_cost
from moed.engine.drafts.mtp_kv import Deferral, MTPBacklog
from moed.engine.drafts.propose import SpecSettings
from moed.engine.plan import ScheduledChunk, StepPlan
from moed.engine.request import Request
from moed.engine.runner import StepRunner
from moed.model.mtp import mtp_inputs
from moed.model.sampler import SampleRow
from moed.model.spec_verify import DraftRow, Verified, verify
from moed.obs import metrics
from moed.types import TokenEvent

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SpecOut:
    """What a step's speculation produced, by request id: each drafting chunk's verification,
    and the MTP layer's drafts for each sampled request's next step; with the MTP layer, what
    the step did with its deferred KV entries (moed.engine.drafts.mtp_kv)."""
    verified: dict[str, Verified] = field(default_factory=dict)
    mtp: dict[str, tuple[int, ...]] = field(default_factory=dict)
    deferral: Deferral | None = None


def mtp_drafts(runner: StepRunner, plan: StepPlan, hidden: torch.Tensor, idx: Sequence[int],
               sampled: Sequence[int] | None, verified: dict[str, Verified],
               k: int = 1, drafting: bool = True, passes: int = 0,
               backlog: MTPBacklog | None = None
               ) -> tuple[dict[str, tuple[int, ...]], Deferral | None]:
    """The MTP step after a main step (docs/models.md, "The MTP layer"): every position the
    main step kept, each with the token after it (the next prompt token, the sampled one, or
    for a drafting chunk the accepted drafts then the emitted token: keep = accepted + 1), so
    the MTP layer's KV covers every computed position; the last position of each sampling
    request drafts greedily for the position after its next known token, and chains up to k
    drafts (ModelRunner.draft_mtp) as far as its block table has slots past that position
    (the scheduler reserves k - 1 with a draft: `Scheduler.speculate`). -> (those drafts per
    sampling request, what the step did with the backlog). drafting False (the per-step switch
    said plain, moed.engine.drafts.gate): nothing drafts; with a backlog the decoding rows'
    KV entries wait in it (mtp_kv: written with a later pass), without one they are written
    now (KV only). passes (expert parallelism): the MTP layer's MoE exchanges this rank makes
    this step, its own passes then as many with no rows, so every rank of the group makes the
    same number (k where any rank drafts: moed.parallel.agree.Verdict.mtp_passes); 0 outside a
    group."""
    batch = plan.batch
    if backlog is not None and not drafting:    # the common plain step: every row waits
        d = backlog.defer_all(plan.chunks, batch, hidden)
        if d is not None:
            if passes:      # (outside a group none: not even the call's inference-mode entry)
                runner.mtp_exchanges(passes)
            return {}, d
    tok = {} if sampled is None else {i: int(t) for i, t in zip(idx, sampled)}
    next_ids, keep, depth, wait = [], [], [], []
    bs = runner.block_size
    for i, c in enumerate(plan.chunks):
        r, n = c.request, len(batch.token_ids[i])
        if c.draft:
            v = verified[r.request_id]
            next_ids.append(v.token_ids[-1])
            keep.append(v.accepted + 1)
        else:
            next_ids.append(tok[i] if c.sample else r.token_ids[r.num_computed_tokens + n])
            keep.append(n)
        # the chain's entries at last + 1 .. last + depth - 1: inside the table and the context
        last = batch.start_pos[i] + keep[-1] - 1
        room = min(len(batch.block_tables[i]) * bs, r.max_model_len) - last
        # a prefill-only request's first draft is all that travels (with_first_drafts);
        # otherwise no more than its next step may verify (propose.draft_room): none when
        # this step's tokens leave it one to emit or none (a closed batch's last steps)
        left = r.params.max_tokens - r.num_output_tokens - (keep[-1] if c.draft else 1) - 1
        chain = 1 if r.prefill_only else min(k, room, left)
        # paused (propose.observe: its drafts were a loss): its next step drops any draft
        # made now, so none is made; a closed batch's straggler is often such a row
        paused = r.acceptance is not None and r.acceptance.skip > 0
        depth.append(chain if c.sample and drafting and chain > 0 and not paused else 0)
        # no draft reads its entry before a later write: it may wait unwritten
        wait.append(left <= 0 or paused)
    if backlog is None:     # rejected drafts' rows stay as padding: the main step's plan
        mb, _ = mtp_inputs(batch, next_ids, keep, pad=True)
        out = runner.draft_mtp(mb, hidden, depth, passes, keep)
        return {c.request.request_id: tuple(out[i])
                for i, c in enumerate(plan.chunks) if out[i]}, None
    p = backlog.pass_inputs(batch, plan.chunks, hidden, next_ids, keep, depth, drafting, wait)
    if p.batch is None:         # every row waits: the group's exchanges only
        runner.mtp_exchanges(passes)
        return {}, p.deferral
    out = runner.draft_mtp(p.batch, p.hidden, p.depth, passes, p.kept)
    return {plan.chunks[i].request.request_id: tuple(out[j])
            for j, i in enumerate(p.chunks) if out[j]}, p.deferral


def with_first_drafts(events: list[TokenEvent], chunks: Sequence[ScheduledChunk],
                      drafts: dict[str, tuple[int, ...]]) -> list[TokenEvent]:
    """A prefill-only request's token event with the MTP layer's (first) draft for the position
    after that token: a prefill node sends it on with the token (moed.roles.prefill), so the
    decode node's first step drafts too (one token: a chain past it is the decode node's)."""
    first = {c.request.request_id for c in chunks if c.request.prefill_only}
    return [replace(ev, draft=drafts[ev.request_id][0])
            if ev.request_id in first and ev.request_id in drafts and ev.token_ids else ev
            for ev in events]


def verify_rows(logits: torch.Tensor, last: Sequence[int], chunks: Sequence[ScheduledChunk],
                sample_row: Callable[[Request], SampleRow],
                masks: Mapping[str, torch.Tensor] | None = None) -> dict[str, Verified]:
    """logits: the runner's rows with every drafting chunk flagged all_logits; last[i]: where
    chunk i's last row landed; masks: a grammar row's masks for its first positions
    (moed.engine.masks: [1 + n, words], n <= its drafts; a shorter block cuts its draft to n:
    the positions past it are verified as rejected). -> each drafting request's verification,
    by request id."""
    idx = [i for i, c in enumerate(chunks) if c.draft]
    if not idx:
        return {}
    rows, reqs = [], []
    for i in idx:
        c, r = chunks[i], chunks[i].request
        m = None if r.grammar is None else (masks or {}).get(r.request_id)
        draft = c.draft if m is None else c.draft[:m.shape[0] - 1]
        start = last[i] - len(c.draft)
        rows.append(logits[start:start + len(draft) + 1])
        reqs.append(DraftRow(sample_row(r), draft, r.num_output_tokens, masks=m))
    return {chunks[i].request.request_id: v for i, v in zip(idx, verify(torch.cat(rows), reqs))}


def gate_rows(running: Sequence[Request]) -> int:
    """The decoding rows a step is about to have: the per-step switch's class."""
    return sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1
               and r.num_output_tokens > 0)


def tail_charge(chunks: Sequence[ScheduledChunk], verified: dict[str, Verified] | None,
                fixed_s: Callable[[], float], waiting: Sequence[Request]) -> float:
    """gate.spread_cost of a drafting step of a draining batch (none waiting for a seat), before
    the scheduler's update: each row's emitted tokens (1 without a draft) and what it had to
    go; fixed_s, the cost model's fixed step seconds (EngineBalance.fixed_step_s, read only
    when it counts). 0 for a step without drafts, one row, or requests waiting."""
    if not verified or waiting or len(chunks) < 2:
        return 0.0
    got = [len(verified[c.request.request_id].token_ids) if c.request.request_id in verified else 1
           for c in chunks]
    return spread_cost(got, [c.request.params.max_tokens - c.request.num_output_tokens for c in chunks],
                       fixed_s())


def emitted(sampled: int, verified: dict[str, Verified]) -> int:
    """Tokens a step emitted: one per sampled row, each verification's run."""
    return sampled + sum(len(v.token_ids) for v in verified.values())


def record(chunks: Sequence[ScheduledChunk], verified: dict[str, Verified]) -> None:
    """vLLM's spec_decode counters for one step."""
    for c in chunks:
        v = verified.get(c.request.request_id) if c.draft else None
        if v is None:
            continue
        metrics.SPEC_DRAFTS.inc()
        metrics.SPEC_DRAFT_TOKENS.inc(len(c.draft))
        metrics.SPEC_ACCEPTED.inc(v.accepted)
        for pos in range(v.accepted):
            metrics.SPEC_ACCEPTED_POS.labels(str(pos)).inc()


def log_start(spec: SpecSettings | None) -> None:
    """One line at start naming the method and its settings (nothing when off)."""
    if spec is None:
        return
    log.info("speculative_decoding", method=spec.method, num_speculative_tokens=spec.k,
             prompt_lookup_min=spec.n_min, prompt_lookup_max=spec.n_max,
             adaptive="measured per decoding row count" if spec.adaptive else "off",
             grammar_rows="speculated: drafts cut to the grammar-valid prefix, one mask per "
                          "verified position",
             native_decode="steps with drafts take the layered path (the native decode "
                           "step, where it runs, serves 1-token rows only)")
