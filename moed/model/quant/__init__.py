"""Quantized weights: the record (weight.py), checkpoint formats (formats.py, checkpoint.py),
online quantizers (quantize.py) and the reference matmul (linear.py). See docs/quantization.md."""
from __future__ import annotations

import torch

from moed.model.quant.weight import QuantWeight

# Canonical weights (loader names, the part after `layers.{i}.`) that a format applies to:
# the projections of attention, the experts, dense and shared MLPs. Routers, norms, embeddings,
# the heads (unless model.quantization_lm_head: is_head) and biases stay in the checkpoint's
# dtype; MLA's kv_b too (its per-head halves are
# read as plain matrices by the absorbed decode).
QUANTIZABLE = frozenset({"qkv", "o_proj", "experts.gate_up", "experts.down", "mlp.gate_up", "mlp.down",
                         "attn.q", "attn.q_a", "attn.q_b", "attn.kv_a",
                         "shared.gate", "shared.up", "shared.down"})


def quantizable(name: str) -> bool:
    return name.startswith("layers.") and name.split(".", 2)[2] in QUANTIZABLE


def is_head(name: str) -> bool:
    """The logits heads, plain unless model.quantization_lm_head asks (formats.Plan.head):
    lm_head and DeepSeek-V3's MTP shared head."""
    return name == "lm_head" or name.endswith(".mtp.head")


def bytes_by_format(weights: dict[str, torch.Tensor | QuantWeight]) -> dict[str, int]:
    """Bytes held per format (QuantWeights by format, plain tensors by dtype), shared tensors once."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for w in weights.values():
        key = id(w)
        if key in seen:
            continue
        seen.add(key)
        name = w.fmt if isinstance(w, QuantWeight) else str(w.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + w.nbytes
    return out


def held_bytes(shape: tuple[int, ...], fmt: str, group: int, asymmetric: bool = False) -> int:
    """Bytes a [..., out, in] matrix holds in a format: data, a float32 scale per row and
    group, and (asymmetric formats) a one-byte zero point per row and group."""
    *lead, out, n = shape
    rows = out
    for d in lead:
        rows *= d
    groups = -(-n // group)
    per_row = {"fp8": n, "int8": n, "int4": -(-n // 2)}[fmt] + (5 if asymmetric else 4) * groups
    return rows * per_row


def plan_bytes(name: str, shape: tuple[int, ...], itemsize: int, plan: object | None) -> int:
    """What a canonical weight will hold under a quantization Plan (formats.Plan; None: plain)."""
    import math

    fmt = getattr(plan, "fmt", "")
    if is_head(name) and getattr(plan, "head", ""):
        head, group = plan.head_format(shape[-1])          # type: ignore[attr-defined]
        return held_bytes(shape, head, group)
    if not fmt or not quantizable(name):
        return math.prod(shape) * itemsize
    ck = getattr(plan, "checkpoint", None)
    if ck is not None:
        group = ck.block[1] if fmt == "fp8" else (ck.group or shape[-1])
        return held_bytes(shape, fmt, group, asymmetric=not ck.symmetric)
    group = 128 if fmt == "fp8" else shape[-1] if fmt == "int8" else getattr(plan, "group_size")
    return held_bytes(shape, fmt, group)
