"""Block stores below L1, behind one small interface: L2 host memory and L3 local disk.

A store holds opaque block payloads (one KV block across all layers, bytes) by key (the chained
prefix hash) and knows its bytes used; capacity and eviction are the cache's (tiers/cache.py).
`get` may run on the tier's I/O thread; `put`/`delete` on the disk store do file I/O and run
there too; the in-memory index every caller reads is changed only on the engine's loop thread
(cache.py applies each finished I/O). The disk store's payload bytes go through NIXL's POSIX
backend where it loads, else plain pread/pwrite (fileio.py; `tiers.disk_io`); headers are
plain I/O.

Disk file format (one file per block, `<dir>/<namespace>/<hash:032x>.kvb`, written to a temp
name and renamed, so a crash leaves no half file under the final name):

    magic b"MOEDKV1\\n" | u16 len + namespace (utf-8) | 16-byte key | u64 payload length
    | 16-byte blake2b of the payload | payload

The namespace is the KV layout id plus the checkpoint's model id (the engine's), so a node
restarted on other weights of the same shape never reads their KV. A restart rebuilds the
index from the files (`scan`): a file whose namespace, key, length or checksum does not match
is skipped, counted and removed — never served.

Only regular files are opened: an entry is checked with lstat before the open (a FIFO, a
device, a directory or a symlink is never opened), and opened with O_NOFOLLOW | O_NONBLOCK and
checked again with fstat (an entry swapped in between cannot block the open or lead out of the
tier). Anything else in the directory is left where it is and never read (`NotRegular`; `scan`
lists it as ignored).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moed.kvcache.tiers.fileio import FileIO

MAGIC = b"MOEDKV1\n"
SUFFIX = ".kvb"


class CorruptBlock(Exception):
    """A stored block failed its checks (truncated, bit-flipped, another layout)."""


class NotRegular(OSError):
    """The entry under a block's file name is not a regular file (a FIFO, a directory, a
    device, a symlink): never opened for reading, never removed."""


# never block on an open (a FIFO) and never follow a link out of the tier
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "unknown"


def open_regular(p: Path, flags: int = os.O_RDONLY) -> int:
    """An fd on `p` if it is a regular file (NotRegular otherwise; FileNotFoundError)."""
    st = os.lstat(p)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(f"{p.name}: a {kind_of(st.st_mode)}, not a regular file")
    try:
        fd = os.open(p, flags | OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:      # became a symlink since the lstat
            raise NotRegular(f"{p.name}: a symlink, not a regular file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegular(f"{p.name}: a {kind_of(st.st_mode)}, not a regular file")
    return fd


def checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class BlockStore(ABC):
    """One tier's payloads. The cache calls it; nothing else does."""

    name: str

    @abstractmethod
    def put(self, key: int, data: bytes) -> None:
        """Store a payload (OSError when the medium refuses, e.g. ENOSPC)."""

    @abstractmethod
    def get(self, key: int) -> bytes:
        """The payload, checked (CorruptBlock when it fails its checks, KeyError if absent)."""

    @abstractmethod
    def delete(self, key: int) -> None:
        """Forget a payload (absent: no error)."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes the payloads occupy now (what the tier's capacity is compared with)."""


class HostStore(BlockStore):
    """L2: payloads in host memory, a pool apart from the KV tensor (on a GPU node the tensor is
    in device memory; here on CPU the separate pool still exercises the copy path). A checksum
    is kept per payload, so a load verifies L2 exactly as it verifies L3."""

    name = "host"

    def __init__(self) -> None:
        self._data: dict[int, tuple[bytes, bytes]] = {}
        self._used = 0

    def put(self, key: int, data: bytes) -> None:
        self.delete(key)
        self._data[key] = (bytes(data), checksum(data))
        self._used += len(data)

    def get(self, key: int) -> bytes:
        data, digest = self._data[key]
        if checksum(data) != digest:
            raise CorruptBlock(f"host block {key:032x}: checksum mismatch")
        return data

    def delete(self, key: int) -> None:
        old = self._data.pop(key, None)
        if old is not None:
            self._used -= len(old[0])

    def used_bytes(self) -> int:
        return self._used

    def keys(self) -> Iterator[int]:
        return iter(list(self._data))


@dataclass(frozen=True)
class ScanResult:
    entries: dict[int, int]      # key -> payload bytes, for every valid file
    skipped: int                 # corrupt, truncated or foreign files (removed)
    ignored: tuple[tuple[str, str], ...] = ()   # (name, kind): not regular files, left alone


