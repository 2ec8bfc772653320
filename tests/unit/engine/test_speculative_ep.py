"""Speculation in an expert-parallel group, the step's half (moed.engine.step, drivers): a rank
tells its group whether its step runs the MTP layer's MoE (StepCore._mtp_full), and joins that
layer's exchange with no rows when a peer's step runs it and its own does not: a step whose
switch said plain (its MTP pass writes KV entries only) or a rank with no rows at all (the
empty forward). The agreement's rule is Verdict.join_mtp (pure). The group itself, over real
processes: tests/integration/test_ep_speculative.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moed.config import EngineConfig, SpeculativeConfig
from moed.engine.drivers import SyncDriver, run_sync
from moed.engine.engine import Engine
from moed.engine.plan import StepPlan
from moed.engine.step import Go
from moed.model.batch import ForwardBatch
from moed.model.runner import ModelRunner
from moed.model.tokenizer import Tokenizer
from moed.parallel.agree import Verdict
from moed.types import SamplingParams

torch.set_num_threads(1)

DEMO = Path(__file__).resolve().parents[3] / "models" / "stdlib-ds3-tiny"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_a_rank_joins_the_mtp_exchange_only_when_a_peer_runs_it_and_it_does_not() -> None:
    # Verdict(working, leaving, rebalance, mtp): mtp counts the ranks running the layer's MoE
    assert not Verdict(2, 0, 0, 0).join_mtp(False)      # nobody runs it: nobody joins
    assert Verdict(2, 0, 0, 1).join_mtp(False)          # a peer does, this rank does not
    assert Verdict(1, 0, 0, 3).join_mtp(False)          # (an empty rank too)
    assert not Verdict(2, 0, 0, 1).join_mtp(True)       # this rank is the one running it
    assert not Verdict(2, 0, 0, 2).join_mtp(True)       # it exchanges its rows already


class PeerDrafts(SyncDriver):
    """A group driver's verdicts where a peer's step always runs the MTP layer in full, has
    work every step (so this rank steps, empty when it has no plan), and this rank's switch
    alternates draft / plain."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.steps = engine, 0
        self.join_mtp = False

    async def agree(self, plan: StepPlan | None) -> Go:
        self.steps += 1
        self.engine.scheduler.drafting = self.steps % 2 == 0
        own = self.engine._mtp_full(plan)
        self.join_mtp = Verdict(2, 0, 0, 1 + own).join_mtp(own)
        return Go.STEP if plan is not None else Go.EMPTY


def _engine(spec: SpeculativeConfig | None) -> Engine:
    r = ModelRunner(DEMO, dtype="float32", device="cpu", num_blocks=128, block_size=4,
                    mtp=spec is not None)
    return Engine(r, Tokenizer.from_dir(DEMO), EngineConfig(
        block_size=4, max_num_seqs=4, max_num_batched_tokens=16), speculative=spec)


def test_the_step_joins_the_mtp_exchange_when_its_pass_skips_the_moe(monkeypatch) -> None:
    tok = Tokenizer.from_dir(DEMO)
    prompts = [tok.encode(p) for p in ("import os\nimport sys\nimport", "def f(x):\n    return",
                                       "for i in range(10):\n    print(i)\nfor j in range(")]
    want = _engine(None).generate(prompts, GREEDY)
    eng = _engine(SpeculativeConfig(method="mtp", num_speculative_tokens=1, adaptive=False))
    calls: list[tuple[bool, bool]] = []     # each MTP pass: (kv_only, exchange)
    joins: list[str] = []
    runner, real_mtp = eng.runner, eng.runner.forward_mtp

    def forward_mtp(batch, hidden, kv_only=False, exchange=False):
        calls.append((kv_only, exchange))
        return real_mtp(batch, hidden, kv_only=kv_only, exchange=exchange)
    monkeypatch.setattr(runner, "forward_mtp", forward_mtp)
    monkeypatch.setattr(runner.mtp, "empty_step", lambda: joins.append("mtp"))
    monkeypatch.setattr(runner.model, "empty_step", lambda: joins.append("main"))
    reqs = [eng._new_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.scheduler.add(r)
    driver = PeerDrafts(eng)
    while not all(r.finished for r in reqs):
        assert run_sync(eng.step(driver)) is Go.STEP
    assert [r.output_token_ids for r in reqs] == want      # joining changes nothing here
    # every plain step's MTP pass wrote its KV entries and joined the peer's exchange; every
    # drafting step's ran the layer itself (no join)
    assert calls and set(calls) == {(False, False), (True, True)}
    assert joins == ["mtp"] * calls.count((True, True))
    # a rank without rows while the peer drafts: the main layers' exchanges, then the MTP's
    joins.clear()
    driver.steps = 1        # the next agree makes this rank's switch say draft: no matter
    assert run_sync(eng.step(driver)) is Go.STEP and joins == ["main", "mtp"]
    assert driver.join_mtp


def test_the_runner_refuses_an_exchange_it_cannot_make() -> None:
    on = ModelRunner(DEMO, dtype="float32", device="cpu", num_blocks=8, block_size=4, mtp=True)
    batch = ForwardBatch([[5, 6]], [0], [[0]])
    with pytest.raises(ValueError, match="kv_only"):
        on.forward_mtp(batch, torch.zeros(2, on.spec.hidden_size), exchange=True)
    off = ModelRunner(DEMO, dtype="float32", device="cpu", num_blocks=8, block_size=4)
    with pytest.raises(RuntimeError, match="without mtp=True"):
        off.forward_empty(mtp=True)
    off.forward_empty()       # no group: the main layers' exchanges are nothing
