"""The native quantized matmul (cpu_quant.c, in the kernels' .so) from Python: which weights and
calls it serves, and the call.

It serves a 2-D QuantWeight on CPU (int8, int4, fp8; symmetric or with zero points) whose groups
the vector loop can take (a multiple of 16 input columns, int4 32, or one group per row), for
bf16 or fp32 activations of at most MAX_ROWS rows. Larger bf16 batches (prefill) take
qlinear_blocked: each block of 32 weight rows dequantized once per call into the bf16 matmul's
packed layout and every row streamed through it (cpu_bf16.c's prefill kernel), with the
reference path's numerics (the bf16-rounded weight). Larger fp32 batches take the reference path
(quant/linear.py). Numerics up to MAX_ROWS: cpu_quant.c's header (the reference's fp32 matmul of
the same dequantized weight, up to fp32 summation order).

moe_q / moe_q_routed: a quantized MoE layer's experts and weighted sum in one call (moed_moe_q,
bf16 models routed in it too), for expert stacks experts_unserved() accepts; moe.LocalExperts
and MoELayer call them for up to MAX_ROWS tokens, and for bf16 batches past it with
blocked=True (each touched expert's blocks packed once per call, as qlinear_blocked;
docs/quantization.md).
"""
from __future__ import annotations

import copy
import ctypes
from typing import Any

import torch

from moed.model.quant.weight import QuantWeight

# Rows up to which the native kernel serves a call (decode and small batches; prefill chunks
# take the reference path). bench/quant_kernels.py: native 7-10x the reference at 32 rows, 1-2x
# at 128 (AVX512, one thread, 4096x2048), so 64 is well inside the win on either variant.
MAX_ROWS = 64
FORMAT_CODES = {"int8": 0, "int4": 1, "fp8": 2}
_p, _l, _i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def bind(lib: ctypes.CDLL) -> None:
    """Declare cpu_quant.c's and cpu_qdot.c's signatures on a loaded kernels library."""
    lib.moed_pack_p32.argtypes, lib.moed_pack_p32.restype = [_p, _l, _l, _p], None   # kernels/pack.py
    lib.moed_read_pack_p32.argtypes = [_l, _p, _p, _p, _p, _p, _p, _i]                 # kernels/pack.py
    lib.moed_read_pack_p32.restype = _i
    lib.moed_read_experts_p32.argtypes = [_l, _p, _p, _p, _l, _l, _p, _p, _p, _p, _p, _i]     # kernels/pack.py
    lib.moed_read_experts_p32.restype = _i
    lib.moed_qlinear.argtypes = [_p, _i, _l, _l, _i, _p, _l, _p, _l, _p, _l, _l, _l, _p, _p, _i, _i]
    lib.moed_qlinear.restype = _i
    lib.moed_qlinear_blocked.argtypes = [_p, _l, _l, _i, _p, _l, _p, _l, _p, _l, _l, _l, _p, _p, _i]
    lib.moed_qlinear_blocked.restype = _i
    lib.moed_moe_q.argtypes = [_p, _i, _l, _l, _l, _p, _p, _i, _i, _l, _l, _p, _p, _p, _p, _p, _i, _i, _i]
    lib.moed_moe_q.restype = _i
    lib.moed_moe_q_routed.argtypes = [_p, _l, _l, _p, _l, _l, _i, _p, _l, _p, _l, _p, _i, _l, _l, _p, _p, _p, _p,
                                      _p, _i, _i, _i]
    lib.moed_moe_q_routed.restype = _i
    lib.moed_qdot_linear.argtypes = lib.moed_qlinear.argtypes       # cpu_qdot.c: int8 activations
    lib.moed_qdot_linear.restype = _i
    lib.moed_qdot_vnni.argtypes, lib.moed_qdot_vnni.restype = [_i], _i


def unserved(w: QuantWeight) -> str:
    """Why the native kernel cannot read weight w ('' when it can)."""
    if w.device.type != "cpu":
        return f"weight on {w.device.type}"
    if w.data.dim() != 2:
        return f"a {w.data.dim()}-D weight stack"
    step = 32 if w.fmt == "int4" else 16
    if w.group < w.in_features and w.group % step:
        return f"group {w.group} is not a multiple of {step}"
    parts = [w.data, w.scale] + ([] if w.zero is None else [w.zero])
    if any(t.stride(-1) != 1 for t in parts):
        return "a column-strided view"
    if w.scale.dtype != torch.float32:
        return f"{w.scale.dtype} scales"
    return ""


def act_unserved(w: QuantWeight) -> str:
    """Why cpu_qdot.c cannot take weight w with int8 activations ('' when it can)."""
    if w.fmt not in ("int8", "int4"):
        return f"{w.fmt} weights (int8 activations serve int8 and int4)"
    return "int4 with an odd input size" if w.fmt == "int4" and w.in_features % 2 else ""


