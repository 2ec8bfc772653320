"""Cold-expert misses read straight into their slots (moed/model/cold/store.py read_slots):
the slots are chosen before the reads (policy.victims), a miss goes from the file into the
slot with no private buffer and no second copy, the output stays the all-resident one bit for
bit, and a read that hangs past the timeout loses its slots instead of letting them be reused
under it."""
from __future__ import annotations

import random
import time

import pytest
import torch

from moed.model.cold import ColdSettings, ExpertReadError, policy
from moed.model.cold import store as store_mod
from moed.model.cold.reader import ExpertIndex
from moed.model.moe import LocalExperts
from test_cold_experts import _budget, _runner, _steps


def test_victims_are_the_slots_victim_picks_in_turn():
    heat = [5.0, 1.0, 3.0, 0.5, 2.0]
    expert_in = [0, 1, -1, 2, 4]
    assert policy.victims(expert_in, heat, set(), 3) == [2, 1, 4]    # empty, then coldest
    assert policy.victims(expert_in, heat, {1}, 2) == [2, 4]
    assert policy.victims(expert_in, heat, {0, 1, 2, 4}, 3) == [2]   # not enough: fewer


def test_installs_give_the_hottest_misses_the_coldest_slots_only_when_hotter():
    heat = [9.0, 1.0, 4.0, 0.5, 2.0, 0.0, 0.0, 3.0]
    expert_in = [0, 1, -1, 2, 4]                # slot 2 empty; 3, 5, 6, 7 not resident
    n_rows = [0, 0, 0, 1, 0, 1, 2, 1]
    # by heat + rows: 7 (4), 6 (2), 3 (1.5), 5 (1) take slots empty 2, then 1 (expert 1, heat 1),
    # then 4 (expert 4, heat 2): 7 and 6 installed, 3 not (1.5 is colder than 2), 5 no slot left
    assert policy.installs(expert_in, heat, {0, 2}, [3, 5, 6, 7], n_rows) == [-1, -1, 1, 2]
    assert policy.installs(expert_in, heat, {0, 1, 2, 4}, [7, 3], n_rows) == [2, -1]
    assert policy.installs(expert_in, heat, set(), [], n_rows) == []


def test_hottest_ranked_equals_hottest():
    """The ranking made at cool() (a stable descending argsort of the heat) gives hottest()'s set,
    ties included (heats drawn from a few values)."""
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 40)
        heat = torch.tensor([float(rng.choice([0, 1, 2, 2.5, 7])) for _ in range(n)], dtype=torch.float64)
        expert_in = rng.sample(range(n), rng.randint(1, n)) + [-1] * rng.randint(0, 3)
        slot_of = [-1] * n
        for slot, e in enumerate(expert_in):
            if e >= 0:
                slot_of[e] = slot
        rank = torch.argsort(heat, descending=True, stable=True).tolist()
        k = rng.randint(0, len(expert_in) + 1)
        assert policy.hottest_ranked(rank, slot_of, k) == policy.hottest(expert_in, heat.tolist(), k)


def test_victims_in_one_sort_equal_victim_picked_in_turn():
    """victims sorts once; it must pick exactly what victim() picks one slot at a time (ties in
    heat, empty and lost slots, kept experts, too few candidates)."""
    rng = random.Random(5)
    for _ in range(2000):
        slots = rng.randint(1, 12)
        heat = [float(rng.randint(0, 4)) for _ in range(16)]
        expert_in = [rng.choice([-1, policy.LOST, *range(16)]) for _ in range(slots)]
        keep = set(rng.sample(range(16), rng.randint(0, 6)))
        n = rng.randint(0, slots + 2)
        held, want = list(expert_in), []
        for _ in range(n):
            slot = policy.victim(held, heat, keep | {policy.LOST - 1})
            if slot < 0:
                break
            held[slot] = policy.LOST - 1
            want.append(slot)
        assert policy.victims(expert_in, heat, keep, n) == want, (expert_in, heat, keep, n)


def test_a_lost_slot_is_never_a_victim_nor_the_coldest():
    heat = [5.0, 1.0, 3.0]
    assert policy.victim([0, policy.LOST, 2], heat, set()) == 2
    assert policy.victims([policy.LOST, -1, 2], heat, set(), 3) == [1, 2]
    assert policy.coldest([policy.LOST, 0], heat) == 5.0


@pytest.mark.parametrize("arch,dtype", [
    ("qwen3_moe", "bfloat16"),      # the kernels' packed slots: packed straight into the slot
    ("qwen3_moe", "float32"),       # plain slots: the file read into the slot itself
])
def test_misses_land_in_their_slots_without_a_copy(make_checkpoint, monkeypatch, arch, dtype):
    ck = make_checkpoint(arch)
    full = _runner(ck, dtype)
    want = _steps(full, 4)
    r = _runner(ck, dtype, ColdSettings(_budget(full, 0.3), 0, 4.0, 0))     # misses only
    copies = []
    for name in ("slot_format", "load_slot"):       # the buffer-then-copy path of a miss
        orig = getattr(LocalExperts, name)
        monkeypatch.setattr(LocalExperts, name, lambda self, *a, _o=orig, _n=name, **k:
                            copies.append(_n) or _o(self, *a, **k))
    got = _steps(r, 4)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "logits differ from all-resident"
    assert r.cold.stats.misses > 0
    spec = r.spec       # packed slots: rows a multiple of the packing block, no padding
    assert (2 * spec.moe_intermediate_size) % 32 == 0 and spec.hidden_size % 32 == 0
    assert copies == []


def test_a_read_that_hangs_loses_its_slots(tiny_qwen3, monkeypatch):
    full = _runner(tiny_qwen3, "float32")
    want = _steps(full, 2)
    r = _runner(tiny_qwen3, "float32", ColdSettings(_budget(full, 0.3), 0, 4.0, 0))
    orig = ExpertIndex.read_into
    monkeypatch.setattr(store_mod, "READ_TIMEOUT_S", 0.2)
    # a read that can hang is one the page cache does not hold: the miss thread's, timed
    monkeypatch.setattr(ExpertIndex, "read_into", lambda self, *a, cached=False:
                        False if cached else (time.sleep(0.6), orig(self, *a))[1])
    with pytest.raises(ExpertReadError, match="within"):
        _steps(r, 2)
    lost = [(ly.pos, s) for ly in r.cold.layers for s, e in enumerate(ly.expert_in) if e == policy.LOST]
    assert lost, "a hung read's slots must not be reused"
    monkeypatch.setattr(ExpertIndex, "read_into", orig)
    monkeypatch.undo()
    time.sleep(1.0)                     # the hung read finishes writing into its lost slot
    got = _steps(r, 2)                  # the other slots still serve the right output
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(r.cold.layers[p].expert_in[s] == policy.LOST for p, s in lost)
