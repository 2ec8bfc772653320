"""The cost of a cold-expert miss into a packed slot (moed/model/cold/store.py read_slots,
LocalExperts.fill_slot): the read lands in the calling thread's reused buffer (no fresh pages
to fault in per miss) and the packing is written by one thread (moed/model/kernels/pack.py), byte for byte
CpuKernels.pack; staged reads (read-aheads, prefetches) still get their own tensors."""
from __future__ import annotations

import threading

import pytest
import torch

from moed.model.cold import ColdSettings
from moed.model.cold.reader import ExpertIndex
from moed.model.kernels import BLOCK, CpuKernels
from moed.model.kernels.pack import pack_copy, pack_into
from test_cold_experts import _budget, _runner, _steps


def test_pack_into_writes_cpu_kernels_pack():
    g = torch.Generator().manual_seed(3)
    for n, k in ((4 * BLOCK, 6 * BLOCK), (2 * BLOCK, 2 * BLOCK + 2)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        want = CpuKernels.pack(w)
        got = torch.full_like(want, 7.0)
        pack_into(w, got)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        pack_into(w.t().contiguous().t(), got)       # a non-contiguous source: same bytes
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert torch.equal(pack_copy(w).view(torch.int16), want.view(torch.int16))
    odd = torch.randn(BLOCK + 3, 8, generator=g).to(torch.bfloat16)     # padding rows: CpuKernels.pack
    assert torch.equal(pack_copy(odd).view(torch.int16), CpuKernels.pack(odd).view(torch.int16))


def test_the_kernels_c_pack_writes_the_same_bytes(isa_kern):
    """Each kernel variant's moed_pack_p32 (what a miss into a packed slot uses) against
    CpuKernels.pack, with pair counts that are and are not a multiple of the 8x8 tile; a shape
    it cannot take is refused, not written."""
    g = torch.Generator().manual_seed(5)
    for n, k in ((4 * BLOCK, 6 * BLOCK), (2 * BLOCK, 2 * 13), (BLOCK, 2 * 8 + 2), (3 * BLOCK, 2)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        want = CpuKernels.pack(w)
        got = torch.full_like(want, 7.0)
        pack_into(w, got, isa_kern)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (isa_kern.isa, n, k)
        assert torch.equal(pack_copy(w.t().contiguous().t(), isa_kern).view(torch.int16), want.view(torch.int16))
    w = torch.randn(BLOCK + 3, 8, generator=g).to(torch.bfloat16)
    with pytest.raises(ValueError, match="pack_into"):
        pack_into(w, torch.empty(2, 4, BLOCK, 2, dtype=torch.bfloat16), isa_kern)
    with pytest.raises(ValueError, match="pack_into"):
        pack_into(w[:BLOCK], torch.empty(2, 4, BLOCK, 2, dtype=torch.bfloat16), isa_kern)   # wrong dst


def test_read_reuse_is_one_buffer_per_thread(tiny_qwen3):
    full = _runner(tiny_qwen3, "bfloat16")
    ix = ExpertIndex(tiny_qwen3, full.spec, torch.bfloat16)
    layer = next(i for i in range(full.spec.num_layers) if i not in full.spec.dense_layers)
    try:
        a = ix.read(layer, 0, reuse=True)
        want1 = [t.clone() for t in ix.read(layer, 1)]
        b = ix.read(layer, 1, reuse=True)
        assert [t.data_ptr() for t in a] == [t.data_ptr() for t in b]      # the same buffer
        assert all(torch.equal(x, y) for x, y in zip(b, want1))            # holding expert 1
        other: list = []
        th = threading.Thread(target=lambda: other.extend(ix.read(layer, 0, reuse=True)))
        th.start()
        th.join()
        assert other[0].data_ptr() != a[0].data_ptr()           # another thread: its own
        fresh = ix.read(layer, 0)
        assert fresh[0].data_ptr() != a[0].data_ptr()           # without reuse: a new one
    finally:
        ix.close()


def test_packed_misses_read_into_reused_buffers_and_staged_reads_do_not(tiny_qwen3, monkeypatch):
    full = _runner(tiny_qwen3, "bfloat16")
    want = _steps(full, 6)
    # misses, read-aheads between steps and layer-ahead prefetches all at once
    r = _runner(tiny_qwen3, "bfloat16", ColdSettings(_budget(full, 0.3), 1 << 30, 2.0, 4))
    assert r.cold.layers[0].local.gate_up_p is not None, "the kernels' packed slots"
    calls: list[tuple[str, bool]] = []
    orig = ExpertIndex.read
    monkeypatch.setattr(ExpertIndex, "read", lambda self, *a, reuse=False, **k: calls.append(
        (threading.current_thread().name, reuse)) or orig(self, *a, reuse=reuse, **k))
    got = _steps(r, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "logits differ from all-resident"
    assert r.cold.stats.misses > 0
    assert calls and all(reuse for _, reuse in calls)       # every read of a packed slot
    # a staged read is packed out of the thread's buffer into tensors of its own
    one = r.cold._read_ahead(0, 5)
    two = r.cold._read_ahead(0, 6)
    assert {t.data_ptr() for t in one}.isdisjoint({t.data_ptr() for t in two})
    buf = r.cold.index._local.bufs
    assert all(t.data_ptr() not in {b.data_ptr() for b in buf} for t in one + two)
    layer = r.cold.layers[0]
    gu, dn = orig(r.cold.index, layer.layer, 5)
    assert torch.equal(one[0].view(torch.int16), CpuKernels.pack(gu).view(torch.int16))
    assert torch.equal(one[1].view(torch.int16), CpuKernels.pack(dn).view(torch.int16))
