"""A safetensors file read through its own mapping, each tensor's pages dropped once copied.

The format: an 8-byte little-endian header size, a JSON header (name -> dtype, shape and byte
range after the header), then the data, row-major and little-endian. A mapped page counts in
the process's RSS until it is unmapped or dropped. safetensors' own reader kept the whole file
resident until it closed, so a load peaked at twice the weights: 1343 MiB for the bench model,
against 794 after the load. Here each tensor's pages are dropped (madvise DONTNEED) right
after its copy, and the page cache still holds them.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import sys
import warnings
from pathlib import Path

import torch


class WeightError(ValueError):
    """The checkpoint's tensors do not match its config (missing, unexpected or mis-shaped), or
    a file is not a readable safetensors file."""


# safetensors dtype names (the format's spec); the data is little-endian, row-major
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
              "F8_E5M2": torch.float8_e5m2}
_ST_MAX_HEADER = 100 << 20      # the format's own bound on the JSON header


class Mapped:
    """A safetensors file mapped read-only; release() drops the pages of what was copied."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            # read-only and shared: no commit charge (a private writable map of a 500 GB file
            # fails under strict overcommit); the tensor over it is only ever read
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        if self.mm is None:
            self.bytes = torch.empty(0, dtype=torch.uint8)
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)

    # A read fault maps pages around it too (fault-around, 64 KiB by default; a large page
    # cache folio, up to 2 MiB), some of tensors already released: each release reaches back.
    BACK = 2 << 20

    def release(self, offset: int, nbytes: int) -> None:
        """Drop this process's pages up to offset + nbytes, from BACK before offset (the page
        cache keeps them: a page shared with the next tensor is just faulted in again)."""
        if self.mm is None or not hasattr(self.mm, "madvise"):
            return
        lo = max(0, offset - self.BACK)
        lo -= lo % mmap.PAGESIZE
        hi = min(offset + nbytes, self.size)
        if hi > lo:
            self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        self.bytes = None           # the tensor's export of the buffer, released before close
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:     # a view still held (an error's traceback): unmapped with it
                pass

    def __enter__(self) -> Mapped:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Stored:
    """One tensor of a Mapped file: its dtype, shape and place."""

    __slots__ = ("file", "offset", "nbytes", "dtype", "shape")

    def __init__(self, file: Mapped, offset: int, nbytes: int, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> None:
        self.file, self.offset, self.nbytes, self.dtype, self.shape = file, offset, nbytes, dtype, shape

    def _view(self) -> torch.Tensor:
        raw = self.file.bytes[self.offset:self.offset + self.nbytes]
        if self.offset % self.dtype.itemsize:       # the format does not promise alignment
            raw = raw.clone()
        return raw.view(self.dtype).view(self.shape)

    def into(self, dst: torch.Tensor) -> None:
        """dst.copy_(this tensor) (cast and device move included), then its pages dropped."""
        dst.copy_(self._view())
        self.file.release(self.offset, self.nbytes)

    def read(self) -> torch.Tensor:
        """A tensor of its own (the file's pages dropped)."""
        t = self._view().clone()
        self.file.release(self.offset, self.nbytes)
        return t


def read_index(f: Mapped) -> dict[str, Stored]:
    """Name -> Stored for every tensor of a mapped safetensors file, in file order."""
    if sys.byteorder != "little":
        raise WeightError("safetensors data is little-endian; this host is big-endian")
    head = f.mm[:8] if f.mm is not None else b""
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < n <= min(_ST_MAX_HEADER, f.size - 8):
        raise WeightError(f"{f.name}: not a safetensors file (header size {n})")
    try:
        meta = json.loads(f.mm[8:8 + n])
    except ValueError as e:
        raise WeightError(f"{f.name}: unreadable safetensors header ({e})") from None
    base, out = 8 + n, {}
    f.release(0, base)
    for key, v in meta.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES.get(v["dtype"])
            shape = tuple(int(x) for x in v["shape"])
            begin, end = (int(x) for x in v["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise WeightError(f"{f.name}: {key}: malformed header entry {v!r:.200}") from None
        if dtype is None:
            raise WeightError(f"{f.name}: {key}: dtype {v['dtype']!r} not supported")
        nbytes = math.prod(shape) * dtype.itemsize
        if begin < 0 or end - begin != nbytes or base + end > f.size:
            raise WeightError(f"{f.name}: {key}: data range [{begin}, {end}) does not hold "
                              f"{list(shape)} {str(dtype).removeprefix('torch.')} within the file")
        out[key] = Stored(f, base + begin, nbytes, dtype, shape)
    return dict(sorted(out.items(), key=lambda kv: kv[1].offset))   # one forward pass over the file
