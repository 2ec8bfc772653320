"""Attention backends by name, imported only when chosen (CPU machines never import CUDA packages)."""
from __future__ import annotations

import importlib
import importlib.util

import torch

from moed.model.attention.base import AttentionBackend
from moed.model.context import ComputeContext
from moed.model.kv_layout import KVLayout
from moed.model.spec import ModelSpec

BACKENDS: dict[str, str] = {
    "torch": "moed.model.attention.torch_backend:TorchBackend",
    "flashinfer": "moed.model.attention.flashinfer_backend:FlashInferBackend",
}
# The same names for the mla KVLayout (DeepSeek-V3's latent cache): its own implementations.
MLA_BACKENDS: dict[str, str] = {
    "torch": "moed.model.attention.mla_torch:TorchMLABackend",
    "flashinfer": "moed.model.attention.mla_flashinfer:FlashInferMLABackend",
}


# FlashInfer's paged MLA kernels (0.6.1, seen on an H200) are built for DeepSeek-V3's sizes only
# (latent 512, rope 64; other sizes built but failed at run time) and for a 16-bit cache only
# (an e4m3 cache fails to build: "DType must be 16bit").
FLASHINFER_MLA_SIZES = (512, 64)


def flashinfer_refusal(spec: ModelSpec, kv: KVLayout) -> str | None:
    """Why FlashInfer cannot serve this model's attention (None: it can)."""
    if kv.kind != "mla":
        return None
    if (spec.kv_lora_rank, spec.qk_rope_head_dim) != FLASHINFER_MLA_SIZES:
        return (f"FlashInfer's MLA kernels take kv_lora_rank 512 and qk_rope_head_dim 64 only; this "
                f"model has {spec.kv_lora_rank} and {spec.qk_rope_head_dim}")
    if kv.dtype.itemsize != 2:
        return "FlashInfer's MLA kernels take a 16-bit KV cache only, not kv_cache_dtype fp8"
    return None


def resolve(name: str, device: torch.device, spec: ModelSpec | None = None,
            kv: KVLayout | None = None) -> str:
    """"auto" = flashinfer on CUDA when it is importable and serves this model, else torch."""
    if name != "auto":
        return name
    if device.type != "cuda" or importlib.util.find_spec("flashinfer") is None:
        return "torch"
    if spec is not None and kv is not None and flashinfer_refusal(spec, kv):
        return "torch"
    return "flashinfer"


def get_backend(name: str, spec: ModelSpec, kv: KVLayout, ctx: ComputeContext) -> AttentionBackend:
    name = resolve(name, ctx.device, spec, kv)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected auto, {', '.join(BACKENDS)}")
    if name == "flashinfer" and ctx.device.type != "cuda":
        raise ValueError("attention backend 'flashinfer' needs a CUDA device")
    if name == "flashinfer" and (why := flashinfer_refusal(spec, kv)):
        raise ValueError(f"attention backend 'flashinfer': {why}; use attention backend torch or auto")
    module, cls = (MLA_BACKENDS if kv.kind == "mla" else BACKENDS)[name].split(":")
    return getattr(importlib.import_module(module), cls)(spec, kv, ctx)
