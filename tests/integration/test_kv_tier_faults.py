"""The disk tier (L3) of a real `moed serve` when its directory or its medium misbehaves (tiny
Qwen3-MoE, fp32, an L1 of 16 blocks of 4 tokens):

- a FIFO in place of every block file at run time: the requests load, meet the FIFOs, recompute
  and answer the same text (no 408); a FIFO is never removed (a block stored again replaces
  it), and SIGTERM exits cleanly within the drain grace;
- a FIFO named like a block file, a directory, a symlink out of the tier at restart: the node
  becomes ready, logs each entry it ignores, and answers the same text;
- a full file system (a 256 KiB tmpfs) with the default `disk_io` (NIXL's POSIX backend where
  it loads): the refused writes are logged and counted, and the tier's blocks and bytes equal
  what the files on disk hold.

- a read that never returns (the tier's directory becomes a FUSE mount whose reads are never
  answered, tests/integration/stallfs.py): each load is abandoned at `tiers.read_timeout_s`
  and its request recomputes the same text, spare threads stand in until every one is stuck,
  loads are then suspended, and SIGTERM still exits cleanly with threads stuck in reads.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from moed.kvcache.tiers import fileio
from moed_server import ServerProcess, serve_process
from stallfs import StallFS

pytestmark = pytest.mark.timeout(240)

PROMPTS = [f"Session {i}: the quick brown fox jumps over the lazy dog while the cat {i} sat "
           f"on the mat and watched the rain" for i in range(5)]
GRACE_S = 5
# ~170-token prompts (43 blocks of 4 tokens) in an L1 of 64 blocks, read with plain file I/O
LONG_ENV = {"MOED_TIERS_DISK_IO": "file", "MOED_ENGINE_NUM_KV_BLOCKS": "64",
            "MOED_MODEL_MAX_MODEL_LEN": "256"}
LONG_PROMPTS = [f"Session {i}: " + " ".join(f"the quick fox {i} jumps over the lazy dog {j}"
                                            for j in range(9)) for i in range(5)]


def env(l3: Path, **kw: str) -> dict[str, str]:
    return {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_BLOCK_SIZE": "4",
            "MOED_ENGINE_NUM_KV_BLOCKS": "16", "MOED_MODEL_MAX_MODEL_LEN": "60",
            "MOED_MODEL_SERVED_NAME": "tiny", "MOED_TIERS_DISK_BYTES": str(1 << 24),
            "MOED_TIERS_DISK_DIR": str(l3), "MOED_SERVER_SHUTDOWN_GRACE_S": str(GRACE_S),
            # a request stuck on the tier would end 408 in 20 s rather than hang the test
            "MOED_SERVER_REQUEST_TIMEOUT_S": "20", **kw}


def complete(srv: ServerProcess, prompt: str) -> str:
    """The greedy text; an HTTP error (a 408) raises."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def stop_within_grace(srv: ServerProcess) -> None:
    """SIGTERM: a clean exit (0) within the drain grace (plus 10 s for the interpreter to exit); a
    process that hangs is killed at the deadline and fails here."""
    t0 = time.monotonic()
    rc = srv.stop(signal.SIGTERM, timeout=GRACE_S + 10)
    assert rc == 0, f"exit {rc} after {time.monotonic() - t0:.1f} s; log tail:\n{srv.tail()}"


def tier_dir(l3: Path) -> Path:
    (sub,) = [p for p in l3.iterdir() if p.is_dir()]
    return sub


@pytest.fixture(scope="module")
def filled(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory):
    """An L3 directory filled by a first run, and that run's answers."""
    l3 = tmp_path_factory.mktemp("l3") / "tier"
    with serve_process(model=tiny_qwen3, env=env(l3),
                       log_dir=tmp_path_factory.mktemp("logs")) as srv:
        answers = [complete(srv, p) for p in PROMPTS]
        stop_within_grace(srv)
    assert len(list(tier_dir(l3).glob("*.kvb"))) >= 5
    return l3, answers


