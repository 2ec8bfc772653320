"""Speculation in an expert-parallel group, the step's half (moed.engine.step, drivers): a rank
tells its group whether its step runs the MTP layer's MoE (StepCore._mtp_full); when any rank's
does, every rank makes k of that layer's exchanges (the chain's length): its own chained passes,
then the rest with no rows, so a step whose switch said plain (KV entries only), a chain that
ends early and a rank with no rows at all (the empty forward) all match a peer that drafts.
The agreement's rule is Verdict.mtp_passes (pure). The group itself, over real processes:
tests/integration/test_ep_speculative.py."""
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
K = 3       # chained MTP drafts: a drafting rank's chain may end before k passes


def test_every_rank_makes_k_mtp_exchanges_when_any_rank_drafts() -> None:
    # Verdict(working, leaving, rebalance, mtp): mtp counts the ranks running the layer's MoE
    assert Verdict(2, 0, 0, 0).mtp_passes(3) == 0       # nobody runs it: no exchange
    assert Verdict(2, 0, 0, 1).mtp_passes(3) == 3       # one does: k on every rank
    assert Verdict(1, 0, 0, 2).mtp_passes(1) == 1


class PeerDrafts(SyncDriver):
    """A group driver's verdicts where a peer's step always runs the MTP layer in full, has
    work every step (so this rank steps, empty when it has no plan), and this rank's switch
    alternates draft / plain."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.steps = engine, 0
        self.mtp_passes = 0

    async def agree(self, plan: StepPlan | None) -> Go:
        self.steps += 1
        self.engine.scheduler.drafting = self.steps % 2 == 0
        own = self.engine._mtp_full(plan)
        self.mtp_passes = Verdict(2, 0, 0, 1 + own).mtp_passes(K)
        return Go.STEP if plan is not None else Go.EMPTY


def _engine(spec: SpeculativeConfig | None) -> Engine:
    r = ModelRunner(DEMO, dtype="float32", device="cpu", num_blocks=128, block_size=4,
                    mtp=spec is not None)
    return Engine(r, Tokenizer.from_dir(DEMO), EngineConfig(
        block_size=4, max_num_seqs=4, max_num_batched_tokens=16), speculative=spec)


def test_the_step_makes_k_mtp_exchanges_every_step_a_peer_drafts(monkeypatch) -> None:
    tok = Tokenizer.from_dir(DEMO)
    prompts = [tok.encode(p) for p in ("import os\nimport sys\nimport", "def f(x):\n    return",
                                       "for i in range(10):\n    print(i)\nfor j in range(")]
    want = _engine(None).generate(prompts, GREEDY)
    eng = _engine(SpeculativeConfig(method="mtp", num_speculative_tokens=K, adaptive=False))
    runner, mtp = eng.runner, eng.runner.mtp
    log: list[str] = []       # this rank's exchanges in order: "main", "draft" (rows), "mtp" (none)
    real_draft = mtp.draft

    def draft(*a, **kw):
        log.append("draft")
        return real_draft(*a, **kw)
    monkeypatch.setattr(mtp, "draft", draft)
    monkeypatch.setattr(mtp, "empty_step", lambda: log.append("mtp"))
    monkeypatch.setattr(runner.model, "empty_step", lambda: log.append("main"))
    reqs = [eng._new_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.scheduler.add(r)
    driver = PeerDrafts(eng)
    per_step, kinds = [], set()
    while not all(r.finished for r in reqs):
        log.clear()
        assert run_sync(eng.step(driver)) is Go.STEP
        per_step.append(len(log))
        kinds.add((log.count("draft"), log.count("mtp")))
    assert [r.output_token_ids for r in reqs] == want      # the empty exchanges change nothing
    # every step made exactly K of the MTP layer's exchanges: plain steps K empty ones,
    # drafting steps their chained passes then empty ones up to K
    assert per_step and set(per_step) == {K}
    assert (0, K) in kinds and any(d > 0 for d, _ in kinds)
    # a rank without rows while the peer drafts: the main layers' exchanges, then K of the MTP's
    log.clear()
    driver.steps = 1
    assert run_sync(eng.step(driver)) is Go.STEP and log == ["main"] + ["mtp"] * K
    assert driver.mtp_passes == K


def test_the_runner_refuses_an_exchange_it_cannot_make() -> None:
    on = ModelRunner(DEMO, dtype="float32", device="cpu", num_blocks=8, block_size=4, mtp=True)
    batch = ForwardBatch([[5, 6]], [0], [[0, 1]])
    with pytest.raises(ValueError, match="the group agreed on 1"):
        on.draft_mtp(batch, torch.zeros(2, on.spec.hidden_size), [3], passes=1)
    off = ModelRunner(DEMO, dtype="float32", device="cpu", num_blocks=8, block_size=4)
    with pytest.raises(RuntimeError, match="without mtp=True"):
        off.forward_empty(mtp=1)
    off.forward_empty()       # no group: the main layers' exchanges are nothing
