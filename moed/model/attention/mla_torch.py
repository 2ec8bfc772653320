"""Reference MLA attention on plain torch (CPU or any device), over the mla KVLayout.

The layer's cache [num_blocks, bs, r + rope] is viewed as rows [num_blocks * bs, r + rope]
(slot s of block b at row b * bs + s); plan() turns block tables into those row indices once per
step. forward_mla writes the new tokens' [c_kv | k_rope] with one index_copy_, then:
  absorbed rows: a decode sequence's one new token, and each token of a short chunk of decoded
    tokens after a history (a speculative step's known token and drafts, at most
    ABSORBED_CHUNK), each row over its own causal history, so a verified position is computed
    as plain decoding computes it.
    bf16 on CPU over a bf16 cache with the native kernels (ComputeContext.kernels): all of
    them, a lone chunk too, in one native call per layer (kernels/cpu_mla.c: reads the cache
    through the block tables, a row's bits depend only on its query and its own history, not
    on its company, the thread count or the variant; demo model, 150-token histories, 1
    Ice Lake thread, two runs at load 3-4.5: 44-84 us a layer for one decode row against
    239-296 for the torch absorbed form, 94-104 against 371-589 (absorbed) and 453-526
    (expanded) for a lone 5-row chunk, 185-191 against 521-537 for 16 decode rows, 357-427
    against 691-707 for 16 x 2-row chunks).
    Otherwise (fp32, float16, an fp8 cache, CUDA) batched in torch, the absorbed form over
    their gathered latent rows with a length mask, the history read once per sequence, in a
    step of ABSORBED_MIN_SEQS such sequences or more (a lone chunk takes the expanded form):
    at batch 16 on the demo model a step verifying one draft a row costs 13 ms instead of 25
    (the expanded form re-expanded every history per sequence)
  prefill / chunked prompt sequences: one expanded-form SDPA call each (causal, offset by the
    tokens already cached; the history is read back from the cache)
An fp8 cache (moed/model/kv_layout.py) is written through quantize_kv and read through
dequantize_kv; a fresh prompt attends over its latent rounded the same way (chunked = at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from moed.model.attention import mla
from moed.model.attention.base import DECODED_CHUNK, decoded_chunks, paging
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kernels import CpuKernels
from moed.model.kernels.mla import mla_decode_bf16
from moed.model.kv_layout import KVLayout, is_fp8, quantize_kv, write_rows
from moed.model.spec import ModelSpec


@dataclass
class _Prefill:
    row: int                          # first of this sequence's rows in the new tokens
    n: int                            # new tokens
    rows: torch.Tensor | None         # cache rows of the whole history (None: start == 0)
    mask: torch.Tensor | None         # [n, start + n] bool (None: plain causal)


# the longest chunk of decoded tokens whose rows take the absorbed form (base.decoded_chunks)
ABSORBED_CHUNK = DECODED_CHUNK
# ... on the torch path (not the native kernel's), when the absorbed form has this many
# sequences at least: a lone chunk keeps the expanded form (one call either way, and on the
# demo model's sizes the expanded one is ~12% cheaper for 5 tokens: CPU bf16 batched matmuls of
# these shapes take a slow path); from two sequences the one batched call wins (demo, bf16, a
# 150-token history, whole step: 2 x 5 tokens 12.7 ms vs 12.8, 4 x 5 14.7 vs 18.0, 16 x 2 13.4
# vs 24.6)
ABSORBED_MIN_SEQS = 2


class TorchMLABackend(mla.MLABackend):
    name = "torch"

    def __init__(self, spec: ModelSpec, kv: KVLayout, ctx: ComputeContext) -> None:
        super().__init__(spec, kv, ctx)
        # the native absorbed kernel (kernels/cpu_mla.c): bf16 on CPU over a bf16 cache
        self.kernels: CpuKernels | None = ctx.kernels if ctx.device.type == "cpu" and \
            ctx.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 else None
        if ctx.batch_invariant and ctx.dtype == torch.bfloat16 and self.kernels is None:
            # the torch path pads every history to the longest, and a lone chunk takes the
            # expanded form: a row's bits would depend on its company
            raise ValueError(f"model.batch_invariant in bf16 needs the native MLA attention "
                             f"kernel (a bf16 KV cache; this one: {kv.dtype_name})")

    def plan(self, batch: ForwardBatch, positions: torch.Tensor) -> None:
        bs, dev = self.block_size, self.device
        pg = paging(batch, bs)
        q_lens, kv_lens, tables = pg.q_lens, pg.kv_lens, pg.tables
        table_t = pg.table_tensor(dev)
        self.write = pg.token_blocks(table_t, positions, bs) * bs + positions % bs
        row_of = list(accumulate(q_lens, initial=0))
        self.native: tuple[torch.Tensor, ...] | None = None
        # the absorbed form's sequences: a decode token's (one prompt token is a prefill,
        # batch.py) and a short chunk of decoded tokens after its history (a speculative step's
        # known token and drafts: verified as decode rows, as plain decoding computes those
        # positions), m queries each (the longest chunk's; a shorter one repeats its last row,
        # whose extra outputs are dropped), each query over its own history
        short = decoded_chunks(batch)
        if self.kernels is not None:       # every such row, a lone chunk too: one native call
            dec = sorted(set(batch.decode_seqs) | set(short))
            self._plan_native(dec, q_lens, kv_lens, row_of, table_t)
            self._plan_prefills(batch, set(dec), row_of, table_t)
            return
        dec = sorted(set(batch.decode_seqs) | set(short)) \
            if len(batch.decode_seqs) + len(short) >= ABSORBED_MIN_SEQS else batch.decode_seqs
        self.dec_m = m = max((q_lens[i] for i in dec), default=1)
        qrow = [row_of[i] + j for i in dec for j in range(q_lens[i])]
        self.dec_all = len(qrow) == row_of[-1]
        self.dec_rows = torch.tensor(qrow, dtype=torch.long, device=dev) if dec else None
        if dec:
            length = max(len(tables[i]) for i in dec) * bs
            slot = torch.arange(length, device=dev)
            dt = table_t[dec, :length // bs]
            self.dec_gather = (dt[:, slot // bs] * bs + slot % bs).reshape(-1)          # [Bd * L]
            last = [min(j, q_lens[i] - 1) for i in dec for j in range(m)]
            lens = torch.tensor([kv_lens[i] - q_lens[i] + 1 + last[k * m + j]
                                 for k, i in enumerate(dec) for j in range(m)], device=dev)
            valid = (slot[None, :] < lens[:, None]).view(len(dec), m, 1, length)      # [Bd, m, 1, L]
            if m == 1:
                valid = valid.squeeze(1)                                              # [Bd, 1, L]
            else:   # index tensors, None where they are the identity (every chunk m long)
                qi = [row_of[i] + last[k * m + j] for k, i in enumerate(dec) for j in range(m)]
                keep = [k * m + j for k, i in enumerate(dec) for j in range(q_lens[i])]
                self.dec_q = None if qi == list(range(len(qi))) and self.dec_all \
                    else torch.tensor(qi, device=dev)
                self.dec_keep = None if len(keep) == len(qi) else torch.tensor(keep, device=dev)
            self.dec_bias = torch.zeros(valid.shape, device=dev).masked_fill_(~valid, float("-inf"))
            self.dec_shape = (len(dec), length)
        self._plan_prefills(batch, set(dec), row_of, table_t)

    def _plan_native(self, dec: list[int], q_lens: list[int], kv_lens: list[int], row_of: list[int],
                     table_t: torch.Tensor) -> None:
        """The native call's arguments: per absorbed row its token row, its sequence (a row of
        the tables) and its own causal length (a chunk's row j: history + j + 1)."""
        self.dec_rows = None
        if not dec:
            return
        dev, seq_rows = self.device, [(k, i, j) for k, i in enumerate(dec) for j in range(q_lens[i])]
        nblk = -(-max(kv_lens[i] for i in dec) // self.block_size)
        self.native = (table_t[dec, :nblk].contiguous(),
                       torch.tensor([row_of[i] + j for _, i, j in seq_rows], device=dev),
                       torch.tensor([k for k, _, _ in seq_rows], device=dev),
                       torch.tensor([kv_lens[i] - q_lens[i] + 1 + j for _, i, j in seq_rows], device=dev))

    def _plan_prefills(self, batch: ForwardBatch, dec: set[int], row_of: list[int],
                       table_t: torch.Tensor) -> None:
        bs, dev = self.block_size, self.device
        self.prefills: list[_Prefill] = []
        for i, n in enumerate(len(t) for t in batch.token_ids):
            if i in dec:
                continue
            start, rows, mask = batch.start_pos[i], None, None
            if start > 0:      # chunked prefill / prefix hit: attend over the cached history too
                slot = torch.arange(start + n, device=dev)
                rows = table_t[i, slot // bs] * bs + slot % bs
                mask = slot[None, :] <= torch.arange(start, start + n, device=dev)[:, None]
            self.prefills.append(_Prefill(row_of[i], n, rows, mask))

    def forward_mla(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor,
                    k_rope: torch.Tensor, kv_layer: torch.Tensor, w_uk: torch.Tensor,
                    w_uv: torch.Tensor, w_uk_abs: torch.Tensor | None = None,
                    w_uv_abs: torch.Tensor | None = None, kv_b: mla.Linear | None = None) -> torch.Tensor:
        flat = kv_layer.view(-1, kv_layer.shape[-1])
        new = torch.cat((c_kv, k_rope), dim=-1)                                  # [T, r + rope]
        write_rows(flat, self.write, new)
        if is_fp8(flat.dtype):     # a fresh prompt reads what the cache holds, as chunks do
            new = self.read_kv(quantize_kv(new, flat.dtype))
        t, h = q_nope.shape[0], q_nope.shape[1]
        out = torch.empty((t, h, w_uv.shape[1]), dtype=q_nope.dtype, device=q_nope.device)
        if self.native is not None:
            uk = w_uk_abs if w_uk_abs is not None and w_uk_abs.dtype == torch.float32 else w_uk.float()
            uv = w_uv_abs if w_uv_abs is not None and w_uv_abs.dtype == torch.float32 else w_uv.float()
            tables, rows, seqs, lens = self.native
            mla_decode_bf16(self.kernels, q_nope, q_rope, kv_layer, tables, rows, seqs, lens, uk, uv,
                            self.scale, out)
        elif self.dec_rows is not None:
            b, length = self.dec_shape
            latent = self.read_kv(flat.index_select(0, self.dec_gather)).view(b, length, -1)
            uk, uv = w_uk if w_uk_abs is None else w_uk_abs, w_uv if w_uv_abs is None else w_uv_abs
            if self.dec_m == 1:
                qn, qr = (q_nope, q_rope) if self.dec_all else \
                    (q_nope.index_select(0, self.dec_rows), q_rope.index_select(0, self.dec_rows))
                od = mla.absorbed(qn, qr, latent, self.dec_bias, uk, uv, self.scale)
            else:
                m, qi = self.dec_m, self.dec_q
                qn = (q_nope if qi is None else q_nope.index_select(0, qi)).view(b, m, h, -1)
                qr = (q_rope if qi is None else q_rope.index_select(0, qi)).view(b, m, h, -1)
                od = mla.absorbed_chunks(qn, qr, latent, self.dec_bias, uk, uv, self.scale)
                od = od.reshape(b * m, h, -1)
                if self.dec_keep is not None:
                    od = od.index_select(0, self.dec_keep)
            if self.dec_all:
                return od
            out.index_copy_(0, self.dec_rows, od)
        for p in self.prefills:    # one call per sequence: compute-bound, the loop is cheap
            sl = slice(p.row, p.row + p.n)
            latent = new[sl] if p.rows is None else self.read_kv(flat.index_select(0, p.rows))
            out[sl] = mla.expanded(q_nope[sl], q_rope[sl], latent, w_uk, w_uv, self.scale, p.mask, kv_b)
        return out
