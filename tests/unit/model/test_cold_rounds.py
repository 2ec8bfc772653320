"""A cold layer call in one round (moed/model/cold/store.py run_grouped, policy.rounds): the
misses are read first into slots that hold none of the call's resident experts, then every
expert's rows run in one pass; on the torch path each expert's rows run in place
(LocalExperts.expert_rows: no gather into slot order, no scatter back). Output stays the
all-resident one bit for bit; a call whose misses do not fit runs in rounds as before."""
from __future__ import annotations

import pytest
import torch

from moed.model.cold import ColdSettings, policy
from moed.model.kernels import rows as kernel_rows
from moed.model.moe import LocalExperts
from test_cold_experts import _budget, _runner, _steps


def test_rounds_merge_only_when_the_misses_fit():
    resident = [True, False, True, False, False]
    needed = [0, 1, 2, 3, 4]
    assert policy.rounds(needed, resident, 2, room=3) == [needed]            # one pass
    assert policy.rounds(needed, resident, 2, room=2) == [[0, 2], [1, 3], [4]]
    assert policy.rounds([1, 3], resident, 2, room=5) == [[1, 3]]           # no hits: as before
    assert policy.rounds([0, 2], resident, 2, room=5) == [[0, 2]]


def test_room_leaves_out_kept_and_lost_slots():
    assert policy.room([0, 1, -1, policy.LOST, 4], {0, 4}) == 2               # slot 1, the empty one


@pytest.mark.parametrize("arch,dtype", [
    ("deepseek_v3", "bfloat16"),    # the torch path, the kernels serving: one call per round
    ("qwen3_moe", "float32"),       # the torch path without them: rows in place
    ("qwen3_moe", "bfloat16"),      # the fused kernels' expert half: gather / scatter per round
])
def test_one_round_per_call_equals_all_resident(make_checkpoint, monkeypatch, arch, dtype):
    ck = make_checkpoint(arch)
    full = _runner(ck, dtype)
    want = _steps(full, 4)
    r = _runner(ck, dtype, ColdSettings(_budget(full, 0.75), 1 << 30, 4.0, 0))   # room for a miss
    for layer in r.cold.layers:         # misses through slots (the direct path: test_cold_miss)
        layer.direct = False
    merged: list[bool] = []         # per call with hits and misses: run in one pass?
    orig = policy.rounds

    def rounds(needed, resident, *a, **k):
        g = orig(needed, resident, *a, **k)
        if len({resident[e] for e in needed}) == 2:
            merged.append(len(g) == 1)
        return g
    monkeypatch.setattr(policy, "rounds", rounds)
    gathered = []           # one kernel call per round: gathered in torch, or rows in place in C
    monkeypatch.setattr(LocalExperts, "run_grouped", lambda self, *a, _o=LocalExperts.run_grouped:
                        gathered.append(1) or _o(self, *a))
    monkeypatch.setattr(kernel_rows, "experts_rows", lambda *a, _o=kernel_rows.experts_rows: gathered.append(1) or _o(*a))
    got = _steps(r, 4)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "logits differ from all-resident"
    assert r.cold.stats.misses > 0 and r.cold.stats.hits > 0
    assert any(merged), merged      # calls with hits and misses ran in one pass
    assert (not gathered) == (dtype == "float32")       # no kernels (fp32): in place
