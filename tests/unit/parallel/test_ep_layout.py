"""EPLayout (pure): which physical expert slots each rank holds."""
from __future__ import annotations

import pytest

from moed.parallel.layout import EPLayout


@pytest.mark.parametrize("experts,ranks", [(8, 1), (8, 2), (8, 4), (8, 8), (128, 64), (6, 4), (3, 4)])
def test_contiguous_covers_every_expert_evenly(experts: int, ranks: int) -> None:
    lay = EPLayout.contiguous(experts, ranks)
    s = lay.slots_per_rank
    assert s == -(-experts // ranks) and lay.num_physical == s * ranks
    held = [lay.local_experts(r) for r in range(ranks)]
    assert all(len(h) == s for h in held)
    assert sorted({e for h in held for e in h}) == list(range(experts))
    # the first E slots are experts 0..E-1 in order: rank r holds a contiguous block
    assert lay.slot_expert[:experts] == tuple(range(experts))
    assert all(lay.rank_of(p) == p // s for p in range(lay.num_physical))
    # spare slots are replicas, counted as redundant
    assert sum(lay.redundant_slots(r) for r in range(ranks)) == lay.num_physical - experts


def test_uneven_spare_slots_replicate_onto_another_rank() -> None:
    lay = EPLayout.contiguous(6, 4)            # S = 2, P = 8: slots 6, 7 on rank 3
    assert lay.local_experts(3) == (0, 1)
    reps = lay.replicas()
    assert reps[0] == [0, 6] and reps[1] == [1, 7] and reps[5] == [5]
    assert {lay.rank_of(p) for p in reps[0]} == {0, 3}
    assert lay.redundant_slots(3) == 2 and lay.redundant_slots(0) == 0


def test_from_slots_installs_a_redundant_map() -> None:
    lay = EPLayout.from_slots(4, 2, [0, 1, 2, 3, 3, 0])   # hot experts 3 and 0 replicated
    assert lay.slots_per_rank == 3
    assert lay.local_experts(0) == (0, 1, 2) and lay.local_experts(1) == (3, 3, 0)
    assert lay.replicas()[3] == [3, 4] and lay.replicas()[0] == [0, 5]
    assert lay.redundant_slots(1) == 2


@pytest.mark.parametrize("slots,why", [([0, 1, 2], "split evenly"), ([0, 1, 1, 1], "no slot"),
                                       ([0, 1, 2, 9], "outside"), ([0, 1], "fewer")])
def test_bad_maps_are_refused(slots: list[int], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        EPLayout.from_slots(4, 2, slots)


def test_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match="rank 2"):
        EPLayout.contiguous(8, 2).local_experts(2)
