"""Layer-ahead prediction and prefetch in the cold-expert store (moed/model/cold/prefetch.py):
its pure sizing and picks; with prefetch on, a runner at 30% of the expert bytes gives the
all-resident logits bit for bit while prefetched experts serve layer calls; a wrong prediction
changes nothing but the counters; a failed prefetch read is read again as a miss (and fails
the step as a miss does when the file is bad); an expert the page cache holds is not staged but
left to its miss (one copy, not two), and while all it checks is cached the prediction rests;
under expert parallelism it is off.

The tests of staging make the store see the checkpoint as not page-cached (as under a memory
cap): the tiny checkpoints are always cached here."""
from __future__ import annotations

import shutil

import pytest
import torch

from moed.model.cold import ColdSettings, ExpertIndex, ExpertReadError, policy
from moed.model.runner import ModelRunner
from test_cold_experts import BLOCK, _budget, _runner, _steps


# ---- policy (pure) ------------------------------------------------------------------------
def test_split_budget_takes_the_staging_out_of_the_budget():
    assert policy.split_budget(1200, 100, 4, 8, 0) == (3, 0)
    assert policy.split_budget(1200, 100, 4, 8, 4) == (2, 4)            # (1200 - 400) / 400
    assert policy.split_budget(10**9, 100, 4, 8, 4) == (8, 0)           # all resident: no staging
    assert policy.split_budget(1200, 100, 4, 8, -1) == (2, 1)           # auto: 12 experts / 8
    assert policy.split_budget(100_000, 100, 4, 1000, -1) == (246, 16)  # auto: at most 16
    with pytest.raises(ValueError, match="the minimum is 800"):
        policy.split_budget(799, 100, 4, 8, 4)
    assert policy.prefetch_setting(-1, 1) == -1 and policy.prefetch_setting(-1, 2) == 0
    assert policy.prefetch_setting(5, 1) == 5 and policy.prefetch_setting(0, 1) == 0


def test_prefetch_picks_most_predicted_non_resident_first():
    rows = [3, 0, 5, 1, 5, 2]
    resident = [False, False, True, False, False, False]
    assert policy.prefetch_picks(rows, resident, set(), 10) == [4, 0, 5, 3]
    assert policy.prefetch_picks(rows, resident, {4}, 2) == [0, 5]
    assert policy.prefetch_picks(rows, resident, set(), 0) == []


# ---- the runner -------------------------------------------------------------------------------
@pytest.fixture
def uncached(monkeypatch):
    monkeypatch.setattr(ExpertIndex, "cached", lambda self, layer, expert: False)


@pytest.mark.parametrize("arch,dtype", [
    ("qwen3_moe", "bfloat16"),      # the fused CPU kernel's router and expert halves
    ("qwen3_moe", "float32"),       # the torch path
    ("deepseek_v3", "bfloat16"),    # grouped sigmoid routing (its choice scores), a dense layer
])
def test_prefetch_on_equals_all_resident_and_serves_layer_calls(make_checkpoint, arch, dtype, uncached):
    ck = make_checkpoint(arch)
    full = _runner(ck, dtype)
    want = _steps(full, 6)
    budget = _budget(full, 0.30)
    r = _runner(ck, dtype, ColdSettings(budget, 0, 4.0, 4))
    store = r.cold
    assert store.prefetch is not None and store.prefetch.capacity == 4
    assert r.resident_expert_bytes() + 4 * store.expert_bytes <= budget     # staging inside it
    got = _steps(r, 6)
    for step, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"step {step}: logits differ from the all-resident run"
    st = store.stats
    assert st.prefetch_reads > 0 and st.predicted_right > 0
    assert st.prefetch_ready + st.prefetch_waited > 0          # prefetched experts served calls
    assert st.hits + st.misses + st.prefetch_ready + st.prefetch_waited > st.hits + st.misses
    store.between_steps()
    assert not store.prefetch._staged and not store.prefetch._predicted


def test_page_cached_experts_are_not_staged_but_left_to_their_miss(tiny_qwen3):
    full = _runner(tiny_qwen3, "bfloat16")      # its load leaves the checkpoint page-cached
    want = _steps(full, 4)
    r = _runner(tiny_qwen3, "bfloat16", ColdSettings(_budget(full, 0.3), 0, 4.0, 4))
    got = _steps(r, 4)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    st = r.cold.stats
    assert st.prefetch_cached > 0 and st.misses > 0, st
    # a check may rarely see a page not cached for a moment: then it is read, correctly
    assert st.prefetch_reads <= st.prefetch_cached // 10, st
    assert st.prefetch_ready + st.prefetch_waited == st.prefetch_reads - st.prefetch_unused, st