def linear_act(kernels: object, w: QuantWeight) -> bool:
    """Whether qlinear runs weight w on int8 activations (moed_qdot_linear) rather than
    moed_qlinear: kernels.quant_act "int8" and a weight act_unserved() accepts. The native
    decode step picks each projection's kernel with it too (decode_step.py)."""
    return getattr(kernels, "quant_act", "none") == "int8" and not act_unserved(w)


def qlinear(kernels: object, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] (bf16 or fp32, CPU) @ W^T (+ bias fp32 [N]) -> [R, N] in x's dtype, for a weight
    unserved() accepts. kernels: a loaded CpuKernels (its .lib); with kernels.quant_act "int8"
    (CpuKernels.with_quant_act) and a weight act_unserved() accepts, on int8 activations
    (cpu_qdot.c, quant/actquant.py)."""
    x = x.contiguous()
    r, k = x.shape
    if k != w.in_features:
        raise ValueError(f"qlinear: input has {k} columns, the weight {w.in_features}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"qlinear: {x.dtype} activations (bf16 or float32)")
    n = w.data.shape[0]
    out = torch.empty((r, n), dtype=x.dtype)
    f32 = int(x.dtype == torch.float32)
    z = w.zero
    rc = (kernels.lib.moed_qdot_linear if linear_act(kernels, w) else kernels.lib.moed_qlinear)(      # type: ignore[attr-defined]
        x.data_ptr(), f32, r, k, FORMAT_CODES[w.fmt], w.data.data_ptr(), w.data.stride(0),
        w.scale.data_ptr(), w.scale.stride(0), None if z is None else z.data_ptr(),
        0 if z is None else z.stride(0), w.group, n, None if bias is None else bias.data_ptr(),
        out.data_ptr(), f32, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("moed_qlinear: " + ("out of memory" if rc == -1 else f"cannot take {w.describe()}"))
    return out


def blocked_unserved(w: QuantWeight) -> str:
    """Why qlinear_blocked cannot read weight w ('' when it can): unserved(), or an odd K (the
    packed layout holds column pairs)."""
    return unserved(w) or (f"{w.in_features} input columns (odd)" if w.in_features % 2 else "")


def qlinear_blocked(kernels: object, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] bf16 (CPU, many rows) @ W^T (+ bias fp32 [N]) -> [R, N] bf16, for a weight
    blocked_unserved() accepts: the reference path's numbers (x @ w.dequantize(bf16)^T in fp32,
    one rounding) up to fp32 summation order, each weight dequantized once per call."""
    x = x.contiguous()
    r, k = x.shape
    if k != w.in_features or x.dtype != torch.bfloat16:
        raise ValueError(f"qlinear_blocked: {x.dtype} [{r}, {k}] input for a weight of {w.in_features} columns (bf16)")
    n = w.data.shape[0]
    out = torch.empty((r, n), dtype=x.dtype)
    z = w.zero
    rc = kernels.lib.moed_qlinear_blocked(      # type: ignore[attr-defined]
        x.data_ptr(), r, k, FORMAT_CODES[w.fmt], w.data.data_ptr(), w.data.stride(0), w.scale.data_ptr(),
        w.scale.stride(0), None if z is None else z.data_ptr(), 0 if z is None else z.stride(0), w.group, n,
        None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("moed_qlinear_blocked: " + ("out of memory" if rc == -1 else f"cannot take {w.describe()}"))
    return out


# ---- a whole MoE layer of quantized experts in one call (moed_moe_q) -------------------------

def experts_unserved(gate_up: QuantWeight, down: QuantWeight) -> str:
    """Why moed_moe_q cannot take these expert stacks (gate_up [P, 2I, H], down [P, H, I]; ''
    when it can): each expert's matrix as unserved() says, one format and zero-point kind."""
    if gate_up.data.dim() != 3 or down.data.dim() != 3:
        return "not a 3-D expert stack"
    if (gate_up.fmt, gate_up.zero is None) != (down.fmt, down.zero is None):
        return "gate_up and down differ in format or zero points"
    return unserved(gate_up[0]) or unserved(down[0])


def experts_blocked_unserved(gate_up: QuantWeight, down: QuantWeight) -> str:
    """Why moe_q(blocked=True) cannot take these stacks ('' when it can): experts_unserved(),
    or an odd hidden or intermediate size."""
    return experts_unserved(gate_up, down) or blocked_unserved(gate_up[0]) or blocked_unserved(down[0])


def experts_act(kernels: object, gate_up: QuantWeight, down: QuantWeight) -> int:
    """1: moed_moe_q runs the experts (up to MAX_ROWS rows each) on int8 activations (the
    native decode step passes the same)."""
    return int(getattr(kernels, "quant_act", "none") == "int8" and not act_unserved(gate_up[0])
               and not act_unserved(down[0]))


def with_act(kernels: Any, act: str) -> Any:
    """kernels as a model with model.quantization_activations `act` hands them to its quantized
    Linears and experts: "none" the object itself; "int8" a shallow copy whose quant_act says so
    (one per kernels object, as choice.native_only makes its copy)."""
    if kernels is None or act == "none":
        return kernels
    views = kernels.__dict__.setdefault("_act_views", {})
    if act not in views:
        view = copy.copy(kernels)
        view.quant_act = act
        views[act] = view
    return views[act]


def qdot_vnni(kernels: Any, use: int = -1) -> bool:
    """Whether the integer dots use vpdpbusd (cpu_qdot.c moed_qdot_vnni): use -1 asks, 0 turns
    it off (the tests run the vpmaddubsw path on a VNNI CPU that way), 1 on where the CPU has it."""
    return bool(kernels.lib.moed_qdot_vnni(use))


def expert_mats(w: QuantWeight) -> tuple[ctypes.Array, ctypes.Array]:
    """moed_moe_q's {codes, scales, zeros} pointers and their row / expert strides and group
    (cpu_quant.c's expert_mat) of an expert stack w."""
    z = w.zero
    ptr = (_p * 3)(w.data.data_ptr(), w.scale.data_ptr(), None if z is None else z.data_ptr())
    dim = (_l * 7)(w.data.stride(1), w.data.stride(0), w.scale.stride(1), w.scale.stride(0),
                   0 if z is None else z.stride(1), 0 if z is None else z.stride(0), w.group)
    return ptr, dim


def moe_q(kernels: object, x: torch.Tensor, physical: torch.Tensor, weights: torch.Tensor,
          gate_up: QuantWeight, down: QuantWeight, single: bool, blocked: bool = False) -> torch.Tensor:
    """x [T, H] (bf16 or fp32) through the routed experts, weighted and summed -> [T, H] in x's
    dtype; physical [T, k] slots and weights [T, k] (x's dtype) as the router gives them.
    single: sum in top-k order rounding per add (LocalExperts._single_token) rather than in
    ascending slot order. For expert stacks experts_unserved() accepts. blocked (bf16 x, stacks
    experts_blocked_unserved() accepts; prefill): an expert with more than MAX_ROWS rows through
    qlinear_blocked's kernel, one with fewer through qlinear's, as the per-expert path's Linears."""
    x = x.contiguous()
    t, h = x.shape
    phys = physical.to(torch.int64).contiguous()
    w = weights.float().contiguous()            # bf16 weights are exact in fp32
    out = torch.empty((t, h), dtype=x.dtype)
    gp, gd = expert_mats(gate_up)
    dp, dd = expert_mats(down)
    rc = kernels.lib.moed_moe_q(        # type: ignore[attr-defined]
        x.data_ptr(), int(x.dtype == torch.float32), t, h, phys.shape[1], phys.data_ptr(), w.data_ptr(),
        int(single), FORMAT_CODES[gate_up.fmt], gate_up.data.shape[0], down.in_features, gp, gd, dp, dd,
        out.data_ptr(), MAX_ROWS if blocked else 0, experts_act(kernels, gate_up, down), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("moed_moe_q: " + ("out of memory" if rc == -1 else "cannot take these experts or slots"))
    return out


def moe_q_routed(kernels: object, x: torch.Tensor, router_p: torch.Tensor, router: object,
                 gate_up: QuantWeight, down: QuantWeight, blocked: bool = False) -> torch.Tensor:
    """moe_q with the bf16 MoE kernel's router in front (moed_route_bf16, in the same call): x
    [T, H] bf16; router_p the router packed (CpuKernels.pack); router a moe.Router (its map,
    replicas, load row and call offset)."""
    x = x.contiguous()
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype)
    gp, gd = expert_mats(gate_up)
    dp, dd = expert_mats(down)
    r: Any = router
    l2p = r.logical_to_physical
    rc = kernels.lib.moed_moe_q_routed(       # type: ignore[attr-defined]
        x.data_ptr(), t, h, router_p.data_ptr(), r.num_experts, r.top_k, int(r.norm_topk), l2p.data_ptr(),
        l2p.shape[1], r.num_replicas.data_ptr(), r.next_offset(), r.load.data_ptr(), FORMAT_CODES[gate_up.fmt],
        gate_up.data.shape[0], down.in_features, gp, gd, dp, dd, out.data_ptr(), MAX_ROWS if blocked else 0,
        experts_act(kernels, gate_up, down), torch.get_num_threads())
    if rc != 0:
        why = "out of memory" if rc == -1 else "expert map or experts out of range"
        raise RuntimeError(f"moed_moe_q_routed: {why}")
    return out
