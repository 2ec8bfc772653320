"""The rebalance controller's pure parts (moed/parallel/rebalance.py: which slot copies whose
weights) and the router's replica split (each expert's own tokens numbered, modulo its
replicas) in the torch path and the CPU kernel. The controller on a running group:
tests/integration/test_ep_rebalance.py."""
from __future__ import annotations

import pytest
import torch

from moed.model.experts_route import split_over_replicas
from moed.model import kernels as K
from moed.model.context import ComputeContext
from moed.model.moe import MoELayer
from moed.model.hf_config import load_spec
from moed.parallel.layout import EPLayout
from moed.parallel.rebalance import plan_moves, router_map

CPU = torch.device("cpu")


def test_only_changed_slots_move_from_a_slot_holding_the_expert() -> None:
    old = EPLayout.from_slots(6, 2, [0, 1, 2, 0, 3, 4, 5, 1])        # S = 4
    new = EPLayout.from_slots(6, 2, [0, 1, 2, 5, 3, 4, 5, 0])
    moves = plan_moves(old, new)
    assert [m.slot for m in moves] == [3, 7]
    for m in moves:
        assert old.slot_expert[m.source] == new.slot_expert[m.slot]
    assert moves[0].source == 6          # expert 5 lives only on rank 1
    assert moves[1].source == 0          # expert 0: rank 0 (slots 0, 3) only; lowest slot


def test_a_local_holder_is_preferred_and_sends_spread_over_replicas() -> None:
    old = EPLayout.from_slots(4, 4, [0, 1, 2, 3, 0, 1, 2, 3])        # S = 2, two copies each
    # rank 2 (slots 4, 5) takes experts 3 and 0 (0 is already there: local copy);
    # rank 3 (slots 6, 7) takes 0 and 1 (from peers: the least-used holder)
    new = EPLayout.from_slots(4, 4, [0, 1, 2, 3, 3, 0, 0, 1])
    moves = {m.slot: m.source for m in plan_moves(old, new)}
    assert moves[5] == 4                  # expert 0 at slot 4 on the same rank
    assert old.rank_of(moves[6]) != 3 and old.slot_expert[moves[6]] == 0
    assert moves[6] == 0                  # slot 4 already sent once (to slot 5): slot 0 next
    assert plan_moves(old, old) == []


def test_router_map_lists_every_replica() -> None:
    lay = EPLayout.from_slots(3, 2, [0, 1, 2, 0])
    l2p, nrep = router_map(lay, CPU)
    assert nrep.tolist() == [2, 1, 1] and l2p[0].tolist() == [0, 3] and l2p[1, 0] == 1


def _layer(make_checkpoint, ctx_kernels):
    spec = load_spec(make_checkpoint("qwen3_moe", num_experts=4, num_kv_heads=1))
    g = torch.Generator().manual_seed(3)
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    router = torch.randn(e, h, generator=g).bfloat16()
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.1).bfloat16()
    down = (torch.randn(e, h, i, generator=g) * 0.1).bfloat16()
    reps = [0, 0, 0]                      # expert 0 on slots 0, 4, 5, 6: four replicas
    gate_up, down = torch.cat([gate_up, gate_up[reps]]), torch.cat([down, down[reps]])
    ctx = ComputeContext(CPU, torch.bfloat16, kernels=ctx_kernels)
    layer = MoELayer(spec, router, gate_up, down, torch.zeros(e, dtype=torch.long), ctx)
    layer.set_expert_map(torch.tensor([[0, 4, 5, 6], [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]]),
                         torch.tensor([4, 1, 1, 1]))
    # bias the router so expert 0 is every token's second choice (the old split's bad case:
    # flat index t*k + 1 is always odd, so 4 replicas got [0, n, 0, n]-like shares)
    layer.router.route = lambda x: (torch.full((x.shape[0], 2), 0.5, dtype=x.dtype),
                                    torch.tensor([[1 + t % 3, 0] for t in range(x.shape[0])]))
    return layer


def test_torch_router_splits_a_replicated_expert_evenly(make_checkpoint) -> None:
    layer = _layer(make_checkpoint, None)
    x = torch.zeros(10, layer.hidden, dtype=torch.bfloat16)
    phys = layer.router(x).physical[:, 1]
    counts = torch.bincount(phys, minlength=7)[[0, 4, 5, 6]].tolist()
    assert sorted(counts) == [2, 2, 3, 3], counts
    # the offset rotates which replicas take the extra tokens from one call to the next
    again = torch.bincount(layer.router(x).physical[:, 1], minlength=7)[[0, 4, 5, 6]].tolist()
    assert sorted(again) == [2, 2, 3, 3] and again != counts


