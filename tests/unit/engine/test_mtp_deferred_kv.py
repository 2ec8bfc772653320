"""The MTP layer's KV entries deferred by plain steps (moed.engine.drafts.mtp_kv).

A step the per-step switch keeps plain runs no MTP pass for its decoding rows; their hidden
states wait and their entries are written with the next pass (a drafting step's) or when
MAX_STEPS steps are held. Against the same engine writing every entry at once (its backlog
off), step by step with the same switch and batch-invariant kernels: the main layers' KV is
bitwise the same throughout, the MTP layer's is bitwise the same after every write and
differs in between (the entries did wait); the drafts and the output are the same, and greedy
output equals plain decoding. The prefix cache never takes a block whose MTP entries wait;
preemption and aborts leave no block behind and never get a stale request's rows written.
"""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moed.config import EngineConfig, SpeculativeConfig
from moed.engine.drafts.gate import Why
from moed.engine.drafts.mtp_kv import MAX_STEPS, Deferral, MTPBacklog, deferrable
from moed.engine.drivers import SyncDriver, run_sync
from moed.engine.engine import Engine
from moed.engine.plan import ScheduledChunk
from moed.engine.request import Request
from moed.model.batch import ForwardBatch
from moed.model.runner import ModelRunner
from moed.model.tokenizer import Tokenizer
from moed.types import RequestState, SamplingParams

torch.set_num_threads(1)

DEMO = Path(__file__).resolve().parents[3] / "models" / "stdlib-ds3-tiny"
DTYPE = "bfloat16"     # batch-invariant with the native kernels: bitwise comparisons
ADAPTIVE = SpeculativeConfig(method="mtp", num_speculative_tokens=1)    # the switch on
SNIPPETS = ["def {a}(x, y):\n    return x + y\n\n\ndef {b}(x, y):\n    return x - y\n\n\ndef",
            "import {a}\nimport {b}\nimport {a}\nimport",
            "for {a} in range(10):\n    print({a})\nfor {b} in range(10):\n    print(",
            "{a} = [1, 2, 3]\n{b} = [1, 2, 3]\n{a} = [1, 2,"]
NAMES = ["os", "sys", "re", "json", "path", "item", "value", "key"]


def _engine(spec=None, blocks=400, seqs=4, caching=True) -> Engine:
    r = ModelRunner(DEMO, dtype=DTYPE, device="cpu", num_blocks=blocks, block_size=4,
                    mtp=spec is not None, batch_invariant=True)
    return Engine(r, Tokenizer.from_dir(DEMO), EngineConfig(
        block_size=4, max_num_seqs=seqs, max_num_batched_tokens=64,
        enable_prefix_caching=caching), speculative=spec)


def _switch(e: Engine, plain: int, draft: int) -> None:
    """The switch says plain for `plain` decisions, then draft for `draft`, over and over."""
    n = [0]

    def choose(rows: int) -> tuple[bool, Why]:
        n[0] += 1
        return n[0] % (plain + draft) >= plain, Why.EXPLORE
    e._gate.choose = choose


def _prompts(n: int) -> list[list[int]]:
    tok = Tokenizer.from_dir(DEMO)
    return [tok.encode(t.format(a=NAMES[i % 8], b=NAMES[(i + 3) % 8]))
            for i, t in enumerate((SNIPPETS * n)[:n])]


@pytest.mark.parametrize("plain,draft,new", [(6, 3, 40), (1000, 0, 150), (70, 4, 120)],
                         ids=["alternating", "never-drafts", "past-the-bound"])
