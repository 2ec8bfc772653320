"""The machine's bf16 compute ceiling and a model's matmul FLOPs per prefill token: what
bench/engine.py and bench/prefill_kernels.py state moed's prefill as a fraction of."""
from __future__ import annotations

import time

import torch


def best_of(fn, repeats: int, min_s: float = 0.0) -> float:
    """Fastest of `repeats` timed calls (after one warm-up), running on until min_s has passed."""
    fn()
    ts, end = [], time.perf_counter() + min_s
    while len(ts) < repeats or (time.perf_counter() < end and len(ts) < 200):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def ceiling(repeats: int, kernels=None, rows: int = 4096) -> dict:
    """The bf16 matmul rate: a [rows, 4096] x [4096, 4096] bf16 matmul through torch (oneDNN),
    best of `repeats`; with `kernels` (moed's CPU kernels) also a [1024, 4096] x [4096, 4096]
    native call (fewer rows when `rows` is smaller), and the higher of the two is the ceiling (a call stretched by another process
    only lowers a figure, so the higher one is nearer the machine's own). rows=1024 gives both
    probes the same shape, a quarter of the work: on a CPU without AVX512-BF16 torch's bf16
    matmul converts element by element and a 4096^3 product takes seconds. Where oneDNN's bf16
    does not run at all (no AVX512, or ONEDNN_MAX_CPU_ISA=AVX2) torch's probe takes 4 rows:
    it multiplies at ~0.2 GFLOP/s there (32 rows took 5.9 s a call on a 2-core Zen2, 24 s of
    each bench/peers.py run), and 1024 rows cost ~10 minutes for 3 calls."""
    from moed.model.context import can_pack
    a, b = (torch.randn(4096, 4096).bfloat16() for _ in range(2))
    tr = rows if can_pack(torch.device("cpu"), torch.bfloat16) else min(rows, 4)
    lhs = a[:tr].contiguous()
    t = best_of(lambda: torch.matmul(lhs, b), max(repeats, 3))
    out = {"shape": [tr, 4096, 4096], "seconds": t, "torch_flop_s": 2 * tr * 4096 ** 2 / t}
    out["flop_s"] = out["torch_flop_s"]
    if kernels is not None:
        nr = min(rows, 1024)
        x, wp = a[:nr].contiguous(), kernels.pack(b)
        tn = best_of(lambda: kernels.linear_bf16(x, wp, 4096), max(repeats, 3))
        out["native_flop_s"] = 2 * nr * 4096 ** 2 / tn
        out["flop_s"] = max(out["flop_s"], out["native_flop_s"])
    return out


def bandwidth(repeats: int, nbytes: int = 1 << 30) -> float:
    """The machine's memory read rate (bytes/s): torch.sum over an fp32 buffer of `nbytes` (far
    past the caches), all of torch's threads, best of `repeats`. What a decode step's weight
    reads are stated as a fraction of (bench/quant_kernels.py)."""
    buf = torch.ones(nbytes // 4)
    return nbytes / best_of(lambda: buf.sum(), max(repeats, 3))


def model_shapes(spec) -> dict[str, tuple[int, int]]:
    """[out, in] of every matmul in a layer of this model, plus lm_head."""
    h, d = spec.hidden_size, spec.head_dim
    return {"qkv": ((spec.num_heads + 2 * spec.num_kv_heads) * d, h), "o_proj": (h, spec.num_heads * d),
            "router": (spec.num_experts, h), "expert_gate_up": (2 * spec.moe_intermediate_size, h),
            "expert_down": (h, spec.moe_intermediate_size), "lm_head": (spec.vocab_size, h)}


def flops_per_token(spec) -> float:
    """Matmul FLOPs per prefill token (lm_head runs on one row per sequence: left out; attention
    scores add 4 * heads * D * context / 2 on average, small at these lengths: left out)."""
    s = model_shapes(spec)
    per_layer = sum(n * k for name, (n, k) in s.items() if name in ("qkv", "o_proj", "router"))
    per_layer += spec.top_k * (s["expert_gate_up"][0] * s["expert_gate_up"][1]
                               + s["expert_down"][0] * s["expert_down"][1])
    return 2.0 * per_layer * spec.num_layers
