"""KV transfer between nodes behind one small interface (see base.py); backends load lazily."""
from moed.transfer.base import (BadMetadata, IncompatibleLayout, KVFormat, KVRegion, PeerMetadata,
                                RegionLayout, StalePeer, TransferBackend, TransferError,
                                TransferHandle, TransferState, TransferStatus, UnknownPeer,
                                create_backend)
from moed.transfer.ranges import merge_runs

__all__ = ["BadMetadata", "IncompatibleLayout", "KVFormat", "KVRegion", "PeerMetadata",
           "RegionLayout", "StalePeer", "TransferBackend", "TransferError", "TransferHandle",
           "TransferState", "TransferStatus", "UnknownPeer", "create_backend", "merge_runs"]
