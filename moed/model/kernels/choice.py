"""Which matmul serves a bf16 weight shape at a given row count: the native kernel or oneDNN.

The native kernel (cpu_bf16.c) streams a weight once for up to 8 rows at a time with bf16 dot
products (AVX512-BF16, or FMAs on widened weights): it wins the skinny matmuls of decode everywhere, and on a Zen4-class CPU stays at
the dot-product rate for hundreds of rows. On a CPU with AMX tiles oneDNN multiplies many rows
several times faster. No fixed row threshold is right on both, so each weight shape [N, K] is
timed once, native vs oneDNN (race()), at one row count per class (ROW_CLASSES); oneDNN is chosen for
a class only if it beats the native kernel by MARGIN (choosing it keeps a second copy of the
weight, oneDNN-packed, beside the kernels' one). Answers are cached in a JSON file next to the
kernel build, keyed by CPU model, kernel build (source hash), torch version and thread count,
so a restart reuses them; each shape's answer is logged once per process (`kernel_choice`).
A measurement during which this process's threads waited for a CPU (another process had the
cores: the kernel's per-thread run delay) is used for this process but not cached: a race lost
to load would otherwise stay chosen in every later start (a wrongly cached oneDNN class keeps a
second copy of that weight), and the next start measures again.

Numerics are the same rule on both sides (fp32 accumulation, one rounding to bf16): results
agree to fp32 summation order. Bitwise agreement across thread counts holds for the native
kernel only: a class served by oneDNN agrees to an ulp.
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import platform
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import structlog
import torch

log = structlog.get_logger(__name__)
K = TypeVar("K")

# Upper bound of each row class (inclusive; the last is open): 1, 2-8, 9-64, 65-512, >512.
ROW_CLASSES: tuple[int | None, ...] = (1, 8, 64, 512, None)
# Rows timed per class: its top (a kernel's weak point is where row tiles stop filling), and
# 1024 for the open class.
PROBE_ROWS: tuple[int, ...] = (1, 8, 64, 512, 1024)
# oneDNN must be this much faster to be chosen: it costs a second weight copy, and a smaller
# gap is within what load noise on a shared 2-core machine moves one timing.
MARGIN = 1.15
# A probe costs at most this many FLOPs per call (rows are cut down to fit): keeps the start-up
# measurement of all shapes of a model near a second. A class whose cut-down rows fall below
# its own range takes the class below's answer (lm_head past 64 rows: prompt logprobs only).
PROBE_MAX_FLOP = 2.0e9
ONEDNN_ROWS_HINT = 8     # oneDNN packs for this many rows (as the torch path does; see layers.Linear)
# A measurement is "busy" (not cached) when this process's threads waited for a CPU for more
# than this share of its wall time: with T threads racing, one thread descheduled that long
# skews a parallel call's time by as much.
BUSY_SHARE = 0.1


CLASS_NAMES = ("1", "2-8", "9-64", "65-512", ">512")       # ROW_CLASSES, as logged


def by_class(choices: Sequence["LinearChoice"], isa: str) -> str:
    """What serves each row class over a model's weight shapes, for model_runner_ready: the
    kernel variant (e.g. 'avx2'), 'onednn', or both with oneDNN's share of the shapes."""
    if not choices:
        return "none"
    out = []
    for i, name in enumerate(CLASS_NAMES):
        o = sum(c.onednn[i] for c in choices)
        out.append(f"{name}:{isa if o == 0 else 'onednn' if o == len(choices) else f'{isa}+onednn({o}/{len(choices)})'}")
    return " ".join(out)


def row_class(rows: int) -> int:
    """Index into ROW_CLASSES of the class holding `rows` (>= 1)."""
    for i, top in enumerate(ROW_CLASSES):
        if top is None or rows <= top:
            return i
    raise AssertionError("the last class is open")


@dataclass(frozen=True)
class LinearChoice:
    """Per row class: True where oneDNN serves, False where the native kernel does."""
    onednn: tuple[bool, ...]

    def use_onednn(self, rows: int) -> bool:
        return self.onednn[row_class(rows)]

    @property
    def any_onednn(self) -> bool:
        return any(self.onednn)

    def describe(self) -> str:
        """e.g. 'native<=64 onednn>64'."""
        return " ".join(f"{'onednn' if o else 'native'}:{n}" for n, o in zip(CLASS_NAMES, self.onednn))


NATIVE_ONLY = LinearChoice((False,) * len(ROW_CLASSES))


