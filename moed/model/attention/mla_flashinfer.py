"""FlashInfer MLA attention (CUDA only) over the mla KVLayout, absorbed form for every token.

flashinfer is imported here and nowhere else, so CPU machines never load it. The layer's cache
[num_blocks, bs, r + rope] is handed to FlashInfer's paged MLA kernel
(`flashinfer.mla.BatchMLAPagedAttentionWrapper`) as two views, ckv = [..., :r] and
kpe = [..., r:] (pages of page_size = block_size tokens). plan() builds the CSR page table
(qo_indptr, kv_indptr, kv_indices, kv_len_arr) once per step and plans the wrapper, causal, so
chunked prefill and prefix hits (queries at the end of their sequence's KV) work as decode does;
forward_mla writes the new [c_kv | k_rope] rows, projects q_nope into the latent space with W_uk,
runs the kernel (output in the latent space) and projects back with W_uv. Served for
DeepSeek-V3's sizes (r 512, rope 64) over a 16-bit cache only: FlashInfer 0.6.1's kernels fail
otherwise (registry.flashinfer_refusal: `auto` takes the torch MLA backend for such a model, and
naming flashinfer is refused). Tested on an H200: tests/gpu/test_flashinfer_mla.py.
"""
from __future__ import annotations

import torch

from moed.model.attention import mla
from moed.model.attention.base import paging
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kv_layout import KVLayout, write_rows
from moed.model.spec import ModelSpec

_WORKSPACE_BYTES = 128 << 20


class FlashInferMLABackend(mla.MLABackend):
    name = "flashinfer"

    def __init__(self, spec: ModelSpec, kv: KVLayout, ctx: ComputeContext) -> None:
        super().__init__(spec, kv, ctx)
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        ws = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self._wrapper = BatchMLAPagedAttentionWrapper(ws)     # sizes and dtype: registry.py

    def plan(self, batch: ForwardBatch, positions: torch.Tensor) -> None:
        bs, dev, s = self.block_size, self.device, self.spec
        pg = paging(batch, bs)
        q_lens, kv_lens = pg.q_lens, pg.kv_lens
        pages = [len(t) for t in pg.tables]
        indices = [b for t in pg.tables for b in t]
        i32 = torch.int32
        qo = torch.tensor([0] + q_lens, dtype=i32).cumsum(0, dtype=i32)
        kv_indptr = torch.tensor([0] + pages, dtype=i32).cumsum(0, dtype=i32)
        kv_indices = torch.tensor(indices, dtype=i32)
        self._wrapper.plan(qo.to(dev), kv_indptr.to(dev), kv_indices.to(dev),
                           torch.tensor(kv_lens, dtype=i32, device=dev), s.num_heads, self.rank,
                           s.qk_rope_head_dim, bs, True, self.scale, self.dtype, self.kv.dtype)
        # cache rows of the new tokens: block * bs + slot, as the torch MLA backend writes them
        self.write = pg.token_blocks(pg.table_tensor(dev), positions, bs) * bs + positions % bs

    def forward_mla(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor,
                    k_rope: torch.Tensor, kv_layer: torch.Tensor, w_uk: torch.Tensor,
                    w_uv: torch.Tensor, w_uk_abs: torch.Tensor | None = None,
                    w_uv_abs: torch.Tensor | None = None, kv_b: mla.Linear | None = None) -> torch.Tensor:
        write_rows(kv_layer.view(-1, kv_layer.shape[-1]), self.write, torch.cat((c_kv, k_rope), dim=-1))
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk).contiguous()              # [T, H, r]
        o_lat = self._wrapper.run(q_lat, q_rope.contiguous(), kv_layer[..., :self.rank], kv_layer[..., self.rank:])
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)