class DiskStore(BlockStore):
    """L3: one file per block under `root/<layout_id>/`."""

    name = "disk"

    def __init__(self, root: str | Path, layout_id: str, fileio: FileIO | None = None) -> None:
        if not layout_id:
            raise ValueError("a disk tier needs the model's KV layout id")
        self.layout_id = layout_id
        self.fileio = fileio or FileIO()
        self.dir = Path(root) / layout_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self._header_len = len(self._header(0, 0, b"\0" * 16))

    def _header(self, key: int, n: int, digest: bytes) -> bytes:
        lid = self.layout_id.encode()
        return (MAGIC + struct.pack("<H", len(lid)) + lid + key.to_bytes(16, "little")
                + struct.pack("<Q", n) + digest)

    def path(self, key: int) -> Path:
        return self.dir / f"{key:032x}{SUFFIX}"

    def put(self, key: int, data: bytes) -> None:
        final = self.path(key)
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        try:
            # O_EXCL: a fresh file (a stale temp file of this pid is removed first; anything
            # else under that name fails the write)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.lstat(tmp).st_mode):
                    os.unlink(tmp)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o644)
            try:
                header = self._header(key, len(data), checksum(data))
                FileIO.write(self.fileio, fd, 0, header)        # metadata: plain I/O
                self.fileio.write(fd, len(header), data)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(tmp).st_mode):
                    os.unlink(tmp)
            raise

    def _read(self, p: Path, key: int | None) -> bytes:
        fd = open_regular(p)
        try:
            size = os.fstat(fd).st_size
            h = self._header_len
            raw = os.pread(fd, h, 0)
            if len(raw) < h or not raw.startswith(MAGIC):
                raise CorruptBlock(f"{p.name}: truncated or not a block file")
            n = self._check_header(p, raw, key)
            if size - h != n:
                raise CorruptBlock(f"{p.name}: {size - h} payload bytes, header says {n}")
            data = self.fileio.read(fd, h, n)
        finally:
            os.close(fd)
        if checksum(data) != raw[h - 16:h]:
            raise CorruptBlock(f"{p.name}: checksum mismatch")
        return data

    def _check_header(self, p: Path, raw: bytes, key: int | None) -> int:
        """The header's payload length, once its namespace and key match."""
        lid = self.layout_id.encode()
        (n_lid,) = struct.unpack_from("<H", raw, len(MAGIC))
        at = len(MAGIC) + 2
        if raw[at:at + n_lid] != lid or n_lid != len(lid):
            raise CorruptBlock(f"{p.name}: another KV layout")
        at += n_lid
        k = int.from_bytes(raw[at:at + 16], "little")
        (n,) = struct.unpack_from("<Q", raw, at + 16)
        if (key is not None and k != key) or p.name != f"{k:032x}{SUFFIX}":
            raise CorruptBlock(f"{p.name}: key does not match the file name")
        return n

    def get(self, key: int) -> bytes:
        try:
            return self._read(self.path(key), key)
        except FileNotFoundError:
            raise KeyError(key) from None

    def delete(self, key: int) -> None:
        """Remove the block's file; anything but a regular file there is left alone."""
        p = self.path(key)
        try:
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.unlink(p)
        except FileNotFoundError:
            pass

    def used_bytes(self) -> int:
        """Bytes of the payloads in the directory (a walk: tests and restarts, not hot)."""
        return sum(st.st_size - self._header_len for _, st in self._regular_blocks())

    def _regular_blocks(self) -> list[tuple[Path, os.stat_result]]:
        out = []
        for p in self.dir.glob(f"*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(p)
                if stat.S_ISREG(st.st_mode):
                    out.append((p, st))
        return out

    def scan(self) -> ScanResult:
        """Rebuild the index after a restart: every valid file; invalid ones are removed;
        entries that are not regular files (FIFOs, directories, links, devices) are listed
        as ignored and left where they are, never opened."""
        entries: dict[int, int] = {}
        skipped = 0
        ignored: list[tuple[str, str]] = []
        for p in self.dir.iterdir():
            try:
                mode = os.lstat(p).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(mode):
                ignored.append((p.name, kind_of(mode)))
                continue
            if p.suffix != SUFFIX:      # a temp file left by a crash mid-write
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
                continue
            try:
                data = self._read(p, None)
            except NotRegular as e:     # swapped in since the lstat
                ignored.append((p.name, str(e)))
                continue
            except (CorruptBlock, OSError, ValueError, struct.error):
                skipped += 1
                self._remove_file(p)
                continue
            entries[int(p.stem, 16)] = len(data)
        return ScanResult(entries, skipped, tuple(ignored))

    @staticmethod
    def _remove_file(p: Path) -> None:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.unlink(p)
