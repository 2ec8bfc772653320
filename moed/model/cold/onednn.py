"""The oneDNN copies of cold experts, kept in a side file so that a slot refilled by a miss is
not re-packed.

On the torch bf16 path each expert's Linear keeps a oneDNN-packed copy beside its plain weight
(layers.Linear: calls of 3+ rows read it, and must, to stay bitwise equal to all-resident). A
slot a miss or a promotion refills gets new plain weights and a stale copy, packed again the
first time a call reads it (LocalExperts._repack, ~0.45 ms a matrix here, ~10 ms of a 16-layer
cold step). The packed bytes depend only on the expert's weights and the matrix shape, so the
first pack of an expert is kept here, and the next time a slot holding that expert needs its
copy the bytes are copied back into the slot's oneDNN tensor in place (one read from the page
cache, ~0.1 ms) instead of packed.

The file is an unlinked temporary file (TMPDIR), written once per expert and kept by the page
cache like the checkpoint, and capped at `experts.resident_bytes` (the experts that come back
first are kept; later ones pack as before): a model far bigger than memory must not fill the
host's TMPDIR with a packed copy of every expert it has. Reads use RWF_NOWAIT (never waiting for the disk on the step thread);
anything not restored whole (not cached, a short read, an error) is packed as before, and a
write that fails turns the file off: both are the old path, so the output never depends on
the file. Off where torch has no byte access to a oneDNN tensor or os no RWF_NOWAIT.
"""
from __future__ import annotations

import ctypes
import os
import tempfile

import structlog
import torch

from moed.model.cold.stats import ColdStats
from moed.model.context import can_pack

log = structlog.get_logger(__name__)


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable view of a oneDNN tensor's buffer (valid while `t` lives: used at once)."""
    n = torch.ops.mkldnn._nbytes(t)
    return memoryview((ctypes.c_char * n).from_address(torch.ops.mkldnn.data_ptr(t))).cast("B")


def unavailable() -> str | None:
    """Why the side file cannot work here, or None."""
    if getattr(os, "RWF_NOWAIT", None) is None:
        return "no RWF_NOWAIT (not Linux)"
    if not can_pack(torch.device("cpu"), torch.bfloat16):   # nothing of oneDNN's to keep
        return "oneDNN has no bf16 matmul on this CPU (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT)"
    try:
        _bytes(torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 8))
    except (AttributeError, RuntimeError) as e:
        return f"no byte access to oneDNN tensors in this torch ({type(e).__name__})"
    return None


class OnednnFile:
    """(MoE layer position, unit) -> the oneDNN bytes of that expert's matrices, in one file."""

    def __init__(self, stats: ColdStats, cap: int) -> None:
        self.stats, self.cap = stats, cap      # bytes the file may hold
        self._f = tempfile.TemporaryFile(prefix="moed-onednn-")
        self.fd = self._f.fileno()
        self.end = 0
        self.where: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}   # offset, sizes
        self.on = True

    def restore(self, key: tuple[int, int], copies: list[torch.Tensor]) -> bool:
        """Copy `key`'s kept bytes into `copies` (the slot's oneDNN tensors) -> whether all were."""
        at = self.where.get(key)
        if at is None or not copies:
            return False
        offset, sizes = at
        views = [_bytes(t) for t in copies]
        if tuple(len(v) for v in views) != sizes:      # another layout: never mix
            return False
        try:
            for v in views:
                if os.preadv(self.fd, [v], offset, os.RWF_NOWAIT) != len(v):
                    return False
                offset += len(v)
        except OSError:             # EAGAIN (not cached), or any error: pack instead
            return False
        self.stats.onednn_restored += 1
        return True

    def keep(self, key: tuple[int, int], copies: list[torch.Tensor]) -> None:
        """Append `key`'s freshly packed bytes (once per key)."""
        self.stats.onednn_packed += 1
        if not self.on or not copies or key in self.where:
            return
        views = [_bytes(t) for t in copies]
        if self.end + sum(len(v) for v in views) > self.cap:
            return                  # full: this expert packs each time, as without the file
        try:
            for i, v in enumerate(views):
                if os.pwrite(self.fd, v, self.end + sum(len(w) for w in views[:i])) != len(v):
                    raise OSError("short write")
        except OSError as e:        # a full TMPDIR: pack every time, as without the file
            self.on = False
            log.warning("cold_experts_onednn_file_off", error=str(e))
            return
        self.where[key] = (self.end, tuple(len(v) for v in views))
        self.end += sum(len(v) for v in views)

    def close(self) -> None:
        self._f.close()


class LayerOnednn:
    """What one MoE layer's LocalExperts asks (its `onednn_side`): slot -> the unit the layer's
    table says it holds -> the file's key. A slot being filled (-1) or lost is never kept."""

    def __init__(self, file: OnednnFile, pos: int, expert_in: list[int]) -> None:
        self.file, self.pos, self.expert_in = file, pos, expert_in

    def restore(self, slot: int, copies: list[torch.Tensor]) -> bool:
        unit = self.expert_in[slot]
        return unit >= 0 and self.file.restore((self.pos, unit), copies)

    def keep(self, slot: int, copies: list[torch.Tensor]) -> None:
        unit = self.expert_in[slot]
        if unit >= 0:
            self.file.keep((self.pos, unit), copies)
