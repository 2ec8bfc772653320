"""balance.experts: the expert load balancer (EPLB); the token split it assumes is model.experts_route
(tests/unit/model/test_experts_route.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moed.balance.experts import (ExpertMap, align, balancedness, moved_slots, rank_loads, rebalance,
                                  rebalance_from_scratch, replicate)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def zipf_load(layers: int, experts: int, s: float = 1.0, tokens: int = 32768,
              seed: int = 0) -> torch.Tensor:
    """[L, E] token counts: a Zipf(s) popularity over a random permutation per layer."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    rows = [torch.multinomial(p[torch.randperm(experts, generator=g)], tokens, replacement=True,
                              generator=g).bincount(minlength=experts) for _ in range(layers)]
    return torch.stack(rows)


def check_map(m: ExpertMap, n_layers: int, n_logical: int, n_physical: int, n_ranks: int) -> None:
    """The invariants every map the balancer returns must hold."""
    p2l = m.physical_to_logical
    assert p2l.shape == (n_layers, n_physical) and n_physical % n_ranks == 0
    assert bool((m.replicas >= 1).all()) and bool((m.replicas.sum(1) == n_physical).all())
    rank = torch.arange(n_physical) // m.slots_per_rank
    for layer in range(n_layers):
        pairs = set(zip(rank.tolist(), p2l[layer].tolist()))
        assert len(pairs) == n_physical, "two replicas of one expert share a rank"
        for e in range(n_logical):                 # logical_to_physical agrees with p2l
            r = int(m.replicas[layer, e])
            slots = m.logical_to_physical[layer, e]
            assert slots[:r].tolist() == sorted((p2l[layer] == e).nonzero().view(-1).tolist())
            assert bool((slots[r:] == -1).all())


