"""The cold-expert store (moed/model/cold): its pure policy, and a runner holding 30% of the
expert bytes whose logits equal the all-resident runner's bit for bit, step after step, while
misses are read from disk and hot experts are promoted between steps; a disk read that fails
raises a clean ExpertReadError and leaves no stale slot behind."""
from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from moed.model.batch import ForwardBatch
from moed.model.cold import ColdSettings, ExpertReadError
from moed.model.cold import policy
from moed.model.runner import ModelRunner

BLOCK = 16


# ---- policy (pure) ------------------------------------------------------------------------
def test_slots_per_layer_budget():
    assert policy.slots_per_layer(0, 100, 4, 8) == 8                 # 0 = all
    assert policy.slots_per_layer(10**9, 100, 4, 8) == 8             # more than all = all
    assert policy.slots_per_layer(1200, 100, 4, 8) == 3              # 1200 / (4 x 100)
    with pytest.raises(ValueError, match="the minimum is 400"):
        policy.slots_per_layer(399, 100, 4, 8)


def test_rounds_run_resident_experts_first_then_misses_through_the_stream_slots():
    resident = [False, True, False, True, False, False]
    assert policy.rounds([0, 1, 2, 3, 4], resident, 2) == [[1, 3], [0, 2], [4]]
    assert policy.rounds([0, 2], resident, 3) == [[0, 2]]
    assert policy.rounds([1, 3], resident, 1) == [[1, 3]]
    assert [policy.stream_slots(s) for s in (1, 2, 7, 8, 40)] == [1, 1, 1, 2, 10]


def test_hottest_are_protected():
    heat = [5.0, 1.0, 3.0, 0.5, 9.0]
    assert policy.hottest([0, 1, 2, 3, -1], heat, 2) == {0, 2}
    assert policy.hottest([3, -1], heat, 5) == {3}
    assert policy.hottest([0, 1], heat, 0) == set()


def test_victim_prefers_empty_then_coldest_not_kept():
    heat = [5.0, 1.0, 3.0, 0.5]
    assert policy.victim([0, -1, 2], heat, set()) == 1
    assert policy.victim([0, 1, 2], heat, set()) == 1
    assert policy.victim([0, 1, 2], heat, {1}) == 2
    assert policy.victim([0, 1], heat, {0, 1}) == -1


def test_promotions_hottest_gain_first_with_margin_and_busy():
    heats = [[10.0, 1.0, 9.0, 2.0], [1.0, 1.0, 1.1, 8.0]]
    held = [[1, 3], [0, 1]]      # layer 0 coldest resident: 1.0; layer 1: 1.0
    got = policy.promotions(heats, held, set(), limit=3)
    assert got == [(0, 0), (0, 2), (1, 3)]          # 1.1 is within the margin of 1.0
    assert policy.promotions(heats, held, {(0, 0)}, limit=1) == [(0, 2)]
    assert policy.promotions(heats, held, set(), limit=0) == []


def _promotions_one_by_one(heats, held, busy, limit, margin=1.25):
    """promotions() as its docstring says it, expert by expert (the oracle)."""
    cands = []
    for li, (heat, expert_in) in enumerate(zip(heats, held)):
        floor = policy.coldest(expert_in, heat)
        for e, h in enumerate(heat):
            if e not in set(expert_in) and h > 0 and h > margin * floor and (li, e) not in busy:
                cands.append((h - floor, li, e))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [(li, e) for _, li, e in cands[:limit]]


def test_promotions_in_tensor_ops_pick_what_one_by_one_picks():
    rng = random.Random(11)
    for _ in range(400):
        layers, experts, slots = rng.randint(1, 5), rng.randint(1, 12), rng.randint(0, 6)
        heats = [[rng.choice([0.0, 0.5, 1.0, 1.25, 2.0, rng.random() * 8]) for _ in range(experts)]
                 for _ in range(layers)]
        held = [[rng.choice([-1, policy.LOST, *range(experts)]) for _ in range(slots)] for _ in range(layers)]
        busy = {(rng.randrange(layers), rng.randrange(experts)) for _ in range(rng.randint(0, 3))}
        limit = rng.randint(0, 8)
        want = _promotions_one_by_one(heats, held, busy, limit)
        assert policy.promotions(heats, held, busy, limit) == want, (heats, held, busy, limit)
        assert policy.promotions([torch.tensor(h, dtype=torch.float64) for h in heats], held, busy, limit) == want
        assert policy.promotions(torch.tensor(heats, dtype=torch.float64), held, busy, limit) == want  # the store's [L, E]


