"""Conformance suite every KV transfer backend must pass: real transfers between two real
processes (this one initiates, a spawned peer owns the destination region).

Covers data integrity for scattered and contiguous block lists (WRITE and READ), notifications after the data,
clear errors for bad metadata/layout/ids, re-adding a peer with a new incarnation, a peer killed
mid-stream (FAILED, never a hang) and the asyncio TransferWorker in both directions.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch

from moed.transfer import (BadMetadata, IncompatibleLayout, StalePeer, TransferState,
                           UnknownPeer, create_backend)
from moed.transfer.worker import TransferWorker

BACKENDS = ["nixl"]
SHAPE = (3, 48, 2, 4, 2, 16)          # [layers, blocks, 2, block_size, kv_heads, head_dim]
DEADLINE_S = 10.0


def _pattern(seed: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _peer_main(kind: str, conn: Any, seed: int, shape: tuple[int, ...]) -> None:
    """The other process: owns a KV region, keeps progress going, answers commands."""
    torch.set_num_threads(1)
    backend = create_backend(kind, "peer")
    kv = _pattern(seed, shape)
    backend.register_kv(kv)
    conn.send(("md", backend.local_metadata(), os.getpid()))
    notifs: list[tuple[str, bytes]] = []
    while True:
        if not conn.poll(0.001):
            notifs.extend(backend.get_notifs())   # without a progress thread, the target polls
            continue
        cmd, *args = conn.recv()
        if cmd == "notifs":
            want, deadline = args[0], time.monotonic() + args[1]
            while len(notifs) < want and time.monotonic() < deadline:
                notifs.extend(backend.get_notifs())
                time.sleep(0.001)
            conn.send([m for _, m in notifs])
            notifs.clear()
        elif cmd == "blocks":
            conn.send(kv[:, args[0]].clone())
        elif cmd == "add_peer":
            conn.send(backend.add_peer(*args))
        elif cmd == "write":
            h = backend.write_blocks(*args)
            st, deadline = backend.poll(h), time.monotonic() + DEADLINE_S
            while not st.terminal and time.monotonic() < deadline:
                backend.get_notifs()
                st = backend.poll(h)
            conn.send(st.state.value)
        elif cmd == "exit":
            backend.close()
            conn.send("bye")
            return


class Peer:
    def __init__(self, kind: str, seed: int, shape: tuple[int, ...] = SHAPE) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(kind, child, seed, shape), daemon=True)
        self.proc.start()          # metadata is awaited lazily, so peers start in parallel
        self.seed = seed
        self._md: bytes | None = None

    @property
    def metadata(self) -> bytes:
        if self._md is None:
            if not self.conn.poll(60):
                raise RuntimeError("transfer peer did not start")
            _, self._md, _ = self.conn.recv()
        return self._md

    def ask(self, *msg: Any, timeout: float = DEADLINE_S) -> Any:
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {msg[0]}")
        return self.conn.recv()

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)


@pytest.fixture(scope="module", params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def peer(kind: str):
    p = Peer(kind, seed=1)
    try:
        yield p
    finally:
        p.kill()


@pytest.fixture(scope="module")
def local(kind: str, peer: Peer):
    torch.set_num_threads(1)
    b = create_backend(kind, "local")
    kv = _pattern(seed=2)
    b.register_kv(kv)
    assert b.add_peer("p", peer.metadata, incarnation=1) is True
    try:
        yield b, kv
    finally:
        b.close()


def _wait(backend: Any, handle: Any, deadline_s: float = DEADLINE_S):
    end = time.monotonic() + deadline_s
    st = backend.poll(handle)
    while not st.terminal:
        assert time.monotonic() < end, "transfer neither finished nor failed within deadline"
        backend.get_notifs()
        st = backend.poll(handle)
    return st


def test_scattered_blocks_arrive_intact(local, peer: Peer) -> None:
    b, kv = local
    src, dst = [3, 7, 1, 12, 13], [9, 2, 5, 0, 40]
    h = b.write_blocks("p", src, dst, b"scattered")
    assert h.num_blocks == 5 and h.nbytes == 5 * SHAPE[0] * kv[0, 0].numel() * 4
    assert _wait(b, h).state is TransferState.DONE
    assert peer.ask("notifs", 1, 5.0) == [b"scattered"]
    assert torch.equal(peer.ask("blocks", dst), kv[:, src])
    # untouched destination blocks keep the peer's own data
    assert torch.equal(peer.ask("blocks", [1, 3]), _pattern(peer.seed)[:, [1, 3]])
    # 12,13 -> 0,40 is not contiguous on the destination: no merge; nothing else merges either
    assert h.num_descs == 5 * SHAPE[0]


def test_contiguous_range_is_one_descriptor_per_layer(local, peer: Peer) -> None:
    b, kv = local
    src, dst = list(range(4, 20)), list(range(24, 40))
    h = b.write_blocks("p", src, dst, b"contig")
    assert h.num_descs == SHAPE[0]
    assert _wait(b, h).state is TransferState.DONE
    assert peer.ask("notifs", 1, 5.0) == [b"contig"]
    assert torch.equal(peer.ask("blocks", dst), kv[:, src])


def test_notifications_in_order_and_without_data(local, peer: Peer) -> None:
    b, _ = local
    for i in range(3):
        assert _wait(b, b.write_blocks("p", [i], [i], f"n{i}".encode())).state is TransferState.DONE
    b.send_notif("p", b"bare")
    empty = b.write_blocks("p", [], [], b"empty-list")   # no blocks: notification only
    assert empty.nbytes == 0 and b.poll(empty).state is TransferState.DONE
    assert peer.ask("notifs", 5, 5.0) == [b"n0", b"n1", b"n2", b"bare", b"empty-list"]


def test_read_copies_peer_blocks_into_local_ones_then_notifies(local, peer: Peer) -> None:
    """READ (cluster prefix reuse): the peer's blocks land in ours; the peer keeps its own and
    learns of the read from the notification that follows the data."""
    b, kv = local
    src, dst = [30, 31, 32, 5], [10, 11, 12, 44]
    theirs = peer.ask("blocks", src)
    assert not torch.equal(kv[:, dst], theirs)
    h = b.read_blocks("p", src, dst, b"read-done")
    assert h.num_blocks == 4 and h.num_descs == 2 * SHAPE[0]     # 30..32 -> 10..12 merge
    assert _wait(b, h).state is TransferState.DONE
    assert torch.equal(kv[:, dst], theirs)
    assert torch.equal(peer.ask("blocks", src), theirs)
    assert peer.ask("notifs", 1, 5.0) == [b"read-done"]
    with pytest.raises(ValueError, match="source block id out of range"):
        b.read_blocks("p", [SHAPE[1]], [0])
    with pytest.raises(ValueError, match="destination block ids contain duplicates"):
        b.read_blocks("p", [0, 1], [3, 3])
    with pytest.raises(UnknownPeer):
        b.read_blocks("nope", [0], [0])


def test_bad_input_is_a_clear_error(kind: str, local, peer: Peer) -> None:
    b, _ = local
    with pytest.raises(BadMetadata, match="envelope"):
        b.add_peer("x", b"not metadata", 1)
    with pytest.raises(BadMetadata, match="corrupt"):
        b.add_peer("x", peer.metadata[:20], 1)
    with pytest.raises(UnknownPeer, match="unknown transfer peer 'nope'"):
        b.write_blocks("nope", [0], [0])
    with pytest.raises(ValueError, match="destination block id out of range"):
        b.write_blocks("p", [0], [SHAPE[1]])
    with pytest.raises(ValueError, match="duplicates"):
        b.write_blocks("p", [0, 1], [2, 2])
    with pytest.raises(ValueError, match="src has 2 block ids but dst has 1"):
        b.write_blocks("p", [0, 1], [2])
    other = create_backend(kind, "other")
    try:
        other.register_kv(torch.zeros(SHAPE[0], 4, 2, 8, 2, 16))   # block_size 8 vs 4
        with pytest.raises(IncompatibleLayout, match="KV layout mismatch"):
            other.add_peer("p", peer.metadata, 1)
    finally:
        other.close()


def test_killed_peer_fails_then_new_incarnation_replaces_it(kind: str, local, peer: Peer) -> None:
    """A node dies mid-stream (FAILED within a deadline, never a hang) and comes back under the
    same name with a new incarnation (played by the module's peer): the pair works again."""
    b, kv = local
    victim = Peer(kind, seed=21)
    try:
        assert b.add_peer("n", victim.metadata, 1) is True
        assert b.add_peer("n", victim.metadata, 1) is False         # same incarnation: no-op
        assert _wait(b, b.write_blocks("n", list(range(40)), list(range(40)), b"v")).state \
            is TransferState.DONE
        assert victim.ask("notifs", 1, 5.0) == [b"v"]
        victim.kill()
        t0 = time.monotonic()
        states = []
        while time.monotonic() - t0 < DEADLINE_S:          # keep writing until the loss shows
            states.append(_wait(b, b.write_blocks("n", list(range(40)), list(range(40)))))
            if states[-1].state is TransferState.FAILED:
                break
        assert states[-1].state is TransferState.FAILED, states
        assert states[-1].reason
        # the node restarts with a new incarnation: old connection dropped, new one loaded
        assert b.add_peer("n", peer.metadata, 2) is True
        assert b.has_peer("n") == 2
        assert _wait(b, b.write_blocks("n", [7], [8], b"to2")).state is TransferState.DONE
        assert peer.ask("notifs", 1, 5.0) == [b"to2"]
        assert torch.equal(peer.ask("blocks", [8]), kv[:, [7]])
        with pytest.raises(StalePeer, match="incarnation 1 < known 2"):
            b.add_peer("n", victim.metadata, 1)
        b.remove_peer("n")
        assert b.has_peer("n") is None
        with pytest.raises(UnknownPeer):
            b.write_blocks("n", [0], [0])
    finally:
        victim.kill()


async def test_worker_both_directions(kind: str, peer: Peer) -> None:
    """The asyncio wrapper: writes off the loop, and its poll task receives a peer's writes."""
    kv = _pattern(seed=3)
    got: list[tuple[str, bytes]] = []
    w = TransferWorker(lambda: create_backend(kind, "async"),
                       on_notif=lambda agent, msg: got.append((agent, msg)))
    await w.start()
    try:
        await w.register_kv(kv)
        await w.add_peer("p", peer.metadata, 1)
        h = await w.write_blocks("p", [0, 1, 2], [45, 46, 47], b"from-worker")
        st = await w.wait(h, DEADLINE_S)
        assert st.state is TransferState.DONE and w.in_flight == 0
        assert peer.ask("notifs", 1, 5.0) == [b"from-worker"]
        assert torch.equal(peer.ask("blocks", [45, 46, 47]), kv[:, :3])
        # reverse direction: the peer writes into us; only our poll task drives progress
        assert peer.ask("add_peer", "w", await w.local_metadata(), 1) is True
        with w.expecting():   # ask in a thread: a blocked loop would starve our progress
            assert await asyncio.to_thread(
                peer.ask, "write", "w", [10, 11], [20, 30], b"to-worker") == "done"
            end = time.monotonic() + 5
            while not got and time.monotonic() < end:
                await asyncio.sleep(0.005)
        assert [m for _, m in got] == [b"to-worker"]
        assert torch.equal(kv[:, [20, 30]], _pattern(peer.seed)[:, [10, 11]])
        # and a READ through the worker: the peer's blocks into ours
        theirs = peer.ask("blocks", [40, 41])
        h = await w.read_blocks("p", [40, 41], [5, 6], b"worker-read")
        assert (await w.wait(h, DEADLINE_S)).state is TransferState.DONE
        assert torch.equal(kv[:, [5, 6]], theirs)
        assert peer.ask("notifs", 1, 5.0) == [b"worker-read"]
    finally:
        await w.close()


def test_model_regions_register_from_their_kv_layout(kind: str, peer: Peer) -> None:
    """A node registers its model's region (a RegionLayout from its KVLayout, as
    ModelRunner.kv_region() gives it): a layout that does not cover the tensor is refused, the
    region pairs with a peer of the same block format and moves data, and two regions whose
    layout ids differ refuse each other even when their bytes agree."""
    from moed.model.kv_layout import KVLayout
    from moed.transfer import RegionLayout

    kvl = KVLayout.gqa(SHAPE[0], SHAPE[4], SHAPE[5], SHAPE[3], torch.float32)
    assert kvl.shape(SHAPE[1]) == SHAPE
    kv = kvl.allocate(SHAPE[1], "cpu")
    kv.copy_(_pattern(seed=4))
    b, other = create_backend(kind, "model"), create_backend(kind, "model2")
    try:
        small = kv[:, :8].clone()
        with pytest.raises(ValueError, match="does not match the tensor"):
            b.register_kv(small, RegionLayout.from_kv_layout(kvl, kv.data_ptr(), SHAPE[1]))
        lay = b.register_kv(kv, RegionLayout.from_kv_layout(kvl, kv.data_ptr(), SHAPE[1]))
        assert lay.layout_id == kvl.layout_id and lay == RegionLayout.from_kv_layout(kvl, kv.data_ptr(), SHAPE[1])
        assert b.add_peer("p", peer.metadata, 1) is True       # a bare-tensor peer: formats agree
        assert _wait(b, b.write_blocks("p", [1, 2], [43, 44], b"model")).state is TransferState.DONE
        assert peer.ask("notifs", 1, 5.0) == [b"model"]
        assert torch.equal(peer.ask("blocks", [43, 44]), kv[:, [1, 2]])
        twin = torch.zeros(SHAPE)
        forged = RegionLayout(**{**RegionLayout.from_tensor(twin).__dict__, "layout_id": "gqa-000000000000"})
        other.register_kv(twin, forged)
        with pytest.raises(IncompatibleLayout, match="gqa-000000000000"):
            b.add_peer("q", other.local_metadata(), 1)
    finally:
        b.close()
        other.close()
