"""QuantWeight: one quantized weight matrix (or a stack of them) in moed's in-memory layout.

Every format is stored the same way, group-wise along the input dim, per output row:

    W[..., i, j] = (q[..., i, j] - zero[..., i, j // group]) * scale[..., i, j // group]

  fp8   q float8_e4m3fn [..., out, in]; zero None. A checkpoint's 128x128 block scales
        (`weight_scale_inv` [ceil(out/128), ceil(in/128)]) are repeated per row at load:
        exact, +1/32 byte per weight, and every row owns its scales.
  int8  q int8 [..., out, in]; zero None (symmetric) or int8
  int4  q two unsigned nibbles per byte, uint8 [..., out, ceil(in/2)], column 2c in the low
        nibble; zero None (symmetric: 8) or uint8 0..15
  scale float32 [..., out, ceil(in/group)]

Why per row: the loader fuses checkpoint matrices along the output dim (q|k|v, gate|up, the
experts of a layer) and permutes rows (MLA's rope rows); with per-row scales these are plain
row copies for data, scales and zeros alike, exact for any split of the rows, where 128-row
blocks would straddle parts whose sizes are not multiples of 128. Slicing the leading or row
dims (an expert, a row range) gives a view of all three tensors (`qw[e]`, `qw[e, lo:hi]`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("fp8", "int8", "int4")
FP8_MAX = 448.0          # largest finite float8_e4m3fn


@dataclass(frozen=True)
class QuantWeight:
    fmt: str                        # "fp8" | "int8" | "int4"
    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group: int                      # input columns per scale
    in_features: int

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-1], self.in_features)

    @property
    def dtype(self) -> str:
        return self.fmt

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.data.device

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that hold it (what a mover copies); fp8 data as uint8 bytes (collective
        backends move bytes; the view writes through)."""
        data = self.data.view(torch.uint8) if self.fmt == "fp8" else self.data
        return [data, self.scale] + ([] if self.zero is None else [self.zero])

    def __getitem__(self, idx: object) -> QuantWeight:
        """A view over leading/row indices (never the input dim)."""
        if not isinstance(idx, tuple):
            idx = (idx,)
        if len(idx) >= self.data.dim():
            raise IndexError("a QuantWeight is indexed over its leading and row dims only")
        z = None if self.zero is None else self.zero[idx]
        return QuantWeight(self.fmt, self.data[idx], self.scale[idx], z, self.group, self.in_features)

    def index_rows(self, rows: torch.Tensor) -> QuantWeight:
        """Rows (output dim) in the given order: data, scales and zeros alike."""
        pick = lambda t: t.index_select(-2, rows.to(t.device)).contiguous()      # noqa: E731
        return QuantWeight(self.fmt, pick(self.data), pick(self.scale),
                           None if self.zero is None else pick(self.zero), self.group, self.in_features)

    def copy_(self, src: QuantWeight, name: str = "weight") -> None:
        """Write src (same format, group, shape) into this view."""
        if (src.fmt, src.group, src.in_features) != (self.fmt, self.group, self.in_features) \
                or tuple(src.data.shape) != tuple(self.data.shape):
            raise ValueError(f"{name}: {src.describe()} does not fit {self.describe()}")
        self.data.copy_(src.data)
        self.scale.copy_(src.scale)
        if self.zero is not None:
            self.zero.copy_(src.zero if src.zero is not None else implicit_zero(self.fmt, self.zero))
        elif src.zero is not None:
            raise ValueError(f"{name}: an asymmetric part (with zero points) joins symmetric ones")

    def describe(self) -> str:
        return (f"{self.fmt} {list(self.shape)} group {self.group}"
                f"{' asymmetric' if self.zero is not None else ''}")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The plain weight [..., out, in]: computed in fp32 ((q - zero) is exact there, one
        rounding for the scale product), then cast. Bytes become floats through a 256-entry
        table (index_select with int32 indices: 5x fp8's own conversion on CPU, 2.5x int4's
        shifts and masks; the same values)."""
        n, lead = self.in_features, self.data.shape[:-1]
        if self.fmt == "int4":
            lut = _INT4_SYM if self.zero is None else _INT4
            q = _lut(lut, self.data).view(*lead, -1)[..., :n]
        elif self.fmt == "fp8":
            q = _lut(_FP8, self.data.view(torch.uint8)).view(*lead, n)
        else:
            q = self.data.float()
        if self.zero is not None:
            q = _per_group(q, self.zero.float(), self.group, torch.Tensor.sub_)
        w = _per_group(q, self.scale, self.group, torch.Tensor.mul_)
        return w if dtype == torch.float32 else w.to(dtype)


# byte -> float tables: fp8 e4m3fn values; int4 [low, high] nibbles (symmetric: minus 8)
_FP8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_INT4 = torch.stack(((torch.arange(256) & 15).float(), (torch.arange(256) >> 4).float()), dim=-1)
_INT4_SYM = _INT4 - 8.0


def _lut(table: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    if table.device != data.device:
        table = table.to(data.device)
    return table.index_select(0, data.reshape(-1).int())


def _per_group(q: torch.Tensor, per_group: torch.Tensor, group: int, op) -> torch.Tensor:
    """op(q, per-group values over their columns), in place on q (a fresh tensor: fewer
    multi-MB allocations, each of which page-faults anew); broadcast where the groups tile."""
    n = q.shape[-1]
    if n % group == 0 and q.is_contiguous():
        op(q.view(*q.shape[:-1], n // group, group), per_group.unsqueeze(-1))
        return q
    return op(q, expand(per_group, group, n))


def expand(per_group: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """[..., groups] -> [..., n]: each group's value over its `group` columns."""
    return per_group.repeat_interleave(group, dim=-1)[..., :n]