class NativeOnly:
    """model.batch_invariant's chooser: the native kernel for every shape at every row count.
    Its per-row sum does not depend on the row count or the thread split (threads split the
    columns, never K), where oneDNN's bf16 GEMM sums in another order than the native kernel:
    a row's logits would change with the class its step's row count falls in."""

    def __call__(self, n: int, k: int) -> LinearChoice:
        return NATIVE_ONLY

    def chosen(self) -> list[LinearChoice]:
        return [NATIVE_ONLY]


def native_only(kernels: K) -> K:
    """The same kernels (CpuKernels) with NativeOnly as their chooser (model.batch_invariant)."""
    pinned = copy.copy(kernels)
    pinned.choose = NativeOnly()        # type: ignore[attr-defined]
    return pinned


def decide(native_s: Sequence[float | None], onednn_s: Sequence[float | None],
           margin: float = MARGIN) -> LinearChoice:
    """The policy: per class, oneDNN iff native_s / onednn_s >= margin; a class not timed
    (None: its probe did not fit PROBE_MAX_FLOP) takes the answer of the class below."""
    out: list[bool] = []
    for n, o in zip(native_s, onednn_s, strict=True):
        if n is None or o is None:
            out.append(out[-1] if out else False)
        else:
            out.append(n >= margin * o)
    return LinearChoice(tuple(out))


