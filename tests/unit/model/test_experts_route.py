"""model.experts_route: the token split over a replicated expert's slots (even and exact), on
maps the expert balancer (balance.experts) builds."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moed.balance.experts import rebalance_from_scratch
from moed.model.experts_route import split_over_replicas

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.integers(1, 200), st.integers(1, 4), st.integers(0, 2**31 - 1), st.integers(0, 7))
def test_split_over_replicas_is_even_and_exact(tokens, k, seed, offset) -> None:
    n_exp = 6
    g = torch.Generator().manual_seed(seed)
    load = torch.randint(0, 100, (1, n_exp), generator=g)
    m = rebalance_from_scratch(load, num_physical=12, num_ranks=4)
    logical = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(tokens)])
    l2p, reps = m.layer(0)
    phys = split_over_replicas(logical, l2p, reps, offset=offset)
    assert phys.shape == logical.shape
    assert torch.equal(m.physical_to_logical[0][phys], logical)   # each slot holds its expert
    served = torch.bincount(phys.view(-1), minlength=12)
    for e in range(n_exp):
        slots = l2p[e, :reps[e]]
        c = served[slots]
        assert int(c.sum()) == int((logical == e).sum())          # conserved
        assert int(c.max() - c.min()) <= 1                       # even to within one token
    assert torch.equal(phys, split_over_replicas(logical, l2p, reps, offset=offset))


def test_split_balances_where_index_modulo_does_not() -> None:
    # expert 0 is every token's first choice: flat indices 0, 2, 4, ... all even
    l2p = torch.tensor([[0, 1], [2, -1], [3, -1]])
    reps = torch.tensor([2, 1, 1])
    logical = torch.tensor([[0, 1 + t % 2] for t in range(10)])
    naive = l2p[logical.view(-1), torch.arange(20) % reps[logical.view(-1)]].view(10, 2)
    assert int((naive[:, 0] == 0).sum()) == 10                      # the bias this avoids
    phys = split_over_replicas(logical, l2p, reps)
    assert int((phys[:, 0] == 0).sum()) == 5 and int((phys[:, 0] == 1).sum()) == 5
    one = split_over_replicas(torch.tensor([[0, 1]]), l2p, reps, offset=0)
    other = split_over_replicas(torch.tensor([[0, 1]]), l2p, reps, offset=1)
    assert {int(one[0, 0]), int(other[0, 0])} == {0, 1}            # the offset rotates the extra one
