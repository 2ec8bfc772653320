"""What the benchmarks share: order statistics, the machine's load and the process's memory,
and waiting for a server they started.

Pure functions, no torch, so the parsing tests import it in milliseconds.
"""
from __future__ import annotations

import os
import platform
import subprocess
import time
import urllib.request
from collections.abc import Sequence


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]); NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90, mean, min and max of samples (a step's time, a round's figure)."""
    nan = float("nan")
    return {"median": quantile(xs, 0.5), "p10": quantile(xs, 0.1), "p90": quantile(xs, 0.9),
            "mean": sum(xs) / len(xs) if xs else nan, "min": min(xs) if xs else nan,
            "max": max(xs) if xs else nan, "n": len(xs)}


def load_average() -> list[float]:
    """1/5/15-minute load average: the figures beside it are only comparable at a like load."""
    return [round(x, 2) for x in os.getloadavg()]


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (Linux /proc), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_model() -> str:
    """The CPU's model name and its bf16 matrix features (AMX vs AVX512-BF16 changes the
    ceiling: say which machine a figure came from)."""
    name, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name in ("", "unknown", platform.machine()):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    feats = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{name} [{' '.join(feats)}]" if feats else name


def cores_available() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # not Linux
        return os.cpu_count() or 1


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, path: str = "/ready") -> str | None:
    """Poll url + path (moed's /ready; vLLM's /health) until it answers 200 -> None; or why not:
    the process exited, or timeout_s passed (the caller says which server and where its log is)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url + path, timeout=1) as r:
                if r.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(0.2)
    return f"not ready in {timeout_s:g} s"
