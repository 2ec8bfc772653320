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


def resolve(name: str, device: torch.device) -> str:
    """"auto" = flashinfer on CUDA when it is importable, else torch."""
    if name != "auto":
        return name
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "torch"


def get_backend(name: str, spec: ModelSpec, kv: KVLayout, ctx: ComputeContext) -> AttentionBackend:
    name = resolve(name, ctx.device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected auto, {', '.join(BACKENDS)}")
    if name == "flashinfer" and ctx.device.type != "cuda":
        raise ValueError("attention backend 'flashinfer' needs a CUDA device")
    module, cls = (MLA_BACKENDS if kv.kind == "mla" else BACKENDS)[name].split(":")
    return getattr(importlib.import_module(module), cls)(spec, kv, ctx)
