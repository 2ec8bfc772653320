"""Quantized checkpoint tensors -> QuantWeights, by the published layouts.

A quantized matrix is several checkpoint tensors under one prefix X; the Grouper collects them
as the loader walks the files (they may straddle shards: a part left waiting at a file's end is
read into memory) and hands the loader one QuantSource named `X.weight`, so the architecture's
name rules apply unchanged. Layouts (W = dequantized weight, [out, in] as nn.Linear holds it):

  fp8 (DeepSeek)     X.weight float8_e4m3fn [out, in]; X.weight_scale_inv [ceil(out/bo), ceil(in/bi)]
                     W[i, j] = q[i, j] * s[i // bo, j // bi]    (bo, bi) = weight_block_size
  compressed-tensors X.weight_packed int32 [out, ceil(in/p)], p = 32 / bits values per word, low
  pack-quantized     bits first, each stored as q + 2^(bits-1); X.weight_shape [2] = (out, in);
                     X.weight_scale [out, groups]; X.weight_zero_point (asymmetric only) int32
                     [ceil(out/p), groups], packed along the rows the same way
                     W[i, j] = (q[i, j] - zp[i, g]) * s[i, g], g = j // group
  compressed-tensors X.weight int8 [out, in]; X.weight_scale [out, groups]; X.weight_zero_point
  int-quantized      int8 [out, groups] (asymmetric)
  gptq               X.qweight int32 [in/8, out], 8 nibbles per word along the input, low first;
                     X.qzeros int32 [groups, out/8] (v1: zero - 1); X.scales [groups, out];
                     X.g_idx [in] (must be j // group: act-order is refused)
                     W[i, j] = (q[j, i] - z[g, i]) * s[g, i]
  awq (GEMM)         X.qweight int32 [in, out/8], 8 nibbles per word along the output in the
                     order (0, 2, 4, 6, 1, 3, 5, 7); X.qzeros int32 [groups, out/8] packed alike
                     (zeros as they are); X.scales [groups, out]; W as gptq's
Every shape is checked against the others and the config's group/block size; a mismatch is a
WeightError naming the tensor. A symmetric checkpoint's zero points, when stored, must be zero.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from moed.model.quant.formats import CheckpointQuant
from moed.model.quant.quantize import from_block_fp8
from moed.model.quant.weight import QuantWeight, pack_int4
from moed.model.safetensors_file import Stored, WeightError

Part = Stored | torch.Tensor

_SUFFIXES = {
    "fp8": ("weight", "weight_scale_inv"),
    "ct-packed": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"),
    "ct-int": ("weight", "weight_scale", "weight_zero_point"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}
# AutoAWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i] of its 8; reading the
# nibbles in AWQ_REVERSE order gives the columns in order
AWQ_REVERSE = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])


def _kind(ck: CheckpointQuant) -> str:
    if ck.method == "compressed-tensors":
        return "ct-packed" if ck.packed else "ct-int"
    return ck.method


def _read(t: Part) -> torch.Tensor:
    return t.read() if isinstance(t, Stored) else t


def _shape(t: Part) -> list[int]:
    return list(t.shape)


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> unsigned values (int32), `32 / bits` per word along `dim`, low bits first."""
    per = 32 // bits
    mask = (1 << bits) - 1
    parts = [(words >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=dim + 1).flatten(dim, dim + 1)


class QuantSource:
    """One quantized matrix still on disk (or in memory): what the loader places."""

    def __init__(self, base: str, parts: dict[str, Part], ck: CheckpointQuant) -> None:
        self.base, self.parts, self.ck = base, parts, ck
        self.fmt = ck.fmt
        self.asymmetric = not ck.symmetric
        self.nbytes = sum(p.nbytes for p in parts.values())
        kind = _kind(ck)
        if kind == "fp8":
            self.shape = tuple(_shape(parts["weight"]))
            self.group = ck.block[1]
        elif kind == "ct-packed":
            self.shape = tuple(int(x) for x in _read(parts["weight_shape"]).tolist())
            self.group = ck.group or self.shape[-1]
        elif kind == "ct-int":
            self.shape = tuple(_shape(parts["weight"]))
            self.group = ck.group or self.shape[-1]
        elif kind == "awq":
            n, cols = _shape(parts["qweight"])
            self.shape = (cols * 8, n)
            self.group = ck.group or n
        else:
            rows, out = _shape(parts["qweight"])
            self.shape = (out, rows * 8)
            self.group = ck.group or self.shape[-1]
        if len(self.shape) != 2:
            raise WeightError(f"{base}: a quantized weight of shape {list(self.shape)}; expected 2 dims")
        self._check(kind)

    def _expect(self, name: str, shape: list[int], why: str) -> None:
        got = _shape(self.parts[name])
        if got != shape:
            raise WeightError(f"{self.base}.{name}: shape {got}, expected {shape} ({why})")

    def _check(self, kind: str) -> None:
        out, n = self.shape
        groups = -(-n // self.group)
        if kind == "fp8":
            bo, bi = self.ck.block
            self._expect("weight_scale_inv", [-(-out // bo), -(-n // bi)],
                         f"{self.base}.weight {[out, n]} in {bo}x{bi} blocks, quantization_config.weight_block_size")
        elif kind == "ct-packed":
            p = 32 // (4 if self.fmt == "int4" else 8)
            self._expect("weight_packed", [out, -(-n // p)], f"weight_shape {[out, n]}, {32 // p}-bit packed")
            self._expect("weight_scale", [out, groups], f"group size {self.group}")
            if self.asymmetric:
                self._expect("weight_zero_point", [-(-out // p), groups], "zero points packed along rows")
        elif kind == "ct-int":
            self._expect("weight_scale", [out, groups], f"group size {self.group}")
            if self.asymmetric:
                self._expect("weight_zero_point", [out, groups], f"group size {self.group}")
        else:       # gptq, awq: the same zeros and scales
            if out % 8:
                raise WeightError(f"{self.base}.qweight: {out} output columns, not a multiple of 8")
            self._expect("qzeros", [groups, out // 8], f"group size {self.group}")
            self._expect("scales", [groups, out], f"group size {self.group}")

    def read(self) -> QuantWeight:
        kind, p = _kind(self.ck), self.parts
        out, n = self.shape
        if kind == "fp8":
            return from_block_fp8(_read(p["weight"]), _read(p["weight_scale_inv"]), self.ck.block)
        if kind == "awq":
            u = _awq_columns(unpack_int32(_read(p["qweight"]), 4, 1)).t()        # [out, in]
            z = _awq_columns(unpack_int32(_read(p["qzeros"]), 4, 1)).t()         # [out, groups]
            scale = _read(p["scales"]).float().t().contiguous()
            return QuantWeight("int4", pack_int4(u), scale, z.to(torch.uint8).contiguous(), self.group, n)
        if kind == "gptq":
            u = unpack_int32(_read(p["qweight"]), 4, 0)[:n].t()                  # [out, in]
            z = unpack_int32(_read(p["qzeros"]), 4, 1) + int(self.ck.zeros_minus_one)   # [groups, out]
            scale = _read(p["scales"]).float().t().contiguous()
            zero = None if bool((z == 8).all()) else z.t().to(torch.uint8).contiguous()
            return QuantWeight("int4", pack_int4(u), scale, zero, self.group, n)
        scale = _read(p["weight_scale"]).float().contiguous()
        bits = 4 if self.fmt == "int4" else 8
        if kind == "ct-packed":
            u = unpack_int32(_read(p["weight_packed"]), bits, 1)[:, :n]
            zp = None
            if self.asymmetric:
                zp = unpack_int32(_read(p["weight_zero_point"]), bits, 0)[:out]  # stored zp + offset
            if bits == 4:
                return QuantWeight("int4", pack_int4(u), scale,
                                   None if zp is None else zp.to(torch.uint8).contiguous(), self.group, n)
            q = (u - 128).to(torch.int8)
            return QuantWeight("int8", q.contiguous(), scale,
                               None if zp is None else (zp - 128).to(torch.int8).contiguous(), self.group, n)
        q = _read(p["weight"])
        zp = _read(p["weight_zero_point"]).to(torch.int8).contiguous() if self.asymmetric else None
        return QuantWeight("int8", q.contiguous(), scale, zp, self.group, n)


def _awq_columns(u: torch.Tensor) -> torch.Tensor:
    """[rows, cols] unpacked in nibble order -> columns in order (AWQ_REVERSE per 8)."""
    r, c = u.shape
    return u.view(r, c // 8, 8)[..., AWQ_REVERSE].reshape(r, c)


class Grouper:
    """Collects each quantized matrix's tensors as the files are walked (see the module doc)."""

    def __init__(self, ck: CheckpointQuant) -> None:
        self.ck, self.kind = ck, _kind(ck)
        self.suffixes = _SUFFIXES[self.kind]
        self.pending: dict[str, dict[str, Part]] = {}

    def _required(self) -> set[str]:
        req = {"fp8": {"weight", "weight_scale_inv"}, "gptq": {"qweight", "qzeros", "scales"},
               "awq": {"qweight", "qzeros", "scales"},
               "ct-packed": {"weight_packed", "weight_scale", "weight_shape"},
               "ct-int": {"weight", "weight_scale"}}[self.kind]
        if not self.ck.symmetric and self.kind.startswith("ct"):
            req.add("weight_zero_point")
        return req

    def _member(self, suffix: str, t: Part) -> bool:
        if suffix not in self.suffixes:
            return False
        if suffix == "weight":        # a plain weight (norm, router, an ignored layer) passes
            return t.dtype == (torch.float8_e4m3fn if self.kind == "fp8" else torch.int8)
        return True

    def feed(self, items: Iterable[tuple[str, Stored]]) -> Iterator[tuple[str, Part | QuantSource]]:
        for key, t in items:
            base, _, suffix = key.rpartition(".")
            if not self._member(suffix, t):
                yield key, t
                continue
            if self._side_check(key, suffix, t):
                continue
            g = self.pending.setdefault(base, {})
            if suffix in g:
                raise WeightError(f"{key}: duplicate tensor")
            g[suffix] = t
            if self._required() <= set(g):
                del self.pending[base]
                yield base + ".weight", QuantSource(base, g, self.ck)

    def _side_check(self, key: str, suffix: str, t: Part) -> bool:
        """Tensors that carry nothing moed keeps, checked and dropped: a symmetric checkpoint's
        zero points (must be zero), GPTQ's g_idx (must be the plain grouping)."""
        if suffix == "weight_zero_point" and self.ck.symmetric:
            if bool(_read(t).any()):
                raise WeightError(f"{key}: non-zero zero points in a symmetric checkpoint")
            return True
        if suffix == "g_idx":
            g = _read(t).to(torch.long)
            group = self.ck.group or g.numel()
            if not torch.equal(g, torch.arange(g.numel()) // group):
                raise WeightError(f"{key}: not the plain grouping j // {group} (act-order); not supported")
            return True
        return False

    def end_of_file(self) -> None:
        """The file is about to be unmapped: read the parts still waiting for their partners."""
        for g in self.pending.values():
            for s, t in g.items():
                if isinstance(t, Stored):
                    g[s] = t.read()

    def finish(self) -> None:
        if self.pending:
            base, g = next(iter(self.pending.items()))
            missing = sorted(self._required() - set(g))
            raise WeightError(f"{base}: {', '.join(base + '.' + m for m in missing)} missing "
                              f"(quantization_config.quant_method {self.ck.method})"
                              + (f"; {len(self.pending) - 1} more incomplete" if len(self.pending) > 1 else ""))