# ---- the runner: equality with all-resident ------------------------------------------------
def _runner(ck, dtype, cold=None):
    return ModelRunner(ck, dtype=dtype, device="cpu", num_blocks=64, block_size=BLOCK, cold=cold)


def _steps(r: ModelRunner, decode_steps: int = 10) -> list[torch.Tensor]:
    """Two prompts prefilled together, then both decoded greedily, and midway a third prompt
    prefilled alone (many rows per expert again, after slots changed): each step's logits."""
    prompts = [[5, 17, 33, 2, 9, 100, 7], [40, 41, 3, 3, 250, 12, 1, 90, 66, 4, 8]]
    tables = [[0, 1, 2], [3, 4, 5]]
    start, toks, out = [0, 0], prompts, []
    for i in range(decode_steps + 1):
        logits = r.forward(ForwardBatch(token_ids=toks, start_pos=list(start), block_tables=tables))
        out.append(logits.clone())
        start = [s + len(t) for s, t in zip(start, toks)]
        toks = [[int(x)] for x in logits.argmax(-1)]
        if i == decode_steps // 2:
            third = [[(7 * j + 3) % 500 + 1 for j in range(40)]]
            out.append(r.forward(ForwardBatch(token_ids=third, start_pos=[0], block_tables=[[8, 9, 10]])).clone())
    return out


def _budget(r: ModelRunner, share: float) -> int:
    return int(share * r.resident_expert_bytes())


@pytest.mark.parametrize("arch,dtype,move", [
    ("qwen3_moe", "bfloat16", 0),               # misses only (the kernels' path where they load)
    ("qwen3_moe", "bfloat16", 1 << 30),         # misses + promotions between steps
    ("qwen3_moe", "float32", 1 << 30),          # the torch path
    ("deepseek_v3", "bfloat16", 1 << 30),       # grouped routing, shared experts, a dense layer
])
def test_thirty_percent_resident_equals_all_resident(make_checkpoint, arch, dtype, move):
    ck = make_checkpoint(arch)
    full = _runner(ck, dtype)
    want = _steps(full)
    budget = _budget(full, 0.30)
    cold = _runner(ck, dtype, ColdSettings(budget, move, 4.0))
    assert cold.cold is not None and cold.cold.slots < cold.spec.num_experts
    assert cold.resident_expert_bytes() <= budget
    got = _steps(cold)
    for step, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"step {step}: logits differ from the all-resident run"
    st = cold.cold.stats
    assert st.misses > 0 and st.hits > 0 and st.miss_stall_s > 0
    assert (st.promoted_bytes > 0) == (move > 0)


def test_deepseek_experts_are_held_once_in_the_kernels_layout(make_checkpoint):
    """DeepSeek-V3's experts (the torch MoE path, its router in torch) run on the native
    kernels: all-resident and cold, a slot is its packed copy alone, with no plain weight and no
    oneDNN copy beside it (kept only for a row class oneDNN was measured to win), so the
    process holds the bytes the budget counts, not twice them."""
    ck = make_checkpoint("deepseek_v3")
    full = _runner(ck, "bfloat16")
    if full.ctx.kernels is None:
        pytest.skip("no native CPU kernels here")
    cold = _runner(ck, "bfloat16", ColdSettings(_budget(full, 0.30), 0, 4.0))
    assert cold.cold is not None and cold.cold.onednn is None       # no oneDNN copies to restore
    for r in (full, cold):
        moes = [layer.mlp.experts for layer in r.model.layers if hasattr(layer.mlp, "experts")]
        assert moes
        for local in moes:
            assert local.gate_up_p is not None and local.down_p is not None
            for lin in (lin for pair in local.experts for lin in pair):
                assert lin.weight is None
                assert lin.packed is None or lin.choice.any_onednn
        assert r.resident_expert_bytes() == sum(e.gate_up_p.nbytes + e.down_p.nbytes for e in moes)


