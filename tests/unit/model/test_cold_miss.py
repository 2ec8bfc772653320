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
    for layer in r.cold.layers:         # the store's own reads (cold/packread.py: test_cold_cached)
        layer.packread = False
    calls: list[tuple[str, bool]] = []
    orig = ExpertIndex.read
    monkeypatch.setattr(ExpertIndex, "read", lambda self, *a, reuse=False, **k: calls.append(
        (threading.current_thread().name, reuse)) or orig(self, *a, reuse=reuse, **k))
    got = _steps(r, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "logits differ from all-resident"
    assert r.cold.stats.misses > 0
    assert calls and all(reuse for _, reuse in calls)       # every read of a packed slot
    # a staged read is packed out of the thread's buffer into tensors of its own
    one = r.cold.read_ahead(0, 5)
    two = r.cold.read_ahead(0, 6)
    assert {t.data_ptr() for t in one}.isdisjoint({t.data_ptr() for t in two})
    buf = r.cold.index._local.bufs
    assert all(t.data_ptr() not in {b.data_ptr() for b in buf} for t in one + two)
    layer = r.cold.layers[0]
    gu, dn = orig(r.cold.index, layer.layer, 5)
    assert torch.equal(one[0].view(torch.int16), CpuKernels.pack(gu).view(torch.int16))
    assert torch.equal(one[1].view(torch.int16), CpuKernels.pack(dn).view(torch.int16))


def test_read_pack_reads_and_packs_each_matrix_or_leaves_it_whole(isa_kern, tmp_path):
    """kernels/pack.py read_pack (cpu_quant.c moed_read_pack_p32): matrices read from a file at
    their offsets and packed into their destinations by the team, split in chunks; a matrix past
    the end of the file (truncated) is refused with its chunks unwritten; an unaligned
    destination takes ordinary stores; every byte is CpuKernels.pack's."""
    import os
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT (not Linux)")
    from moed.model.kernels.pack import read_pack
    g = torch.Generator().manual_seed(4)
    shapes = [(64, 96), (96, 2048), (32, 6), (160, 4100)]      # 128 KB blocks: chunks of 2 blocks
    ws = [torch.randn(n, k, generator=g).bfloat16() for n, k in shapes]
    path, offsets, pos = tmp_path / "w.bin", [], 4096 + 6
    with open(path, "wb") as f:
        f.write(b"\0" * pos)
        for w in ws:
            offsets.append(pos)
            f.write(w.view(torch.uint8).numpy().tobytes())
            pos += w.numel() * 2
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, pos, 0)            # in the page cache
        outs = [torch.full((n // BLOCK, k // 2, BLOCK, 2), 7.0, dtype=torch.bfloat16) for n, k in shapes]
        odd = torch.full((outs[0].numel() + 8,), 7.0, dtype=torch.bfloat16)[2:2 + outs[0].numel()]
        reads = [(fd, o, n // BLOCK, k // 2, t.data_ptr()) for (n, k), o, t in zip(shapes, offsets, outs)]
        reads.append((fd, offsets[0], 2, 48, odd.data_ptr()))          # 4-byte aligned only
        reads.append((fd, pos - 100, 1, 8, torch.empty(512, dtype=torch.bfloat16).data_ptr()))  # past EOF
        assert read_pack(isa_kern, reads) == [True] * len(shapes) + [True, False]
        for w, got in zip(ws, outs):
            assert torch.equal(got.view(torch.int16), CpuKernels.pack(w).view(torch.int16)), (isa_kern.isa, w.shape)
        assert torch.equal(odd.view(torch.int16), CpuKernels.pack(ws[0]).view(torch.int16).reshape(-1))
        # truncated inside its third block: refused; its first chunk (two blocks) packed, the
        # short one unwritten
        short = torch.full((3, 1024, BLOCK, 2), 7.0, dtype=torch.bfloat16)
        os.truncate(path, offsets[1] + 5 * 64 * 1024)
        assert read_pack(isa_kern, [(fd, offsets[1], 3, 1024, short.data_ptr())]) == [False]
        assert torch.equal(short[:2].view(torch.int16), CpuKernels.pack(ws[1])[:2].view(torch.int16))
        assert torch.equal(short[2], torch.full_like(short[2], 7.0))
        assert read_pack(isa_kern, []) == []
    finally:
        os.close(fd)


@pytest.mark.parametrize("hidden,inter", [(64, 96), (512, 192), (96, 4128)])
def test_read_experts_gives_a_slots_bits_or_says_it_could_not(isa_kern, tmp_path, hidden, inter):
    """kernels/pack.py read_experts (cpu_quant.c moed_read_experts_p32): experts run straight from
    a file's plain bf16 matrices give, row for row, the bits experts_bf16 gives from packed slots
    holding them (1, 2, 3 and 40 rows an expert, in any order of the rows; down in chunks of
    several blocks and of one), rows of no expert untouched, and those given slots are installed
    with CpuKernels.pack's bytes; an expert whose matrix the file no longer holds (truncated) is
    reported and the others are still right."""
    import os
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT (not Linux)")
    from moed.model.kernels.pack import read_experts
    g = torch.Generator().manual_seed(hidden + inter)
    counts = [1, 2, 3, 40]
    mats = [[torch.randn(n, k, generator=g).bfloat16() * 0.1 for n, k in ((inter, hidden), (inter, hidden), (hidden, inter))]
            for _ in counts]
    path, files, pos = tmp_path / "e.bin", [], 4096 + 2
    with open(path, "wb") as f:
        f.write(b"\0" * pos)
        for ms in mats:
            where = []
            for m in ms:
                where.append(pos)
                f.write(m.view(torch.uint8).numpy().tobytes())
                pos += m.numel() * 2
            files.append(where)
    xs = torch.randn(sum(counts), hidden, generator=g).bfloat16()
    gate_up = torch.stack([CpuKernels.pack(torch.cat([ms[0], ms[1]])) for ms in mats])
    down = torch.stack([CpuKernels.pack(ms[2]) for ms in mats])
    want = isa_kern.experts_bf16(xs, counts, gate_up, down, inter)
    # the experts' rows where the store has them: grouped by unit, other units' rows between
    first = [5, 0, 50, 8]
    big = torch.randn(100, hidden, generator=g).bfloat16()
    for f0, c, s0 in zip(first, counts, (0, 1, 3, 6)):
        big[f0:f0 + c] = xs[s0:s0 + c]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, pos, 0)            # in the page cache
        experts = [tuple((fd, o) for o in where) for where in files]
        out = torch.full_like(big, 3.0)
        assert read_experts(isa_kern, experts, big, first, counts, inter, out) == [True] * len(counts)
        for f0, c, s0 in zip(first, counts, (0, 1, 3, 6)):
            assert torch.equal(out[f0:f0 + c].view(torch.int16), want[s0:s0 + c].view(torch.int16)), isa_kern.isa
        assert torch.equal(out[90:], torch.full_like(out[90:], 3.0))
        # installed as read: experts 1 and 3 into slots (one at an odd address), bytes as packed
        gu_s, dn_s = torch.full_like(gate_up[:2], 7.0), torch.full_like(down[:2], 7.0)
        odd = torch.full((down[0].numel() + 8,), 7.0, dtype=torch.bfloat16)[2:2 + down[0].numel()]
        dsts = [None, (gu_s[0].data_ptr(), gu_s[0].data_ptr() + inter * hidden * 2, dn_s[0].data_ptr()), None,
                (gu_s[1].data_ptr(), gu_s[1].data_ptr() + inter * hidden * 2, odd.data_ptr())]
        got = torch.empty_like(xs)
        assert read_experts(isa_kern, experts, xs, [0, 1, 3, 6], counts, inter, got, dsts) == [True] * 4
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert torch.equal(gu_s.view(torch.int16), gate_up[1::2].view(torch.int16))
        assert torch.equal(dn_s[0].view(torch.int16), down[1].view(torch.int16))
        assert torch.equal(odd.view(torch.int16), down[3].view(torch.int16).reshape(-1))
        os.truncate(path, files[2][2] + 100)            # the third expert's down cut short
        got = torch.empty_like(xs)
        assert read_experts(isa_kern, experts[:3], xs, [0, 1, 3], counts[:3], inter, got) == [True, True, False]
        assert torch.equal(got[:3].view(torch.int16), want[:3].view(torch.int16))
        assert read_experts(isa_kern, [], xs, [], [], inter, got) == []
        with pytest.raises(ValueError, match="inside"):
            read_experts(isa_kern, experts[:1], xs, [len(xs)], [1], inter, got)
    finally:
        os.close(fd)
