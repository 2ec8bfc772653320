"""TieredCache without a model (a dict stands in for the KV tensor): write-back L1 -> L2 -> L3,
eviction never takes a pinned block, byte counts equal what the stores hold, a restart finds L3
again, truncated / bit-flipped / foreign files are skipped and counted, never served, and a
full disk degrades to "not cached" with a logged reason."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from moed.kvcache.tiers import TieredCache, TierSettings
from moed.kvcache.tiers.store import SUFFIX, CorruptBlock, DiskStore

BB = 64     # bytes per block


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


def cache(tmp: Path | None, host: int = 0, disk: int = 0, io: DictIO | None = None
          ) -> TieredCache:
    s = TierSettings(host_bytes=host, disk_bytes=disk, disk_dir=str(tmp) if tmp else "")
    return TieredCache(s, io or DictIO(), "gqa-test")


def settle(c: TieredCache) -> list:
    assert c.wait(10.0)
    return c.collect()


def fill(c: TieredCache, keys) -> None:
    io = c.io
    for k in keys:
        io.blocks[k] = payload(k)
        c.offer(k, k)       # block id k holds key k


def consistent(c: TieredCache) -> None:
    """The byte counts equal what the pools and the files hold."""
    settle(c)
    if c.host is not None:
        assert c.used["host"] == c.host.used_bytes() == \
            BB * sum(c.tier_of(k) == "host" for k in list(c.host.keys()))
    if c.disk is not None:
        files = list(c.disk.dir.glob(f"*{SUFFIX}"))
        assert c.used["disk"] == c.disk.used_bytes() == BB * len(files)
        assert {int(p.stem, 16) for p in files} == {k for k in c._index if c.tier_of(k) == "disk"}


def test_write_back_host_then_disk_and_load(tmp_path: Path) -> None:
    c = cache(tmp_path, host=4 * BB, disk=100 * BB)
    fill(c, range(10))
    consistent(c)
    assert c.used["host"] == 4 * BB and c.used["disk"] == 6 * BB
    m = c.match(list(range(10)) + [99])
    assert m.keys == tuple(range(10)) and set(m.tiers) == {"host", "disk"}
    c.pin(m.keys)
    c.start_load("r", m.keys, tuple(range(100, 110)), 1.0)
    (r,) = settle(c)
    assert r.failed is None and r.payloads == tuple(payload(k) for k in range(10))
    assert c.counters["disk"].loads + c.counters["host"].loads == 10
    assert c.bandwidth["disk"].samples == 1
    consistent(c)


def test_eviction_never_takes_a_pinned_block(tmp_path: Path) -> None:
    c = cache(None, host=3 * BB)
    fill(c, [1, 2, 3])
    c.pin((1, 2, 3))
    c.start_load("r", (1, 2, 3), (7, 8, 9), 1.0)    # pinned until collected
    fill(c, [4])                    # no room and nothing evictable: not stored
    assert c.tier_of(4) is None and {c.tier_of(k) for k in (1, 2, 3)} == {"host"}
    settle(c)
    fill(c, [4])
    assert c.tier_of(4) == "host" and sum(c.tier_of(k) is None for k in (1, 2, 3)) == 1
    consistent(c)


def test_restart_finds_l3_and_skips_bad_files(tmp_path: Path) -> None:
    c = cache(tmp_path, disk=100 * BB)
    fill(c, range(6))
    c.close()
    files = sorted(c.disk.dir.glob(f"*{SUFFIX}"))
    assert len(files) == 6
    raw = files[0].read_bytes()
    files[0].write_bytes(raw[:-10])                         # truncated
    raw = bytearray(files[1].read_bytes())
    raw[-3] ^= 0x10
    files[1].write_bytes(bytes(raw))                        # one bit flipped
    other = DiskStore(tmp_path, "gqa-other")                # a file of another layout, renamed in
    other.put(77, payload(77))
    os.replace(other.path(77), c.disk.dir / f"{77:032x}{SUFFIX}")
    bad = {int(files[0].stem, 16), int(files[1].stem, 16), 77}

    c2 = cache(tmp_path, disk=100 * BB)
    assert c2.counters["disk"].corrupt == 3 and c2.restored == 6 - 2
    for k in range(6):
        assert (c2.tier_of(k) is None) == (k in bad)
    good = [k for k in range(6) if k not in bad]
    c2.pin(tuple(good))
    c2.start_load("r", tuple(good), tuple(range(len(good))), 1.0)
    (r,) = settle(c2)
    assert r.payloads == tuple(payload(k) for k in good)
    consistent(c2)


def test_bit_flip_after_restart_is_detected_at_load(tmp_path: Path) -> None:
    c = cache(tmp_path, disk=100 * BB)
    fill(c, range(3))
    settle(c)
    p = c.disk.path(1)
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlock):
        c.disk.get(1)
    with capture_logs() as logs:
        c.pin((0, 1, 2))
        c.start_load("r", (0, 1, 2), (10, 11, 12), 1.0)
        (r,) = settle(c)
    assert len(r.payloads) == 1 and "checksum" in (r.failed or "")
    assert c.tier_of(1) is None and c.counters["disk"].corrupt == 1
    assert any(e["event"] == "kv_tier_block_corrupt" for e in logs)
    consistent(c)


def test_disk_full_degrades_to_not_cached_with_a_reason(tmp_path: Path, monkeypatch) -> None:
    c = cache(tmp_path, disk=100 * BB)

    def full(self, key, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "put", full)
    with capture_logs() as logs:
        fill(c, range(3))
        settle(c)
    assert c.match([0, 1, 2]).keys == () and c.counters["disk"].write_errors == 3
    # every failure counted, the first logged (a full disk fails every write: no flood)
    assert [e["reason"] for e in logs if e["event"] == "kv_tier_write_failed"] == ["disk full"]
    consistent(c)


def test_disk_capacity_evicts_files(tmp_path: Path) -> None:
    c = cache(tmp_path, disk=5 * BB)
    fill(c, range(12))
    consistent(c)
    assert c.used["disk"] == 5 * BB and c.counters["disk"].evicted == 7


def test_a_load_pays_the_step_in_flight_only_when_the_engine_is_busy() -> None:
    c = cache(None, host=10 * BB)
    fill(c, range(4))
    m = c.match([0, 1, 2, 3])
    c.observe_step(0.5)
    rec = lambda k: 0.01 * (4 - k) + 0.001      # recomputing all 4 blocks: 41 ms
    assert c.plan(m, rec, busy=False).num_load == 4     # idle: the load wakes the loop
    busy = c.plan(m, rec, busy=True)                    # busy: one 0.5 s step to wait
    assert busy.num_load == 0 and busy.decision == "recompute"
    assert busy.recompute_s == pytest.approx(0.041)


@pytest.mark.parametrize("write_through", [False, True])
def test_write_through_copies_a_block_when_it_is_completed(write_through: bool) -> None:
    io = DictIO()
    c = TieredCache(TierSettings(host_bytes=10 * BB, write_through=write_through), io, "gqa-t")
    io.blocks[5] = payload(5)
    c.on_cached(5, 55)                  # L1 registered block 5 under prefix hash 55
    assert (c.tier_of(55) == "host") is write_through
    c.offer(5, 55)                      # L1 evicts it later: stored once either way
    assert c.tier_of(55) == "host" and c.counters["host"].stored == 1
    consistent(c)


def test_start_measures_each_tier_and_leaves_no_probe(tmp_path: Path) -> None:
    seeds = dict(host_bandwidth=1.0, disk_bandwidth=1.0)     # 1 B/s: absurd on purpose
    with capture_logs() as logs:
        c = TieredCache(TierSettings(host_bytes=10 * BB, disk_bytes=10 * BB,
                                     disk_dir=str(tmp_path), **seeds), DictIO(), "gqa-test")
    assert c.bandwidth["host"].value > 1e3 and c.bandwidth["disk"].value > 1e3
    assert c.bandwidth["host"].samples == 0       # a seed: the first real load still counts
    assert c.latency_s > 0.0            # the hand-off to the load thread costs something
    assert [e["event"] for e in logs if e["event"] == "kv_tier_calibrated"]
    assert c.used == {"host": 0, "disk": 0} and not list(c.host.keys())
    assert not list(c.disk.dir.glob(f"*{SUFFIX}")) and c.restored == 0
    c.close()
    again = TieredCache(TierSettings(disk_bytes=10 * BB, disk_dir=str(tmp_path)),
                        DictIO(), "gqa-test")
    assert again.restored == 0 and again.counters["disk"].corrupt == 0   # nothing left over
    off = TieredCache(TierSettings(host_bytes=10 * BB, calibrate=False, **seeds), DictIO(),
                      "gqa-test")
    assert off.bandwidth["host"].value == 1.0 and off.latency_s == 0.0


def test_a_disk_that_refuses_the_probe_keeps_the_seed(tmp_path: Path, monkeypatch) -> None:
    def full(self, key, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "put", full)
    with capture_logs() as logs:
        c = TieredCache(TierSettings(disk_bytes=10 * BB, disk_dir=str(tmp_path),
                                     disk_bandwidth=123.0), DictIO(), "gqa-test")
    assert c.bandwidth["disk"].value == 123.0
    assert [e["tier"] for e in logs if e["event"] == "kv_tier_calibration_failed"] == ["disk"]


def test_a_load_is_slower_when_it_is_collected_late() -> None:
    """The load's time is the request's wait: from the decision until collected at a step
    boundary, not only the read on the I/O thread."""
    c = cache(None, host=10 * BB)
    fill(c, range(2))
    for late_s, slower in ((0.0, 0), (0.15, 1)):
        c.pin([0, 1])
        c.start_load("r", [0, 1], (100, 101), predicted_recompute_s=0.1, predicted_load_s=0.01)
        assert c.wait(10.0)
        time.sleep(late_s)                  # a step of other requests runs meanwhile
        (r,) = c.collect()
        assert r.failed is None and c.slower_than_recompute == slower
        rec = c.recent_loads[-1]
        assert rec.blocks == 2 and rec.read_s <= rec.load_s and rec.load_s >= late_s
        assert rec.predicted_load_s == 0.01 and rec.predicted_recompute_s == 0.1


def test_a_hold_keeps_entries_until_the_next_step_boundary() -> None:
    c = cache(None, host=3 * BB)
    fill(c, range(3))
    c.hold([0])                         # a waiting prompt was taken to load key 0
    fill(c, [3])                        # L2 full: the least useful unheld entry goes
    assert c.tier_of(0) == "host" and c.counters["host"].evicted == 1
    c.collect()                         # the next step boundary releases the hold
    fill(c, [4, 5, 6])
    assert c.tier_of(0) is None         # evictable again
    consistent(c)
