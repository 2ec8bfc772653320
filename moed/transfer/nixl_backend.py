"""NIXL (UCX) backend: WRITE local KV blocks into a peer's registered KV region, or READ a
peer's blocks into local ones (cluster prefix reuse, moed/kvcache/tiers/peer.py).

Measured facts this follows (notes/nixl-on-cpu.md): no progress thread (it spins a core) so
both sides poll via get_notifs()/poll(); transfer() may copy synchronously (cma) and releases
the GIL, so callers keep it off the event loop; the agent is not thread-safe (one thread);
agent names are unique per process incarnation because NIXL does not reject duplicates; a
SIGKILLed peer surfaces as nixlRemoteDisconnectError, a stalled one never does (callers keep
deadlines).
"""
from __future__ import annotations

import logging
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import structlog

from moed.transfer.base import (BadMetadata, PeerMetadata, RegionLayout, StalePeer,
                                TransferBackend, TransferError, TransferHandle, TransferState,
                                TransferStatus, UnknownPeer, check_transition)
from moed.transfer.ranges import byte_ranges, check_ids, merge_runs

log = structlog.get_logger(__name__)

_KEEP_FINISHED = 4096     # terminal statuses remembered for late polls


@dataclass
class _Peer:
    name: str
    incarnation: int
    agent: str
    layout: RegionLayout


@dataclass
class _Xfer:
    handle: TransferHandle
    nixl: Any                 # nixl_xfer_handle while PENDING, else None
    status: TransferStatus


def _reason(e: BaseException) -> str:
    kind = type(e).__name__
    if kind == "nixlRemoteDisconnectError":
        return "peer_disconnected"
    if kind == "nixlNotFoundError":
        return "peer_unknown"
    return f"backend_error:{kind}"