def test_prediction_rests_while_the_page_cache_holds_the_experts(tiny_qwen3):
    assert policy.prediction_rest(True, 5, False, 0, 8) == 1        # all 5 checked were cached
    assert policy.prediction_rest(True, 0, False, 0, 8) == 0        # nothing to check: on
    assert policy.prediction_rest(False, 0, False, 0, 8) == 0       # no prediction ran (start)
    assert policy.prediction_rest(True, 5, True, 0, 8) == 0         # one needed the disk
    assert policy.prediction_rest(False, 0, False, 1, 8) == 2
    assert policy.prediction_rest(False, 0, False, 7, 8) == 0       # the probe step
    assert policy.prediction_rest(False, 0, True, 3, 8) == 0        # a miss needed the disk
    full = _runner(tiny_qwen3, "bfloat16")
    want = _steps(full, 6)
    r = _runner(tiny_qwen3, "bfloat16", ColdSettings(_budget(full, 0.3), 0, 4.0, 4))
    pf, did = r.cold.prefetch, []
    reset = pf.reset
    pf.reset = lambda: (did.append(pf._did), reset())[1]
    got = _steps(r, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert did[1] and len(did) > 4 and not any(did[2:]), did        # predicted once, then rests
    pf.rested = 3
    pf.uncached()                       # a miss read from the disk
    reset()
    assert pf.rested == 0


class _WrongRouter:
    """Ranks first the experts the real router ranks last (of the tiny model's 8 experts a
    batch still needs some of them)."""

    def __init__(self, real) -> None:
        self.real, self.top_k = real, real.top_k
        self.logical_to_physical = real.logical_to_physical

    def choice_scores(self, x: torch.Tensor) -> torch.Tensor:
        return -self.real.choice_scores(x)


def test_a_wrong_prediction_only_costs_reads(tiny_qwen3, uncached):
    full = _runner(tiny_qwen3, "bfloat16")
    want = _steps(full, 4)
    r = _runner(tiny_qwen3, "bfloat16", ColdSettings(_budget(full, 0.3), 0, 4.0, 4))
    pf = r.cold.prefetch
    pf.routers = [_WrongRouter(x) for x in pf.routers]
    got = _steps(r, 4)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    st = r.cold.stats
    assert st.prefetch_unused > 0 and st.misses > 0       # read for nothing, the real routing ran


def test_a_failed_prefetch_read_is_read_again_as_a_miss(tiny_qwen3, uncached):
    full = _runner(tiny_qwen3, "bfloat16")
    want = _steps(full, 4)
    r = _runner(tiny_qwen3, "bfloat16", ColdSettings(_budget(full, 0.3), 0, 4.0, 4))

    def failing(pos: int, unit: int) -> list[torch.Tensor]:
        raise ExpertReadError("expert weights could not be read from disk (test)")
    r.cold.prefetch.read = failing
    got = _steps(r, 4)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    st = r.cold.stats
    assert st.read_failures > 0 and st.prefetch_ready == st.prefetch_waited == 0 and st.misses > 0


def test_truncated_file_with_prefetch_fails_the_step_cleanly_and_recovers(tiny_qwen3, tmp_path, uncached):
    ck = shutil.copytree(tiny_qwen3, tmp_path / "ck")
    full = _runner(ck, "bfloat16")
    want = _steps(full, 3)
    r = _runner(ck, "bfloat16", ColdSettings(_budget(full, 0.3), 0, 4.0, 4))
    f0 = sorted(ck.glob("*.safetensors"))[0]
    saved = tmp_path / "saved"
    shutil.copy(f0, saved)
    with open(f0, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(ExpertReadError) as err:
        _steps(r, 3)
    assert "could not be read from disk" in str(err.value) and str(tmp_path) not in str(err.value)
    shutil.copy(saved, f0)                      # whole again: the same runner serves correctly
    got = _steps(r, 3)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_prefetch_is_off_under_expert_parallelism(tiny_qwen3):
    from moed.model.hf_config import load_spec
    from moed.parallel.dispatch import RankPlacement
    from moed.parallel.layout import EPLayout
    layout = EPLayout.contiguous(load_spec(tiny_qwen3).num_experts, 2, 0)

    def rank(cold):
        return ModelRunner(tiny_qwen3, dtype="bfloat16", device="cpu", num_blocks=8, block_size=BLOCK,
                           placement=RankPlacement(layout, 1, torch.device("cpu")), cold=cold)
    budget = int(0.3 * rank(None).resident_expert_bytes())
    with pytest.raises(ValueError, match="prefetch_experts under expert parallelism"):
        rank(ColdSettings(budget, 0, 4.0, 4))
    auto = rank(ColdSettings(budget, 0, 4.0, -1))
    assert auto.cold is not None and auto.cold.prefetch is None
    assert auto.cold.describe()["prefetch"] == "off: expert parallelism"
