"""The MTP layer's deferred KV entries: a step that does not draft writes them later, batched.

With speculative.method mtp the MTP layer attends over its own KV, one entry per position the
main model computed (moed/model/mtp.py), so every step used to write its rows' entries, also a
step the per-step switch keeps plain (the KV-only pass, draft_mtp with depth 0). On the demo
model at batch 16 that pass is ~0.6 ms of a 10-14 ms step, nearly all of it per-pass overhead,
not rows (bench/mtp_kv_cost.py): the plain arm ran ~5% behind plain decoding. So a plain step's
decoding rows are deferred: their hidden states (the main model's, after its final norm) are
held here, and their entries are written as extra sequences of the next MTP pass, in one
KV-only write: the next drafting step's, or at the latest the plain step that finds MAX_STEPS
steps held (~60 us per held step of 16 rows). The rules:

- a draft reads complete entries only: a step that drafts writes everything held first (the
  pass writes every row's entries before any drafting row attends);
- the prefix cache takes complete blocks only: `Request.mtp_pending_from` is a request's first
  deferred position and the scheduler commits blocks below it (`num_cacheable_tokens`) until
  its entries are written (a request that finishes with entries held leaves its last blocks
  uncached: at most MAX_STEPS positions);
- nothing stale is written: a request that finished or was preempted since is skipped (its
  blocks may be another request's by now), and its rows go at the next write;
- only decoding rows wait (one token, sampled, not a prefill-only request's: a prefill node
  sends the prompt's KV with the MTP layer's; prompt chunks write theirs at once);
- a decoding row whose request makes no draft next step waits even in a step that writes
  (`wait`): one that will draft no more (its next steps could verify no draft, max_tokens or
  the context is near: it finishes within two steps, dropping its entries), or one paused for
  its acceptance (moed.engine.drafts.propose.observe: its entries go with the write of the
  step it drafts again). A closed batch's tail is such rows: its straggler is often a paused
  request alone, and each of its steps ran the MTP pass for a draft it then dropped;
- a step writes only when one of its rows drafts (or MAX_STEPS steps are held): a step the
  switch lets draft whose rows all wait runs no pass, as a plain step;
- expert parallelism: a KV-only write makes no MoE exchange, so deferring changes nothing in
  what the group agrees (a step still makes Verdict.mtp_passes empty exchanges).
Memory: at most MAX_STEPS hidden states per decoding request (DeepSeek-V3: 14 KB each).
`MTPBacklog` is read by the executor thread (`pass_inputs`) and changed only by the loop
thread after the step (`apply`): the two never run at once.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from moed.engine.plan import ScheduledChunk
from moed.engine.request import Request
from moed.model.batch import ForwardBatch
from moed.model.mtp import mtp_inputs

MAX_STEPS = 64      # held steps before a plain step writes them: bounds memory and cache delay


def deferrable(c: ScheduledChunk) -> bool:
    """Whether a chunk's MTP entry may wait in a step that does not draft: a decoding row."""
    r = c.request
    return c.sample and not c.draft and c.num_new_tokens == 1 and not r.prefill_only \
        and r.num_output_tokens > 0


@dataclass
class _Held:
    """One request's live held positions, gathered for a write."""
    req: Request
    table: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Deferral:
    """What a step did with the backlog, for the loop thread to apply after it: `written`, the
    step's pass wrote everything held; `hidden` [R, H], the rows it deferred, row j that of
    `reqs[j]` at position `starts[j]`, in the blocks of `tables[j]`."""
    written: bool = False
    hidden: torch.Tensor | None = None
    reqs: tuple[Request, ...] = ()
    starts: Sequence[int] = ()
    tables: Sequence[list[int]] = ()


@dataclass(frozen=True)
class MTPPass:
    """A step's MTP pass: its batch and hidden rows (the step's own sequences first, then the
    held ones), each sequence's draft depth and real rows (the rest: a rejected draft's row,
    padding, mtp_inputs(pad=True)), and which chunk each of the first sequences is."""
    batch: ForwardBatch | None      # None: no row runs the layer this step
    hidden: torch.Tensor | None
    depth: list[int]
    chunks: list[int]
    deferral: Deferral
    kept: list[int] = field(default_factory=list)


