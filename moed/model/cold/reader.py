"""The disk tier: one routed expert's weights read from the checkpoint's own safetensors files.

At start the files' headers are read once (the loader's `read_index`, so the same names, the
same checks) into an index (MoE layer, expert) -> where its gate, up and down matrices lie:
per-expert tensors, or an expert's slice of a fused [E, ...] tensor. A read is `os.preadv`
into a private buffer, not a mapping: mapped pages would count in this process's RSS until
dropped, and a budget on resident bytes is the point. The page cache still keeps what was read
(the kernel reclaims it first under a cgroup's memory.max).

`read_into` / `read` with `cached` read only what the page cache holds (`RWF_NOWAIT`: the
kernel copies cached pages and never waits for the disk), so the step thread can do them
itself, with no hand-off to a reader thread and no timeout to guard; anything not cached is
left to the blocking read on the miss thread (moed/model/cold/store.py read_slots).

Each file stays open from the index on: a file removed after start is still read (the open
descriptor holds it), so output stays correct. A read that comes back short (the file was
truncated) or fails (EIO) raises ExpertReadError with a message fit for a client; the path and
the OS error go to the log only.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from moed.model import archs
from moed.model.loader import checkpoint_files, compile_rules
from moed.model.safetensors_file import Mapped, WeightError, read_index
from moed.model.spec import ModelSpec

log = structlog.get_logger(__name__)


def _libc_mincore() -> ctypes.CDLL | None:
    """libc with mmap / mincore / munmap typed, or None where there is no mincore."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc_mincore()
_MAP_FAILED = ctypes.c_void_p(-1).value


