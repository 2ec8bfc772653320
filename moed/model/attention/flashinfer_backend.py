"""FlashInfer attention (CUDA only) over the shared paged NHD layout.

flashinfer is imported here and nowhere else, so CPU machines never load it. plan() builds
FlashInfer's CSR page table (indptr, indices, last_page_len) once per step and plans the
decode wrapper (every sequence has one new token) or the prefill wrapper (anything else);
forward() appends the new K/V with append_paged_kv_cache, then runs the planned wrapper.
The softmax scale is FlashInfer's default, 1/sqrt(head_dim), as in the HF models.
An fp8 KV cache (moed/model/kv_layout.py): the new K/V are clamped and cast to e4m3 before the
append, the wrappers are planned with kv_data_type float8_e4m3fn and run with k_scale = v_scale
= FP8_KV_SCALE (FlashInfer dequantizes inside the kernel); prefill runs FlashInfer's FA2 kernels
then (its FA3 ones need one dtype for q and KV). Tested on an H200: tests/gpu/.
"""
from __future__ import annotations

import torch

from moed.model.attention.base import AttentionBackend, paging
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kv_layout import FP8_KV_SCALE, KVLayout, is_fp8, quantize_kv
from moed.model.spec import ModelSpec

_WORKSPACE_BYTES = 128 << 20


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, spec: ModelSpec, kv: KVLayout, ctx: ComputeContext) -> None:
        super().__init__(spec, kv, ctx)
        import flashinfer

        self._fi = flashinfer
        ws = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        # FlashInfer's "auto" picks its FA3 (sm90) prefill on Hopper, whose kernels need q and
        # KV of one dtype (0.6.1 fails to build bf16 q over an e4m3 cache); FA2 takes the pair.
        backend = "fa2" if is_fp8(kv.dtype) else "auto"
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        # Tensor-core decode kernels cover the larger GQA group sizes the CUDA-core ones lack.
        group = spec.num_heads // spec.num_kv_heads
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=group > 4)
        self._wrapper = None

    def plan(self, batch: ForwardBatch, positions: torch.Tensor) -> None:
        bs, dev, s = self.block_size, self.device, self.spec
        pg = paging(batch, bs)
        q_lens, kv_lens = pg.q_lens, pg.kv_lens
        pages = [len(t) for t in pg.tables]
        indices = [b for t in pg.tables for b in t]
        i32 = torch.int32
        cum = torch.tensor([0] + pages, dtype=i32).cumsum(0, dtype=i32)
        last = torch.tensor([kv - (n - 1) * bs for kv, n in zip(kv_lens, pages)], dtype=i32)
        self.indptr, self.last_page_len = cum.to(dev), last.to(dev)
        self.indices = torch.tensor(indices, dtype=i32, device=dev)
        self.batch_indices = torch.repeat_interleave(
            torch.arange(len(q_lens), dtype=i32, device=dev), torch.tensor(q_lens, device=dev))
        self.positions = positions.to(i32)
        if batch.is_decode_only:
            self._decode.plan(cum, self.indices, last, s.num_heads, s.num_kv_heads, s.head_dim, bs,
                              pos_encoding_mode="NONE",
                              q_data_type=self.dtype, kv_data_type=self.kv.dtype)
            self._wrapper = self._decode
        else:
            qo = torch.tensor([0] + q_lens, dtype=i32).cumsum(0, dtype=i32)
            self._prefill.plan(qo, cum, self.indices, last, s.num_heads, s.num_kv_heads, s.head_dim, bs,
                               causal=True,
                               q_data_type=self.dtype, kv_data_type=self.kv.dtype)
            self._wrapper = self._prefill

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        k, v = quantize_kv(k.contiguous(), kv_layer.dtype), quantize_kv(v, kv_layer.dtype)
        self._fi.append_paged_kv_cache(k, v, self.batch_indices, self.positions, kv_layer,
                                       self.indices, self.indptr, self.last_page_len, kv_layout="NHD")
        if is_fp8(kv_layer.dtype):
            return self._wrapper.run(q.contiguous(), kv_layer, k_scale=FP8_KV_SCALE, v_scale=FP8_KV_SCALE)
        return self._wrapper.run(q.contiguous(), kv_layer)     # q may be a view of the fused q|k
