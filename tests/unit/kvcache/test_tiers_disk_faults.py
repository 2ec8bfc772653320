"""The disk tier where its directory or its medium misbehaves: entries that are not regular files
(a FIFO, a directory, a symlink out of the tier) are never opened and never removed; a read that
stalls is abandoned at its deadline (the request recomputes) and a spare thread takes the stuck
one's place; NIXL's own exception types count as write errors; a stopped cache never waits for
a stuck read. The same cases against a real `moed serve`:
tests/integration/test_kv_tier_faults.py."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from moed.kvcache.tiers import TieredCache, TierSettings, fileio
from moed.kvcache.tiers.iopool import IOPool
from moed.kvcache.tiers.store import SUFFIX, DiskStore, NotRegular

BB = 64


class DictIO:
    block_bytes = BB

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}

    def read(self, block_id: int) -> bytes:
        return self.blocks[block_id]

    def write(self, block_id: int, data: bytes) -> None:
        self.blocks[block_id] = data


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(BB))


def disk_cache(tmp: Path, **kw) -> TieredCache:
    s = TierSettings(disk_bytes=100 * BB, disk_dir=str(tmp), disk_io="file", **kw)
    return TieredCache(s, DictIO(), "gqa-test")


def fill(c: TieredCache, keys) -> None:
    for k in keys:
        c.io.blocks[k] = payload(k)
        c.offer(k, k)
    assert c.wait(10.0)
    c.collect()


def load(c: TieredCache, keys, rid: str = "r"):
    m = c.match(list(keys))
    assert m.keys == tuple(keys)
    c.pin(m.keys)
    c.start_load(rid, m.keys, tuple(range(100, 100 + len(keys))), 1.0)


# ---- the store: only regular files --------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_the_store_never_opens_or_removes_what_is_not_a_regular_file(tmp_path: Path, within,
                                                                     kind: str) -> None:
    s = DiskStore(tmp_path / "l3", "gqa-x", fileio.make("file"))
    outside = tmp_path / "elsewhere.kvb"
    s.put(1, b"x" * 100)
    os.replace(s.path(1), outside)              # a valid block file, outside the tier
    p = s.path(1)
    {"fifo": lambda: os.mkfifo(p), "directory": p.mkdir,
     "symlink": lambda: p.symlink_to(outside)}[kind]()
    with pytest.raises(NotRegular, match="not a regular file"):
        within(lambda: s.get(1))                # a FIFO: no open that waits for a writer
    within(lambda: s.delete(1))
    assert os.path.lexists(p) and outside.exists()      # left alone, the link's target too
    scan = within(s.scan)
    assert scan.entries == {} and scan.skipped == 0
    assert scan.ignored == ((p.name, kind),) and os.path.lexists(p)
    assert s.used_bytes() == 0
    s.put(2, b"y" * 100)                        # the rest of the tier still works
    assert s.get(2) == b"y" * 100


def test_a_block_written_over_a_fifo_replaces_it(tmp_path: Path, within) -> None:
    s = DiskStore(tmp_path, "gqa-x", fileio.make("file"))
    os.mkfifo(s.path(3))
    within(lambda: s.put(3, b"z" * 10))
    assert within(lambda: s.get(3)) == b"z" * 10


def test_a_restart_ignores_odd_entries_with_a_log_line(tmp_path: Path, within) -> None:
    c = disk_cache(tmp_path)
    fill(c, range(4))
    c.close()
    d = c.disk.dir
    os.mkfifo(d / f"{99:032x}{SUFFIX}")
    (d / "a-directory").mkdir()
    os.mkfifo(d / "not-a-block")
    with capture_logs() as logs:
        again = within(lambda: disk_cache(tmp_path), timeout=20.0)
    assert again.restored == 4 and again.counters["disk"].ignored == 3
    assert sorted(e["kind"] for e in logs if e["event"] == "kv_tier_file_ignored") == \
        ["directory", "fifo", "fifo"]
    assert again.stats()["tier_disk_ignored"] == 3.0
    assert (d / "a-directory").is_dir() and (d / "not-a-block").exists()


def test_a_fifo_met_by_a_load_is_forgotten_and_the_rest_recomputes(tmp_path: Path) -> None:
    c = disk_cache(tmp_path)
    fill(c, range(3))
    p = c.disk.path(1)
    p.unlink()
    os.mkfifo(p)
    load(c, [0, 1, 2])
    assert c.wait(10.0)
    (r,) = c.collect()
    assert r.payloads == (payload(0),) and "not a regular file" in r.failed
    assert c.tier_of(1) is None and c.counters["disk"].ignored == 1
    assert c.counters["disk"].corrupt == 0 and c.used["disk"] == 2 * BB
    assert c.wait(10.0) and p.exists()          # left where it is


# ---- the read deadline --------------------------------------------------------------------
class Stall:
    """DiskStore.get blocks on one key until released (a read stuck in the kernel)."""

    def __init__(self, monkeypatch, key: int) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        real = DiskStore.get

        def get(store: DiskStore, k: int) -> bytes:
            if k == key:
                self.entered.set()
                self.release.wait(30.0)
            return real(store, k)

        monkeypatch.setattr(DiskStore, "get", get)


def test_a_stalled_read_is_abandoned_at_its_deadline(tmp_path: Path, monkeypatch) -> None:
    c = disk_cache(tmp_path, read_timeout_s=0.3, load_threads=1)
    fill(c, range(6))
    stall = Stall(monkeypatch, 1)
    t0 = time.monotonic()
    with capture_logs() as logs:
        load(c, [0, 1, 2], "stuck")
        assert c.wait(10.0)
        (r,) = c.collect()
    assert r.timed_out and r.payloads == () and "no progress in 0.3 s" in r.failed
    assert time.monotonic() - t0 >= 0.3
    assert [e["request_id"] for e in logs if e["event"] == "kv_tier_read_timeout"] == ["stuck"]
    assert c.counters["disk"].read_timeouts == 1
    assert c.tier_of(1) is None                 # the entry it stuck on: dropped
    assert c.tier_of(0) == "disk" and c._index[0].pins == 0 and c._index[2].pins == 0
    # the stuck thread's place is taken: the next load runs meanwhile
    load(c, [3, 4], "next")
    assert c.wait(10.0)
    (r2,) = c.collect()
    assert r2.failed is None and r2.payloads == (payload(3), payload(4))
    stall.release.set()                         # the stuck read comes back: its result dropped
    deadline = time.monotonic() + 10.0
    while c._loader._stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.collect() == [] and c._loader._stuck == 0 and c._loader._extra == 0


def test_a_read_that_progresses_is_not_abandoned(tmp_path: Path, monkeypatch) -> None:
    """The deadline is per block read: a long load of many quick blocks runs to its end."""
    c = disk_cache(tmp_path, read_timeout_s=0.2)
    fill(c, range(8))
    real = DiskStore.get
    monkeypatch.setattr(DiskStore, "get", lambda s, k: (time.sleep(0.06), real(s, k))[1])
    load(c, range(8))
    assert c.wait(10.0)
    (r,) = c.collect()
    assert r.failed is None and len(r.payloads) == 8 and c.counters["disk"].read_timeouts == 0


def test_every_loader_stuck_suspends_loads_until_one_returns(tmp_path: Path,
                                                             monkeypatch) -> None:
    c = disk_cache(tmp_path, read_timeout_s=0.2, load_threads=1)
    fill(c, range(4))
    stalls = [Stall(monkeypatch, 0)]
    load(c, [0], "a")
    assert c.wait(10.0) and c.collect()[0].timed_out
    c2 = Stall(monkeypatch, 1)     # stacks on the first: both keys stall
    stalls.append(c2)
    load(c, [1], "b")               # runs on the spare, sticks too
    assert c.wait(10.0) and c.collect()[0].timed_out
    assert c._loader.saturated
    with capture_logs() as logs:
        assert c.match([2, 3]).keys == ()       # no load would ever start: recompute
        assert c.match([2, 3]).keys == ()
    assert [e["event"] for e in logs].count("kv_tier_loads_suspended") == 1
    for s in stalls:
        s.release.set()
    deadline = time.monotonic() + 10.0
    while c._loader.saturated and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.match([2, 3]).keys == (2, 3)


def test_close_does_not_wait_for_a_stuck_read(tmp_path: Path, monkeypatch) -> None:
    c = disk_cache(tmp_path, read_timeout_s=60.0)
    fill(c, range(2))
    stall = Stall(monkeypatch, 0)
    load(c, [0])
    assert stall.entered.wait(5.0)
    t0 = time.monotonic()
    c.close(timeout=5.0)
    assert time.monotonic() - t0 < 5.0      # the read is not waited for (a hang fails)
    threads = [t for t in threading.enumerate() if t.name.startswith("moed-kv-load")]
    assert threads and all(t.daemon for t in threads)
    stall.release.set()


def test_io_pool_threads_are_daemons_and_spares_retire() -> None:
    pool = IOPool(1, "t-pool", spares=1)
    gate = threading.Event()
    fut = pool.submit(gate.wait, 10.0)
    while not fut.running():
        time.sleep(0.001)
    pool.stuck(fut)
    assert not pool.saturated and pool.submit(lambda: 7).result(5.0) == 7
    gate.set()
    assert fut.result(5.0) is True
    deadline = time.monotonic() + 5.0
    while pool._extra and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._extra == 0 and pool._stuck == 0
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("t-pool"))
    pool.close()


# ---- writes that fail ----------------------------------------------------------------------------
class NixlLikeError(Exception):
    """Stands for nixl's own exception types (nixlBackendError is not an OSError)."""


