"""How the disk tier moves payload bytes to and from its files: NIXL's POSIX backend (the same
library the node's KV transfer uses, moed/transfer/nixl_backend.py), or plain pread/pwrite.

One small interface, `FileIO.write(fd, offset, data)` / `read(fd, offset, n)`; the store
(store.py) owns the files, their headers and checksums. NIXL agents are not shared between
threads: each I/O thread gets its own (the loader, the writer, the start-up scan).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from typing import Any

IO_KINDS = ("auto", "nixl", "file")
XFER_TIMEOUT_S = 30.0


class FileIO:
    name = "file"

    def write(self, fd: int, offset: int, data: bytes) -> None:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    def read(self, fd: int, offset: int, n: int) -> bytes:
        out = os.pread(fd, n, offset)
        if len(out) != n:
            raise OSError(f"short read: {len(out)} of {n} bytes")
        return out


class NixlFileIO(FileIO):
    """Payloads through NIXL: a DRAM buffer and a FILE segment registered per transfer."""

    name = "nixl-posix"

    def __init__(self) -> None:
        self._local = threading.local()
        self._agent()       # fail here (at start) if the POSIX backend does not load

    def _agent(self) -> Any:
        ag = getattr(self._local, "agent", None)
        if ag is None:
            from nixl._api import nixl_agent, nixl_agent_config  # lazy: optional dependency

            logging.getLogger("nixl").setLevel(logging.WARNING)
            name = f"moed-l3-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            ag = nixl_agent(name, nixl_agent_config(enable_prog_thread=False,
                                                    enable_listen_thread=False, backends=[]))
            ag.create_backend("POSIX")
            self._local.agent, self._local.name = ag, name
        return ag

    def _xfer(self, op: str, buf: Any, fd: int, offset: int) -> None:
        """NIXL raises its own exception types (nixlBackendError when the POSIX backend's
        write fails, e.g. on a full disk): they become OSError, what the cache takes for a
        failed read or write, with ENOSPC when the file system is out of space."""
        try:
            self._xfer_nixl(op, buf, fd, offset)
        except Exception as e:      # noqa: BLE001 - nixlBackendError and friends
            if isinstance(e, OSError) and e.errno is not None:
                raise
            code = errno.ENOSPC if op == "WRITE" and _no_space(fd) else errno.EIO
            raise OSError(code, f"NIXL {op} of {buf.nbytes} bytes failed: "
                                f"{type(e).__name__}: {e}") from None

    def _xfer_nixl(self, op: str, buf: Any, fd: int, offset: int) -> None:
        ag = self._agent()
        n = buf.nbytes
        mem = ag.register_memory([(buf.ctypes.data, n, 0, "")], "DRAM")
        fil = None
        handle = None
        try:
            fil = ag.register_memory([(offset, n, fd, "")], "FILE")
            handle = ag.initialize_xfer(op, ag.get_xfer_descs([(buf.ctypes.data, n, 0)], "DRAM"),
                                        ag.get_xfer_descs([(offset, n, fd)], "FILE"),
                                        self._local.name)
            state = ag.transfer(handle)
            deadline = time.monotonic() + XFER_TIMEOUT_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise OSError(f"NIXL {op} of {n} bytes did not finish in {XFER_TIMEOUT_S} s")
                time.sleep(0)
                state = ag.check_xfer_state(handle)
            if state != "DONE":
                raise OSError(f"NIXL {op} of {n} bytes failed ({state})")
        finally:
            if handle is not None:
                ag.release_xfer_handle(handle)
            if fil is not None:
                ag.deregister_memory(fil)
            ag.deregister_memory(mem)

    def write(self, fd: int, offset: int, data: bytes) -> None:
        import numpy as np
        self._xfer("WRITE", np.frombuffer(data, dtype=np.uint8), fd, offset)

    def read(self, fd: int, offset: int, n: int) -> bytes:
        import numpy as np
        if os.fstat(fd).st_size < offset + n:
            raise OSError(f"short file: fewer than {n} payload bytes")
        buf = np.empty(n, dtype=np.uint8)
        self._xfer("READ", buf, fd, offset)
        return buf.tobytes()


def _no_space(fd: int) -> bool:
    try:
        st = os.fstatvfs(fd)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024       # less than a few pages left


def make(kind: str) -> FileIO:
    """"nixl": NIXL's POSIX backend or an error; "file": plain I/O; "auto": NIXL when it
    loads here, else plain I/O."""
    if kind not in IO_KINDS:
        raise ValueError(f"unknown disk I/O {kind!r}; expected one of {', '.join(IO_KINDS)}")
    if kind == "file":
        return FileIO()
    try:
        return NixlFileIO()
    except Exception as e:      # ImportError, or the plugin missing: NIXL raises its own types
        if kind == "nixl":
            raise RuntimeError(f"NIXL's POSIX backend does not load: {type(e).__name__}: {e}") \
                from None
        return FileIO()
