"""Two builds of the CPU kernels on the native decode step, interleaved call by call.

    .venv/bin/python bench/kernel_ab.py A.c B.c [--batches 1,8] [--calls 600] [--threads 2]
                                        [--isa avx512,avx2] [--part bf16|quant|qdot|step|mla]
                                        [--quant int4 --activations int8 --lm-head int8]

Each file is a variant of one of the kernels' C files (--part: cpu_bf16.c by default, or
cpu_quant.c, cpu_qdot.c, cpu_step.c, cpu_mla.c; the others are the project's) with the same ABI (the
decode step's structs and signatures); --quant etc. load the model quantized as bench/step_ab.py
does, so a quantized kernel's two builds race on the native step. A and B may be folders
(two trees' moed/model/kernels, e.g. `git archive main`'s and this one's): all five files each. Both are compiled with the project's flags for their ISA variant (--isa,
one per build, default the fastest this CPU runs for both; `cpu_bf16.c cpu_bf16.c --isa avx512,avx2`
races two variants of one source; cpu_avx2.h and cpu_avx512.h are found beside the source or in
moed/model/kernels) and loaded
into one process, and the bench model's decode step is called alternately on each (A B B A ...),
so a change of the host's memory bandwidth, which on a shared VM moves a decode step by tens of
percent within minutes, falls on both alike. Two separate runs of one build differ by up to ±6%
on the 2-core dev VM; `A.c A.c` here gives ~1%. Prints the median forward + argmax time per build and
B/A per batch size, with the load average; JSON to bench/results/kernel_ab.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import cpu_model, load_average  # noqa: E402
from engine import _checkpoint  # noqa: E402

from moed.model import kernels as K  # noqa: E402
from moed.model.batch import ForwardBatch  # noqa: E402
from moed.model.runner import ModelRunner  # noqa: E402
from moed.model.sampler import argmax_rows  # noqa: E402


# bf16, quant, qdot, step, mla: the kernels' C files (kernels.EXTRA_SOURCES names all but the first)
PARTS = {"bf16": K.SOURCE, **{p.stem.removeprefix("cpu_"): p for p in K.EXTRA_SOURCES}}


def compile_variant(src: Path, out: Path, isa: str = "avx512bf16", part: str = "bf16") -> Path:
    cc = K._compiler()
    flags = K.COMMON_CFLAGS + K.ISA_CFLAGS[isa]
    # src in place of `part`, with the project's other three files: the loader binds all their calls;
    # src a folder (another tree's moed/model/kernels): all five files and headers from there
    files = [src / path.name if src.is_dir() else src if name == part else path for name, path in PARTS.items()]
    inc = src if src.is_dir() else K.SOURCE.parent
    p = subprocess.run([cc, *flags, "-I", str(inc), "-o", str(out), *map(str, files), "-lm"],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise SystemExit(f"compiling {src} failed:\n{p.stderr[-2000:]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--calls", type=int, default=600, help="decode steps per batch size, both builds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default=f"{K.best_isa()},{K.best_isa()}", help="the variant of A and of B (kernels.ISAS)")
    ap.add_argument("--part", default="bf16", choices=tuple(PARTS), help="the C file A and B are variants of")
    ap.add_argument("--quant", default="none", choices=("none", "int8", "int4", "fp8"))
    ap.add_argument("--activations", default="none", choices=("none", "int8"))
    ap.add_argument("--lm-head", default="none", choices=("none", "int8", "model"))
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernel_ab.json"))
    a = ap.parse_args()
    isas = a.isa.split(",")
    if len(isas) != 2 or any(i not in K.ISAS for i in isas):
        raise SystemExit(f"--isa: two of {', '.join(K.ISAS)}, comma-separated")
    torch.set_num_threads(a.threads)
    runner = ModelRunner(_checkpoint("qwen3_moe", Path(a.cache)), dtype="bfloat16", device="cpu",
                         attention_backend="torch", num_blocks=400, block_size=16,
                         quantization="" if a.quant == "none" else a.quant, quantization_lm_head=a.lm_head,
                         quantization_activations=a.activations)
    step = runner.native_decode
    if step is None:
        raise SystemExit("the native decode step does not serve here (see model_runner_ready's native_decode)")
    with tempfile.TemporaryDirectory() as tmp:
        builds = [K.CpuKernels(compile_variant(src, Path(tmp) / f"{tag}.so", isa, a.part), isa)
                  for tag, src, isa in (("a", a.a, isas[0]), ("b", a.b, isas[1]))]
    print(f"A {a.a} ({isas[0]})  B {a.b} ({isas[1]}) as cpu_{a.part}.c; quant {a.quant} (activations "
          f"{a.activations}, lm_head {a.lm_head}); {a.threads} threads; CPU: {cpu_model()}; "
          f"load {load_average()[0]:.2f}", flush=True)
    rows = []
    for batch in (int(x) for x in a.batches.split(",")):
        fb = ForwardBatch([[5]] * batch, [130] * batch, [list(range(i * 10, i * 10 + 10)) for i in range(batch)])
        before = load_average()
        times: dict[int, list[float]] = {0: [], 1: []}
        for i in range(a.calls + 10):
            v = (i + i // 2) % 2               # A B B A A B B A ...: neither always goes first
            step.kernels = builds[v]
            t = time.perf_counter()
            argmax_rows(runner.forward(fb)).tolist()
            if i >= 10:                        # warm-up
                times[v].append(time.perf_counter() - t)
        ma, mb = statistics.median(times[0]), statistics.median(times[1])
        rows.append({"batch": batch, "a_ms": ma * 1e3, "b_ms": mb * 1e3, "b_over_a": mb / ma,
                     "load_before": before, "load_after": load_average()})
        print(f"batch {batch:>2}: A {ma * 1e3:.3f} ms  B {mb * 1e3:.3f} ms  B/A {mb / ma:.3f}  "
              f"(load {before[0]:.2f} -> {load_average()[0]:.2f})", flush=True)
    step.kernels = runner.model.kernels
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "kernel_ab", "a": str(a.a), "b": str(a.b), "isa": isas, "part": a.part,
                               "quant": [a.quant, a.activations, a.lm_head], "cpu": cpu_model(),
                               "threads": a.threads, "calls": a.calls, "runs": rows}, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