def test_fifos_in_place_of_block_files_recompute_and_stop_cleanly(moed_server, tiny_qwen3,
                                                                  tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    # ~170-token prompts (43 blocks) read with plain file I/O: loading is predicted 5-10x
    # faster than recomputing, so the requests do load (the tiny model's short prompts cost
    # about one step's fixed overhead either way, and the decision then goes by noise); the
    # FIFO is met at the open, before any payload I/O
    srv = moed_server(model=tiny_qwen3, env=env(l3, **LONG_ENV))
    prompts = LONG_PROMPTS
    first = [complete(srv, p) for p in prompts]
    files = sorted(tier_dir(l3).glob("*.kvb"))
    assert len(files) >= 5
    for f in files:             # what a load opens next is a FIFO without a writer
        f.unlink()
        os.mkfifo(f)
    for _ in range(4):          # until a load has met a FIFO (each pass: the same answers)
        assert [complete(srv, p) for p in prompts] == first
        recs = srv.log_records()
        ignored = [r for r in recs if r.get("event") == "kv_tier_file_ignored"]
        if ignored:
            break
    assert ignored, "no load from L3 was decided: nothing met a FIFO"
    assert [complete(srv, p) for p in prompts] == first     # and again, nothing left stuck
    recs = srv.log_records()
    ignored = [r for r in recs if r.get("event") == "kv_tier_file_ignored"]
    assert ignored and all("not a regular file" in r["reason"] for r in ignored)
    assert not [r for r in recs if r.get("event") == "access" and r.get("status") != 200]
    m = srv.metrics()
    assert m['moed_kv_tier_ignored_files_total{tier="disk"}'] == len(ignored)
    assert m['moed_kv_tier_corrupt_blocks_total{tier="disk"}'] == 0
    # never removed: still a FIFO, or replaced by the block's file when it was stored again
    assert all(f.is_fifo() or f.is_file() for f in files)
    assert any(f.is_file() for f in files)
    stop_within_grace(srv)


def test_a_read_that_never_returns_is_abandoned_and_does_not_hold_the_exit(
        moed_server, tiny_qwen3, tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    srv = moed_server(model=tiny_qwen3, env=env(l3, MOED_TIERS_READ_TIMEOUT_S="1",
                                                MOED_TIERS_LOAD_THREADS="1", **LONG_ENV))
    first = [complete(srv, p) for p in LONG_PROMPTS]
    with StallFS(tier_dir(l3)) as fs:   # from now on every block file's read hangs
        for _ in range(4):              # until both threads (the loader, its spare) are stuck
            assert [complete(srv, p) for p in LONG_PROMPTS] == first
            if any(r.get("event") == "kv_tier_loads_suspended" for r in srv.log_records()):
                break
        recs = srv.log_records()
        timeouts = [r for r in recs if r.get("event") == "kv_tier_read_timeout"]
        assert len(timeouts) == 2 and fs.reads == 2, (timeouts, fs.reads)
        assert all("no progress in 1 s" in r["reason"] for r in timeouts)
        assert any(r.get("event") == "kv_tier_loads_suspended" for r in recs)
        assert not [r for r in recs if r.get("event") == "access" and r.get("status") != 200]
        assert srv.metrics()['moed_kv_tier_read_timeouts_total{tier="disk"}'] == 2
        assert [complete(srv, p) for p in LONG_PROMPTS] == first    # suspended: recomputed
        stop_within_grace(srv)          # two threads still blocked in a read
        assert fs.interrupted == 2      # the exit's kill reached them (stallfs.py)


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_odd_entries_at_restart_are_ignored(moed_server, tiny_qwen3, filled, tmp_path: Path,
                                            kind: str) -> None:
    base, answers = filled
    l3 = tmp_path / "l3"
    shutil.copytree(base, l3, symlinks=True)
    d = tier_dir(l3)
    odd = d / f"{12345:032x}.kvb"
    if kind == "fifo":
        os.mkfifo(odd)
    elif kind == "directory":
        odd = d / "a-directory"
        odd.mkdir()
        (odd / "inside.kvb").write_bytes(b"not a block")
    else:           # a link out of the tier, to a valid block file
        outside = tmp_path / "outside.kvb"
        victim = sorted(d.glob("*.kvb"))[0]
        shutil.copy(victim, outside)
        victim.unlink()
        victim.symlink_to(outside)
        odd = victim
    srv = moed_server(model=tiny_qwen3, env=env(l3), ready_timeout=60)
    recs = srv.log_records()
    (restored,) = [r for r in recs if r.get("event") == "kv_tier_restored"]
    assert restored["ignored"] == 1 and restored["skipped"] == 0
    (line,) = [r for r in recs if r.get("event") == "kv_tier_file_ignored"]
    assert line["name"] == odd.name and line["kind"] == kind
    assert [complete(srv, p) for p in PROMPTS] == answers
    assert srv.metrics()['moed_kv_tier_ignored_files_total{tier="disk"}'] == 1
    assert os.path.lexists(odd)         # left where it was
    stop_within_grace(srv)


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A 256 KiB tmpfs, unmounted at the end whatever happens (skips where mount is refused)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                         capture_output=True, text=True, timeout=30)
    if got.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused: {got.stderr.strip() or got.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_a_full_disk_counts_write_errors_and_accounting_matches_du(moed_server, tiny_qwen3,
                                                                   tiny_fs: Path) -> None:
    io = fileio.make("auto").name       # what the node's default disk_io picks here
    srv = moed_server(model=tiny_qwen3, env=env(tiny_fs / "l3", MOED_TIERS_WRITE_THROUGH="true"))
    prompts = [f"Topic {i}: " + " ".join(f"w{i}x{j}" for j in range(12)) for i in range(16)]
    first = [complete(srv, p) for p in prompts]
    assert [complete(srv, p) for p in prompts] == first     # some load from the full tier
    recs = srv.log_records()
    (restored,) = [r for r in recs if r.get("event") == "kv_tier_restored"]
    assert restored["io"] == io
    failed = [r for r in recs if r.get("event") == "kv_tier_write_failed"]
    assert failed and failed[0]["reason"] == "disk full", failed[:1]
    d = tier_dir(tiny_fs / "l3")
    header = len(b"MOEDKV1\n") + 2 + len(d.name.encode()) + 16 + 8 + 16

    def on_disk() -> tuple[int, int]:
        files = list(d.glob("*.kvb"))
        du = subprocess.run(["du", "-b", "-c", "--apparent-size", *map(str, files)],
                            capture_output=True, text=True, timeout=30).stdout
        total = int(du.splitlines()[-1].split()[0]) if files else 0
        return len(files), total - header * len(files)        # payload bytes, as counted

    # the last writes settle at a step boundary: wait (bounded) until the accounting agrees
    deadline = time.monotonic() + 20.0
    while True:
        m = srv.metrics()
        got = (int(m['moed_kv_tier_blocks{tier="disk"}']),
               int(m['moed_kv_tier_used_bytes{tier="disk"}']))
        if got == on_disk() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == on_disk(), f"tier says (blocks, bytes) {got}, the disk holds {on_disk()}"
    assert m['moed_kv_tier_write_errors_total{tier="disk"}'] > 0
    stop_within_grace(srv)