def test_deferred_entries_are_the_eager_ones_once_written(plain, draft, new):
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    prompts = _prompts(4)
    deferring, eager = _engine(ADAPTIVE), _engine(ADAPTIVE)
    eager._mtp_kv = None        # every step writes its rows' entries (KV only when plain)
    reqs = []
    for e in (deferring, eager):
        _switch(e, plain, draft)
        for i, p in enumerate(prompts):
            reqs.append(e._new_request(f"r{i}", p, params))
            e.scheduler.add(reqs[-1])
    mtp = deferring.runner.spec.num_layers
    driver, waited, writes, drafts = SyncDriver(), 0, 0, [0, 0]
    calls = [deferring.runner.draft_mtp, eager.runner.draft_mtp]
    for j, e in enumerate((deferring, eager)):
        def spy(batch, hidden, depth, passes=0, kept=None, _j=j):
            drafts[_j] += sum(d > 0 for d in depth)
            return calls[_j](batch, hidden, depth, passes, kept)
        e.runner.draft_mtp = spy
    while deferring.scheduler.has_unfinished():
        held = deferring._mtp_kv.steps
        run_sync(deferring.step(driver))
        run_sync(eager.step(driver))
        a, b = deferring.runner.kv_cache, eager.runner.kv_cache
        assert torch.equal(a[:mtp], b[:mtp])
        assert deferring._mtp_kv.steps <= MAX_STEPS
        if deferring._mtp_kv.steps == 0:
            writes += held > 0
            # every live request's entries (a finished one's last, drafting no more, may be
            # left unwritten: mtp_kv's `final`)
            for r in reqs[:4]:
                if r.state is RequestState.RUNNING:
                    t, bs = deferring.kv.block_table(r.request_id), 4
                    at = [(t[p // bs], p % bs) for p in range(r.num_computed_tokens - 1)]
                    assert all(torch.equal(a[mtp][i, j], b[mtp][i, j]) for i, j in at)
        else:
            waited += not torch.equal(a[mtp], b[mtp])
    assert waited > 0 and writes > 0 and drafts[0] == drafts[1]
    if draft == 0:      # never drafting: written when MAX_STEPS steps are held, only then
        assert writes == (new - 1) // (MAX_STEPS + 1)
    want = _engine().generate(prompts, params)
    assert [r.output_token_ids for r in reqs[:4]] == want == [r.output_token_ids for r in reqs[4:]]
    assert deferring.kv.num_used_blocks == 0


def test_the_prefix_cache_never_takes_a_block_whose_mtp_entries_wait():
    e = _engine(ADAPTIVE)
    _switch(e, 30, 2)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    reqs = [e._new_request(f"r{i}", p, params) for i, p in enumerate(_prompts(4))]
    for r in reqs:
        e.scheduler.add(r)
    pool, bs, driver = e.kv._pool, e.kv.block_size, SyncDriver()
    waited = cached_late = 0
    while e.scheduler.has_unfinished():
        run_sync(e.step(driver))
        for r in reqs:
            if r.finished or not e.kv.has(r.request_id):
                continue
            start = r.mtp_pending_from
            waited += start is not None
            for j, blk in enumerate(e.kv.block_table(r.request_id)):
                if pool.block_hash(blk) is not None:
                    assert start is None or (j + 1) * bs <= start, (r.request_id, j, start)
                    cached_late += start is None and (j + 1) * bs > r.num_prompt_tokens
    assert waited > 0 and cached_late > 0     # decode blocks are cached, once written


def test_preemption_and_aborts_leak_nothing_and_write_no_stale_row():
    """A pool that preempts, requests aborted mid-way, the switch in long plain runs: greedy
    output equals plain, every written sequence lies in a live request's blocks, and the pool
    is whole at the end."""
    prompts = _prompts(24)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = {i: o for i, o in enumerate(_engine(seqs=6).generate(prompts, params))}
    e = _engine(ADAPTIVE, blocks=48, seqs=6)
    _switch(e, 20, 3)
    draft_mtp, bs = e.runner.draft_mtp, e.kv.block_size

    def checked(batch, hidden, depth, passes=0, kept=None):
        live = [e.kv.block_table(r.request_id) for r in e.scheduler.running]
        for toks, start, table in zip(batch.token_ids, batch.start_pos, batch.block_tables):
            need = (start + len(toks) - 1) // bs + 1
            assert any(t[:need] == table[:need] for t in live), (start, table)
        return draft_mtp(batch, hidden, depth, passes, kept)
    e.runner.draft_mtp = checked
    free0, rng, live, k, aborted = e.kv.num_free_blocks, random.Random(1), [], 0, set()
    driver = SyncDriver()
    while k < len(prompts) or live:
        while k < len(prompts) and len(live) < 6:
            r = e._new_request(f"r{k}", prompts[k], params)
            e.scheduler.add(r)
            live.append((k, r))
            k += 1
        run_sync(e.step(driver))
        for i, r in list(live):
            if not r.finished and rng.random() < 0.02:
                e.scheduler.abort(r.request_id)
                aborted.add(i)
            if r.finished:
                live.remove((i, r))
                if i not in aborted:
                    assert r.output_token_ids == want[i], i
    assert e.scheduler.num_preemptions > 0 and aborted
    assert e.kv.num_free_blocks == free0 and e.kv.num_used_blocks == 0


# ---- the backlog alone ----------------------------------------------------------------------

def _req(rid: str, tokens: list[int], out: int = 1) -> Request:
    r = Request(rid, tokens[:len(tokens) - out], SamplingParams(max_tokens=100))
    r.token_ids = list(tokens)
    r.state = RequestState.RUNNING
    return r


def test_only_decoding_rows_wait():
    dec = _req("d", list(range(10)))
    first = _req("f", list(range(10)), out=0)
    pre = _req("p", list(range(10)))
    pre.prefill_only = True
    assert deferrable(ScheduledChunk(dec, 1, True))
    assert not deferrable(ScheduledChunk(dec, 1, True, (5,)))      # a draft: verified now
    assert not deferrable(ScheduledChunk(dec, 3, True))            # a chunk of positions
    assert not deferrable(ScheduledChunk(first, 1, True))          # the prompt's last token
    assert not deferrable(ScheduledChunk(pre, 1, True))            # a prefill node's: sent
    assert not deferrable(ScheduledChunk(dec, 1, False))


def test_held_rows_become_sequences_and_stale_ones_are_dropped():
    b = MTPBacklog(max_steps=3)
    a, c, gone = _req("a", list(range(20))), _req("c", list(range(30, 50))), _req("g", list(range(9)))
    hid = [torch.full((3, 2), float(s)) for s in range(3)]
    for s in range(2):      # two plain steps, three decoding rows each
        b.apply(Deferral(False, hid[s], (a, c, gone), [10 + s, 5 + s, 4 + s],
                         [[0, 1, 2], [3, 4], [5, 6]]))
    a.num_computed_tokens = 12
    assert b.steps == 2 and a.mtp_pending_from == 10 and c.mtp_pending_from == 5
    assert a.num_cacheable_tokens == 10
    gone.state = RequestState.FINISHED      # aborted: its rows must never be written
    c.num_preemptions += 1                  # preempted: its blocks went back to the pool
    batch = ForwardBatch([[7], [8]], [12, 3], [[0, 1, 2, 3], [7]])
    chunks = [ScheduledChunk(a, 1, True), ScheduledChunk(_req("n", list(range(5))), 1, True)]
    # a third plain step: both rows wait (3 steps held now)
    p = b.pass_inputs(batch, chunks, torch.zeros(2, 2), [9, 9], [1, 1], [0, 0], drafting=False)
    assert p.batch is None and not p.deferral.written and len(p.deferral.reqs) == 2
    b.apply(p.deferral)
    # the bound: the next plain step writes everything, its own rows too
    batch = ForwardBatch([[9], [6]], [13, 4], [[0, 1, 2, 3], [7]])
    p = b.pass_inputs(batch, chunks, torch.ones(2, 2), [4, 4], [1, 1], [0, 0], drafting=False)
    assert p.deferral.written and p.deferral.hidden is None and p.chunks == [0, 1]
    # a's three held positions in one sequence, n's one; c and g (stale) left out
    assert p.batch.start_pos == [13, 4, 10, 3] and p.batch.token_ids[2:] == [[11, 12, 13], [4]]
    assert p.batch.block_tables[2] == [0, 1, 2, 3] and p.depth == [0, 0, 0, 0]
    assert p.hidden[2:, 0].tolist() == [0.0, 1.0, 0.0, 0.0]
    b.apply(p.deferral)
    assert b.steps == 0 and a.mtp_pending_from is None and c.mtp_pending_from is None


def test_a_step_that_drafts_writes_everything_held_first():
    b = MTPBacklog()
    a = _req("a", list(range(20)))
    b.apply(Deferral(False, torch.zeros(1, 2), (a,), [10], [[0, 1, 2]]))
    batch = ForwardBatch([[7]], [11], [[0, 1, 2]])
    p = b.pass_inputs(batch, [ScheduledChunk(a, 1, True)], torch.ones(1, 2), [3], [1], [1],
                      drafting=True)
    assert p.deferral.written and p.depth == [1, 0] and p.batch.start_pos == [11, 10]



def test_a_row_that_drafts_no_more_waits_even_when_the_step_writes():
    # a closed batch's tail: a drafting step whose request has no draft left to verify runs
    # no MTP pass for it (no draft reads its entry; it finishes with it held)
    from moed.engine.speculate import mtp_drafts

    made = []
    runner = SimpleNamespace(block_size=4, mtp_exchanges=made.append,
                             draft_mtp=lambda *a: pytest.fail("no row runs the MTP layer"))
    a = _req("a", list(range(20)))
    a.params = SamplingParams(max_tokens=3)     # 1 out, this step's 1, the next step's 1
    plan = SimpleNamespace(batch=ForwardBatch([[7]], [18], [[0, 1, 2, 3, 4]]),
                           chunks=(ScheduledChunk(a, 1, True),))
    b = MTPBacklog()
    drafts, d = mtp_drafts(runner, plan, torch.zeros(1, 2), [0], [9], {}, 1, drafting=True,
                           passes=1, backlog=b)
    # nothing drafts, nothing is written: held rows would wait too
    assert drafts == {} and made == [1] and not d.written and d.reqs == (a,)
    b.apply(d)
    assert b.steps == 1 and a.mtp_pending_from == 18     # its blocks stay out of the cache
    # with rows held, the step writes them and its final row still waits
    c = _req("c", list(range(20)))
    p = b.pass_inputs(ForwardBatch([[7], [8]], [19, 18], [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
                      [ScheduledChunk(a, 1, True), ScheduledChunk(c, 1, True)], torch.ones(2, 2),
                      [3, 4], [1, 1], [0, 1], drafting=True, wait=[True, False])
    assert p.chunks == [1] and p.batch.start_pos == [18, 18] and p.depth == [1, 0]
    assert p.deferral.written and p.deferral.reqs == (a,) and p.deferral.starts == [19]

def test_a_paused_row_makes_no_draft_and_waits():
    # a request paused for its acceptance drops any draft made for its next step: none is
    # made, and its entry waits for the write of a step that drafts
    from moed.engine.drafts.propose import Acceptance
    from moed.engine.speculate import mtp_drafts

    made, ran = [], []
    runner = SimpleNamespace(block_size=4, mtp_exchanges=made.append,
                             draft_mtp=lambda mb, h, depth, passes, kept: ran.append(depth) or [[5]])
    a, c = _req("a", list(range(30))), _req("c", list(range(30)))
    a.acceptance = Acceptance(0.1, skip=3)
    plan = SimpleNamespace(batch=ForwardBatch([[7]], [18], [[0, 1, 2, 3, 4]]),
                           chunks=(ScheduledChunk(a, 1, True),))
    b = MTPBacklog()
    drafts, d = mtp_drafts(runner, plan, torch.zeros(1, 2), [0], [9], {}, 1, drafting=True,
                           passes=1, backlog=b)
    assert drafts == {} and ran == [] and made == [1] and not d.written and d.reqs == (a,)
    b.apply(d)
    assert a.mtp_pending_from == 18
    # beside a drafting row: that one runs (and writes a's held entry first), a waits again
    plan = SimpleNamespace(batch=ForwardBatch([[9], [8]], [19, 18], [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
                           chunks=(ScheduledChunk(a, 1, True), ScheduledChunk(c, 1, True)))
    drafts, d = mtp_drafts(runner, plan, torch.zeros(2, 2), [0, 1], [3, 4], {}, 1, drafting=True,
                           passes=1, backlog=b)
    assert drafts == {"c": (5,)} and ran == [[1, 0]] and d.written and d.reqs == (a,)
    b.apply(d)
    assert a.mtp_pending_from == 19
    a.acceptance = Acceptance(0.1, skip=0)      # its next step drafts: so does this one
    plan = SimpleNamespace(batch=ForwardBatch([[3]], [20], [[0, 1, 2, 3, 4, 10]]),
                           chunks=(ScheduledChunk(a, 1, True),))
    drafts, d = mtp_drafts(runner, plan, torch.zeros(1, 2), [0], [4], {}, 1, drafting=True,
                           passes=1, backlog=b)
    assert drafts == {"a": (5,)} and ran[-1] == [1, 0] and d.written and d.hidden is None


def test_a_rank_with_every_row_waiting_still_makes_the_groups_exchanges():
    from moed.engine.speculate import mtp_drafts

    made = []
    runner = SimpleNamespace(block_size=4, mtp_exchanges=made.append,
                             draft_mtp=lambda *a: pytest.fail("no row runs the MTP layer"))
    a = _req("a", list(range(20)))
    plan = SimpleNamespace(batch=ForwardBatch([[7]], [18], [[0, 1, 2, 3, 4]]),
                           chunks=(ScheduledChunk(a, 1, True),))
    drafts, d = mtp_drafts(runner, plan, torch.zeros(1, 2), [0], [9], {}, 3, drafting=False,
                           passes=3, backlog=MTPBacklog())
    assert drafts == {} and made == [3] and d.reqs == (a,) and d.starts == [18]
