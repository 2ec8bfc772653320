"""kernels/rows.py: an expert call over rows where the caller has them, and the combine of each
token's k outputs, in C; the same bits as the torch ops they replace, on every kernel variant
this CPU runs."""
from __future__ import annotations

import pytest
import torch

from moed.model.executor import MoEMode, combine_sorted
from moed.model.kernels import CpuKernels
from moed.model.kernels.rows import combine_rows, experts_rows, group_rows, serves_combine


@pytest.mark.parametrize("hidden,inter", [(64, 96), (96, 160)])
def test_experts_rows_equal_the_gathered_call_scattered_back(isa_kern, hidden, inter):
    g = torch.Generator().manual_seed(hidden)
    slots = 5
    gate_up = torch.stack([CpuKernels.pack(torch.randn(2 * inter, hidden, generator=g).bfloat16() * 0.1)
                           for _ in range(slots)])
    down = torch.stack([CpuKernels.pack(torch.randn(hidden, inter, generator=g).bfloat16() * 0.1)
                        for _ in range(slots)])
    xs = torch.randn(90, hidden, generator=g).bfloat16()
    for counts in ([1, 0, 2, 0, 1], [0, 40, 3, 1, 30]):        # few rows (team), many (chunks)
        rows = torch.randperm(90, generator=g)[:sum(counts)].tolist()
        want = torch.full_like(xs, 5.0)
        want[rows] = isa_kern.experts_bf16(xs[rows], counts, gate_up, down, inter)
        got = torch.full_like(xs, 5.0)
        experts_rows(isa_kern, xs, rows, counts, gate_up, down, inter, got)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (isa_kern.isa, counts)
    with pytest.raises(ValueError, match="rows inside"):
        experts_rows(isa_kern, xs, [90], [1, 0, 0, 0, 0], gate_up, down, inter, got)


@pytest.mark.parametrize("t,k,h", [(1, 4, 64), (3, 1, 100), (8, 4, 512), (40, 6, 72)])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_combine_rows_equals_combine_sorted(isa_kern, t, k, h, wdtype):
    g = torch.Generator().manual_seed(t * k + h)
    experts = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(t)])
    order = torch.argsort(experts.reshape(-1), stable=True)
    ys = (torch.randn(t * k, h, generator=g) * 3).bfloat16()
    ys[0, :3] = torch.tensor([0.0, -0.0, 1e-38])                 # zeros and a denormal-sized value
    weights = torch.rand(t, k, generator=g).to(wdtype)
    assert serves_combine(ys, weights)
    want = combine_sorted(ys, order, weights, experts, MoEMode.FUSED)
    got = combine_rows(isa_kern, ys, order, weights)
    assert got.dtype == want.dtype and torch.equal(got.view(torch.int16), want.view(torch.int16)), isa_kern.isa
    if t > 1:               # the torch path's order for t > 1 is the same sum
        assert torch.equal(combine_sorted(ys, order, weights, experts, MoEMode.TORCH).view(torch.int16),
                           got.view(torch.int16))


@pytest.mark.parametrize("t,k,units", [(1, 1, 4), (8, 4, 128), (33, 6, 16)])
def test_group_rows_equals_argsort_bincount_and_gather(kern, t, k, units):
    g = torch.Generator().manual_seed(t * k)
    phys = torch.randint(0, units, (t, k), generator=g)          # repeats within a token too
    x = torch.randn(t, 40, generator=g).bfloat16()
    order, count, xs = group_rows(kern, phys, x, units)
    want = torch.argsort(phys.reshape(-1), stable=True)
    assert torch.equal(order, want)
    assert torch.equal(count, torch.bincount(phys.reshape(-1), minlength=units))
    assert torch.equal(xs.view(torch.int16), x.index_select(0, want // k).view(torch.int16))
    with pytest.raises(ValueError, match="outside"):
        group_rows(kern, torch.full((t, k), units), x, units)


def test_blocks_at_once_equal_one_block_at_a_time(isa_kern):
    """moed_blocks_rows_bf16 (several packed blocks a call: the AVX2 tile widens each panel's
    inputs once for all of them) gives every output the bits moed_block_rows_bf16 gives it one
    block at a time: row counts across the 2-row, 3-row and full tiles, a partial last panel
    (K/2 % 64), 1 to 8 blocks."""
    import ctypes
    lib, p, l_ = isa_kern.lib, ctypes.c_void_p, ctypes.c_long
    lib.moed_block_rows_bf16.argtypes = [p, l_, l_, p, l_, p, l_]
    lib.moed_blocks_rows_bf16.argtypes = [p, l_, l_, p, l_, l_, l_, p, l_]
    g = torch.Generator().manual_seed(5)
    for k, nb in ((64, 1), (130, 3), (1024, 8)):
        w = CpuKernels.pack(torch.randn(32 * nb, k, generator=g).bfloat16())     # nb blocks of 32 columns
        for rows in (1, 2, 3, 5, 31, 47, 48):
            x = torch.randn(rows, k + 6, generator=g).bfloat16()      # a row stride past K
            got = torch.full((rows, 32 * nb + 3), 7.0)
            want = got.clone()
            lib.moed_blocks_rows_bf16(x.data_ptr(), rows, k + 6, w.data_ptr(), nb, 32 * k, k, got.data_ptr(), 32 * nb + 3)
            for j in range(nb):
                lib.moed_block_rows_bf16(x.data_ptr(), rows, k + 6, w.data_ptr() + 2 * 32 * k * j, k,
                                         want.data_ptr() + 4 * 32 * j, 32 * nb + 3)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (isa_kern.isa, k, nb, rows)
            assert not torch.equal(got[:, :32 * nb], torch.full_like(got[:, :32 * nb], 7.0))
