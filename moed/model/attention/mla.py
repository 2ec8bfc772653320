"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the layer block, its rotary and the math.

Glossary (per token; DeepSeek-V3's sizes in brackets):
  r       kv_lora_rank [512]: width of c_kv, the normed compressed KV — what the cache keeps
  rope    qk_rope_head_dim [64]: the rotated key, ONE head shared by all query heads (cached too)
  nope    qk_nope_head_dim [128]: per-head q/k part without rotary (k_nope = W_uk c_kv)
  vd      v_head_dim [128]: per-head value (v = W_uv c_kv)
  W_uk    [H, nope, r], W_uv [H, vd, r]: kv_b_proj split per head

The KV cache entry is [c_kv | k_rope] (r + rope values, KVLayout kind "mla"): per-head K/V are
never stored. Two forms compute the same attention over that cache:
  expanded  K = [W_uk c_kv, k_rope], V = W_uv c_kv per head, then plain SDPA (prefill: many
            queries share each expanded key, so expanding once is cheaper)
  absorbed  q_lat = q_nope W_uk (query moved into the latent space), scores = q_lat . c_kv +
            q_rope . k_rope, o_lat = probs . c_kv, out = W_uv o_lat: no per-head K/V
            materialised (decode: one query per sequence; FlashInfer's MLA kernel takes this form)
Backends (mla_torch.py on any device, mla_flashinfer.py on CUDA) own the cache and pick the form;
this file has the block that projects q and the latent, and both forms as pure functions.

Rotary: DeepSeek checkpoints lay the rope dims out interleaved (pairs (x0, x1), ...); the rows of
the q and kv_a projections are permuted once at load so the usual rotate-half rotary applies
(q_rope . k_rope is unchanged by the same permutation of both). YaRN scaling as transformers
computes it (inv_freq blend, cos/sin times attention_factor, softmax scale times mscale^2).
"""
from __future__ import annotations

import math
from abc import abstractmethod

import torch
import torch.nn.functional as F

from moed.model.attention.base import AttentionBackend
from moed.model.context import ComputeContext
from moed.model.kv_layout import KVLayout, write_rows
from moed.model.layers import Linear, Rotary, apply_rotary, rms_norm
from moed.model.quant.weight import QuantWeight
from moed.model.spec import ModelSpec

# DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank) are built with their default eps, not the config's.
LATENT_NORM_EPS = 1e-6


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(dim: int, theta: float, yarn: dict[str, float],
                    max_pos: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention_factor) for YaRN, as transformers' _compute_yarn_parameters."""
    factor = yarn.get("factor") or max_pos / yarn["original_max_position_embeddings"]
    mscale, mscale_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
    att = yarn.get("attention_factor")
    if att is None:
        att = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all \
            else _yarn_mscale(factor)
    beta_fast, beta_slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1
    orig = yarn["original_max_position_embeddings"]

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if yarn.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extra = 1 - ramp       # share of the unscaled (extrapolated) frequency per dim
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv_freq, float(att)


def softmax_scale(spec: ModelSpec) -> float:
    """1/sqrt(nope + rope), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's rule)."""
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5
    yarn = dict(spec.rope_yarn)
    if yarn and yarn.get("mscale_all_dim"):
        m = _yarn_mscale(yarn["factor"], yarn["mscale_all_dim"])
        scale *= m * m
    return scale


class ScaledRotary(Rotary):
    """Rotary with given inverse frequencies and cos/sin scaled by attention_factor (YaRN)."""

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float, max_pos: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq, self.factor, self.dtype = inv_freq.to(device), attention_factor, dtype
        self._build(max_pos, device)

    def _build(self, n: int, device: torch.device) -> None:
        pos = torch.arange(n, device=device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.factor).to(self.dtype)     # scaled in fp32, then cast (as HF)
        self.sin = (torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * self.factor).to(self.dtype)


def mla_rotary(spec: ModelSpec, ctx: ComputeContext) -> Rotary:
    """The model's rotary over the rope dims (plain RoPE, or YaRN when the config says)."""
    if not spec.rope_yarn:
        return Rotary(spec.qk_rope_head_dim, spec.rope_theta, spec.max_position_embeddings, ctx.dtype, ctx.device)
    inv_freq, att = yarn_parameters(spec.qk_rope_head_dim, spec.rope_theta, dict(spec.rope_yarn),
                                    spec.max_position_embeddings)
    return ScaledRotary(inv_freq, att, spec.max_position_embeddings, ctx.dtype, ctx.device)


def deinterleave(rope: int) -> torch.Tensor:
    """Row order that turns interleaved rope pairs into halves: evens then odds."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))


def expanded(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor,
             w_uv: torch.Tensor, scale: float, mask: torch.Tensor | None,
             kv_b: Linear | None = None) -> torch.Tensor:
    """One sequence, expanded form. q_nope [n, H, nope], q_rope [n, H, rope], latent [S, r + rope]
    (its history, the n queries last), mask [n, S] bool or None (plain causal, S == n)
    -> [n, H, vd]. kv_b: kv_b_proj as one Linear (the same numbers as w_uk/w_uv, one packed
    matmul instead of two batched ones that copy the weight: -25% of a CPU bf16 prefill)."""
    r, h, nope = w_uk.shape[2], w_uk.shape[0], w_uk.shape[1]
    c, k_rope = latent[:, :r], latent[:, r:]
    if kv_b is not None:
        kv = kv_b(c).view(c.shape[0], h, -1).transpose(0, 1)                    # [H, S, nope + vd]
        k_nope, v = kv[:, :, :nope], kv[:, :, nope:]
    else:
        k_nope = torch.einsum("sr,hnr->hsn", c, w_uk)                            # [H, S, nope]
        v = torch.einsum("sr,hvr->hsv", c, w_uv)                                 # [H, S, vd]
    k = torch.cat((k_nope, k_rope.unsqueeze(0).expand(k_nope.shape[0], -1, -1)), dim=-1)
    q = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)                      # [H, n, nope + rope]
    o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                       is_causal=mask is None, scale=scale)
    return o.squeeze(0).transpose(0, 1)


def absorbed(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, bias: torch.Tensor,
             w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """B sequences, one query each, absorbed form. q_nope [B, H, nope], q_rope [B, H, rope],
    latent [B, L, r + rope] (gathered history, padded), bias [B, 1, L] (0 or -inf, fp32)
    -> [B, H, vd]. Softmax in fp32; the score/value matmuls in the cache dtype; the two small
    per-head projections in fp32 (w_uk/w_uv may be given in fp32): CPU bf16 batched matmuls of
    this shape take a slow path (measured 16 heads x 64 x 256, 1 row: 0.48 ms bf16 per layer)."""
    r, dt = w_uk.shape[2], q_nope.dtype
    q_lat = torch.einsum("bhn,hnr->bhr", q_nope.to(w_uk.dtype), w_uk).to(dt)     # [B, H, r]
    q = torch.cat((q_lat, q_rope), dim=-1)                                      # [B, H, r + rope]
    scores = torch.matmul(q, latent.transpose(1, 2))                             # [B, H, L]
    probs = torch.softmax(torch.add(bias, scores, alpha=scale), dim=-1).to(dt)
    o_lat = torch.matmul(probs, latent[:, :, :r])                               # [B, H, r]
    return torch.einsum("bhr,hvr->bhv", o_lat.to(w_uv.dtype), w_uv).to(dt)


def absorbed_chunks(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                    bias: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """`absorbed` with m queries per sequence over one gathered history each (a speculative
    step's verified rows): q_nope [B, m, H, nope], q_rope [B, m, H, rope], latent [B, L, r +
    rope], bias [B, m, 1, L] -> [B, m, H, vd]; each query's numbers are those `absorbed`
    computes for it alone, the history is read once per sequence, not once per query."""
    b, m, h = q_nope.shape[:3]
    r, dt = w_uk.shape[2], q_nope.dtype
    q_lat = torch.einsum("bmhn,hnr->bmhr", q_nope.to(w_uk.dtype), w_uk).to(dt)
    q = torch.cat((q_lat, q_rope), dim=-1).view(b, m * h, -1)                    # [B, m H, r + rope]
    scores = torch.matmul(q, latent.transpose(1, 2)).view(b, m, h, -1)          # [B, m, H, L]
    probs = torch.softmax(torch.add(bias, scores, alpha=scale), dim=-1).to(dt)
    o_lat = torch.matmul(probs.view(b, m * h, -1), latent[:, :, :r]).view(b, m, h, r)
    return torch.einsum("bmhr,hvr->bmhv", o_lat.to(w_uv.dtype), w_uv).to(dt)


class MLABackend(AttentionBackend):
    """An attention backend over the mla KVLayout: the block hands it the new tokens' query
    parts and latent; it writes [c_kv | k_rope] into the cache and returns the per-head output."""
    kv_kinds = ("mla",)

    def __init__(self, spec: ModelSpec, kv: KVLayout, ctx: ComputeContext) -> None:
        if spec.attention_kind != "mla":
            raise ValueError(f"attention backend {self.name!r} for a {spec.attention_kind} model "
                             f"does not serve KV layout kind {kv.kind!r}")
        super().__init__(spec, kv, ctx)
        if kv.rope_dim != spec.qk_rope_head_dim or kv.latent_rank != spec.kv_lora_rank:
            raise ValueError(f"KV layout {kv.entry_shape} (rope {kv.rope_dim}) does not match the model's "
                             f"kv_lora_rank {spec.kv_lora_rank} + qk_rope_head_dim {spec.qk_rope_head_dim}")
        self.scale = softmax_scale(spec)
        self.rank = kv.latent_rank

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{self.name} MLA backend: the MLA block calls forward_mla, not forward")

    def write_latent(self, latent: torch.Tensor, kv_layer: torch.Tensor) -> None:
        """Only the new tokens' [c_kv | k_rope] rows into the planned rows (`self.write`,
        which both backends' plan() sets), no attention: MLAAttention.write_kv."""
        write_rows(kv_layer.view(-1, kv_layer.shape[-1]), self.write, latent)

    @abstractmethod
    def forward_mla(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor,
                    k_rope: torch.Tensor, kv_layer: torch.Tensor, w_uk: torch.Tensor,
                    w_uv: torch.Tensor, w_uk_abs: torch.Tensor | None = None,
                    w_uv_abs: torch.Tensor | None = None, kv_b: Linear | None = None) -> torch.Tensor:
        """q_nope [T, H, nope], q_rope [T, H, rope] (rotated), c_kv [T, r] (normed), k_rope
        [T, rope] (rotated) of the new tokens -> [T, H, vd]; the latent is cached first.
        w_uk/w_uv [H, nope|vd, r] in the model dtype; *_abs: the same for the absorbed form
        (possibly fp32; default: w_uk/w_uv); kv_b: the same weights as one Linear (expanded form)."""


class MLAAttention:
    """q (direct or through q_lora_rank), the latent [c_kv | k_rope], rotary, the backend's
    attention over the latent cache, output projection. Canonical weights `layers.{i}.attn.*`."""

    def __init__(self, spec: ModelSpec, layer: int, w: dict[str, torch.Tensor], ctx: ComputeContext) -> None:
        p = f"layers.{layer}."
        self.layer, self.eps = layer, LATENT_NORM_EPS
        self.h, self.nope, self.rope = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim
        self.r, self.vd = spec.kv_lora_rank, spec.v_head_dim
        perm = deinterleave(self.rope) if spec.rope_interleave else None
        qd = self.nope + self.rope

        def rows(t: torch.Tensor | QuantWeight, idx: torch.Tensor) -> torch.Tensor | QuantWeight:
            if isinstance(t, QuantWeight):      # data, scales and zeros: rows are exact
                return t.index_rows(idx)
            return t.index_select(0, idx.to(t.device))

        def q_rows(t: torch.Tensor | QuantWeight) -> torch.Tensor | QuantWeight:   # each head's rope rows
            if perm is None:
                return t
            idx = torch.arange(self.h * qd).view(self.h, qd)
            idx[:, self.nope:] = idx[:, self.nope:][:, perm]
            return rows(t, idx.flatten())

        def lin(name: str, rows=None) -> Linear:
            wt, b = w[p + name], w.get(p + name + ".bias")
            if rows is not None:
                wt = rows(wt)
                b = None if b is None else rows(b.unsqueeze(1)).squeeze(1)
            return Linear(wt if isinstance(wt, QuantWeight) else wt.contiguous(), b, ctx.pack, ctx.for_weight(wt))

        def kv_rows(t: torch.Tensor | QuantWeight) -> torch.Tensor | QuantWeight:
            if perm is None:
                return t
            return rows(t, torch.cat((torch.arange(self.r), self.r + perm)))

        self.lora = spec.q_lora_rank > 0
        if self.lora:
            self.q_a, self.q_a_norm = lin("attn.q_a"), w[p + "attn.q_a_norm"]
            self.q_b = lin("attn.q_b", q_rows)
        else:
            self.q = lin("attn.q", q_rows)
        self.kv_a, self.kv_a_norm = lin("attn.kv_a", kv_rows), w[p + "attn.kv_a_norm"]
        self.kv_b = Linear(w[p + "attn.kv_b"], None, ctx.pack, ctx.kernels)
        kv_b = w[p + "attn.kv_b"].view(self.h, self.nope + self.vd, self.r)
        self.w_uk = kv_b[:, :self.nope].contiguous()          # [H, nope, r]
        self.w_uv = kv_b[:, self.nope:].contiguous()          # [H, vd, r]
        # fp32 copies for the absorbed decode's per-head projections on CPU (see absorbed())
        cpu_half = ctx.device.type == "cpu" and ctx.dtype != torch.float32
        self.w_uk_abs = self.w_uk.float() if cpu_half else self.w_uk
        self.w_uv_abs = self.w_uv.float() if cpu_half else self.w_uv
        self.o = lin("o_proj")
        self.kernels = ctx.kernels      # the latent and query norms on the native kernel, as add_rms_norm

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:    # ~4x faster than F.rms_norm's dispatch on a decode row
            return self.kernels.rms_norm_bf16(x, weight, self.eps)[0]
        return rms_norm(x, weight, self.eps)

    def write_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 backend: MLABackend, kv_layer: torch.Tensor) -> torch.Tensor:
        """The cache entries __call__ writes for x's tokens, and nothing else (no query, no
        attention, no output): for a layer whose output the step does not need. -> those
        entries, [T, r + rope] (unquantized), for MLABackend.write_latent to write again."""
        lat = self.kv_a(x)
        c_kv = self._norm(lat[:, :self.r], self.kv_a_norm)
        new = torch.cat((c_kv, apply_rotary(lat[:, None, self.r:], cos, sin)[:, 0]), dim=-1)
        backend.write_latent(new, kv_layer)
        return new

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 backend: MLABackend, kv_layer: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_b(self._norm(self.q_a(x), self.q_a_norm)) if self.lora else self.q(x)
        q = q.view(t, self.h, self.nope + self.rope)
        q_rope = apply_rotary(q[:, :, self.nope:], cos, sin)
        lat = self.kv_a(x)                                                    # [T, r + rope]
        c_kv = self._norm(lat[:, :self.r], self.kv_a_norm)
        k_rope = apply_rotary(lat[:, None, self.r:], cos, sin)[:, 0]
        out = backend.forward_mla(self.layer, q[:, :, :self.nope], q_rope, c_kv, k_rope, kv_layer,
                                  self.w_uk, self.w_uv, self.w_uk_abs, self.w_uv_abs, self.kv_b)   # [T, H, vd]
        return self.o(out.reshape(t, self.h * self.vd))