def test_budget_of_everything_is_todays_path(tiny_qwen3):
    full = _runner(tiny_qwen3, "bfloat16")
    same = _runner(tiny_qwen3, "bfloat16", ColdSettings(full.resident_expert_bytes(), 0, 4.0))
    assert same.cold is None and same.ctx.placement is None


def test_budget_under_one_expert_per_layer_is_refused(tiny_qwen3):
    with pytest.raises(ValueError, match="the minimum is"):
        _runner(tiny_qwen3, "bfloat16", ColdSettings(1, 0, 4.0))


# ---- the disk tier failing ------------------------------------------------------------------
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_removed_file_still_reads_truncated_file_fails_cleanly(tiny_qwen3, tmp_path):
    ck = _copy(tiny_qwen3, tmp_path / "ck")
    want = _steps(_runner(ck, "bfloat16"), 3)
    cold = _runner(ck, "bfloat16", ColdSettings(_budget(_runner(ck, "bfloat16"), 0.3), 0, 4.0))
    files = sorted(ck.glob("*.safetensors"))
    moved = tmp_path / "moved.safetensors"
    shutil.copy(files[0], moved)
    os.remove(files[0])        # removed after start: the open descriptor still reads it
    got = _steps(cold, 3)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert cold.cold.stats.misses > 0
    # truncated: a miss's read comes back short -> a clean error, no path in it
    shutil.copy(moved, files[0])
    cold2 = _runner(ck, "bfloat16", ColdSettings(_budget(_runner(ck, "bfloat16"), 0.3), 0, 4.0))
    with open(files[0], "r+b") as f:
        f.truncate(4096)
    with pytest.raises(ExpertReadError) as err:
        _steps(cold2, 3)
    assert "could not be read from disk" in str(err.value) and str(tmp_path) not in str(err.value)
    assert cold2.cold.stats.read_failures >= 1
    # a failed round changes no slot: each still holds the expert the table says, whole
    for layer in cold2.cold.layers:
        for slot, e in enumerate(layer.expert_in):
            assert e < 0 or int(layer.slot_of[e]) == slot
            if e >= 0:
                gate_up, down = cold.cold.index.read(layer.layer, e)        # the intact copy
                want = layer.local.slot_format(gate_up, down)
                assert all(torch.equal(a, b) for a, b in zip(layer.local.slot_weights(slot), want))