def implicit_zero(fmt: str, like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, 8 if fmt == "int4" else 0)


def empty(fmt: str, shape: tuple[int, ...], group: int, asymmetric: bool,
          device: torch.device | str = "cpu") -> QuantWeight:
    """An uninitialised QuantWeight of logical shape [..., out, in] (what the loader fills)."""
    *lead, n = shape
    groups = -(-n // group)
    cols = -(-n // 2) if fmt == "int4" else n
    dt = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.uint8}[fmt]
    zero = None
    if asymmetric:
        zero = torch.empty((*lead, groups), dtype=torch.uint8 if fmt == "int4" else torch.int8, device=device)
    return QuantWeight(fmt, torch.empty((*lead, cols), dtype=dt, device=device),
                       torch.empty((*lead, groups), dtype=torch.float32, device=device), zero, group, n)


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """Unsigned nibbles [..., n] (0..15, any int dtype) -> uint8 [..., ceil(n/2)], low nibble first."""
    u = u.to(torch.uint8)
    if u.shape[-1] % 2:
        u = torch.nn.functional.pad(u, (0, 1))
    return u[..., 0::2] | (u[..., 1::2] << 4)


def cat_rows(parts: list[torch.Tensor | QuantWeight]) -> torch.Tensor | QuantWeight:
    """Concatenate along the output dim (plain tensors, or QuantWeights of one format/group)."""
    if not isinstance(parts[0], QuantWeight):
        return torch.cat(parts)      # type: ignore[arg-type]
    first = parts[0]
    if any(not isinstance(p, QuantWeight) or (p.fmt, p.group, p.in_features, p.zero is None)
           != (first.fmt, first.group, first.in_features, first.zero is None) for p in parts):
        raise ValueError("weights fused along rows must share format, group and zero points")
    zero = None if first.zero is None else torch.cat([p.zero for p in parts], dim=-2)   # type: ignore[misc]
    return QuantWeight(first.fmt, torch.cat([p.data for p in parts], dim=-2),       # type: ignore[union-attr]
                       torch.cat([p.scale for p in parts], dim=-2), zero,            # type: ignore[union-attr]
                       first.group, first.in_features)


def plain(w: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """A plain tensor of w in dtype (dequantized if quantized)."""
    return w.dequantize(dtype) if isinstance(w, QuantWeight) else w.to(dtype)
