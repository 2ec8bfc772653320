"""Reference MLA attention on plain torch (CPU or any device), over the mla KVLayout.

The layer's cache [num_blocks, bs, r + rope] is viewed as rows [num_blocks * bs, r + rope]
(slot s of block b at row b * bs + s); plan() turns block tables into those row indices once per
step. forward_mla writes the new tokens' [c_kv | k_rope] with one index_copy_, then:
  decode rows: batched, absorbed form over their gathered latent rows with a length mask (no
    per-head K/V): a decode sequence's one new token, and each token of a short chunk of
    decoded tokens after a history (a speculative step's known token and drafts, at most
    ABSORBED_CHUNK), each row over its own history: verified as plain decoding computes those
    positions (bf16: bitwise its logits), and at batch 16 on the demo model a step verifying
    one draft a row costs 16 ms instead of 32 (the expanded form re-expanded every history
    per sequence: 16 rows x 2 tokens cost more than 32 decode rows)
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
from moed.model.attention.base import paging
from moed.model.batch import ForwardBatch
from moed.model.kv_layout import is_fp8, quantize_kv, write_rows


@dataclass
class _Prefill:
    row: int                          # first of this sequence's rows in the new tokens
    n: int                            # new tokens
    rows: torch.Tensor | None         # cache rows of the whole history (None: start == 0)
    mask: torch.Tensor | None         # [n, start + n] bool (None: plain causal)


# the longest chunk of decoded tokens whose rows take the absorbed form: a speculative step's
# known token and up to 8 drafts (speculative.num_speculative_tokens <= 8)
ABSORBED_CHUNK = 9


class TorchMLABackend(mla.MLABackend):
    name = "torch"

    def plan(self, batch: ForwardBatch, positions: torch.Tensor) -> None:
        bs, dev = self.block_size, self.device
        pg = paging(batch, bs)
        q_lens, kv_lens, tables = pg.q_lens, pg.kv_lens, pg.tables
        table_t = pg.table_tensor(dev)
        self.write = pg.token_blocks(table_t, positions, bs) * bs + positions % bs
        row_of = list(accumulate(q_lens, initial=0))
        # the absorbed form's query rows: a decode token's (one prompt token is a prefill,
        # batch.py) and each token of a short chunk of decoded tokens after its history (a
        # speculative step's known token and drafts: verified as decode rows, as plain decoding
        # computes those positions), each over its own history
        dec = set(batch.decode_seqs)
        qseq, qrow, qlen = [], [], []
        for i, n in enumerate(q_lens):
            if i in dec or (n <= ABSORBED_CHUNK and batch.start_pos[i] > 0
                            and not (batch.prompt and batch.prompt[i])):
                dec.add(i)
                qseq.extend([i] * n)
                qrow.extend(range(row_of[i], row_of[i] + n))
                qlen.extend(range(kv_lens[i] - n + 1, kv_lens[i] + 1))
        self.dec_all = len(qrow) == row_of[-1]
        self.dec_rows = torch.tensor(qrow, dtype=torch.long, device=dev) if qrow else None
        if qrow:
            length = max(len(tables[i]) for i in dec) * bs
            slot = torch.arange(length, device=dev)
            dt = table_t[qseq, :length // bs]
            self.dec_gather = (dt[:, slot // bs] * bs + slot % bs).reshape(-1)          # [Q * L]
            lens = torch.tensor(qlen, device=dev)
            valid = (slot[None, :] < lens[:, None]).unsqueeze(1)                          # [Q, 1, L]
            self.dec_bias = torch.zeros(valid.shape, device=dev).masked_fill_(~valid, float("-inf"))
            self.dec_shape = (len(qrow), length)
        self.prefills: list[_Prefill] = []
        for i, n in enumerate(q_lens):
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
        if self.dec_rows is not None:
            b, length = self.dec_shape
            latent = self.read_kv(flat.index_select(0, self.dec_gather)).view(b, length, -1)
            qn, qr = (q_nope, q_rope) if self.dec_all else \
                (q_nope.index_select(0, self.dec_rows), q_rope.index_select(0, self.dec_rows))
            od = mla.absorbed(qn, qr, latent, self.dec_bias, w_uk if w_uk_abs is None else w_uk_abs,
                              w_uv if w_uv_abs is None else w_uv_abs, self.scale)
            if self.dec_all:
                return od
            out.index_copy_(0, self.dec_rows, od)
        for p in self.prefills:    # one call per sequence: compute-bound, the loop is cheap
            sl = slice(p.row, p.row + p.n)
            latent = new[sl] if p.rows is None else self.read_kv(flat.index_select(0, p.rows))
            out[sl] = mla.expanded(q_nope[sl], q_rope[sl], latent, w_uk, w_uv, self.scale, p.mask, kv_b)
        return out
