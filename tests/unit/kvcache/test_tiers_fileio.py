"""The disk store over both payload paths — NIXL's POSIX backend and plain pread/pwrite: the
same files (either reads what the other wrote), the same checks (truncation, a flipped bit)."""
from __future__ import annotations

from pathlib import Path

import pytest

from moed.kvcache.tiers import fileio
from moed.kvcache.tiers.store import CorruptBlock, DiskStore


def test_auto_picks_nixl_when_it_loads() -> None:
    try:
        want = fileio.NixlFileIO().name
    except Exception:       # noqa: BLE001 - NIXL absent (or torch-free run): plain I/O
        want = "file"
    assert fileio.make("auto").name == want
    assert fileio.make("file").name == "file"
    with pytest.raises(ValueError, match="unknown disk I/O"):
        fileio.make("posix")


def kinds() -> list[str]:
    try:
        fileio.NixlFileIO()
        return ["file", "nixl"]
    except Exception:       # noqa: BLE001
        return ["file"]


@pytest.mark.parametrize("writer", kinds())
@pytest.mark.parametrize("reader", kinds())
def test_stores_agree_and_check_the_payload(tmp_path: Path, writer: str, reader: str) -> None:
    w = DiskStore(tmp_path, "gqa-x", fileio.make(writer))
    r = DiskStore(tmp_path, "gqa-x", fileio.make(reader))
    data = bytes(range(256)) * 40
    w.put(7, data)
    w.put(8, data[::-1])
    assert r.get(7) == data and r.get(8) == data[::-1]
    p = w.path(7)
    p.write_bytes(p.read_bytes()[:-1])
    with pytest.raises(CorruptBlock, match="payload bytes"):
        r.get(7)
    raw = bytearray(w.path(8).read_bytes())
    raw[-100] ^= 4
    w.path(8).write_bytes(bytes(raw))
    with pytest.raises(CorruptBlock, match="checksum"):
        r.get(8)
    assert r.scan().skipped == 2 and not list(tmp_path.glob("*/*.kvb"))
