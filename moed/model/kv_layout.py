"""KVLayout: what one token's KV entry is, and from it the paged KV tensor's shape and size.

The KV cache is one tensor `[num_layers, num_blocks, *block_shape]`, so a block of one layer
is one contiguous run of `block_bytes`: transfer and tiering work on block ids and byte ranges
and never look inside. Kinds of entry (per token, per layer):

  gqa  K and V apart: entry [2, num_kv_heads, head_dim]; a block is [2, block_size, H_kv, D]
       with K at [0] and V at [1] (FlashInfer's paged NHD layout). Qwen3-MoE, Mixtral.
  mla  one latent vector, no separate V (DeepSeek-V3: kv_lora_rank + qk_rope_head_dim = 576):
       entry [latent] = c_kv (the normed compressed KV, kv_lora_rank) then the rotated shared
       key k_rope (rope_dim); a block is [block_size, latent]. Served by archs/deepseek_v3.py
       with the attention in moed/model/attention/mla*.py.

The KV dtype is the model's (engine.kv_cache_dtype = auto) or float8 e4m3 (fp8): one byte an
element, so a block is half of bf16's (a quarter of fp32's) and the same MB hold twice the
blocks. Scale: one fixed scale per layer for K and V alike, 1.0 (vLLM's default k_scale = v_scale
= 1.0 for a checkpoint without scales): values are clamped to e4m3's +-448 and rounded to 3
mantissa bits on write (quantize_kv) and cast back to the compute dtype on read (dequantize_kv).
A fixed scale keeps a block raw bytes with no side data: transfer, the tiers and the layout id
need nothing beyond the dtype. (A per-block dynamic scale would be more accurate for small
values, but the scale would have to travel inside each block.)

Everything that sizes, allocates, registers or compares the KV tensor reads it from here (the
architecture module says which layout its model has); nothing else assumes 2 x H_kv x D.
`layout_id` hashes only arch-independent facts (kind, entry shape, dtype, block size, layers):
two nodes with equal ids can read each other's KV blocks byte for byte.

A runner that serves DeepSeek-V3's MTP layer (moed/model/mtp.py) has one more layer, last in the
tensor, with the same entry and block tables (`with_mtp`); `mtp_layers` says so and is in the
layout id, so a node without that layer never pairs with one that has it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch

KINDS = ("gqa", "mla")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                 # e4m3fn's largest finite value
FP8_KV_SCALE = 1.0              # per layer, K and V: stored = clamp(x / scale), read = stored * scale


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """engine.kv_cache_dtype -> the KV tensor's dtype ("auto": the model's own)."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8
    raise ValueError(f"KV cache dtype {name!r}: expected auto, fp8 or fp8_e4m3")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: unchanged for a cache of x's dtype, clamped and cast for fp8
    (a plain cast would turn anything past +-448 into NaN)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    if FP8_KV_SCALE != 1.0:
        x = x / FP8_KV_SCALE
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached values in the compute dtype."""
    if not is_fp8(x.dtype):
        return x if x.dtype == dtype else x.to(dtype)
    y = x.to(dtype)
    return y * FP8_KV_SCALE if FP8_KV_SCALE != 1.0 else y


def write_rows(flat: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """flat.index_copy_(0, index, rows) in the cache's dtype; fp8 goes through a uint8 view
    (torch has no CPU index_copy_ for float8: the bytes are the same)."""
    rows = quantize_kv(rows, flat.dtype)
    if is_fp8(flat.dtype):
        flat.view(torch.uint8).index_copy_(0, index, rows.view(torch.uint8))
    else:
        flat.index_copy_(0, index, rows)


@dataclass(frozen=True)
class KVLayout:
    kind: str                       # "gqa" | "mla"
    entry_shape: tuple[int, ...]    # one token in one layer: (2, H_kv, D) | (latent,)
    dtype: torch.dtype
    block_size: int                 # tokens per block
    num_layers: int
    rope_dim: int = 0               # mla: the trailing k_rope part of the entry (0 for gqa)
    mtp_layers: int = 0             # of num_layers, the trailing ones that are MTP layers'

    @property
    def latent_rank(self) -> int:
        """mla: c_kv's width (the entry minus the rotary key)."""
        return self.entry_shape[0] - self.rope_dim if self.kind == "mla" else 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV layout kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.block_size < 1 or self.num_layers < 1 or not self.entry_shape or min(self.entry_shape) < 1:
            raise ValueError(f"empty KV layout: {self}")
        if self.kind == "gqa" and (len(self.entry_shape) != 3 or self.entry_shape[0] != 2):
            raise ValueError(f"a gqa entry is (2, num_kv_heads, head_dim), got {self.entry_shape}")
        if self.kind == "mla" and len(self.entry_shape) != 1:
            raise ValueError(f"an mla entry is one latent vector (latent,), got {self.entry_shape}")
        if self.rope_dim < 0 or (self.kind == "gqa" and self.rope_dim) or \
                (self.kind == "mla" and self.rope_dim >= self.entry_shape[0]):
            raise ValueError(f"rope_dim {self.rope_dim} does not fit a {self.kind} entry {self.entry_shape}")
        if not 0 <= self.mtp_layers < self.num_layers:
            raise ValueError(f"mtp_layers {self.mtp_layers} of {self.num_layers} layers")

    @classmethod
    def gqa(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
            dtype: torch.dtype) -> KVLayout:
        return cls("gqa", (2, num_kv_heads, head_dim), dtype, block_size, num_layers)

    @classmethod
    def mla(cls, num_layers: int, latent_dim: int, block_size: int, dtype: torch.dtype,
            rope_dim: int = 0) -> KVLayout:
        """latent_dim: kv_lora_rank + the rope part of the key (DeepSeek-V3: 512 + 64);
        rope_dim: that rope part (0: unsaid, for sizing only)."""
        return cls("mla", (latent_dim,), dtype, block_size, num_layers, rope_dim)

    def with_mtp(self, n: int) -> KVLayout:
        """This layout plus n MTP layers after the model's (0: unchanged)."""
        if n == 0:
            return self
        if self.mtp_layers:
            raise ValueError("this KV layout has its MTP layers already")
        return dataclasses.replace(self, num_layers=self.num_layers + n, mtp_layers=n)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of one layer. gqa puts the K/V plane outermost, so each plane of a block
        is contiguous (what FlashInfer's NHD pages and the CPU decode kernel read)."""
        if self.kind == "gqa":
            return (self.entry_shape[0], self.block_size, *self.entry_shape[1:])
        return (self.block_size, *self.entry_shape)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        """The whole KV tensor for num_blocks blocks."""
        return (self.num_layers, num_blocks, *self.block_shape)

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """One block in one layer (the unit transfer moves)."""
        return self.block_size * math.prod(self.entry_shape) * self.elem_bytes

    @property
    def bytes_per_block(self) -> int:
        """One block across all layers (what a block costs the memory budget)."""
        return self.num_layers * self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        """One token's KV across all layers (what --kv-cache-dtype fp8 halves from bf16)."""
        return self.num_layers * math.prod(self.entry_shape) * self.elem_bytes

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def block_format(self) -> str:
        """dtype and block shape, e.g. "bfloat16:2x16x4x128" (the string RegionLayout has always
        carried, so peers of the previous release still compare equal)."""
        return f"{self.dtype_name}:{'x'.join(map(str, self.block_shape))}"

    @property
    def layout_id(self) -> str:
        """Stable across processes and releases: a hash of the facts, never Python's hash()."""
        facts = (f"{self.kind}|{'x'.join(map(str, self.entry_shape))}|{self.dtype_name}|"
                 f"bs{self.block_size}|l{self.num_layers}")
        if self.rope_dim:       # where c_kv ends is part of the meaning (gqa ids unchanged)
            facts += f"|r{self.rope_dim}"
        if self.mtp_layers:     # the last layers are the MTP's: never a plain model's
            facts += f"|mtp{self.mtp_layers}"
        return f"{self.kind}-{hashlib.sha256(facts.encode()).hexdigest()[:12]}"

    def allocate(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        """The zeroed KV tensor (dense: block b of layer l at (l * num_blocks + b) * block_bytes)."""
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        return torch.zeros(self.shape(num_blocks), dtype=self.dtype, device=device)
