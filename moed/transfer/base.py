"""The KV transfer interface: one small ABC that every backend implements.

Model: each node registers its one KV tensor `[num_layers, num_blocks, *block]` with a
`RegionLayout` built from the model's KVLayout (moed/model/kv_layout.py: bytes per block per
layer, block format, layout id) and the tensor's address (`ModelRunner.kv_region()` gives both),
publishes `local_metadata()` once, and a peer that wants to WRITE into it calls
`add_peer(name, metadata, incarnation)`, which refuses a peer whose layout differs. A WRITE copies
src_block_ids[i] (local) → dst_block_ids[i] (peer) in every layer and then delivers `notif` to
the peer, after the data; a READ copies the peer's src blocks into local dst blocks, then
notifies the peer the same way. Transfers are polled, never awaited inside a backend.

Threading: a backend is NOT thread-safe and must be driven by one thread
(`moed.transfer.worker.TransferWorker` does that off the event loop).
"""
from __future__ import annotations

import enum
import importlib
import json
import struct
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Protocol, Sequence


class TransferError(RuntimeError):
    """Base of every transfer error; the message is fit for a log line."""


class BadMetadata(TransferError):
    """Peer metadata could not be parsed, or belongs to another backend."""


class IncompatibleLayout(TransferError):
    """The peer's KV region has a different block format: copying would corrupt it."""


class UnknownPeer(TransferError):
    """No peer of that name was added (or it was removed)."""


class StalePeer(TransferError):
    """Metadata from an older incarnation than the one already known."""


class TransferState(str, enum.Enum):
    PENDING = "pending"      # posted, data may still be moving
    DONE = "done"            # data and notification delivered to the peer's agent
    FAILED = "failed"        # backend error (peer died, disconnect, bad range); reason says which
    ABORTED = "aborted"      # cancelled locally by abort() or remove_peer()


TRANSFER_TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset({TransferState.DONE, TransferState.FAILED,
                                      TransferState.ABORTED}),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
    TransferState.ABORTED: frozenset(),
}


def check_transition(old: TransferState, new: TransferState) -> None:
    if new is not old and new not in TRANSFER_TRANSITIONS[old]:
        raise RuntimeError(f"illegal transfer transition {old.value} -> {new.value}")


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    reason: str = ""          # set for FAILED/ABORTED: "peer_disconnected", "timeout", ...

    @property
    def terminal(self) -> bool:
        return self.state is not TransferState.PENDING


@dataclass(frozen=True)
class TransferHandle:
    id: int
    peer: str
    num_blocks: int
    nbytes: int
    num_descs: int            # descriptors after merging contiguous runs (per all layers)


