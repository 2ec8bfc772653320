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
    """One request's deferred positions and their rows in the backlog's hidden states."""
    req: Request
    preemptions: int        # the request's count when held: a preemption since makes it stale
    table: list[int]        # its block table (holds every position below)
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return not self.req.finished and self.req.num_preemptions == self.preemptions


@dataclass(frozen=True)
class Deferral:
    """What a step did with the backlog, for the loop thread to apply after it: `written`, the
    step's pass wrote everything held; `hidden` [R, H], the rows it deferred, each
    (request, position, block table) in `rows`."""
    written: bool = False
    hidden: torch.Tensor | None = None
    rows: tuple[tuple[Request, int, list[int]], ...] = ()


@dataclass(frozen=True)
class MTPPass:
    """A step's MTP pass: its batch and hidden rows (the step's own sequences first, then the
    held ones), each sequence's draft depth, and which chunk each of the first sequences is."""
    batch: ForwardBatch | None      # None: no row runs the layer this step
    hidden: torch.Tensor | None
    depth: list[int]
    chunks: list[int]
    deferral: Deferral


class MTPBacklog:
    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        self.max_steps = max_steps
        self._hidden: list[torch.Tensor] = []   # one per deferring step
        self._rows = 0                          # rows in those
        self._held: dict[str, _Held] = {}

    @property
    def steps(self) -> int:
        """Deferring steps held since the last write."""
        return len(self._hidden)

    def holds(self, request_id: str) -> bool:
        """Whether entries of this request wait (a stale request's do not count)."""
        h = self._held.get(request_id)
        return h is not None and h.live

    def apply(self, d: Deferral | None) -> None:
        """After the step, before the scheduler's update (its commits read mtp_pending_from)."""
        if d is None:
            return
        if d.written:
            for h in self._held.values():
                h.req.mtp_pending_from = None
            self._held.clear()
            self._hidden.clear()
            self._rows = 0
        if d.hidden is None:
            return
        base = self._rows
        self._hidden.append(d.hidden)
        self._rows += d.hidden.shape[0]
        for j, (req, pos, table) in enumerate(d.rows):
            h = self._held.get(req.request_id)
            if h is None or not h.live:
                h = self._held[req.request_id] = _Held(req, req.num_preemptions, table)
                req.mtp_pending_from = pos
            h.positions.append(pos)
            h.rows.append(base + j)
            h.table = table

    def _sequences(self) -> tuple[list[list[int]], list[int], list[list[int]], list[int]]:
        """The live held entries as MTP sequences: (each position's next token, starts, block
        tables, hidden rows); a request's positions split where they are not contiguous."""
        toks: list[list[int]] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        rows: list[int] = []
        for h in self._held.values():
            if not h.live:
                continue
            ids = h.req.token_ids
            for i, (p, row) in enumerate(zip(h.positions, h.rows)):
                if i == 0 or p != h.positions[i - 1] + 1:
                    toks.append([])
                    starts.append(p)
                    tables.append(h.table)
                toks[-1].append(ids[p + 1])
                rows.append(row)
        return toks, starts, tables, rows

    def pass_inputs(self, batch: ForwardBatch, chunks: Sequence[ScheduledChunk],
                    hidden: torch.Tensor, next_ids: list[int], keep: list[int],
                    depth: list[int], drafting: bool) -> MTPPass:
        """A step's MTP pass (the executor's; reads the backlog, changes nothing): which of its
        sequences (mtp.mtp_inputs' next ids, kept positions and depths) run now and which wait,
        and whether everything held is written with it: when the step drafts, when MAX_STEPS
        steps are held, or when a request with held entries has a row that cannot wait."""
        defer = [not drafting and deferrable(c) for c in chunks]
        write = drafting or self.steps >= self.max_steps or any(
            not d and self.holds(c.request.request_id) for d, c in zip(defer, chunks))
        if write:
            defer = [False] * len(chunks)
        mb, rows = mtp_inputs(batch, next_ids, keep)
        ends = [0]
        for n in keep:
            ends.append(ends[-1] + n)
        now = [i for i, d in enumerate(defer) if not d]
        sel = [r for i in now for r in rows[ends[i]:ends[i + 1]]]
        toks = [mb.token_ids[i] for i in now]
        starts = [mb.start_pos[i] for i in now]
        tables = [mb.block_tables[i] for i in now]
        parts = []
        if sel:
            parts.append(hidden if sel == list(range(hidden.shape[0]))
                         else hidden.index_select(0, torch.tensor(sel, device=hidden.device)))
        if write and self._held:
            h_toks, h_starts, h_tables, h_rows = self._sequences()
            if h_rows:
                toks += h_toks
                starts += h_starts
                tables += h_tables
                held = torch.cat(self._hidden) if len(self._hidden) > 1 else self._hidden[0]
                parts.append(held.index_select(0, torch.tensor(h_rows, device=held.device)))
        deferral = Deferral(written=write)
        late = [i for i, d in enumerate(defer) if d]
        if late:
            lr = [rows[ends[i]] for i in late]
            hid = hidden if len(lr) == hidden.shape[0] else \
                hidden.index_select(0, torch.tensor(lr, device=hidden.device))
            deferral = Deferral(False, hid, tuple(
                (chunks[i].request, mb.start_pos[i], mb.block_tables[i]) for i in late))
        if not toks:
            return MTPPass(None, None, [], [], deferral)
        h = parts[0] if len(parts) == 1 else torch.cat(parts)
        d = [depth[i] for i in now] + [0] * (len(toks) - len(now))
        return MTPPass(ForwardBatch(toks, starts, tables), h, d, now, deferral)