def probe_rows(n: int, k: int) -> list[int | None]:
    """Rows to time per class for weight [n, k] (None: the class is not timed)."""
    rows: list[int | None] = []
    lows = [1] + [top + 1 for top in ROW_CLASSES[:-1] if top is not None]
    for r, low in zip(PROBE_ROWS, lows):
        fit = int(PROBE_MAX_FLOP // (2 * n * k))
        r = min(r, fit)
        rows.append(r if r >= low else None)
    return rows


def _once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _settled(ts: list[float], tol: float) -> bool:
    """The two fastest calls agree: a run not slowed by another process was seen twice."""
    a, b = sorted(ts)[:2]
    return b <= a * (1 + tol)


def race(a: Callable[[], object], b: Callable[[], object], min_calls: int = 3, max_calls: int = 12,
         budget_s: float = 0.3, tol: float = 0.1) -> tuple[float, float]:
    """Fastest call of a and of b, alternating (load swings hit both alike): calls go on until
    each side's two fastest agree within tol, or max_calls, or budget_s. On a shared CPU a
    parallel region whose thread was descheduled takes a whole time slice (4-16 ms measured on
    the 2-core dev VM under load 6-8): only repeated fast calls tell the kernel's own time."""
    a(), b()                                   # warm-up: first-call setup, caches
    ta: list[float] = []
    tb: list[float] = []
    end = time.perf_counter() + budget_s
    while len(ta) < max_calls:
        ta.append(_once(a))
        tb.append(_once(b))
        if len(ta) >= min_calls and _settled(ta, tol) and _settled(tb, tol):
            break
        if time.perf_counter() > end and len(ta) >= 2:
            break
    return min(ta), min(tb)


def measure(kernels, n: int, k: int) -> tuple[list[float | None], list[float | None]]:
    """Seconds per call, native and oneDNN, per class for a random bf16 weight [n, k]."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    kp = kernels.pack(w)
    od = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_ROWS_HINT)
    native: list[float | None] = []
    onednn: list[float | None] = []
    for r in probe_rows(n, k):
        if r is None:
            native.append(None)
            onednn.append(None)
            continue
        x = torch.randn(r, k, generator=g).bfloat16()
        run_native = lambda: kernels.linear_bf16(x, kp, n)  # noqa: E731
        run_onednn = lambda: torch.ops.mkldnn._linear_pointwise(x, od, None, "none", [], "")  # noqa: E731
        tn, to = race(run_native, run_onednn)
        if tn >= MARGIN * to:     # a oneDNN win must show twice (load noise made false ones)
            tn2, to2 = race(run_native, run_onednn)
            if tn2 / to2 < tn / to:
                tn, to = tn2, to2
        native.append(tn)
        onednn.append(to)
    return native, onednn


def run_delay_s() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed (the
    second field of /proc/self/task/*/schedstat); None where /proc does not say."""
    total, seen = 0, False
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
            seen = True
        except (OSError, ValueError, IndexError):
            continue        # a thread that ended meanwhile
    return total / 1e9 if seen else None


def busy_during(delay0: float | None, delay1: float | None, wall_s: float) -> bool:
    """Whether a measurement of wall_s waited for CPUs long enough to distrust (BUSY_SHARE)."""
    if delay0 is None or delay1 is None:
        return False
    return delay1 - delay0 > BUSY_SHARE * max(wall_s, 0.0) and delay1 - delay0 > 1e-3


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class KernelChooser:
    """Per weight shape, the LinearChoice: from memory, else the cache file, else measured."""

    def __init__(self, kernels, so_path: Path | None) -> None:
        """so_path: the kernel build the cache file sits beside (None: memory only)."""
        self.kernels, self.so_path = kernels, so_path
        self.cache_file: Path | None = None
        self._mem: dict[tuple[int, str], LinearChoice] = {}
        self._lock = threading.Lock()

    def __call__(self, n: int, k: int) -> LinearChoice:
        key, threads = f"{n}x{k}", torch.get_num_threads()
        with self._lock:
            got = self._mem.get((threads, key))
            if got is not None:
                return got
            self.cache_file = None if self.so_path is None else cache_file_for(self.so_path)
            # one process measures, the others on this host wait and read its answer: nodes
            # started together (a prefill and a decode node) must not choose differently
            with _host_lock(self.cache_file):
                stored = self._read().get(key)
                source = "cached"
                if stored is not None and len(stored.get("onednn", ())) == len(ROW_CLASSES):
                    choice = LinearChoice(tuple(bool(v) for v in stored["onednn"]))
                else:
                    d0, t0 = run_delay_s(), time.perf_counter()
                    native, onednn = measure(self.kernels, n, k)
                    wall, d1 = time.perf_counter() - t0, run_delay_s()
                    choice, source = decide(native, onednn), "measured"
                    if busy_during(d0, d1, wall):      # for this process only
                        source = "measured_busy"
                        log.info("kernel_choice_not_cached", shape=[n, k], reason="cores busy",
                                 waited_s=round(d1 - d0, 4), measured_s=round(wall, 4))
                    else:
                        self._write(key, {"onednn": list(choice.onednn),
                                          "native_us": [None if v is None else round(v * 1e6, 1) for v in native],
                                          "onednn_us": [None if v is None else round(v * 1e6, 1) for v in onednn]})
            self._mem[(threads, key)] = choice
        log.info("kernel_choice", shape=[n, k], choice=choice.describe(), source=source, threads=threads)
        return choice

    def chosen(self) -> list[LinearChoice]:
        """The choices made so far in this process, at the current thread count."""
        threads = torch.get_num_threads()
        with self._lock:
            return [c for (t, _), c in self._mem.items() if t == threads]

    def _read(self) -> dict:
        if self.cache_file is None:
            return {}
        try:
            return json.loads(self.cache_file.read_text()).get("shapes", {})
        except (OSError, ValueError, AttributeError):
            return {}       # absent or torn: measure again (and rewrite it)

    def _write(self, key: str, entry: dict) -> None:
        """Merge one shape into the file, atomically (processes sharing the cache each install
        a whole file; a lost race only costs another process a measurement)."""
        if self.cache_file is None:
            return
        shapes = self._read()
        shapes[key] = entry
        body = {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                "kernels": self.so_path.name, "shapes": shapes}
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.cache_file.parent, suffix=".json.tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.cache_file)
        except OSError as e:     # a read-only cache: keep the answers in memory only
            log.warning("kernel_choice_not_cached", path=str(self.cache_file), error=str(e))
            self.so_path = None


LOCK_WAIT_S = 30.0      # another process's measurement of a whole model takes about a second


@contextlib.contextmanager
def _host_lock(cache_file: Path | None) -> Iterator[None]:
    """An exclusive lock beside the cache file, across processes (flock), waited for at most
    LOCK_WAIT_S; without one (no cache file, a read-only directory, a holder stuck past the
    wait) the caller measures on its own."""
    if cache_file is None:
        yield
        return
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(cache_file.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("kernel_choice_lock_timeout", path=str(cache_file))
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)            # closing releases the lock


def cache_file_for(so_path: Path) -> Path:
    """The choice file beside the kernel build: one per CPU model, build, torch and threads."""
    key = hashlib.sha256("\0".join([cpu_model(), so_path.name, torch.__version__,
                                    str(torch.get_num_threads())]).encode()).hexdigest()[:16]
    return so_path.with_name(f"moed_kernel_choice-{key}.json")


class FixedChooser:
    """The same answer for every shape (tests pin the path they check)."""

    def __init__(self, choice: LinearChoice) -> None:
        self.choice = choice

    def __call__(self, n: int, k: int) -> LinearChoice:
        return self.choice

    def chosen(self) -> list[LinearChoice]:
        return [self.choice]