def test_kernel_router_half_splits_as_the_torch_router(make_checkpoint) -> None:
    kern = K.cpu_kernels()
    if kern is None:
        assert not K.cpu_flags_ok(), "this CPU has AVX512-BF16: the kernels must load"
        return
    layer = _layer(make_checkpoint, kern)
    r = layer.router
    x = torch.randn(9, layer.hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    for offset in (0, 1, 2, 7):
        phys, _ = kern.route_bf16(x, layer.router_p, r.num_experts, r.top_k, r.norm_topk,
                                  r.logical_to_physical, r.num_replicas, None, 7, offset)
        logical = torch.where(phys >= 4, 0, phys)        # slots 4-6 hold replicas of expert 0
        want = split_over_replicas(logical, r.logical_to_physical, r.num_replicas, offset)
        assert torch.equal(phys, want), (offset, phys.tolist(), want.tolist())
        shares = torch.bincount(phys.reshape(-1), minlength=7)[[0, 4, 5, 6]]
        assert int(shares.sum()) >= 4 and int(shares.max() - shares.min()) <= 1, shares.tolist()


@pytest.mark.parametrize("e,n,r", [(8, 2, 1), (8, 2, 4), (6, 4, 1), (128, 8, 3)])
def test_redundant_slots_never_put_two_copies_on_one_rank(e, n, r) -> None:
    lay = EPLayout.contiguous(e, n, r)
    assert lay.slots_per_rank == -(-e // n) + r
    for rank in range(n):
        held = lay.local_experts(rank)
        assert len(set(held)) == len(held), (rank, held)


def test_balancer_settings_are_refused_where_they_cannot_apply(make_checkpoint) -> None:
    from moed import preflight
    from moed.config import Config, ConfigError, ModelConfig, ParallelConfig, rules

    path = str(make_checkpoint("qwen3_moe"))              # 8 experts
    spec = load_spec(path)
    for kw, key in (({"redundant_experts": 1}, "redundant_experts"),
                    ({"eplb_interval_s": 5.0}, "eplb_interval_s")):
        cfg = Config(model=ModelConfig(path=path), parallel=ParallelConfig(**kw))
        with pytest.raises(ConfigError, match=f"parallel.{key}: .*ep_size > 1"):
            rules.parallel(cfg)
    group = dict(ep_size=2, ep_init="tcp://127.0.0.1:29500")
    ok = Config(model=ModelConfig(path=path), parallel=ParallelConfig(redundant_experts=4, **group))
    rules.parallel(ok)
    preflight.memory_budget(ok, spec, torch.bfloat16, 4)
    bad = Config(model=ModelConfig(path=path), parallel=ParallelConfig(redundant_experts=5, **group))
    with pytest.raises(ConfigError, match="parallel.redundant_experts: 9 slots per rank .* at most 4"):
        preflight.memory_budget(bad, spec, torch.bfloat16, 4)


def test_chunks_keep_every_rank_within_the_step_budget_and_switch_once() -> None:
    old = EPLayout.from_slots(8, 2, [0, 1, 2, 3, 4, 5, 6, 7])        # S = 4
    new = EPLayout.from_slots(8, 2, [4, 5, 6, 3, 0, 1, 2, 7])        # six slots change
    from moed.parallel.rebalance import plan_chunks
    moves = plan_moves(old, new)
    assert len(moves) == 6
    # each move is a peer transfer: 10 bytes on the receiver and 10 on the sender
    for budget, sizes in ((0, [6]), (10, [1] * 6), (20, [2] * 3), (30, [3, 3]), (45, [4, 2]),
                          (1000, [6]), (5, [1] * 6)):
        chunks = plan_chunks(3, old, new, 10, budget)
        assert [len(c.moves) for c in chunks] == sizes, (budget, chunks)
        assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert [m for c in chunks for _, m in c.moves] == moves        # order kept, none lost
        assert [n for c in chunks for n, _ in c.moves] == list(range(6))   # tags stay unique
        assert all(c.layer == 3 for c in chunks)
        if budget >= 10:
            assert all(max(c.cost) <= budget for c in chunks)
        assert all(sum(c.cost) == 20 * len(c.moves) for c in chunks)
    # a map whose slots do not move still switches (one empty, last chunk)
    same = plan_chunks(0, old, old, 10, 20)
    assert len(same) == 1 and same[0].moves == () and same[0].last


def test_the_balancers_thread_yields_to_the_steps() -> None:
    """Its worker runs at nice 19 (and this thread's priority is untouched)."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from moed.parallel.rebalance import _yield_to_steps
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ThreadPoolExecutor(max_workers=1, initializer=_yield_to_steps) as pool:
        nice = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert nice == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
