"""The MoE layer split into a router and an expert executor: bit-identical to the layer it
replaced on the torch path (fp32, bf16, bf16 oneDNN-packed), with and without replicas, and the
executor is a seam another implementation (expert parallelism) can take."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from moed.model.context import ComputeContext, can_pack
from moed.model.executor import ExpertExecutor, MoEMode, Routing, combine, combine_sorted
from moed.model.experts_route import split_over_replicas
from moed.model.hf_config import spec_from_config
from moed.model.layers import Linear
from moed.model.moe import LocalExperts, MoELayer

CPU = torch.device("cpu")
E, H, I = 6, 64, 32
REPLICAS = (torch.tensor([[0, 6], [1, 1], [2, 2], [3, 7], [4, 4], [5, 5]]), torch.tensor([2, 1, 1, 2, 1, 1]))


class PreSplitMoE:
    """The MoELayer torch path as it was before the split (moed 2026-12, verbatim math): the oracle."""

    def __init__(self, spec, router, gate_up, down, load, pack: bool) -> None:
        self.router = Linear(router, pack=pack)
        self.experts = [(Linear(gate_up[e], pack=pack), Linear(down[e], pack=pack)) for e in range(gate_up.shape[0])]
        self.top_k, self.norm_topk, self.num_experts = spec.top_k, spec.norm_topk_prob, spec.num_experts
        self.num_physical = gate_up.shape[0]
        self.logical_to_physical = torch.arange(self.num_experts).unsqueeze(1)
        self.num_replicas = torch.ones(self.num_experts, dtype=torch.long)
        self.load = load
        self.calls = 0

    def route(self, x):
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx

    def __call__(self, x):
        t = x.shape[0]
        weights, logical = self.route(x)
        if t == 1 and self.logical_to_physical.shape[1] == 1:
            self.load.index_add_(0, logical[0], torch.ones_like(logical[0]))
            out = None
            for j, e in enumerate(self.logical_to_physical[logical[0], 0].tolist()):
                gate_up, down = self.experts[e]
                g, u = gate_up(x).chunk(2, dim=-1)
                y = down(F.silu(g) * u) * weights[:, j:j + 1]
                out = y if out is None else out + y
            return out
        flat = logical.reshape(-1)
        if self.logical_to_physical.shape[1] == 1:
            phys = self.logical_to_physical[flat, 0]
        else:
            # the one change since: each expert's own tokens numbered, modulo its replicas,
            # offset by the call count (model/experts_route.py; was flat index % replicas)
            phys = split_over_replicas(logical, self.logical_to_physical, self.num_replicas,
                                       self.calls).reshape(-1)
            self.calls += 1
        self.load += torch.bincount(flat, minlength=self.num_experts)
        order = torch.argsort(phys, stable=True)
        counts = torch.bincount(phys, minlength=self.num_physical).tolist()
        token = order // self.top_k
        xs = x.index_select(0, token)
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate_up, down = self.experts[e]
            g, u = gate_up(xs[start:start + n]).chunk(2, dim=-1)
            ys.append(down(F.silu(g) * u))
            start += n
        ws = weights.reshape(-1).index_select(0, order).unsqueeze(1)
        out = torch.zeros((t, x.shape[1]), dtype=x.dtype)
        return out.index_add_(0, token, torch.cat(ys) * ws)


def _spec(top_k: int, norm_topk: bool):
    return spec_from_config({
        "model_type": "qwen3_moe", "hidden_size": H, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 64, "moe_intermediate_size": I, "num_experts": E,
        "num_experts_per_tok": top_k, "norm_topk_prob": norm_topk, "rope_theta": 1e6,
        "max_position_embeddings": 64})


def _weights(dtype: torch.dtype, seed: int, replicated: bool):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    if replicated:      # experts 0 and 3 get a second replica in physical slots 6 and 7
        gate_up, down = torch.cat([gate_up, gate_up[[0, 3]]]), torch.cat([down, down[[0, 3]]])
    return router.to(dtype), gate_up.to(dtype), down.to(dtype)


CASES = [("fp32", torch.float32, False), ("bf16", torch.bfloat16, False)]
if can_pack(CPU, torch.bfloat16):
    CASES.append(("bf16-onednn", torch.bfloat16, True))


@pytest.mark.parametrize("name,dtype,pack", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("top_k,norm_topk", [(2, True), (3, False)])
@pytest.mark.parametrize("replicated", [False, True])
def test_split_is_bit_identical_to_the_pre_split_layer(name, dtype, pack, top_k, norm_topk, replicated):
    spec = _spec(top_k, norm_topk)
    w = _weights(dtype, seed=top_k, replicated=replicated)
    old_load, new_load = torch.zeros(E, dtype=torch.long), torch.zeros(E, dtype=torch.long)
    old = PreSplitMoE(spec, *w, old_load, pack)
    new = MoELayer(spec, *w, new_load, ComputeContext(CPU, dtype, pack=pack))    # kernels off: torch path
    if replicated:
        old.logical_to_physical, old.num_replicas = REPLICAS
        new.set_expert_map(*REPLICAS)
    g = torch.Generator().manual_seed(5)
    for t in (1, 2, 7, 33):
        x = torch.randn(t, H, generator=g).to(dtype)
        a, b = old(x), new(x)
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), (t, (a.float() - b.float()).abs().max())
    assert torch.equal(old_load, new_load) and int(new_load.sum()) == 43 * top_k


@pytest.mark.parametrize("name,dtype,pack", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("top_k", [1, 2])
def test_two_tokens_skip_the_sort_and_compute_what_it_does(name, dtype, pack, top_k, monkeypatch):
    """Two tokens (batch 1 verifying a draft) of a top-1 or top-2 model take each touched
    expert in turn, no sort, and equal the sorted path (the pre-split layer's), where they
    share an expert and where not (top-3: the sorted path, test_split_is_bit_identical...)."""
    spec = _spec(top_k, True)
    w = _weights(dtype, seed=11, replicated=False)
    old = PreSplitMoE(spec, *w, torch.zeros(E, dtype=torch.long), pack)
    new = MoELayer(spec, *w, torch.zeros(E, dtype=torch.long), ComputeContext(CPU, dtype, pack=pack))
    g = torch.Generator().manual_seed(12)
    xs = [torch.randn(2, H, generator=g).to(dtype) for _ in range(40)]
    want = [old(x) for x in xs]
    monkeypatch.setattr(torch, "argsort", lambda *a, **k: pytest.fail("two tokens were sorted"))
    shared = 0
    for x, a in zip(xs, want):
        ids = new.router.route(x)[1].tolist()
        shared += bool(set(ids[0]) & set(ids[1]))
        b = new(x)
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()
    assert 0 < shared < len(xs)


def test_router_maps_through_replicas_and_counts_logical_load():
    spec = _spec(2, True)
    router_w, gate_up, down = _weights(torch.float32, seed=1, replicated=True)
    load = torch.zeros(E, dtype=torch.long)
    layer = MoELayer(spec, router_w, gate_up, down, load, ComputeContext(CPU, torch.float32))
    layer.set_expert_map(*REPLICAS)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(2))
    r = layer.router(x)
    _, logical = layer.router.route(x)
    assert r.replicated and r.physical.shape == logical.shape == (40, 2)
    l2p = REPLICAS[0]
    assert all(int(p) in l2p[int(e)].tolist() for p, e in zip(r.physical.reshape(-1), logical.reshape(-1)))
    assert {6, 7} <= set(r.physical.reshape(-1).tolist())       # the replicas do get tokens
    assert torch.equal(load, torch.bincount(logical.reshape(-1), minlength=E))   # logical, not physical
    with pytest.raises(ValueError, match="does not fit"):
        layer.set_expert_map(torch.tensor([[0], [1], [2], [3], [4], [8]]), torch.ones(E, dtype=torch.long))


def test_local_experts_compute_the_weighted_sum_of_their_assignment():
    _, gate_up, down = _weights(torch.float32, seed=3, replicated=False)
    ex = LocalExperts(gate_up, down, pack=False, kernels=None, packed=None)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, H, generator=g)
    physical = torch.tensor([[0, 5], [2, 2], [1, 4], [3, 0], [5, 1]])     # any assignment, repeats too
    weights = torch.rand(5, 2, generator=g)
    out = ex(x, Routing(weights, physical, replicated=False))
    for t in range(5):
        ref = torch.zeros(H)
        for j, e in enumerate(physical[t].tolist()):
            g_, u = (gate_up[e] @ x[t]).chunk(2)
            ref += weights[t, j] * (down[e] @ (F.silu(g_) * u))
        torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-5)


def test_run_grouped_is_what_an_ep_rank_computes():
    """SlotExperts.run_grouped: rows grouped by slot -> each row's own expert output (TORCH);
    FUSED on experts without the CPU kernels' copies is refused, never silently the other path."""
    _, gate_up, down = _weights(torch.float32, seed=5, replicated=False)
    ex = LocalExperts(gate_up, down, pack=False, kernels=None, packed=None)
    per_slot = torch.tensor([2, 0, 1, 0, 3, 1])                      # empty slots too
    xs = torch.randn(int(per_slot.sum()), H, generator=torch.Generator().manual_seed(8))
    out = ex.run_grouped(xs, per_slot, MoEMode.TORCH)
    slots = torch.repeat_interleave(torch.arange(len(per_slot)), per_slot).tolist()
    assert out.shape == xs.shape
    for row, e in enumerate(slots):
        g_, u = (gate_up[e] @ xs[row]).chunk(2)
        torch.testing.assert_close(out[row], down[e] @ (F.silu(g_) * u), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="fused CPU kernel path"):
        ex.run_grouped(xs, per_slot, MoEMode.FUSED)
    assert int(MoEMode.TORCH) == 0 and int(MoEMode.FUSED) == 1       # the values on the wire


def test_the_executor_is_a_seam():
    """Expert parallelism replaces `layer.experts` with its dispatch/combine: the layer hands
    it the router's decision and returns what it combines."""
    spec = _spec(2, True)
    layer = MoELayer(spec, *_weights(torch.float32, seed=6, replicated=False),
                     torch.zeros(E, dtype=torch.long), ComputeContext(CPU, torch.float32))
    local = layer.experts

    class Recording(ExpertExecutor):
        def __init__(self) -> None:
            self.seen: list[Routing] = []

        def __call__(self, x, routing):
            self.seen.append(routing)
            return local(x, routing)

    x = torch.randn(9, H, generator=torch.Generator().manual_seed(7))
    want = layer(x)
    layer.experts = rec = Recording()
    assert torch.equal(layer(x), want) and len(rec.seen) == 1 and rec.seen[0].physical.shape == (9, 2)
    with pytest.raises(TypeError):
        ExpertExecutor()        # abstract: one method to implement


def test_fill_slot_writes_the_kernels_packing_byte_for_byte():
    """LocalExperts.fill_slot (a cold miss read into a packed slot) writes what CpuKernels.pack
    gives for that expert, and only into that slot."""
    from moed.model.kernels import BLOCK, CpuKernels
    g = torch.Generator().manual_seed(11)
    i, h = 2 * BLOCK, 3 * BLOCK * 2                  # whole blocks of rows, even columns
    gate_up = torch.randn(3, 2 * i, h, generator=g).to(torch.bfloat16)
    down = torch.randn(3, h, i, generator=g).to(torch.bfloat16)
    packed = (CpuKernels.pack(gate_up), CpuKernels.pack(down))
    ex = LocalExperts(gate_up, down, pack=False, kernels=None, packed=packed)
    before = [t.clone() for t in packed]
    new_gu = torch.randn(2 * i, h, generator=g).to(torch.bfloat16)
    new_dn = torch.randn(h, i, generator=g).to(torch.bfloat16)
    ex.fill_slot(1, new_gu, new_dn)
    for got, want, old in zip(packed, (CpuKernels.pack(new_gu), CpuKernels.pack(new_dn)), before):
        assert torch.equal(got[1].view(torch.int16), want.view(torch.int16))
        assert torch.equal(got[0].view(torch.int16), old[0].view(torch.int16))
        assert torch.equal(got[2].view(torch.int16), old[2].view(torch.int16))


@pytest.mark.parametrize("tokens", [1, 2, 3, 7])
def test_a_few_tokens_take_one_kernel_call_with_the_per_expert_bits(tokens):
    """With the kernels' packed copies, a layer's routed experts run in one moed_experts_bf16
    call (a decode row, a verify step's two rows, EP's and the cold store's grouped rows), not
    one pass of torch ops per touched expert, and every bit is what the per-expert Linears
    (native, torch's silu) give: the one-call and the per-expert results equal."""
    from moed.model.kernels import CpuKernels, cpu_kernels
    k = cpu_kernels()
    if k is None:
        pytest.skip("no native CPU kernels on this host (no compiler or no AVX2 + FMA)")
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    down = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    ex = LocalExperts(gate_up, down, pack=False, kernels=k,
                      packed=(CpuKernels.pack(gate_up), CpuKernels.pack(down)))
    calls = []
    real = k.experts_bf16

    class Spy:
        def __getattr__(self, name):
            return getattr(k, name)

        def experts_bf16(self, *a):
            calls.append(a[0].shape[0])
            return real(*a)
    ex.kernels = Spy()
    for trial in range(6):
        x = (torch.randn(tokens, H, generator=g) * (1 + 4 * trial)).to(torch.bfloat16)
        phys = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
        w = torch.rand(tokens, 2, generator=g).to(torch.bfloat16)
        routing = Routing(w, phys, False)
        calls.clear()
        got = ex(x, routing)
        assert calls == [2 * tokens]                     # one call for the whole layer
        want = torch.zeros_like(x)
        for t in range(tokens):         # each (token, expert) alone through the expert's Linears
            for j in range(2):
                gu, dn = ex.experts[int(phys[t, j])]
                a, b = gu(x[t:t + 1]).chunk(2, dim=-1)
                want[t:t + 1] += dn(F.silu(a) * b) * w[t, j]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_combine_sorted_gives_combine_bits():
    """The cold-expert executor sums each token's outputs from their expert order (no unsort and
    re-sort); every bit must be combine's, -0 and one-token top-k order included."""
    g, rng = torch.Generator().manual_seed(3), random.Random(3)
    for _ in range(150):
        t, k, h = rng.choice([1, 2, 3, 8, 33]), rng.choice([1, 2, 4, 8]), rng.choice([16, 96])
        experts = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(t)])
        w = (torch.rand(t, k, generator=g) * rng.choice([1, -1])).bfloat16()
        ys = (torch.randn(t * k, h, generator=g) * 10 ** rng.uniform(-3, 3)).bfloat16()
        ys[torch.rand(t * k, h, generator=g) < 0.05] = -0.0
        order = torch.argsort(experts.reshape(-1), stable=True)
        for mode in (MoEMode.TORCH, MoEMode.FUSED):
            want = combine(ys.view(t, k, h), w, experts, mode)
            got = combine_sorted(ys[order], order, w, experts, mode)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (t, k, h, mode)