class NixlBackend(TransferBackend):
    def __init__(self, name: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config  # lazy: optional dependency

        logging.getLogger("nixl").setLevel(logging.WARNING)
        self.name = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = nixl_agent(self.name, nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise TransferError("NIXL UCX plugin is not available")
        self._layout: RegionLayout | None = None
        self._reg: Any = None
        self._peers: dict[str, _Peer] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._finished: OrderedDict[int, TransferStatus] = OrderedDict()
        self._zombies: list[Any] = []    # aborted handles NIXL could not cancel yet
        self._next_id = 1
        self._closed = False

    # ---- registration and peers ----------------------------------------------------------

    def register_kv(self, kv: Any, layout: RegionLayout | None = None) -> RegionLayout:
        if self._layout is not None:
            raise TransferError("a KV region is already registered")
        if layout is None:
            layout = RegionLayout.from_tensor(kv)
        else:
            layout.check_covers(kv)
        self._reg = self._agent.register_memory(
            [(layout.base_addr, layout.nbytes, 0, "")], "DRAM")
        self._layout = layout
        return layout

    def local_metadata(self) -> bytes:
        if self._layout is None:
            raise TransferError("register_kv before local_metadata")
        return PeerMetadata("nixl", self.name, self._layout,
                            self._agent.get_agent_metadata()).encode()

    def add_peer(self, name: str, metadata: bytes, incarnation: int) -> bool:
        md = PeerMetadata.decode(metadata)
        if md.backend != "nixl":
            raise BadMetadata(f"peer {name} uses transfer backend {md.backend!r}, not nixl")
        if self._layout is None:
            raise TransferError("register_kv before add_peer")
        self._layout.check_compatible(md.layout)
        old = self._peers.get(name)
        if old is not None:
            if incarnation < old.incarnation:
                raise StalePeer(f"peer {name}: incarnation {incarnation} < known {old.incarnation}")
            if incarnation == old.incarnation and md.agent == old.agent:
                return False
            self.remove_peer(name)
        try:
            agent = self._agent.add_remote_agent(md.blob)
        except Exception as e:  # nixlMismatchError etc.: typed by NIXL, re-raised as ours
            raise BadMetadata(f"peer {name}: NIXL rejected its metadata ({type(e).__name__})") \
                from None
        agent = agent.decode() if isinstance(agent, bytes) else str(agent)
        self._peers[name] = _Peer(name, incarnation, agent, md.layout)
        log.info("transfer_peer_added", peer=name, incarnation=incarnation, agent=agent)
        return True

    def remove_peer(self, name: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        for x in list(self._xfers.values()):
            if x.handle.peer == name:
                self._finish(x, TransferStatus(TransferState.ABORTED, "peer_removed"))
        try:
            self._agent.remove_remote_agent(peer.agent)
        except Exception as e:  # already gone on NIXL's side: nothing left to release
            log.debug("transfer_peer_remove_error", peer=name, error=type(e).__name__)
        log.info("transfer_peer_removed", peer=name, incarnation=peer.incarnation)

    def has_peer(self, name: str) -> int | None:
        p = self._peers.get(name)
        return None if p is None else p.incarnation

    # ---- transfers -----------------------------------------------------------------------

    def write_blocks(self, peer: str, src_block_ids: Sequence[int],
                     dst_block_ids: Sequence[int], notif: bytes = b"") -> TransferHandle:
        return self._post("WRITE", peer, src_block_ids, dst_block_ids, notif)

    def read_blocks(self, peer: str, src_block_ids: Sequence[int],
                    dst_block_ids: Sequence[int], notif: bytes = b"") -> TransferHandle:
        return self._post("READ", peer, dst_block_ids, src_block_ids, notif)

    def _post(self, op: str, peer: str, local_ids: Sequence[int], remote_ids: Sequence[int],
              notif: bytes) -> TransferHandle:
        """One transfer between local blocks and the peer's (WRITE: local → peer; READ: peer →
        local); NIXL delivers notif to the peer after the data either way."""
        p = self._peers.get(peer)
        if p is None:
            raise UnknownPeer(f"unknown transfer peer {peer!r}")
        local = self._layout
        assert local is not None  # add_peer required it
        lside, rside = ("source", "destination") if op == "WRITE" else ("destination", "source")
        check_ids(local_ids, local.num_blocks, lside)
        check_ids(remote_ids, p.layout.num_blocks, rside)
        runs = merge_runs(local_ids, remote_ids)
        hid, self._next_id = self._next_id, self._next_id + 1
        nbytes = sum(n for _, _, n in runs) * local.block_bytes * local.num_layers
        handle = TransferHandle(hid, peer, len(local_ids), nbytes, len(runs) * local.num_layers)
        x = _Xfer(handle, None, TransferStatus(TransferState.PENDING))
        self._xfers[hid] = x
        try:
            if not runs:
                if notif:
                    self._agent.send_notif(p.agent, notif)
                self._finish(x, TransferStatus(TransferState.DONE))
                return handle
            descs = []
            for side, lay in ((0, local), (1, p.layout)):
                rows = byte_ranges(runs, local.num_layers, lay.base_addr, lay.layer_stride,
                                   local.block_bytes, side)
                arr = np.zeros((len(rows), 3), dtype=np.uint64)
                arr[:, :2] = rows
                descs.append(self._agent.get_xfer_descs(arr, "DRAM"))
            x.nixl = self._agent.initialize_xfer(op, descs[0], descs[1], p.agent, notif)
            state = self._agent.transfer(x.nixl)
            if state != "PROC":
                self._finish(x, self._status_of(state))
        except Exception as e:  # a runtime failure is a FAILED transfer, not an exception
            self._finish(x, TransferStatus(TransferState.FAILED, _reason(e)))
        return handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        x = self._xfers.get(handle.id)
        if x is None:
            st = self._finished.get(handle.id)
            if st is None:
                raise TransferError(f"unknown transfer handle {handle.id}")
            return st
        try:
            state = self._agent.check_xfer_state(x.nixl)
        except Exception as e:
            self._finish(x, TransferStatus(TransferState.FAILED, _reason(e)))
            return x.status
        if state != "PROC":
            self._finish(x, self._status_of(state))
        return x.status

    def abort(self, handle: TransferHandle) -> TransferStatus:
        x = self._xfers.get(handle.id)
        if x is None:
            return self.poll(handle)
        self._finish(x, TransferStatus(TransferState.ABORTED, "aborted"))
        return x.status

    def pending(self) -> list[TransferHandle]:
        return [x.handle for x in self._xfers.values()]

    def send_notif(self, peer: str, msg: bytes) -> None:
        p = self._peers.get(peer)
        if p is None:
            raise UnknownPeer(f"unknown transfer peer {peer!r}")
        self._agent.send_notif(p.agent, msg)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self._reap_zombies()
        notifs = self._agent.get_new_notifs()
        return [(agent, m) for agent, msgs in notifs.items() for m in msgs]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for x in list(self._xfers.values()):
            self._finish(x, TransferStatus(TransferState.ABORTED, "closed"))
        for name in list(self._peers):
            self.remove_peer(name)
        self._reap_zombies()
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as e:
                log.warning("transfer_deregister_failed", error=type(e).__name__)
        self._agent = None

    # ---- internals -----------------------------------------------------------------------

    @staticmethod
    def _status_of(state: str) -> TransferStatus:
        if state == "DONE":
            return TransferStatus(TransferState.DONE)
        return TransferStatus(TransferState.FAILED, "transfer_error")

    def _finish(self, x: _Xfer, status: TransferStatus) -> None:
        """Move x to a terminal state (the one place that does) and release its NIXL handle."""
        check_transition(x.status.state, status.state)
        x.status = status
        if x.nixl is not None:
            try:
                x.nixl.release()   # cancels the request if it is still in flight
            except Exception:  # in flight: NIXL started the abort; release again later
                self._zombies.append(x.nixl)
            x.nixl = None
        self._xfers.pop(x.handle.id, None)
        self._finished[x.handle.id] = status
        while len(self._finished) > _KEEP_FINISHED:
            self._finished.popitem(last=False)

    def _reap_zombies(self) -> None:
        keep = []
        for h in self._zombies:
            try:
                h.release()
            except Exception:
                keep.append(h)
        self._zombies = keep

