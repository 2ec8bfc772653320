"""The KV transfer interface: one small ABC that every backend implements.

Model: each node registers its one KV tensor `[num_layers, num_blocks, 2, block_size,
num_kv_heads, head_dim]` (a `RegionLayout`), publishes `local_metadata()` once, and a peer that
wants to WRITE into it calls `add_peer(name, metadata, incarnation)`. A transfer copies
src_block_ids[i] (local) → dst_block_ids[i] (peer) in every layer and then delivers `notif` to
the peer, after the data. Transfers are polled, never awaited inside a backend.

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
from typing import Any, Sequence


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


@dataclass(frozen=True)
class RegionLayout:
    """A registered KV tensor: where it is and how a block maps to bytes."""

    base_addr: int
    num_layers: int
    num_blocks: int
    block_bytes: int          # one block in one layer: 2 * block_size * heads * head_dim * elem
    layer_stride: int         # bytes between layer l and l+1 (num_blocks * block_bytes if dense)
    block_format: str = ""    # dtype and inner shape; peers must match exactly

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_blocks < 1 or self.block_bytes < 1:
            raise ValueError(f"empty KV region: {self}")
        if self.layer_stride < self.num_blocks * self.block_bytes:
            raise ValueError("layer_stride smaller than one layer's blocks")

    @property
    def nbytes(self) -> int:
        return (self.num_layers - 1) * self.layer_stride + self.num_blocks * self.block_bytes

    @classmethod
    def from_tensor(cls, kv: Any) -> "RegionLayout":
        """From a `[num_layers, num_blocks, ...]` torch tensor whose blocks are dense."""
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

    def check_compatible(self, peer: "RegionLayout") -> None:
        if (self.num_layers, self.block_bytes, self.block_format) != (
                peer.num_layers, peer.block_bytes, peer.block_format):
            raise IncompatibleLayout(
                f"KV layout mismatch: local {self.num_layers} layers x {self.block_bytes} B "
                f"({self.block_format}) vs peer {peer.num_layers} layers x {peer.block_bytes} B "
                f"({peer.block_format})")


# ---- metadata envelope: magic, header length, JSON header, backend blob ------------------

_MAGIC = b"MOEDKV1\0"


@dataclass(frozen=True)
class PeerMetadata:
    backend: str
    agent: str                # backend-level name, unique per process incarnation
    layout: RegionLayout
    blob: bytes               # the backend's own metadata (NIXL agent metadata)

    def encode(self) -> bytes:
        head = json.dumps({"backend": self.backend, "agent": self.agent,
                           "layout": asdict(self.layout)}).encode()
        return _MAGIC + struct.pack("<I", len(head)) + head + self.blob

    @classmethod
    def decode(cls, data: bytes) -> "PeerMetadata":
        if not isinstance(data, (bytes, bytearray)) or not data.startswith(_MAGIC):
            raise BadMetadata("peer metadata is not a moed KV transfer envelope")
        try:
            (n,) = struct.unpack_from("<I", data, len(_MAGIC))
            start = len(_MAGIC) + 4
            head = json.loads(data[start:start + n])
            return cls(backend=head["backend"], agent=head["agent"],
                       layout=RegionLayout(**head["layout"]), blob=bytes(data[start + n:]))
        except (struct.error, ValueError, KeyError, TypeError) as e:
            raise BadMetadata(f"peer metadata is corrupt: {e}") from None


class TransferBackend(ABC):
    """One node's side of KV transfers. Driven by a single thread; every call is non-blocking
    except `write_blocks`, which may copy synchronously (UCX cma) and so belongs off the loop."""

    name: str = ""

    @abstractmethod
    def register_kv(self, kv: Any, layout: RegionLayout | None = None) -> RegionLayout:
        """Register the node's KV tensor (once). Returns its layout."""

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