def page_cached(fd: int, offset: int, nbytes: int) -> bool | None:
    """Whether the page cache holds every page of fd's [offset, offset + nbytes), or None when
    this cannot tell (no mincore, an error). mincore over a mapping never touched: no page is
    read, none counts in the RSS; the mapping is gone when this returns."""
    if _LIBC is None:
        return None
    start = offset - offset % mmap.PAGESIZE
    length = offset + nbytes - start
    addr = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr in (None, _MAP_FAILED):
        return None
    try:
        pages = (ctypes.c_ubyte * ((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        if _LIBC.mincore(addr, length, pages) != 0:
            return None
        return all(b & 1 for b in pages)
    finally:
        _LIBC.munmap(addr, length)


class ExpertReadError(RuntimeError):
    """An expert's weights could not be read from disk; str() is safe to show a client."""


@dataclass(frozen=True)
class Extent:
    """One matrix of one expert in a checkpoint file: bytes [offset, offset + nbytes)."""
    file: int                   # index into ExpertIndex.paths
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


_ROLES = ("gate", "up", "down")


class ExpertIndex:
    """(layer, expert) -> its gate, up and down Extents; reads them into plain tensors."""

    def __init__(self, model_dir: str | Path, spec: ModelSpec, dtype: torch.dtype | None) -> None:
        """dtype: what read() returns; None: the checkpoint's own (quantized at load from it)."""
        self.spec = spec
        self.paths = checkpoint_files(Path(model_dir))
        rules = compile_rules(archs.get(spec.arch).weight_names)
        self.where: dict[tuple[int, int, str], Extent] = {}
        for n, path in enumerate(self.paths):
            with Mapped(path) as f:
                for key, st in read_index(f).items():
                    self._add(rules, n, key, st.offset, st.dtype, st.shape)
        self._check()
        layer0 = next(i for i in range(spec.num_layers) if i not in spec.dense_layers)
        self.dtype = dtype if dtype is not None else self.where[(layer0, 0, "gate")].dtype
        self.fds = [os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) for p in self.paths]
        self._nowait: int | None = getattr(os, "RWF_NOWAIT", None)    # Linux only: else no cached reads
        self._local = threading.local()     # read(reuse=True)'s buffer, one per thread

    def _add(self, rules: tuple, n: int, key: str, offset: int, dtype: torch.dtype,
             shape: tuple[int, ...]) -> None:
        for pat, kind in rules:
            m = pat.match(key)
            if m is None:
                continue
            if not kind.startswith(("expert.", "fused.")):
                return
            layer = int(m.group(1))
            if kind.startswith("expert."):
                self.where[(layer, int(m.groups()[1]), kind.split(".")[1])] = Extent(n, offset, dtype, shape)
            elif kind in ("fused.gate_up", "fused.down"):
                per = shape[1:]
                step = torch.Size(per).numel() * dtype.itemsize
                for e in range(shape[0]):
                    if kind == "fused.down":
                        self.where[(layer, e, "down")] = Extent(n, offset + e * step, dtype, per)
                    else:       # [2I, H], gate half first: two halves of one contiguous run
                        half = (per[0] // 2, per[1])
                        hb = step // 2
                        self.where[(layer, e, "gate")] = Extent(n, offset + e * step, dtype, half)
                        self.where[(layer, e, "up")] = Extent(n, offset + e * step + hb, dtype, half)
            return

    def _check(self) -> None:
        s = self.spec
        missing = [(i, e, r) for i in range(s.num_layers) if i not in s.dense_layers
                   for e in range(s.num_experts) for r in _ROLES if (i, e, r) not in self.where]
        if missing:
            raise WeightError(f"cold experts: the checkpoint lacks per-expert tensors for "
                              f"{len(missing)} (layer, expert, matrix), e.g. {missing[:3]}")

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights in the compute dtype (what a resident slot holds)."""
        i, h = self.spec.moe_intermediate_size, self.spec.hidden_size
        return 3 * i * h * self.dtype.itemsize

    def cached(self, layer: int, expert: int) -> bool | None:
        """Whether the page cache holds all of one expert's bytes (None: cannot tell here)."""
        got = [page_cached(self.fds[x.file], x.offset, x.nbytes)
               for x in (self.where[(layer, expert, r)] for r in _ROLES)]
        return None if None in got else all(got)

    def read(self, layer: int, expert: int, cached: bool = False,
             reuse: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up [2I, H] gate half first, down [H, I]) of one expert in the compute dtype,
        cast as the loader casts them; ExpertReadError when the files cannot give them.
        cached: from the page cache only (read_into), None where it did not hold them.
        reuse: into the calling thread's own buffer, overwritten by its next read with reuse
        (for a caller that copies the weights out at once: packs or quantizes them). A fresh
        buffer's pages fault in on the read: 208 us an expert of the bench model against 127
        into a reused one (docs/cold-experts.md, coldmiss)."""
        i, h = self.spec.moe_intermediate_size, self.spec.hidden_size
        bufs = getattr(self._local, "bufs", None) if reuse else None
        if bufs is None:
            bufs = (torch.empty((2 * i, h), dtype=self.dtype), torch.empty((h, i), dtype=self.dtype))
            if reuse:
                self._local.bufs = bufs
        return bufs if self.read_into(layer, expert, *bufs, cached) else None

    def read_into(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor,
                  cached: bool = False) -> bool:
        """read() into the caller's tensors (a resident slot's own: no buffer, no copy, where
        the checkpoint's dtype is the compute dtype); on ExpertReadError they hold a part.
        cached: only what the page cache holds, never waiting for the disk (RWF_NOWAIT): False
        when a byte was not there (or no RWF_NOWAIT here, or any error: the blocking read then
        gives the error its message and overwrites what was copied). True otherwise."""
        i = self.spec.moe_intermediate_size
        for role, dst in (("gate", gate_up[:i]), ("up", gate_up[i:]), ("down", down)):
            ext = self.where[(layer, expert, role)]
            in_place = ext.dtype == self.dtype and tuple(dst.shape) == ext.shape     # no cast
            raw = dst.view(-1).view(torch.uint8) if in_place else torch.empty(ext.nbytes, dtype=torch.uint8)
            if cached:
                if not self._pread_cached(ext, raw):
                    return False
            else:
                self._pread(ext, layer, expert, raw)
            if not in_place:
                dst.copy_(raw.view(ext.dtype).view(ext.shape))
        return True

    def _pread_cached(self, ext: Extent, into: torch.Tensor) -> bool:
        if self._nowait is None:
            return False
        view, got = memoryview(into.numpy()), 0
        try:
            while got < ext.nbytes:     # a partial read stops at a page not cached (or at EOF)
                n = os.preadv(self.fds[ext.file], [view[got:]], ext.offset + got, self._nowait)
                if n == 0:
                    return False
                got += n
        except OSError:                 # EAGAIN: not cached; EOPNOTSUPP: not on this file system
            return False
        return True

    def _pread(self, ext: Extent, layer: int, expert: int, into: torch.Tensor | None = None) -> torch.Tensor:
        raw = torch.empty(ext.nbytes, dtype=torch.uint8) if into is None else into
        view, got = memoryview(raw.numpy()), 0
        try:
            while got < ext.nbytes:
                n = os.preadv(self.fds[ext.file], [view[got:]], ext.offset + got)
                if n == 0:
                    raise OSError(f"short read: {got} of {ext.nbytes} bytes (file truncated?)")
                got += n
        except OSError as e:
            log.error("expert_read_failed", layer=layer, expert=expert, path=str(self.paths[ext.file]),
                      offset=ext.offset, nbytes=ext.nbytes, error=str(e))
            raise ExpertReadError(f"expert weights could not be read from disk (layer {layer}, "
                                  f"expert {expert})") from None
        return raw.view(ext.dtype).view(ext.shape)

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
