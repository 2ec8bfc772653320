"""A directory whose files never answer a read: a tiny FUSE file system served from a thread of
the test process over /dev/fuse (no FUSE library; the kernel protocol directly, 7.31).

    with StallFS(directory) as fs:     # root only; pytest.skip where FUSE or mount is refused
        ...                            # every `*.kvb` name looks up as a regular file; opening
        fs.reads                       # it works, reading it blocks until the mount ends

A read on a FUSE file is not hurried by O_NONBLOCK, so this is what a hung network or failing
disk looks like to the disk KV tier: a regular file whose read never returns, until the kernel
interrupts it because the reading process is exiting (an interruptible mount; a read the
daemon has taken and never answers otherwise keeps even a killed process from exiting).
Creating, removing or renaming files fails (EROFS). Leaving the context aborts the connection (closing
/dev/fuse): every blocked read returns ENOTCONN, then the mount is removed.
"""
from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
import threading
from pathlib import Path

IN_HEADER = struct.Struct("<IIQQIIIHH")       # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")            # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")     # fuse_attr (88 bytes)
LOOKUP, FORGET, GETATTR, OPEN, READ, RELEASE, FLUSH, INIT, OPENDIR, RELEASEDIR, INTERRUPT, \
    BATCH_FORGET, DESTROY = 1, 2, 3, 14, 15, 18, 25, 26, 27, 29, 36, 42, 38
NO_REPLY = (FORGET, BATCH_FORGET)
# setattr readlink symlink mknod mkdir unlink rmdir rename link create: a read-only file system
ROFS = (4, 5, 6, 8, 9, 10, 11, 12, 13, 35)
FOPEN_DIRECT_IO = 1
FILE_SIZE = 1 << 16


class StallFS:
    def __init__(self, target: Path) -> None:
        self.target = Path(target)
        self.reads = 0                  # READ requests held unanswered
        self.interrupted = 0            # of which the kernel interrupted (the reader was killed)
        self._held: set[int] = set()
        self.lookups: list[str] = []
        self.ops: list[int] = []        # every request's opcode, in order
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._fd = -1
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> StallFS:
        import pytest

        if os.geteuid() != 0:
            pytest.skip("a FUSE mount needs root")
        try:
            self._fd = os.open("/dev/fuse", os.O_RDWR)
        except OSError as e:
            pytest.skip(f"/dev/fuse: {e}")
        libc = ctypes.CDLL(None, use_errno=True)
        opts = f"fd={self._fd},rootmode=40755,user_id=0,group_id=0,allow_other".encode()
        if libc.mount(b"stallfs", str(self.target).encode(), b"fuse", 0, opts) != 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            pytest.skip(f"mount -t fuse refused: {os.strerror(err)}")
        # served once mounted: before, /dev/fuse polls as an error and reads fail (EPERM);
        # the kernel queues INIT meanwhile
        self._thread = threading.Thread(target=self._serve, name="stallfs", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        os.close(self._fd)          # aborts the connection: blocked reads end with ENOTCONN
        libc = ctypes.CDLL(None, use_errno=True)
        libc.umount2(str(self.target).encode(), 2)      # MNT_DETACH

    # ---- the protocol ---------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.1)
            if not ready:
                continue
            try:
                buf = os.read(self._fd, 1 << 21)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                    continue
                return      # ENODEV: unmounted
            n, op, unique, node = IN_HEADER.unpack_from(buf)[:4]
            body = buf[IN_HEADER.size:n]
            self._handle(op, unique, node, body)

    def _reply(self, unique: int, error: int = 0, data: bytes = b"") -> None:
        try:
            os.write(self._fd, OUT_HEADER.pack(OUT_HEADER.size + len(data), -error, unique)
                     + data)
        except OSError:
            pass            # the request was interrupted meanwhile

    def _attr(self, node: int) -> bytes:
        if node == 1:
            mode, size, nlink = 0o40755, 0, 2
        else:
            mode, size, nlink = 0o100644, FILE_SIZE, 1
        return ATTR.pack(node, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode, nlink, 0, 0,
                         0, 4096, 0)

    def _handle(self, op: int, unique: int, node: int, body: bytes) -> None:
        self.ops.append(op)
        if op in NO_REPLY:
            return
        if op == INIT:
            (readahead,) = struct.unpack_from("<I", body, 8)
            out = struct.pack("<IIIIHHIIHHI", 7, 31, readahead, 0, 16, 12, 1 << 17, 1, 32, 0, 0)
            self._reply(unique, data=out + bytes(64 - len(out)))
        elif op == LOOKUP:
            name = body.split(b"\0", 1)[0].decode(errors="replace")
            self.lookups.append(name)
            if node != 1 or not name.endswith(".kvb"):
                self._reply(unique, errno.ENOENT)
                return
            ino = 2 + (hash(name) & 0xFFFFFFF)
            self._names[ino] = name
            self._reply(unique, data=struct.pack("<QQQQII", ino, 0, 60, 60, 0, 0)
                        + self._attr(ino))
        elif op == GETATTR:
            self._reply(unique, data=struct.pack("<QII", 60, 0, 0) + self._attr(node))
        elif op in (OPEN, OPENDIR):
            self._reply(unique, data=struct.pack("<QII", 0, FOPEN_DIRECT_IO, 0))
        elif op == READ:
            self.reads += 1         # never answered: the reader blocks
            self._held.add(unique)
        elif op == INTERRUPT:
            # the reader got a signal: the kernel asks to end its request. Only a fatal one
            # reaches a read stuck here (a process's exit kills its threads); honouring it, as
            # a network file system's interruptible mount does, lets that exit complete
            (target,) = struct.unpack_from("<Q", body)
            if target in self._held:
                self._held.discard(target)
                self.interrupted += 1
                self._reply(target, errno.EINTR)
        elif op in (RELEASE, RELEASEDIR, FLUSH, DESTROY):
            self._reply(unique)
        elif op in ROFS:
            self._reply(unique, errno.EROFS)
        else:
            self._reply(unique, errno.ENOSYS)
