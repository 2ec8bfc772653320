"""Quantized checkpoints for the tests, written from a random bf16 checkpoint by each format's
published definition (independently of moed/model/quant, which reads them), plus the oracle:
the same checkpoint with every quantized matrix replaced by its dequantized fp32 values, for
transformers to run.

  fp8    DeepSeek-V3 (inference/kernel.py's weight_dequant): W = q * s[i // bo, j // bi],
         s = amax(block) / 448, `weight_scale_inv`, quantization_config quant_method fp8
  ct     compressed-tensors (compressors/quantized_compressors/pack_quantized.py,
         pack_to_int32): signed q (and zero points) + 2^(bits-1), 32/bits per int32 word,
         low bits first; weight along dim 1, zero points along dim 0; int-quantized: int8 as is
  gptq   GPTQ v1 (AutoGPTQ QuantLinear.pack): qweight [in/8, out] packed along the input,
         qzeros [groups, out/8] storing zero - 1, scales fp16 [groups, out], g_idx = j // group
  awq    AutoAWQ GEMM (WQLinear_GEMM.from_linear): qweight [in, out/8] and qzeros [groups, out/8]
         packed along the output, nibble i = column (0, 2, 4, 6, 1, 3, 5, 7)[i] of its 8
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

# nn.Linear weights that the formats quantize (the router `mlp.gate`, norms, embeddings and
# lm_head stay as they are, as the published checkpoints have them)
LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|q_b_proj|"
                    r"kv_a_proj_with_mqa|kv_b_proj|w1|w2|w3)\.weight$")


def pack_int32(u: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values (0 .. 2^bits - 1) -> int32 words along dim, low bits first, zero-padded."""
    per = 32 // bits
    u = u.to(torch.int64).movedim(dim, -1)
    pad = -u.shape[-1] % per
    u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(*u.shape[:-1], -1, per)
    words = (u << (torch.arange(per) * bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _groups(w: torch.Tensor, g: int) -> torch.Tensor:
    """[out, in] -> [out, groups, g] (in must divide by g here)."""
    return w.view(w.shape[0], -1, g)


def fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    bo, bi = block
    out, n = w.shape
    rb, cb = -(-out // bo), -(-n // bi)
    s = torch.empty(rb, cb)
    q = torch.empty(out, n, dtype=torch.float8_e4m3fn)
    deq = torch.empty(out, n)
    for a in range(rb):
        for b in range(cb):
            blk = w[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi].float()
            sc = float(blk.abs().max()) / 448.0 or 1.0
            s[a, b] = sc
            qb = (blk / torch.tensor(sc)).to(torch.float8_e4m3fn)
            q[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi] = qb
            deq[a * bo:(a + 1) * bo, b * bi:(b + 1) * bi] = qb.float() * s[a, b]
    return {"weight": q, "weight_scale_inv": s}, deq


def _int_quant(w: torch.Tensor, bits: int, g: int, symmetric: bool, gen: torch.Generator):
    """Signed q, zero point, scale per [out, groups] (min-max; zero points random where asymmetric
    so that every value is exercised)."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    wg = _groups(w.float(), g)
    if symmetric:
        s = wg.abs().amax(-1) / hi
        zp = torch.zeros_like(s, dtype=torch.int64)
    else:
        s = (wg.amax(-1) - wg.amin(-1)) / (hi - lo)
        zp = torch.randint(lo + 1, hi, s.shape, generator=gen)
    s = s.to(torch.bfloat16).float()
    q = torch.round(wg / s[..., None] + zp[..., None]).clamp(lo, hi).to(torch.int64)
    deq = ((q - zp[..., None]).float() * s[..., None]).view_as(w)
    return q.view(w.shape), zp, s, deq


def ct(w: torch.Tensor, bits: int, g: int, symmetric: bool, packed: bool, gen: torch.Generator):
    g = g or w.shape[1]
    q, zp, s, deq = _int_quant(w, bits, g, symmetric, gen)
    off = 1 << (bits - 1)
    t: dict[str, torch.Tensor] = {"weight_scale": s.to(torch.bfloat16)}
    if packed:
        t["weight_packed"] = pack_int32(q + off, bits, 1)
        t["weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        if not symmetric:
            t["weight_zero_point"] = pack_int32(zp + off, bits, 0)
    else:
        t["weight"] = q.to(torch.int8)
        if not symmetric:
            t["weight_zero_point"] = zp.to(torch.int8)
    return t, deq


def gptq(w: torch.Tensor, g: int, symmetric: bool, gen: torch.Generator):
    out, n = w.shape
    wg = _groups(w.float(), g)
    if symmetric:
        s, z = wg.abs().amax(-1) / 7, torch.full((out, n // g), 8)
    else:
        s, z = (wg.amax(-1) - wg.amin(-1)) / 15, torch.randint(1, 16, (out, n // g), generator=gen)
    s = s.to(torch.float16).float()
    q = torch.round(wg / s[..., None] + z[..., None]).clamp(0, 15).to(torch.int64)
    deq = ((q - z[..., None]).float() * s[..., None]).view_as(w)
    return {"qweight": pack_int32(q.view(out, n).t(), 4, 0),
            "qzeros": pack_int32((z - 1).t(), 4, 1),
            "scales": s.t().to(torch.float16).contiguous(),
            "g_idx": (torch.arange(n) // g).to(torch.int32)}, deq


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]     # AutoAWQ WQLinear_GEMM: nibble i holds column AWQ_ORDER[i]


def awq(w: torch.Tensor, g: int, gen: torch.Generator):
    out, n = w.shape
    wg = _groups(w.float(), g)
    s = ((wg.amax(-1) - wg.amin(-1)) / 15).to(torch.float16).float()
    z = torch.randint(0, 16, (out, n // g), generator=gen)
    q = torch.round(wg / s[..., None] + z[..., None]).clamp(0, 15).to(torch.int64)
    deq = ((q - z[..., None]).float() * s[..., None]).view_as(w)

    def pack(u: torch.Tensor) -> torch.Tensor:       # [rows, cols] -> [rows, cols / 8]
        r, c = u.shape
        return pack_int32(u.view(r, c // 8, 8)[..., AWQ_ORDER].reshape(r, c), 4, 1)

    return {"qweight": pack(q.view(out, n).t().contiguous()), "qzeros": pack(z.t().contiguous()),
            "scales": s.t().to(torch.float16).contiguous()}, deq


def write(src: Path, dst: Path, oracle: Path, encode: Callable, quantization_config: dict | None) -> None:
    """dst: the quantized checkpoint (config.json with quantization_config); oracle: fp32 weights,
    the quantized ones dequantized. encode(name, w) -> (tensors by suffix, dequantized) or None."""
    for d in (dst, oracle):
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    qt, ot = {}, {}
    for name, w in tensors.items():
        enc = encode(name, w) if LINEAR.search(name) else None
        if enc is None:
            qt[name], ot[name] = w, w.float()
            continue
        parts, deq = enc
        base = name.removesuffix(".weight")
        qt.update({f"{base}.{k}": v.contiguous() for k, v in parts.items()})
        ot[name] = deq
    save_file(qt, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(ot, str(oracle / "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def config_for(method: str, **kw) -> dict:
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(kw["block"])}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": kw["group"], "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": kw["group"], "desc_act": False,
                "sym": kw["symmetric"], "checkpoint_format": "gptq", "damp_percent": 0.01}
    w = {"num_bits": kw["bits"], "type": "int", "symmetric": kw["symmetric"],
         "strategy": "group" if kw["group"] else "channel", "group_size": kw["group"] or None,
         "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized" if kw["packed"] else "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "quantization_status": "compressed", "kv_cache_scheme": None,
            "sparsity_config": {}}


def make(src: Path, dst: Path, oracle: Path, method: str, seed: int = 0, **kw) -> None:
    """A quantized copy of src by method (fp8 block=(bo, bi); ct bits, group, symmetric, packed;
    gptq group, symmetric) and its dequantized fp32 oracle."""
    gen = torch.Generator().manual_seed(seed)
    if method == "fp8":
        encode = lambda name, w: fp8(w, kw["block"])                                       # noqa: E731
    elif method == "ct":
        encode = lambda name, w: ct(w, kw["bits"], kw["group"], kw["symmetric"], kw["packed"], gen)  # noqa: E731
    elif method == "gptq":
        encode = lambda name, w: gptq(w, kw["group"], kw["symmetric"], gen)                  # noqa: E731
    elif method == "awq":
        encode = lambda name, w: awq(w, kw["group"], gen)                                    # noqa: E731
    else:
        raise ValueError(method)
    write(src, dst, oracle, encode, config_for(method, **kw))


def online_oracle(src: Path, oracle: Path, fmt: str, group: int = 128) -> None:
    """The fp32 oracle of `model.quantization = fmt` on src: moed's own quantizer, dequantized,
    on the matrices moed quantizes (MLA's kv_b stays plain)."""
    from moed.model.quant.quantize import quantize

    def encode(name: str, w: torch.Tensor):
        if "kv_b_proj" in name:
            return None
        return {}, quantize(w, fmt, group).dequantize(torch.float32)

    unused = oracle.with_name(oracle.name + "-unused")
    write(src, unused, oracle, encode, None)
    shutil.rmtree(unused, ignore_errors=True)