class KVFormat(Protocol):
    """What transfer needs of the model's KVLayout (read, never imported: transfer sits below
    the model)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def block_format(self) -> str: ...
    @property
    def layout_id(self) -> str: ...


@dataclass(frozen=True)
class RegionLayout:
    """A registered KV tensor: where it is and how a block maps to bytes."""

    base_addr: int
    num_layers: int
    num_blocks: int
    block_bytes: int          # one block in one layer (KVLayout.block_bytes)
    layer_stride: int         # bytes between layer l and l+1 (num_blocks * block_bytes if dense)
    block_format: str = ""    # dtype and block shape; peers must match exactly
    layout_id: str = ""       # KVLayout.layout_id; "" for a raw tensor (from_tensor)

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_blocks < 1 or self.block_bytes < 1:
            raise ValueError(f"empty KV region: {self}")
        if self.layer_stride < self.num_blocks * self.block_bytes:
            raise ValueError("layer_stride smaller than one layer's blocks")

    @property
    def nbytes(self) -> int:
        return (self.num_layers - 1) * self.layer_stride + self.num_blocks * self.block_bytes

    @classmethod
    def from_kv_layout(cls, kv: KVFormat, base_addr: int, num_blocks: int) -> "RegionLayout":
        """The region of a dense KV tensor of num_blocks blocks laid out as kv says, at base_addr."""
        return cls(base_addr=base_addr, num_layers=kv.num_layers, num_blocks=num_blocks,
                   block_bytes=kv.block_bytes, layer_stride=num_blocks * kv.block_bytes,
                   block_format=kv.block_format, layout_id=kv.layout_id)

    @classmethod
    def from_tensor(cls, kv: Any) -> "RegionLayout":
        """From a bare `[num_layers, num_blocks, ...]` torch tensor whose blocks are dense (tests,
        tools; a model's region comes from its KVLayout)."""
        if kv.dim() < 2:
            raise ValueError("KV tensor needs at least [num_layers, num_blocks]")
        elem = kv.element_size()
        inner = tuple(kv.shape[2:])
        dense_block = elem
        for d in inner:
            dense_block *= d
        if kv.stride(1) * elem != dense_block or not kv[0, 0].is_contiguous():
            raise ValueError("KV blocks must be dense: [layers, blocks, ...], blocks contiguous")
        fmt = f"{str(kv.dtype).removeprefix('torch.')}:{'x'.join(map(str, inner))}"
        return cls(base_addr=kv.data_ptr(), num_layers=kv.shape[0], num_blocks=kv.shape[1],
                   block_bytes=dense_block, layer_stride=kv.stride(0) * elem, block_format=fmt)

    def check_covers(self, kv: Any) -> None:
        """The layout describes memory inside the tensor kv (registering more would expose
        memory the tensor does not own)."""
        if self.base_addr != kv.data_ptr() or self.nbytes > kv.numel() * kv.element_size():
            raise ValueError(f"KV layout ({self.nbytes} B at {self.base_addr:#x}) does not match the "
                             f"tensor ({kv.numel() * kv.element_size()} B at {kv.data_ptr():#x})")

    def check_compatible(self, peer: "RegionLayout") -> None:
        """Same layers, block bytes and format (the block count may differ); and the same
        layout id where both sides have one."""
        ids_differ = bool(self.layout_id and peer.layout_id and self.layout_id != peer.layout_id)
        if ids_differ or (self.num_layers, self.block_bytes, self.block_format) != (
                peer.num_layers, peer.block_bytes, peer.block_format):
            raise IncompatibleLayout(
                f"KV layout mismatch: local {self.num_layers} layers x {self.block_bytes} B "
                f"({self.block_format}, {self.layout_id or 'no id'}) vs peer {peer.num_layers} "
                f"layers x {peer.block_bytes} B ({peer.block_format}, {peer.layout_id or 'no id'})")


@dataclass(frozen=True)
class KVRegion:
    """What a node registers for transfer: its KV tensor and the tensor's layout."""
    tensor: Any
    layout: RegionLayout


# ---- metadata envelope: magic, header length, JSON header, backend blob ------------------

_MAGIC = b"MOEDKV1\0"


@dataclass(frozen=True)
class PeerMetadata:
    backend: str
    agent: str                # backend-level name, unique per process incarnation
    layout: RegionLayout
    blob: bytes               # the backend's own metadata (NIXL agent metadata)

    def encode(self) -> bytes:
        # layout_id travels beside "layout", not in it: a node of the previous release builds
        # RegionLayout(**layout) and would refuse an unknown key.
        layout = asdict(self.layout)
        head = json.dumps({"backend": self.backend, "agent": self.agent,
                           "layout_id": layout.pop("layout_id"), "layout": layout}).encode()
        return _MAGIC + struct.pack("<I", len(head)) + head + self.blob

    @classmethod
    def decode(cls, data: bytes) -> "PeerMetadata":
        if not isinstance(data, (bytes, bytearray)) or not data.startswith(_MAGIC):
            raise BadMetadata("peer metadata is not a moed KV transfer envelope")
        try:
            (n,) = struct.unpack_from("<I", data, len(_MAGIC))
            start = len(_MAGIC) + 4
            head = json.loads(data[start:start + n])
            layout = RegionLayout(**head["layout"], layout_id=str(head.get("layout_id", "")))
            return cls(backend=head["backend"], agent=head["agent"], layout=layout,
                       blob=bytes(data[start + n:]))
        except (struct.error, ValueError, KeyError, TypeError) as e:
            raise BadMetadata(f"peer metadata is corrupt: {e}") from None


class TransferBackend(ABC):
    """One node's side of KV transfers. Driven by a single thread; every call is non-blocking
    except `write_blocks`, which may copy synchronously (UCX cma) and so belongs off the loop."""

    name: str = ""

    @abstractmethod
    def register_kv(self, kv: Any, layout: RegionLayout | None = None) -> RegionLayout:
        """Register the node's KV tensor (once) with its layout (a model's comes from its
        KVLayout: `ModelRunner.kv_region()`; None derives one from a bare tensor). Returns it."""

    @abstractmethod
    def local_metadata(self) -> bytes:
        """Opaque bytes a peer passes to add_peer (small; exchange once per peer incarnation)."""

    @abstractmethod
    def add_peer(self, name: str, metadata: bytes, incarnation: int) -> bool:
        """Know a peer. Same incarnation again: no-op (False). A newer one: drop the old
        connection (aborting its transfers) and load the new (True). Older: StalePeer."""

    @abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer; its pending transfers become ABORTED. Unknown names are ignored."""

    @abstractmethod
    def has_peer(self, name: str) -> int | None:
        """The peer's known incarnation, or None."""

    @abstractmethod
    def write_blocks(self, peer: str, src_block_ids: Sequence[int],
                     dst_block_ids: Sequence[int], notif: bytes = b"") -> TransferHandle:
        """Copy local blocks into the peer's blocks (all layers), then deliver notif.
        Bad ids/peer raise; a failure while moving data shows up in poll() as FAILED."""

    @abstractmethod
    def read_blocks(self, peer: str, src_block_ids: Sequence[int],
                    dst_block_ids: Sequence[int], notif: bytes = b"") -> TransferHandle:
        """Copy the peer's blocks src_block_ids[i] into local dst_block_ids[i] (all layers), then
        deliver notif to the peer (it learns its blocks were read). Errors as write_blocks."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Current state; advances the backend. Terminal states are sticky."""

    @abstractmethod
    def abort(self, handle: TransferHandle) -> TransferStatus:
        """Cancel if still pending (→ ABORTED); returns the final status."""

    @abstractmethod
    def send_notif(self, peer: str, msg: bytes) -> None:
        """A notification without data (e.g. a first token when every block was cached)."""

    @abstractmethod
    def get_notifs(self) -> list[tuple[str, bytes]]:
        """New notifications as (sender agent name, message); also drives progress."""

    @abstractmethod
    def close(self) -> None:
        """Abort everything, deregister, release the backend. Idempotent."""


_BACKENDS = {"nixl": "moed.transfer.nixl_backend:NixlBackend"}


def create_backend(kind: str, name: str) -> TransferBackend:
    """Import the backend lazily (a CPU machine without nixl can still import moed)."""
    if kind not in _BACKENDS:
        raise ValueError(f"unknown transfer backend {kind!r} (known: {', '.join(_BACKENDS)})")
    mod, cls = _BACKENDS[kind].split(":")
    return getattr(importlib.import_module(mod), cls)(name)
