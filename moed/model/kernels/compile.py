"""One kernel .so from its C sources: each source its own compiler process, run at once, then
one link. The compiler processes of the whole process share one slot per core, so `moed model
kernels` building every variant (each build's sources at once) runs one compiler a core, never
more: an image build's cores all work, a node's first start does not oversubscribe.

Why per source: the sources are separate translation units anyway; gcc given all of them compiles
them one after another. cpu_quant.c and cpu_qdot.c take ~6 s each at -O3 (Ice Lake, one core),
cpu_bf16.c ~2 s, cpu_step.c 0.1 s: one variant ~14 s in one process, ~8 s on two cores.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def cores_available() -> int:
    """The cores this process may use (its affinity mask; the CPU count off Linux)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:      # not Linux
        return max(1, os.cpu_count() or 1)


# compiler processes running at once, process-wide (every build, every variant)
_SLOTS = threading.BoundedSemaphore(cores_available())


class CompileFailed(Exception):
    """A compiler process exited non-zero: which step (a source's name, or "link") and its stderr."""

    def __init__(self, step: str, stderr: str) -> None:
        super().__init__(f"{step}: {stderr}")
        self.step, self.stderr = step, stderr


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    with _SLOTS:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def compile_shared(cc: str, flags: tuple[str, ...], sources: tuple[Path, ...], out: Path,
                   timeout: float = 300) -> None:
    """Compile `sources` with `flags` (each at once, up to a compiler a core) and link them into
    `out`. CompileFailed names the first source (in the given order) that failed, else the link;
    OSError and subprocess errors (no compiler, a timeout) propagate. The objects live in a
    temp folder beside `out` (`*.tmp`), removed whatever happens."""
    objdir = Path(tempfile.mkdtemp(dir=out.parent, suffix=".o.tmp"))
    try:
        objs = [objdir / f"{i}-{src.stem}.o" for i, src in enumerate(sources)]
        with ThreadPoolExecutor(max_workers=len(sources)) as pool:
            procs = list(pool.map(lambda so: _run([cc, *flags, "-c", "-o", str(so[1]), str(so[0])], timeout),
                                  zip(sources, objs)))
        for src, proc in zip(sources, procs):
            if proc.returncode != 0:
                raise CompileFailed(src.name, proc.stderr)
        proc = _run([cc, *flags, "-o", str(out), *map(str, objs), "-lm"], timeout)
        if proc.returncode != 0:
            raise CompileFailed("link", proc.stderr)
    finally:
        shutil.rmtree(objdir, ignore_errors=True)
