"""Reference attention on plain torch (CPU or any device), over the shared paged NHD layout.

plan() turns block tables into flat slot indices once per step: the layer's cache viewed as
rows [num_blocks * rows_per_block, H_kv, D] (the gqa KVLayout's block [2, bs, H_kv, D] is 2 * bs
rows: K of slot s at block * rows_per_block + s, V one plane, bs rows, later), so writes are one
index_copy_ and reads one index_select per K and V. Decode sequences (one new token) are
attended together in one batched SDPA call over their gathered blocks with a length mask;
prefill/chunked sequences run one SDPA call each (causal, offset by the tokens already cached):
on CPU that is torch's flash kernel (blocked, online softmax: no [T, T] score matrix, for a
fresh prompt and for a chunk with its bool mask alike; tests/unit/model/test_prefill_attention.py
checks the op). On CPU bf16 with the native kernels (moed/model/kernels), decode
sequences instead go to one call that reads K/V straight from their blocks (no gather), with the
same roundings as the torch path, and each prefill to `prefill_attn_bf16`: blocked over 8 query
rows, both products on the packed-block matmul kernel, 2.2-2.7x torch's CPU flash kernel at
128-2048 tokens (1 Zen4 thread), rounding as the flash kernel it replaces. Whether the kernels serve is the model's ComputeContext's
answer; this backend only adds that the kernel is built for head sizes 32, 64, 128 and 256.
An fp8 KV cache (moed/model/kv_layout.py) is written through quantize_kv and read back through
dequantize_kv (with bf16 compute on CPU: the kernels' fp8 -> bf16 table lookup, read_kv); decode
then runs on the torch path (the native decode kernel reads bf16 blocks), prefill on the prefill
kernel as with a bf16 cache (it takes K/V as tensors); a fresh prompt
attends over its own K/V rounded the same way, so a prompt gives the same numbers whether it
is prefilled at once, in chunks, or after a prefix-cache hit.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from moed.model.attention.base import AttentionBackend, decoded_chunks, paging
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kernels import CpuKernels
from moed.model.kv_layout import KVLayout, is_fp8, quantize_kv, write_rows
from moed.model.spec import ModelSpec


@dataclass
class _Prefill:
    row: int                          # first of this sequence's rows in q/k/v
    n: int                            # new tokens
    start: int                        # tokens already cached
    k_rows: torch.Tensor | None       # cache rows of the whole history (None: start == 0)
    mask: torch.Tensor | None         # [n, start + n] bool (None: plain causal)


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, spec: ModelSpec, kv: KVLayout, ctx: ComputeContext) -> None:
        super().__init__(spec, kv, ctx)
        planes, bs, self.hkv, self.d = kv.block_shape
        self.rows_per_block, self.v_rows = planes * bs, bs      # V: one plane after K
        fits = self.d in (32, 64, 128, 256)                     # the head sizes the kernel is built for
        self.fp8 = is_fp8(kv.dtype)                             # the kernels read bf16 blocks only
        self.kernels: CpuKernels | None = ctx.kernels if fits and not self.fp8 else None
        # the prefill kernel takes K/V as tensors (an fp8 history is read back to bf16 first)
        self.prefill_kernels: CpuKernels | None = ctx.kernels if fits else None
        self.kernels_off = "fp8 KV cache (the CPU decode attention kernel reads bf16 blocks)" \
            if self.fp8 and self.prefill_kernels is not None else ""
        if ctx.batch_invariant and ctx.dtype == torch.bfloat16 and self.kernels is None:
            # the torch decode path pads every history to the longest: a row's bits would
            # depend on its company
            raise ValueError(f"model.batch_invariant in bf16 needs the native attention kernel "
                             f"(head_dim 32, 64, 128 or 256 and a bf16 KV cache; this model: "
                             f"head_dim {self.d}, KV {kv.dtype_name})")

    def plan(self, batch: ForwardBatch, positions: torch.Tensor) -> None:
        bs, dev = self.block_size, self.device
        pg = paging(batch, bs)
        q_lens, kv_lens, tables = pg.q_lens, pg.kv_lens, pg.tables
        table_t = pg.table_tensor(dev)
        blk = pg.token_blocks(table_t, positions, bs)
        self.write_k = blk * self.rows_per_block + positions % bs
        self.write_v = self.write_k + self.v_rows

        row_of = list(accumulate(q_lens, initial=0))                       # first row per sequence
        dec = batch.decode_seqs                  # one prompt token is a prefill (batch.py)
        # With the native decode kernel a speculative step's verified chunk is attended as
        # decode rows too, row j over its history and j + 1 new tokens: the bits plain
        # decoding gives those positions (the prefill kernel rounds otherwise)
        chunks = decoded_chunks(batch) if self.kernels is not None else []
        # per decode row: its sequence and how many of the sequence's new tokens it sees
        rows = sorted([(i, 1) for i in dec] + [(i, j + 1) for i in chunks for j in range(q_lens[i])])
        self.has_dec, self.dec_all = bool(rows), len(rows) == row_of[-1]
        self.dec_rows: torch.Tensor | None = None
        self.decoded = set(dec) | set(chunks)
        if rows:
            seqs = [i for i, _ in rows]
            if not self.dec_all:
                self.dec_rows = torch.tensor([row_of[i] + j - 1 for i, j in rows], device=dev)
            nblk = max(len(tables[i]) for i in seqs)
            length = nblk * bs
            dt = table_t[:, :nblk] if self.dec_all and not chunks else table_t[seqs, :nblk]
            lens = torch.tensor([kv_lens[i] - q_lens[i] + j for i, j in rows], device=dev)
            if self.kernels is not None:       # the kernel reads the blocks itself: no gather
                self.dec_tables, self.dec_lens = dt.contiguous(), lens
            else:
                self._plan_gather(dt, lens, length)
        self.prefills: list[_Prefill] = []
        self._plan_prefills(batch, q_lens, row_of, table_t)

    def _plan_gather(self, dt: torch.Tensor, lens: torch.Tensor, length: int) -> None:
        bs, dev, b = self.block_size, self.device, dt.shape[0]
        self.dec_shape = (b, length)
        slot = torch.arange(length, device=dev)
        # Rows of the cache viewed as [*, D] (one per block, K/V, slot, kv head), ordered
        # [Bd, H_kv, L] so the gather lands in the layout the matmuls want (no transpose).
        hkv = self.hkv
        row = dt[:, slot // bs] * self.rows_per_block + slot % bs                   # [Bd, L]
        head = torch.arange(hkv, device=dev)
        self.dec_k = (row[:, None, :] * hkv + head[None, :, None]).reshape(-1)
        self.dec_v = self.dec_k + self.v_rows * hkv
        valid = (slot[None, :] < lens[:, None]).view(b, 1, 1, length)
        self.dec_bias = torch.zeros(valid.shape, device=dev).masked_fill_(~valid, float("-inf"))

    def _plan_prefills(self, batch: ForwardBatch, q_lens: list[int], row_of: list[int],
                       table_t: torch.Tensor) -> None:
        bs, dev = self.block_size, self.device
        for i, n in enumerate(q_lens):
            if i in self.decoded:
                continue
            start = batch.start_pos[i]
            k_rows = mask = None
            if start > 0:     # chunked prefill: attend over the cached history too
                slot = torch.arange(start + n, device=dev)
                k_rows = table_t[i, slot // bs] * self.rows_per_block + slot % bs
                if self.prefill_kernels is None:     # the kernel masks by position itself
                    mask = slot[None, :] <= torch.arange(start, start + n, device=dev)[:, None]
            self.prefills.append(_Prefill(row_of[i], n, start, k_rows, mask))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        flat = kv_layer.view(-1, self.hkv, self.d)
        write_rows(flat, self.write_k, k)
        write_rows(flat, self.write_v, v)
        out = torch.empty_like(q)
        if self.has_dec:
            od = self._decode(q if self.dec_all else q.index_select(0, self.dec_rows), flat, kv_layer)
            if self.dec_all:
                return od
            out.index_copy_(0, self.dec_rows, od)
        for p in self.prefills:   # one call per sequence: compute-bound, the loop is cheap
            if p.k_rows is None:
                ks, vs = k[p.row:p.row + p.n], v[p.row:p.row + p.n]
                if self.fp8:      # what the cache holds, as a later chunk will read it
                    ks, vs = (self.read_kv(quantize_kv(t, kv_layer.dtype)) for t in (ks, vs))
            else:
                ks, vs = (self.read_kv(flat.index_select(0, rows))
                          for rows in (p.k_rows, p.k_rows + self.v_rows))
            if self.prefill_kernels is not None:     # blocked over queries on the packed-block matmul
                out[p.row:p.row + p.n] = self.prefill_kernels.prefill_attn_bf16(q[p.row:p.row + p.n], ks, vs,
                                                                        p.start, self.scale)
                continue
            # Head-major contiguous [1, H, n, D]: CPU flash attention runs faster on it than on
            # strided views, same result bit for bit (2048 tokens, 16/4 heads of 64, 1 Zen4
            # thread: 137 ms a layer with the copies vs 147-164 without).
            qs, ks, vs = (t.transpose(0, 1).contiguous().unsqueeze(0) for t in (q[p.row:p.row + p.n], ks, vs))
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, is_causal=p.mask is None,
                                               scale=self.scale, enable_gqa=True)
            out[p.row:p.row + p.n] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, flat: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """One query per sequence, batched: plain matmuls in the cache dtype (CPU SDPA is slow
        for a single bf16 query row), softmax in fp32, GQA without repeating K/V."""
        if self.kernels is not None:
            return self.kernels.decode_attn_bf16(q, kv_layer, self.dec_tables, self.dec_lens, self.scale)
        b, length = self.dec_shape
        hkv, d = self.hkv, self.d
        rows = flat.view(-1, d)
        kd = self.read_kv(rows.index_select(0, self.dec_k)).view(b, hkv, length, d)
        vd = self.read_kv(rows.index_select(0, self.dec_v)).view(b, hkv, length, d)
        qg = q.view(b, hkv, -1, d)                                              # [B, Hkv, G, D]
        scores = torch.matmul(qg, kd.transpose(-1, -2))                          # [B, Hkv, G, L]
        # bias + scale * scores in fp32 (type promotion) in one op; bias is 0 or -inf, so exact.
        probs = torch.softmax(torch.add(self.dec_bias, scores, alpha=self.scale), dim=-1).to(q.dtype)
        return torch.matmul(probs, vd).view(b, -1, d)                           # [B, Hq, D]