def colocated(m: ExpertMap) -> torch.Tensor:
    rank = (torch.arange(m.num_physical) // m.slots_per_rank).tolist()
    return torch.tensor([len(set(zip(rank, row))) < m.num_physical
                         for row in m.physical_to_logical.tolist()])


@st.composite
def problems(draw):
    """(load, num_physical, num_ranks, num_nodes, num_groups) that the balancer must accept."""
    nodes = draw(st.sampled_from([1, 1, 2]))
    ranks = nodes * draw(st.integers(1, 4))
    experts = nodes * draw(st.integers(1, 6))
    groups = draw(st.sampled_from([g for g in range(nodes, experts + 1, nodes) if experts % g == 0]))
    # slots per rank: E <= slots and at most one replica per rank within a node: <= E / N
    spr = draw(st.integers(-(-experts // ranks), experts // nodes))
    layers = draw(st.integers(1, 3))
    loads = draw(st.lists(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts),
                          min_size=layers, max_size=layers))
    return torch.tensor(loads), spr * ranks, ranks, nodes, groups


@SETTINGS
@given(problems(), st.integers(0, 2**31 - 1))
def test_invariants_from_scratch_and_migration_aware(prob, seed) -> None:
    load, n_phys, n_ranks, n_nodes, n_groups = prob
    n_layers, n_exp = load.shape
    scratch = rebalance_from_scratch(load, n_phys, n_ranks, n_nodes, n_groups)
    check_map(scratch, n_layers, n_exp, n_phys, n_ranks)
    # conservation: every routed token is served by some rank
    assert torch.allclose(rank_loads(load, scratch).sum(1), load.sum(1).double())
    # migrate from the scratch map to a shuffled load, and from an arbitrary current map
    g = torch.Generator().manual_seed(seed)
    drifted = load[:, torch.randperm(n_exp, generator=g)]
    arbitrary = torch.cat([torch.arange(n_exp).expand(n_layers, -1),
                           torch.randint(0, n_exp, (n_layers, n_phys - n_exp), generator=g)], 1)
    arbitrary = arbitrary[:, torch.randperm(n_phys, generator=g)]      # may co-locate replicas
    for cur in (scratch, ExpertMap.from_physical(arbitrary, n_exp, n_ranks)):
        r = rebalance(drifted, cur, num_nodes=n_nodes, num_groups=n_groups)
        check_map(r.map, n_layers, n_exp, n_phys, n_ranks)
        assert torch.allclose(rank_loads(drifted, r.map).sum(1), drifted.sum(1).double())
        forced = colocated(cur)         # a map with co-located replicas is always replaced
        assert bool(r.changed[forced].all())
        assert bool((r.after >= r.before - 1e-12)[~forced].all())   # else never a worse map
        assert torch.equal(r.moved, moved_slots(cur, r.map))
        assert bool((r.moved[~r.changed] == 0).all())
        if n_nodes > 1:     # hierarchical: each group lies within one node (a kept layer: as before)
            node = torch.arange(n_phys) // (n_phys // n_nodes)
            gsize = n_exp // n_groups
            for layer in range(n_layers):
                if cur is not scratch and not bool(r.changed[layer]):
                    continue
                grp = r.map.physical_to_logical[layer] // gsize
                assert all(len(set(node[grp == k].tolist())) == 1 for k in range(n_groups))


def test_greedy_packing_by_hand() -> None:
    # heaviest first onto the least-loaded rank with room: 8 → r0, 4 → r1, 2 → r1, 2 → r0
    m = rebalance_from_scratch(torch.tensor([[8, 4, 2, 2]]), num_physical=4, num_ranks=2)
    assert rank_loads(torch.tensor([[8, 4, 2, 2]]), m).tolist() == [[10.0, 6.0]]
    assert balancedness(torch.tensor([[8, 4, 2, 2]]), m).item() == pytest.approx(0.8)


def test_replicate_follows_load_per_replica() -> None:
    # 10/1 > 1 → 2 replicas; 10/2 = 5 > 1 → 3; capped at 3 → the next slot goes to expert 1
    reps = replicate(torch.tensor([[10.0, 1.0, 1.0, 1.0]]), num_slots=7, max_replicas=3)
    assert reps.tolist() == [[3, 2, 1, 1]]
    with pytest.raises(ValueError):
        replicate(torch.tensor([[1.0, 1.0]]), num_slots=5, max_replicas=2)


def test_zipf_balancedness_with_redundant_slots() -> None:
    load = zipf_load(4, 64, s=1.0)
    before = balancedness(load, ExpertMap.identity(4, 64, 8))
    for n_nodes in (1, 2):
        r = rebalance(load, None, num_physical=96, num_ranks=8, num_nodes=n_nodes)
        assert bool((r.after >= 0.9).all()), (n_nodes, r.after)
        assert bool((r.after > before).all())
    scratch = rebalance_from_scratch(load, 80, 8)               # N/4 redundant slots
    assert bool((balancedness(load, scratch) >= 0.9).all())


def drifting_loads(steps: int, sigma: float, seed: int = 1) -> list[torch.Tensor]:
    """Windows of a Zipf popularity whose log-weights random-walk (4 layers, 64 experts)."""
    g = torch.Generator().manual_seed(seed)
    z = -torch.log(torch.arange(1, 65, dtype=torch.float64)).expand(4, -1).clone()
    z = torch.stack([row[torch.randperm(64, generator=g)] for row in z])
    out = []
    for _ in range(steps):
        z = z + sigma * torch.randn(z.shape, generator=g, dtype=torch.float64)
        p = torch.softmax(z, 1)
        out.append(torch.stack([torch.multinomial(row, 16384, replacement=True, generator=g)
                                .bincount(minlength=64) for row in p]))
    return out


def test_migration_aware_moves_fewer_weights_than_from_scratch() -> None:
    windows = drifting_loads(8, sigma=0.2)
    ours = scratch = rebalance(windows[0], None, num_physical=80, num_ranks=8).map
    moved_ours = moved_scratch = moved_raw = 0
    for load in windows[1:]:
        r = rebalance(load, ours)
        fresh = rebalance_from_scratch(load, 80, 8)
        aligned = align(fresh, scratch)          # the peer, with its free within-rank reorder
        assert torch.equal(rank_loads(load, aligned), rank_loads(load, fresh))
        moved_ours += int(r.moved.sum())
        moved_scratch += int(moved_slots(scratch, aligned).sum())
        moved_raw += int(moved_slots(scratch, fresh).sum())
        # as balanced as the peer (its packing is the swap target), to within noise
        assert float(r.after.mean()) >= float(balancedness(load, fresh).mean()) - 0.01
        ours, scratch = r.map, aligned
    assert moved_ours < 0.5 * moved_scratch <= 0.5 * moved_raw, (moved_ours, moved_scratch, moved_raw)


def test_min_gain_skips_small_gains() -> None:
    windows = drifting_loads(2, sigma=0.05)
    base = rebalance(windows[0], None, num_physical=80, num_ranks=8).map
    same = rebalance(windows[0], base)                  # nothing to gain on the same load
    assert not bool(same.changed.any()) and int(same.moved.sum()) == 0
    assert torch.equal(same.map.physical_to_logical, base.physical_to_logical)
    skewed = zipf_load(4, 64, s=1.2, seed=5)            # a very different load: big gains
    r = rebalance(skewed, base)
    assert bool(r.changed.all()) and bool((r.gain > 0.05).all())
    assert torch.allclose(r.after, r.before + r.gain)
    high = rebalance(skewed, base, min_gain=float(r.gain.max()) + 1e-9)
    assert not bool(high.changed.any()) and int(high.moved.sum()) == 0
    for min_gain in (0.02, float(r.gain.median())):
        part = rebalance(skewed, base, min_gain=min_gain)   # swaps stop min_gain short, too
        assert torch.equal(part.changed, part.gain > min_gain)
        assert int(part.moved.sum()) <= int(r.moved.sum())


def test_bad_arguments_are_refused() -> None:
    load = torch.ones(2, 8)
    with pytest.raises(ValueError, match="ranks"):
        rebalance_from_scratch(load, num_physical=10, num_ranks=4)         # 4 ∤ 10
    with pytest.raises(ValueError, match="replica per rank"):
        rebalance_from_scratch(load, num_physical=32, num_ranks=2)         # 4 copies on 2 ranks
    with pytest.raises(ValueError, match="groups"):
        rebalance_from_scratch(load, num_physical=8, num_ranks=4, num_nodes=2, num_groups=3)
    with pytest.raises(ValueError, match="no slot"):
        ExpertMap.from_physical(torch.zeros(1, 8, dtype=torch.long), 8, 2)
    with pytest.raises(ValueError, match="outside"):
        ExpertMap.from_physical(torch.full((1, 8), 8), 8, 2)
    with pytest.raises(ValueError, match=">= 0"):
        rebalance_from_scratch(-load, num_physical=8, num_ranks=2)
    cur = ExpertMap.identity(2, 8, 2)
    with pytest.raises(ValueError, match="differ"):
        rebalance(load, cur, num_physical=12)
    with pytest.raises(ValueError, match="required"):
        rebalance(load, None, num_physical=8)
    with pytest.raises(ValueError, match="min_gain"):
        rebalance(load, cur, min_gain=-0.1)


def test_idle_layer_counts_as_balanced() -> None:
    m = rebalance_from_scratch(torch.zeros(1, 8), num_physical=12, num_ranks=4)
    check_map(m, 1, 8, 12, 4)
    assert balancedness(torch.zeros(1, 8), m).tolist() == [1.0]


def test_fill_repairs_when_only_holders_have_room() -> None:
    from moed.balance.experts import _pack
    # bin 1 is full; item 4 needs two copies but only bin 0 has room: one of bin 1's items
    # moves to bin 0 so the second copy can go to bin 1
    bins = _pack([5.0, 1.0, 1.0, 1.0, 2.0], [1, 1, 1, 1, 2], [[0, -1, -1], [1, 2, 3]])
    assert all(4 in row for row in bins)
    assert sorted(i for row in bins for i in row) == [0, 1, 2, 3, 4, 4]
    assert bins[0][0] == 0 and sum(bins[1][s] == [1, 2, 3][s] for s in range(3)) == 2   # one move