def test_mover_promotes_the_hottest_between_steps_and_keeps_slots_whole(tiny_qwen3):
    import time
    full = _runner(tiny_qwen3, "bfloat16")
    r = _runner(tiny_qwen3, "bfloat16", ColdSettings(_budget(full, 0.3), 1 << 30, 2.0))
    store = r.cold
    layer = store.layers[1]
    cold_expert = next(e for e in range(store.spec.num_experts) if e not in layer.expert_in)
    layer.window[cold_expert] = 1000            # as if the last step routed 1000 tokens to it
    deadline = time.monotonic() + 10
    while int(layer.slot_of[cold_expert]) < 0:  # queued, read on the background thread, installed
        assert time.monotonic() < deadline, "the hot expert was never promoted"
        store.between_steps()
        time.sleep(0.01)
    assert store.stats.promoted_bytes >= store.expert_bytes
    slot = int(layer.slot_of[cold_expert])
    want = layer.local.slot_format(*store.index.read(layer.layer, cold_expert))
    assert all(torch.equal(a, b) for a, b in zip(layer.local.slot_weights(slot), want))
    # a cooled-off layer promotes nothing: no churn between equals
    before = store.stats.promoted_bytes
    for _ in range(5):
        store.between_steps()
    assert store.stats.promoted_bytes == before


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_online_quantized_experts_at_thirty_percent_equal_all_resident(tiny_qwen3, fmt):
    """model.quantization: a slot holds the quantized parts (data, scales) the loader makes, each
    checkpoint matrix quantized from the file's dtype; those bytes are what the budget counts."""
    def runner(cold=None):
        return ModelRunner(tiny_qwen3, dtype="bfloat16", device="cpu", num_blocks=64, block_size=BLOCK,
                           quantization=fmt, quantization_group_size=32, cold=cold)
    full = runner()
    want = _steps(full, 6)
    budget = _budget(full, 0.30)
    cold = runner(ColdSettings(budget, 1 << 30, 4.0))
    assert cold.cold is not None and cold.resident_expert_bytes() <= budget
    assert cold.cold.expert_bytes * cold.spec.num_experts * len(cold.cold.moe_layers) == full.resident_expert_bytes()
    got = _steps(cold, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert cold.cold.stats.misses > 0


# ---- expert parallelism: a rank tiers its own slots -------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_ranks_tiered_slots_compute_as_its_resident_slots(make_checkpoint, dtype):
    """Rank 1 of an EP=2 layout with a redundant slot per rank (replicas): the store's units are
    the rank's S slots (the loader loads the first R), and rows grouped by slot, as the group's
    exchange hands them over, come out of ColdExperts equal to the all-resident rank's
    LocalExperts bit for bit, call after call, while misses evict and read; each slot's rows
    (a replica's too) are its heat. The exchange itself: tests/integration/test_ep_parity.py."""
    from moed.model.executor import MoEMode
    from moed.model.hf_config import load_spec
    from moed.parallel.dispatch import DistributedExperts, RankPlacement
    from moed.parallel.layout import EPLayout

    ck = make_checkpoint("qwen3_moe")
    layout = EPLayout.contiguous(load_spec(ck).num_experts, 2, 1)
    def rank(cold=None):
        return ModelRunner(ck, dtype=dtype, device="cpu", num_blocks=8, block_size=BLOCK,
                           placement=RankPlacement(layout, 1, torch.device("cpu")), cold=cold)
    full = rank()
    budget = _budget(full, 0.30)
    cold = rank(ColdSettings(budget, 0, 4.0))
    store, s = cold.cold, layout.slots_per_rank
    assert store.units == layout.local_experts(1) and len(store.units) == s > store.slots
    assert layout.redundant_slots(1) >= 1 and cold.resident_expert_bytes() <= budget
    moe = [(a.mlp, b.mlp) for a, b in zip(full.model.layers, cold.model.layers) if hasattr(a.mlp, "dist")]
    assert moe and all(isinstance(b.dist, DistributedExperts) and b.dist.local is store.layers[i]
                       for i, (_, b) in enumerate(moe))
    gen = torch.Generator().manual_seed(0)
    for call in range(6):
        for a, b in moe:
            per_slot = torch.randint(0, 4, (s,), generator=gen) * (torch.rand(s, generator=gen) < 0.6)
            per_slot[call % s] += 1             # some rows (no call at all without: dispatch.py)
            xs = torch.randn(int(per_slot.sum()), a.hidden, generator=gen).to(full.dtype)
            modes = [MoEMode.TORCH] + ([MoEMode.FUSED] if a.kernels is not None else [])
            for mode in modes:
                want = a.experts.run_grouped(xs, per_slot, mode)
                got = b.dist.local.run_grouped(xs, per_slot, mode)
                assert torch.equal(want, got), (call, mode)
        assert torch.equal(store.layers[-1].window, per_slot * len(modes))     # rows = heat
        store.between_steps()
    st = store.stats
    assert st.misses > 0 and st.hits > 0
    # the expert balancer would copy slots from resident ones: refused here too (beside the config rule)
    from moed.config import ParallelConfig
    from moed.parallel.runtime import EPRuntime
    eplb = ParallelConfig(ep_size=2, ep_rank=1, ep_init="tcp://127.0.0.1:1", eplb_interval_s=60.0,
                          redundant_experts=1)
    with pytest.raises(ValueError, match="eplb_interval_s with expert parallelism with cold experts"):
        EPRuntime(eplb, store.inner).attach(cold.model)