class MTPBacklog:
    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        self.max_steps = max_steps
        # per deferring step: its Deferral and each row's request's preemption count then (a
        # preemption since makes the row stale: its blocks went back to the pool)
        self._steps: list[tuple[Deferral, tuple[int, ...]]] = []
        self._reqs: dict[str, Request] = {}     # those whose mtp_pending_from is set

    @property
    def steps(self) -> int:
        """Deferring steps held since the last write."""
        return len(self._steps)

    def apply(self, d: Deferral | None) -> None:
        """After the step, before the scheduler's update (its commits read mtp_pending_from).
        Per deferring step a few attribute reads per row: the grouping waits for the write."""
        if d is None:
            return
        if d.written:
            for r in self._reqs.values():
                r.mtp_pending_from = None
            self._reqs.clear()
            self._steps.clear()
        if d.hidden is None:
            return
        self._steps.append((d, tuple(r.num_preemptions for r in d.reqs)))
        for r, p in zip(d.reqs, d.starts):
            if r.mtp_pending_from is None:  # (a preempted one's stays: later, never wrong)
                r.mtp_pending_from = p
                self._reqs[r.request_id] = r

    def defer_all(self, chunks: Sequence[ScheduledChunk], batch: ForwardBatch,
                  hidden: torch.Tensor) -> Deferral | None:
        """A plain step of decoding rows only, nothing due: all of them wait, the pass is not
        built (pass_inputs' answer, cheaper). None: another case, pass_inputs decides."""
        if self.steps >= self.max_steps or hidden.shape[0] != len(chunks) \
                or not all(deferrable(c) for c in chunks):
            return None
        return Deferral(False, hidden, tuple(c.request for c in chunks), batch.start_pos,
                        batch.block_tables)

    def _sequences(self) -> tuple[list[list[int]], list[int], list[list[int]], list[int]]:
        """The live held entries as MTP sequences: (each position's next token, starts, block
        tables, rows of the held hidden states in step order); a request's positions split
        where they are not contiguous. A row whose request finished or was preempted since is
        left out."""
        held: dict[str, _Held] = {}
        base = 0
        for d, pre in self._steps:
            for j, (r, p, t) in enumerate(zip(d.reqs, d.starts, d.tables)):
                if r.finished or r.num_preemptions != pre[j]:
                    continue
                g = held.get(r.request_id)
                if g is None:
                    g = held[r.request_id] = _Held(r)
                g.positions.append(p)
                g.rows.append(base + j)
                g.table = t         # the latest table holds every earlier position
            base += d.hidden.shape[0]
        toks: list[list[int]] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        rows: list[int] = []
        for g in held.values():
            ids, ps = g.req.token_ids, g.positions
            for i, (p, row) in enumerate(zip(ps, g.rows)):
                if i == 0 or p != ps[i - 1] + 1:
                    toks.append([])
                    starts.append(p)
                    tables.append(g.table)
                toks[-1].append(ids[p + 1])
                rows.append(row)
        return toks, starts, tables, rows

    def pass_inputs(self, batch: ForwardBatch, chunks: Sequence[ScheduledChunk],
                    hidden: torch.Tensor, next_ids: list[int], keep: list[int],
                    depth: list[int], drafting: bool,
                    wait: Sequence[bool] | None = None) -> MTPPass:
        """A step's MTP pass (the executor's; reads the backlog, changes nothing): which of its
        sequences (mtp.mtp_inputs' next ids, kept positions and depths) run now and which wait,
        and whether everything held is written with it: when a row of the step drafts or
        MAX_STEPS steps are held. (A row that cannot wait is written at once, whatever its
        request holds: an entry is written by position, read only by a draft.) wait[i]:
        sequence i's request makes no draft before a later write (it drafts no more, or it
        is paused); its decoding row waits even when the step writes."""
        write = (drafting and any(depth)) or self.steps >= self.max_steps
        fin = wait or [False] * len(chunks)
        defer = [(not write or f) and deferrable(c) for c, f in zip(chunks, fin)]
        mb, rows = mtp_inputs(batch, next_ids, keep, pad=True)
        ends = [0]
        for t in batch.token_ids:
            ends.append(ends[-1] + len(t))
        now = [i for i, d in enumerate(defer) if not d]
        sel = [r for i in now for r in rows[ends[i]:ends[i + 1]]]
        toks = [mb.token_ids[i] for i in now]
        starts = [mb.start_pos[i] for i in now]
        tables = [mb.block_tables[i] for i in now]
        parts = []
        if sel:
            parts.append(hidden if sel == list(range(hidden.shape[0]))
                         else hidden.index_select(0, torch.tensor(sel, device=hidden.device)))
        if write and self._steps:
            h_toks, h_starts, h_tables, h_rows = self._sequences()
            if h_rows:
                toks += h_toks
                starts += h_starts
                tables += h_tables
                held = torch.cat([d.hidden for d, _ in self._steps])
                parts.append(held.index_select(0, torch.tensor(h_rows, device=held.device)))
        deferral = Deferral(written=write)
        late = [i for i, d in enumerate(defer) if d]
        if late:
            lr = [rows[ends[i]] for i in late]
            hid = hidden if len(lr) == hidden.shape[0] else \
                hidden.index_select(0, torch.tensor(lr, device=hidden.device))
            deferral = Deferral(write, hid, tuple(chunks[i].request for i in late),
                                [mb.start_pos[i] for i in late], [mb.block_tables[i] for i in late])
        if not toks:
            return MTPPass(None, None, [], [], deferral)
        h = parts[0] if len(parts) == 1 else torch.cat(parts)
        d = [depth[i] for i in now] + [0] * (len(toks) - len(now))
        kept = [keep[i] for i in now] + [len(t) for t in toks[len(now):]]
        return MTPPass(ForwardBatch(toks, starts, tables), h, d, now, deferral, kept)
