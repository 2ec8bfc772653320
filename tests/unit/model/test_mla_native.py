"""The native absorbed MLA attention (kernels/cpu_mla.c, kernels/mla.py): close to mla.absorbed,
a row's bits its own whatever its company (other sequences, a verify chunk, the thread count,
the ISA variant), and the torch MLA backend routing decode rows and verify chunks (a lone one
too) through it in bf16, so a verify chunk's logits are plain decoding's bit for bit."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from moed.model import archs
from moed.model import kernels as K
from moed.model.attention import mla
from moed.model.attention.registry import get_backend
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.hf_config import spec_from_config
from moed.model.kernels.mla import mla_decode_bf16

from conftest import forced_isa, isa_params     # tests/unit/model/conftest.py
from torch_threads import threads               # tests/unit/model/torch_threads.py

pytestmark = pytest.mark.skipif(not (K.cpu_flags_ok() and (os.environ.get("CC") or shutil.which("cc")
                                                           or shutil.which("gcc"))),
                                reason="CPU runs no native kernel variant, or no C compiler")
DEMO = Path(__file__).resolve().parents[3] / "models" / "stdlib-ds3-tiny"
# (H, nope, rope, r, vd, block size): the demo model's sizes; r, r + rope and H * vd off the
# 16-lane vector width; one head
SHAPES = [(4, 16, 16, 48, 32, 16), (3, 8, 8, 40, 20, 4), (5, 12, 6, 20, 12, 8), (1, 16, 8, 64, 16, 5)]


class Case:
    """Random weights, a shuffled block pool and per sequence a block table (out of order)."""

    def __init__(self, shape: tuple[int, ...], seed: int = 0, num_blocks: int = 96) -> None:
        self.h, self.nope, self.rope, self.r, self.vd, self.bs = shape
        g = self.g = torch.Generator().manual_seed(seed)
        self.cache = torch.randn((num_blocks, self.bs, self.r + self.rope), generator=g).bfloat16()
        self.w_uk = torch.randn((self.h, self.nope, self.r), generator=g) * 0.3
        self.w_uv = torch.randn((self.h, self.vd, self.r), generator=g) * 0.3
        self.pool = torch.randperm(num_blocks, generator=g).tolist()

    def table(self, length: int) -> list[int]:
        n = -(-length // self.bs)
        out, self.pool = self.pool[:n], self.pool[n:]
        return out

    def order_sensitive(self, table: list[int], length: int) -> None:
        """Make the p.v sum of latent dim 0 depend on its order at bf16 resolution: the scores
        do not see dim 0 (W_uk's column 0 zero), positions 4i and 4i + 2 are the same key but
        for dim 0, +-2^20 (equal probabilities: they cancel), the odd positions small, so what
        is left of them depends on where the running sum was when they came; W_uv's column 0
        large, so o_lat[0] shows in the output. (On random data a changed fp32 order hides in
        the bf16 roundings nearly always.)"""
        self.w_uk[:, :, 0] = 0
        self.w_uv[:, :, 0] = 30
        flat = self.cache.view(-1, self.r + self.rope)
        row = [table[p // self.bs] * self.bs + p % self.bs for p in range(length)]
        for p in range(0, length - 2, 4):
            flat[row[p + 2]] = flat[row[p]]
            big = 2.0 ** (12 + p * 5 % 11)      # binades that vary: a partial sum's grid matters
            flat[row[p], 0], flat[row[p + 2], 0] = big, -big

    def queries(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randn((t, self.h, self.nope + self.rope), generator=self.g).bfloat16()
        return q[:, :, :self.nope], q[:, :, self.nope:].contiguous()     # q_nope strided, as the block's

    def native(self, kern, qn, qr, tables: list[list[int]], rows, seqs, lens, scale=0.125) -> torch.Tensor:
        width = max(len(t) for t in tables)
        tt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        out = torch.zeros((qn.shape[0], self.h, self.vd), dtype=torch.bfloat16)
        mla_decode_bf16(kern, qn, qr, self.cache, tt, *(torch.tensor(x) for x in (rows, seqs, lens)),
                        self.w_uk, self.w_uv, scale, out)
        return out

    def absorbed(self, qn, qr, table: list[int], length: int, dtype=torch.bfloat16, scale=0.125):
        slot = torch.arange(length)
        latent = self.cache.view(-1, self.r + self.rope)[torch.tensor(table)[slot // self.bs] * self.bs + slot % self.bs]
        return mla.absorbed(qn.to(dtype), qr.to(dtype), latent[None].to(dtype), torch.zeros((1, 1, length)),
                            self.w_uk, self.w_uv, scale)[0]


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("shape", SHAPES)
def test_native_is_absorbed(isa, shape):
    """Lengths 1, inside a block, on and across block boundaries, long: within bf16 rounding
    of the torch form in bf16, and of the fp32 form."""
    with forced_isa(isa) as kern:
        c = Case(shape)
        lens = [1, 3, c.bs, c.bs + 1, 5 * c.bs - 1, 150]
        tables = [c.table(n) for n in lens]
        qn, qr = c.queries(len(lens))
        out = c.native(kern, qn, qr, tables, range(len(lens)), range(len(lens)), lens)
        for i, n in enumerate(lens):
            ref = c.absorbed(qn[i:i + 1], qr[i:i + 1], tables[i], n)
            ref32 = c.absorbed(qn[i:i + 1], qr[i:i + 1], tables[i], n, torch.float32)
            scale = ref32.abs().max().item()
            assert (out[i].float() - ref.float()).abs().max().item() <= 2 ** -7 * scale, (i, n)
            assert (out[i].float() - ref32).abs().max().item() <= 2 ** -5 * scale, (i, n)


def _company(kern, c: Case, length: int) -> dict[str, torch.Tensor]:
    """The output of one query row (history `length`) computed alone, between rows of other
    sequences of other lengths, and as row 2 of a 5-row verify chunk (rows j attend to
    length - 2 + j tokens); 1 and 2 threads."""
    table, other = c.table(length + 2), [c.table(n) for n in (7, 3 * length, 1)]
    c.order_sensitive(table, length)
    qn, qr = c.queries(5)
    got = {}
    for n in (1, 2):
        with threads(n):
            got[f"alone{n}"] = c.native(kern, qn[2:3], qr[2:3], [table], [0], [0], [length])[0]
            mixed = c.native(kern, qn[[0, 2, 1, 3, 4]], qr[[0, 2, 1, 3, 4]], [other[0], table, other[1], other[2]],
                             range(5), [0, 1, 2, 2, 3], [7, length, 3 * length, 3 * length - 1, 1])
            got[f"company{n}"] = mixed[1]
            chunk = c.native(kern, qn, qr, [other[0], table], range(5), [1] * 5,
                             [length - 2 + j for j in range(5)])
            got[f"chunk{n}"] = chunk[2]
    return got


@pytest.mark.parametrize("isa", isa_params())
def test_a_rows_bits_are_its_own(isa):
    """Alone, in company (the longest row 3x its length), as a verify chunk's row, at 1 and
    2 threads: bitwise one answer, for lengths inside one block and across several."""
    with forced_isa(isa) as kern:
        for shape in SHAPES[:2]:
            c = Case(shape, seed=3, num_blocks=400)
            for length in (5, 37, 150):
                got = _company(kern, c, length)
                for name, o in got.items():
                    assert torch.equal(o, got["alone1"]), (shape, length, name)


def test_the_variants_agree_bitwise():
    """Every variant this CPU runs gives the same bits (the avx512bf16 one skips off its CPUs)."""
    runs = [isa for isa in K.ISAS if not K.isa_missing(isa)]
    if len(runs) < 2:
        pytest.skip(f"this CPU runs {runs} only")
    outs = []
    for isa in runs:
        with forced_isa(isa) as kern:
            c = Case(SHAPES[1], seed=5)
            lens = [2, 9, 33, 70]
            tables = [c.table(n) for n in lens]
            qn, qr = c.queries(4)
            outs.append(c.native(kern, qn, qr, tables, range(4), range(4), lens))
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_bad_ids_are_refused():
    kern = K.cpu_kernels()
    c = Case(SHAPES[0])
    qn, qr = c.queries(1)
    with pytest.raises(RuntimeError, match="bad row or block id"):
        c.native(kern, qn, qr, [[c.cache.shape[0]]], [0], [0], [3])        # a block past the pool
    with pytest.raises(RuntimeError, match="bad row or block id"):
        c.native(kern, qn, qr, [[0]], [0], [0], [c.bs + 1])                 # longer than its table


CFG = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, n_routed_experts=6, n_group=2, topk_group=1, num_experts_per_tok=2,
           moe_intermediate_size=32, intermediate_size=96, kv_lora_rank=32, q_lora_rank=None,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
           vocab_size=100, max_position_embeddings=512, rope_theta=10000.0, n_shared_experts=1)


@pytest.mark.parametrize("kv_dtype,native", [(torch.bfloat16, True), (torch.float8_e4m3fn, False)])
def test_the_backend_sends_a_lone_chunk_native(kv_dtype, native):
    """bf16 with the kernels: a lone verify chunk and decode rows take the native call, each
    row its own causal length; a prompt chunk stays a prefill. An fp8 cache keeps the torch
    path (and its ABSORBED_MIN_SEQS rule: the lone chunk expanded)."""
    spec = spec_from_config(CFG)
    ctx = ComputeContext(torch.device("cpu"), torch.bfloat16, kernels=K.cpu_kernels())
    backend = get_backend("torch", spec, archs.kv_layout(spec, 4, kv_dtype), ctx)
    backend.plan(ForwardBatch([[2, 3, 4]], [6], [[3, 4, 13]]), torch.tensor([6, 7, 8]))
    assert (backend.native is not None) == native
    if not native:
        assert backend.dec_rows is None and [(p.row, p.n) for p in backend.prefills] == [(0, 3)]
        return
    tables, rows, seqs, lens = backend.native
    assert tables.tolist() == [[3, 4, 13]] and rows.tolist() == [0, 1, 2] and lens.tolist() == [7, 8, 9]
    backend.plan(ForwardBatch([[1], [5, 6], [2, 3]], [9, 4, 6], [[0, 1, 2], [5, 6], [3, 4]],
                              prompt=(False, True, False)), torch.tensor([9, 4, 5, 6, 7]))
    tables, rows, seqs, lens = backend.native
    assert rows.tolist() == [0, 3, 4] and seqs.tolist() == [0, 1, 1] and lens.tolist() == [10, 7, 8]
    assert [(p.row, p.n) for p in backend.prefills] == [(1, 2)]


def test_demo_verify_chunk_logits_are_plain_decodings_bitwise():
    """The demo model in bf16 with batch invariance: a lone 5-token verify chunk's logits, row
    by row, and the same chunk beside another sequence's decode row, are the logits of
    decoding those positions one at a time (before: a lone chunk took the expanded form)."""
    from moed.model.runner import ModelRunner

    r = ModelRunner(DEMO, dtype="bfloat16", num_blocks=64, block_size=4, batch_invariant=True)
    assert r.backend.kernels is not None
    prompt, other, cont = list(range(40, 77)), list(range(300, 310)), [71, 72, 73, 74, 75]
    tables = [list(range(12)), list(range(12, 18))]
    r.forward(ForwardBatch([prompt, other], [0, 0], tables, prompt=(True, True)))
    steps = [r.forward(ForwardBatch([[t]], [len(prompt) + j], tables[:1])) for j, t in enumerate(cont)]
    want = torch.cat(steps)
    alone = r.forward(ForwardBatch([cont], [len(prompt)], tables[:1], all_logits=(True,)))
    assert torch.equal(alone, want)
    mixed = r.forward(ForwardBatch([[9], cont], [len(other), len(prompt)], tables[::-1],
                                   all_logits=(False, True)))
    assert torch.equal(mixed[1:], want)


def test_demo_mtp_layer_verify_chunk_is_per_position_bitwise():
    """The MTP layer attends through the same backend, so the same holds for it: its logits over
    a 5-token chunk (the main model's hidden states of that chunk) are those of running it one
    position at a time."""
    from moed.model.mtp import mtp_inputs
    from moed.model.runner import ModelRunner

    r = ModelRunner(DEMO, dtype="bfloat16", num_blocks=32, block_size=4, batch_invariant=True, mtp=True)
    prompt, cont, table = list(range(40, 77)), [71, 72, 73, 74, 75, 76], [list(range(12))]

    def step(toks: list[int], start: int, nxt: int, kv_only: bool = False):
        b = ForwardBatch([toks], [start], table, all_logits=(True,))
        _, hidden = r.forward(b, hidden=True)
        mb, rows = mtp_inputs(b, [nxt])
        mb = ForwardBatch(mb.token_ids, mb.start_pos, mb.block_tables, all_logits=(True,))
        return r.forward_mtp(mb, hidden.index_select(0, torch.tensor(rows)), kv_only=kv_only)

    step(prompt, 0, cont[0], kv_only=True)
    want = torch.cat([step([t], len(prompt) + j, cont[j + 1]) for j, t in enumerate(cont[:5])])
    assert torch.equal(step(cont[:5], len(prompt), cont[5]), want)
