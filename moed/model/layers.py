"""Dense building blocks: RMSNorm, HF-compatible rotary embedding, GQA attention block.

Numerics follow transformers' Qwen3-MoE/Mixtral code (norm in fp32 then cast back, cos/sin
computed in fp32 and cast to the activation dtype, rotate_half convention) so fp32 logits
match the oracle to ~1e-5.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from moed.model.attention.base import AttentionBackend
from moed.model.context import ComputeContext
from moed.model.kernels import CpuKernels
from moed.model.kernels.choice import ONEDNN_ROWS_HINT, LinearChoice, NativeOnly
from moed.model.kernels.quant import MAX_ROWS as QUANT_MAX_ROWS
from moed.model.kernels.quant import blocked_unserved as quant_blocked_unserved
from moed.model.kernels.quant import qlinear as quant_linear
from moed.model.kernels.quant import qlinear_blocked as quant_linear_blocked
from moed.model.kernels.quant import unserved as quant_unserved
from moed.model.quant.linear import qlinear
from moed.model.quant.weight import QuantWeight
from moed.model.spec import ModelSpec


class Linear:
    """y = x W^T (+ b), with a CPU bf16 fast path chosen at load time.

    - With the native kernels (moed/model/kernels, AVX2 or AVX512 CPUs): the weight is repacked
      once into the kernels' layout, which replaces the plain weight. Which kernel serves a row
      count is measured per weight shape and row class at load (kernels/choice.py): the native
      one wins 1-16 rows everywhere (1.2-1.7x oneDNN on Zen4); where oneDNN wins a class by a
      margin (many rows on an AMX CPU) a oneDNN-packed copy is kept beside it for that class.
    - Else on CPU bf16 the weight is also repacked for oneDNN (kept beside the plain one), and
      1 row (2 for weights up to 2 MB) skips oneDNN: torch's own bf16 gemv streams the plain
      weight at full bandwidth with ~4 us of call overhead, where oneDNN reaches ~2/3 of it and
      spends ~14 us per call on setup (measured: [1024,1024] weight, 2 threads, 72 vs 101 us).
    - Else (fp32, GPU) plain F.linear.
    - A quantized weight (moed/model/quant) with the kernels (ctx.for_weight gives them in fp32
      too): the native quantized matmul (kernels/quant.py, dequantized in registers, never
      repacked) for up to qrows rows; more bf16 rows (prefill) the blocked kernel (each weight
      block dequantized once per call to bf16, the reference's numerics); fp32 past qrows, or no
      kernels, the reference path, dequantized per call (quant/linear.py). `qpath` says which
      serves the few-row calls, for model_runner_ready."""

    __slots__ = ("weight", "bias", "packed", "gemv_rows", "kernels", "kpacked", "out_features", "choice",
                 "quant", "qbias", "qrows", "qblocked", "qpath")

    def __init__(self, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None, pack: bool = False,
                 kernels: CpuKernels | None = None, kpacked: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]
        self.quant = weight if isinstance(weight, QuantWeight) else None
        if self.quant is not None:
            self.kpacked = self.packed = self.choice = None
            self.gemv_rows = 0
            why = "no native CPU kernels" if kernels is None else quant_unserved(self.quant)
            self.kernels = None if why else kernels
            self.qpath = f"reference ({why})" if why else "native"
            # the kernel adds the bias in fp32; every row count native under batch invariance
            self.qbias = None if bias is None or why else bias.float().contiguous()
            self.qrows = 0 if why else (1 << 62) if isinstance(kernels.choose, NativeOnly) else QUANT_MAX_ROWS
            # bf16 rows past qrows (prefill): each weight block dequantized once into the bf16
            # kernel's packed layout, the reference path's numerics (kernels/quant.py)
            self.qblocked = 0 < self.qrows == QUANT_MAX_ROWS and not quant_blocked_unserved(self.quant)
            return
        self.qblocked = False
        self.kernels = kernels if kernels is not None and weight.shape[1] % 2 == 0 else None
        self.kpacked = self.packed = None
        self.choice: LinearChoice | None = None     # kernels only: oneDNN for some row classes
        # 2 rows cost the gemv twice its 1-row time; oneDNN's fixed cost amortises on big
        # weights: 2-row gemv wins up to ~2 MB bf16 (experts), loses above (attention, lm_head).
        self.gemv_rows = 2 if weight.numel() <= GEMV_2ROW_MAX_NUMEL else 1
        if self.kernels is not None:
            self.kpacked = kpacked if kpacked is not None else self.kernels.pack(weight)
            # no oneDNN bf16 here (pack False): nothing to race, the native kernel serves all rows
            choice = self.kernels.choose(*weight.shape) if pack else None
            if choice is not None and choice.any_onednn:
                self.choice = choice
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT)
            self.weight = None          # the packed copies are the only ones read
        elif pack:
            # Packed for 8-row inputs (oneDNN picks the layout by expected rows; 1-2 rows never
            # get here): -2% decode step at batch 8 and 32 vs a 1-row layout, prefill no slower.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT)

    def uses_onednn(self, rows: int) -> bool:
        """Whether a call with this many rows reads the oneDNN-packed copy."""
        if self.packed is None:
            return False
        if self.kpacked is not None:
            return self.choice is not None and self.choice.use_onednn(rows)
        return rows > self.gemv_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kpacked is not None:
            if self.choice is None or not self.choice.use_onednn(x.shape[0]):
                return self.kernels.linear_bf16(x, self.kpacked, self.out_features, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.packed is None:
            if self.quant is not None:
                if x.shape[0] <= self.qrows and x.dim() == 2 and x.dtype in _QUANT_DTYPES and not x.is_cuda:
                    return quant_linear(self.kernels, x, self.quant, self.qbias)
                if self.qblocked and x.dim() == 2 and x.dtype == torch.bfloat16 and not x.is_cuda:
                    return quant_linear_blocked(self.kernels, x, self.quant, self.qbias)
                if x.shape[0] <= 2 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
                    # the dequantized matrix through ATen's bf16 gemv, as plain weights (gemv)
                    return gemv(x, self.quant.dequantize(x.dtype), self.bias)
                return qlinear(x, self.quant, self.bias)
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] <= self.gemv_rows:
            return gemv(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


GEMV_2ROW_MAX_NUMEL = 1 << 20
_QUANT_DTYPES = (torch.bfloat16, torch.float32)


def quant_paths(root: object) -> dict[str, int]:
    """How many quantized Linears under `root` (a model) take each path (Linear.qpath): what
    model_runner_ready logs. Walks attributes, lists, tuples and dicts of moed objects."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, Linear):
            if o.quant is not None:
                out[o.qpath] = out.get(o.qpath, 0) + 1
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif type(o).__module__.startswith("moed.") and hasattr(o, "__dict__"):
            stack.extend(vars(o).values())
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with oneDNN off for the call, so bf16 takes ATen's gemv fast path.

    The switch is process-global: a matmul on another thread meanwhile just takes the same
    (slower, equally exact) non-oneDNN path. The lock keeps two threads' save/restore from
    interleaving, which could otherwise leave oneDNN off for good (uncontended: ~0.1 us)."""
    with _MKLDNN_SWITCH:
        prev = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return F.linear(x, weight, bias)
        finally:
            torch._C._set_mkldnn_enabled(prev)


_MKLDNN_SWITCH = threading.Lock()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm upcasts to fp32 and casts back (as transformers does), in one dispatch.
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 kernels: CpuKernels | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h + delta), h + delta): the residual add folded into the next norm, one pass
    with the native kernel (same roundings: the sum is rounded to the dtype first)."""
    if kernels is not None:
        return kernels.rms_norm_bf16(h, weight, eps, delta)
    if delta is not None:
        h = h + delta
    return rms_norm(h, weight, eps), h


class Rotary:
    """cos/sin tables [max_pos, D] built once; per step gathered at the tokens' positions.

    sin is stored with its first half negated, so rotate_half(x) * sin == x.roll(D/2) * sin'
    exactly (negation is exact): one roll instead of chunk, neg and cat.

    The last gather is kept: a call with the same positions tensor (the same object: the runner
    hands the MTP pass the main step's when their rows are the same) returns it again, as a
    speculative step's MTP pass would otherwise gather the main forward's tables a second time.
    Positions tensors are never written after they are built."""
    _last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None     # positions, cos, sin

    def __init__(self, head_dim: int, theta: float, max_pos: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.inv_freq = inv_freq.to(device)
        self.dtype = dtype
        self._build(max_pos, device)

    def _build(self, n: int, device: torch.device) -> None:
        pos = torch.arange(n, device=device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.dtype)
        self.sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(self.dtype)

    def tables(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin of shape [T, 1, D] (broadcast over heads) for positions [T] (all <= max_pos)."""
        last = self._last
        if last is not None and last[0] is positions:
            return last[1], last[2]
        cos, sin = self.full_tables(max_pos)
        got = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        self._last = (positions, *got)
        return got

    def full_tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, signed sin tables [> max_pos, D], extended first if max_pos is past them."""
        if max_pos >= self.cos.shape[0]:      # past max_position_embeddings: extend, never fail
            self._build(max(max_pos + 1, 2 * self.cos.shape[0]), self.cos.device)
            self._last = None
        return self.cos, self.sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, with Rotary's signed sin."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class AttentionBlock:
    """qkv projection, optional per-head q/k RMSNorm, rotary, paged attention, output proj.

    q and k are normed and rotated together as one [T, Hq + Hkv, D] view of the qkv output
    (per-head weights side by side): half the small ops of doing them apart, same numbers."""

    def __init__(self, spec: ModelSpec, layer: int, w: dict[str, torch.Tensor], ctx: ComputeContext) -> None:
        p = f"layers.{layer}."
        self.layer, self.kernels = layer, ctx.kernels
        self.qkv = Linear(w[p + "qkv"], w.get(p + "qkv.bias"), ctx.pack, ctx.for_weight(w[p + "qkv"]))
        self.o = Linear(w[p + "o_proj"], w.get(p + "o_proj.bias"), ctx.pack, ctx.for_weight(w[p + "o_proj"]))
        self.eps = spec.rms_norm_eps
        self.hq, self.hkv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_norm, k_norm = w.get(p + "q_norm"), w.get(p + "k_norm")
        self.qk_norm = None if q_norm is None else torch.cat(
            (q_norm.expand(self.hq, self.d), k_norm.expand(self.hkv, self.d)))   # [Hq + Hkv, D]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 backend: AttentionBackend, kv_layer: torch.Tensor) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.hq, self.hkv, self.d
        qkv = self.qkv(x)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        if self.kernels is not None:     # norm + rotary in one pass over q and k
            qk = self.kernels.qk_norm_rope_bf16(qkv, hq + hkv, d, self.qk_norm, self.eps, cos, sin)
        else:
            qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
            if self.qk_norm is not None:
                qk = rms_norm(qk, self.qk_norm, self.eps)
            qk = apply_rotary(qk, cos, sin)
        out = backend.forward(self.layer, qk[:, :hq], qk[:, hq:], v, kv_layer)      # [T, Hq, D]
        return self.o(out.reshape(t, hq * d))


class DenseMLP:
    """SwiGLU MLP of dense layers (Qwen3 mlp_only_layers)."""

    def __init__(self, gate_up: torch.Tensor | QuantWeight, down: torch.Tensor | QuantWeight,
                 ctx: ComputeContext) -> None:
        self.gate_up = Linear(gate_up, pack=ctx.pack, kernels=ctx.for_weight(gate_up))
        self.down = Linear(down, pack=ctx.pack, kernels=ctx.for_weight(down))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)
