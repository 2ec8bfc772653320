"""Where a decode step's time goes: the native kernels vs the Python and torch glue around them.

    .venv/bin/python bench/decode_profile.py [--batches 1,8] [--steps 200] [--threads 2]
                                             [--quant int8|int4 [--lm-head none|int8|model]]

The bench checkpoint (bench/engine.py's), prefix caching off, greedy, EOS ignored. For each batch
size one request set decodes --steps tokens after a warm-up, once per path: `native` (the
runner's one-call decode step, moed/model/decode_step.py: what serves by default) and `layered`
(the same model layer by layer, the kernels called from Python), one after the other for each
batch size in the same process (native first: a fixed order), while every call
into the kernels' .so, the runner's forward, the attention plan and the sampler is timed
(perf_counter around each call, from the end of the prompt's step on; the wrappers add about a
microsecond a call). Per decode step it prints:
  step      the engine's own StepStats step_seconds (schedule + forward + sample + update)
  forward   ModelRunner.forward (embedding, plan, layers, final norm, lm_head, fp32 logits)
  kernels   the sum over the kernel calls, each kernel's share beside it (native: one call,
            decode_step, holding all of them)
  glue      forward - kernels: the torch ops and Python between the kernel calls
  plan      the attention backend's plan (inside forward), sample: the sampler (outside it)
and the layered/native step ratio: what moving the glue into native code won. --quant runs the
model quantized at load (model.quantization; both paths: the native step serves quantized
weights), its head per --lm-head (model.quantization_lm_head). JSON to bench/results/decode_profile.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import cpu_model, load_average  # noqa: E402
from engine import MoedSide, _checkpoint  # noqa: E402


class Clock:
    """Seconds spent per name, from wrapped callables."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def wrap(self, fn, name: str):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return timed


class TimedLib:
    """The kernels' ctypes library with every call timed under its symbol name."""

    def __init__(self, lib, clock: Clock) -> None:
        self._lib, self._clock, self._cache = lib, clock, {}

    def __getattr__(self, name: str):
        if name not in self._cache:
            self._cache[name] = self._clock.wrap(getattr(self._lib, name), "kernel:" + name)
        return self._cache[name]


def profile(side: MoedSide, batch: int, steps: int, vocab: int, clock: Clock, step_s: list[float]) -> dict:
    """step_s: filled with each decode-only step's seconds by the engine's step hook."""
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, 128), generator=g).tolist()
    side.run(prompts, 8)                                        # warm-up
    step_s.clear()
    side.run(prompts, steps + 1)            # the clock restarts after the prompt's step
    n = len(step_s)
    per = {k: v * 1e3 / n for k, v in clock.seconds.items()}   # ms per decode step
    kernels = {k.removeprefix("kernel:moed_"): v for k, v in per.items() if k.startswith("kernel:")}
    fwd = per.get("forward", 0.0)
    return {"batch": batch, "decode_steps": n, "step_ms": sum(step_s) * 1e3 / n,
            "step_median_ms": statistics.median(step_s) * 1e3, "forward_ms": fwd,
            "kernels_ms": sum(kernels.values()), "glue_ms": fwd - sum(kernels.values()),
            "plan_ms": per.get("plan", 0.0), "sample_ms": per.get("sample", 0.0),
            "by_kernel_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--quant", default="", choices=("", "int8", "int4", "fp8"), help="model.quantization")
    ap.add_argument("--lm-head", default="none", choices=("none", "int8", "model"),
                    help="model.quantization_lm_head (with --quant)")
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_profile.json"))
    a = ap.parse_args()
    if a.steps < 10:
        ap.error("--steps must be >= 10")
    if a.threads:
        torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    model_dir = _checkpoint("qwen3_moe", Path(a.cache))
    side = MoedSide(model_dir, max(batches), 128, a.steps + 8, quantization=a.quant,
                    lm_head=a.lm_head if a.quant else "none")
    runner = side.engine.runner
    if runner.model.kernels is None:
        raise SystemExit("the CPU kernels are off here (MOED_CPU_KERNELS, or the log says why): nothing to split")
    clock = Clock()
    runner.model.kernels.lib = TimedLib(runner.model.kernels.lib, clock)
    runner.forward = clock.wrap(runner.forward, "forward")
    runner.backend.plan = clock.wrap(runner.backend.plan, "plan")
    import moed.engine.engine as engine_mod
    engine_mod.sample = clock.wrap(engine_mod.sample, "sample")
    vocab = runner.spec.vocab_size
    step_s: list[float] = []

    def on_step(st) -> None:  # noqa: ANN001
        if st.num_prefill_tokens:       # the prompt's step: its forward is not decode time
            clock.seconds.clear()
        elif st.num_decode_tokens:
            step_s.append(st.step_seconds)
    side.engine.subscribe_step(on_step)
    fmt = f"{a.quant} (lm_head {a.lm_head})" if a.quant else "bf16"
    print(f"qwen3_moe bench preset, {fmt}, {torch.get_num_threads()} torch threads; CPU: {cpu_model()}; "
          f"load {load_average()[0]:.2f}", flush=True)
    native = runner.native_decode
    paths = {"native": native, "layered": None} if native is not None else {"layered": None}
    rows = []
    for b in batches:
        by_path = {}
        for name, step in paths.items():
            runner.native_decode = step
            before = load_average()
            r = profile(side, b, a.steps, vocab, clock, step_s)
            r["path"], r["load_before"], r["load_after"] = name, before, load_average()
            rows.append(r)
            by_path[name] = r["step_median_ms"]
            ks = ", ".join(f"{k} {v:.2f}" for k, v in r["by_kernel_ms"].items())
            print(f"batch {b:>2} {name:>7}: step {r['step_ms']:.2f} ms (median {r['step_median_ms']:.2f}) = "
                  f"forward {r['forward_ms']:.2f} [kernels {r['kernels_ms']:.2f} + glue {r['glue_ms']:.2f}, "
                  f"of which plan {r['plan_ms']:.2f}] + sample {r['sample_ms']:.2f} + the rest of the step "
                  f"{r['step_ms'] - r['forward_ms'] - r['sample_ms']:.2f}\n          kernels: {ks}", flush=True)
        if len(by_path) == 2:
            print(f"batch {b:>2}: layered/native step (medians) {by_path['layered'] / by_path['native']:.2f}")
    runner.native_decode = native
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "decode_profile", "cpu": cpu_model(),
                               "torch_threads": torch.get_num_threads(), "quant": a.quant,
                               "lm_head": a.lm_head if a.quant else "none", "runs": rows,
                               "load_average": load_average()}, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