def test_a_write_failing_with_any_exception_is_a_write_error(tmp_path: Path,
                                                              monkeypatch) -> None:
    c = disk_cache(tmp_path)

    def broken(self, key, data):
        raise NixlLikeError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(DiskStore, "put", broken)
    with capture_logs() as logs:
        fill(c, range(3))
    assert c.counters["disk"].write_errors == 3 and c.used["disk"] == 0
    assert c.stats()["tier_disk_blocks"] == 0.0 and c.match([0]).keys == ()
    (line,) = [e for e in logs if e["event"] == "kv_tier_write_failed"]
    assert "NixlLikeError" in line["reason"] and line["not_logged"] == 0


def test_nixl_errors_become_os_errors(tmp_path: Path) -> None:
    try:
        io = fileio.NixlFileIO()
    except Exception:       # noqa: BLE001 - NIXL absent here
        pytest.skip("NIXL's POSIX backend does not load here")
    f = tmp_path / "ro"
    f.write_bytes(b"\0" * 4096)
    fd = os.open(f, os.O_RDONLY)        # writing through a read-only fd: NIXL's POSIX fails
    try:
        with pytest.raises(OSError, match="NIXL WRITE of 4096 bytes failed"):
            io.write(fd, 0, b"x" * 4096)
    finally:
        os.close(fd)
