"""Run a command under a memory cap: a fresh memory cgroup (v2 `memory.max`, or v1's twin
`memory.limit_in_bytes` where the v1 memory controller is mounted), the child moved into it
before exec. Needs the right to make a cgroup (root, or a delegated subtree); no swap is
assumed (with swap a capped process pages out instead of being OOM-killed).

The files a run reads can be evicted from the page cache first (`evict`, posix_fadvise
DONTNEED): a page already cached was charged to whoever read it, so a capped process that
maps or reads it would not pay for it under the cap.
"""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class Capped:
    rc: int                 # the command's exit status (-9 or 137: killed, e.g. by the OOM killer)
    out: str
    err: str
    seconds: float
    peak_bytes: int         # the cgroup's peak charge (RSS + page cache it faulted in)
    oom_kills: int          # -1 where the cgroup does not say
    limit_bytes: int


def available() -> str:
    """'v2', 'v1' or '' (no memory controller this process can use)."""
    if (V2 / "cgroup.controllers").is_file() and "memory" in (V2 / "cgroup.controllers").read_text():
        return "v2"
    if (V1 / "memory.limit_in_bytes").is_file():
        return "v1"
    return ""


def evict(paths: list[Path]) -> None:
    """Drop these files' clean pages from the page cache (a hint the kernel follows for
    pages nobody maps)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(cmd: list[str], limit_bytes: int, timeout_s: float = 600.0, env: dict[str, str] | None = None) -> Capped:
    """cmd in a new cgroup capped at limit_bytes; waits for it (killed after timeout_s)."""
    kind = available()
    if not kind:
        raise SystemExit("no memory cgroup controller to cap a run with (need cgroup v2 with "
                         "memory, or v1's memory controller, and the right to make a cgroup)")
    cg = (V2 if kind == "v2" else V1) / f"moed-bench-{os.getpid()}-{time.monotonic_ns()}"
    cg.mkdir()
    try:
        (cg / ("memory.max" if kind == "v2" else "memory.limit_in_bytes")).write_text(str(limit_bytes))
        procs = str(cg / "cgroup.procs")

        def enter() -> None:            # in the child, before exec: everything it maps is charged here
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=enter, env=env)
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        secs = time.monotonic() - t0
        if kind == "v2":
            peak = int((cg / "memory.peak").read_text()) if (cg / "memory.peak").exists() else 0
            events = dict(line.split() for line in (cg / "memory.events").read_text().splitlines())
            ooms = int(events.get("oom_kill", -1))
        else:
            peak = int((cg / "memory.max_usage_in_bytes").read_text())
            oc = dict(line.split() for line in (cg / "memory.oom_control").read_text().splitlines())
            ooms = int(oc.get("oom_kill", -1))
        return Capped(p.returncode, out, err, secs, peak, ooms, limit_bytes)
    finally:
        for _ in range(50):             # the cgroup empties once the child is reaped
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
