"""moed serving against vLLM's CPU backend on the same checkpoint (bench/peers.py --vllm PY).

`moed serve` on the checkpoint and `PY -m vllm.entrypoints.openai.api_server` (vLLM's CPU build
installed in the interpreter PY; docs/benchmarks.md says how), each driven by bench/serve.py's
load (token-id prompts, streaming, ignore_eos, greedy) at each concurrency with the same prompts.
Per concurrency: output tok/s, TTFT p50/p99, requests refused or failed, and moed/vLLM ratios
(tok/s: > 1 moed faster; TTFT: < 1 moed sooner).

Two orders. rounds=1: one server at a time (moed, then vLLM), each alone on the cores. rounds>1:
both servers up at once (an idle server costs the other nothing measurable: neither polls), and
each concurrency is sent to each in turn, the order alternating per round, so both meet the same
background load on a shared machine; the reported figures are per-round medians, and each
ratio the median of the rounds' ratios.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import load_average, wait_ready  # noqa: E402
from serve import _free_port, drive, start_server  # noqa: E402


def start_vllm(python: str, model_dir: Path, threads: int, log_path: Path,
               timeout_s: float) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on the CPU, bf16, its KV in 2 GiB, its OpenMP pool on the first
    `threads` cores (VLLM_CPU_OMP_THREADS_BIND), as wave3's measurements ran it."""
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_TARGET_DEVICE": "cpu"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server",
                                 "--model", str(model_dir), "--served-model-name", "peer",
                                 "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                                 "--max-model-len", "1024"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    why = wait_ready(url, proc, timeout_s, path="/health")
    if why is None:
        return proc, url
    proc.kill()
    raise SystemExit(f"vllm {why}; see {log_path}")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _warm(url: str, model: str, prompts: dict[int, list[list[int]]]) -> None:
    asyncio.run(drive(url, model, prompts[min(prompts)][:1], 4, 1, None, 600))


def _one(url: str, model: str, ps: list[list[int]], max_tokens: int, c: int, side: str) -> dict:
    before = load_average()
    r = asyncio.run(drive(url, model, ps, max_tokens, c, None, 600))
    r["load_before"], r["load_after"] = before, load_average()
    print(f"    {side:<5} c={c:<3} ok {r['ok']}/{r['requests']}  {r['output_tok_s']:.1f} tok/s  "
          f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms p99 {r['ttft_ms']['p99']:.0f} ms  load "
          f"{before[0]:.1f} -> {r['load_after'][0]:.1f}", flush=True)
    return r


def _ratio(m: dict, v: dict) -> dict:
    nan = float("nan")
    return {"output_tok_s": m["output_tok_s"] / v["output_tok_s"] if v["output_tok_s"] else nan,
            "ttft_p50": m["ttft_ms"]["p50"] / v["ttft_ms"]["p50"] if v["ok"] else nan,
            "moed_failed": m["requests"] - m["ok"], "vllm_failed": v["requests"] - v["ok"]}


def _median_run(runs: list[dict]) -> dict:
    """One row from a concurrency's rounds: medians of the rates and TTFTs, failures summed."""
    med = statistics.median
    return {"requests": sum(r["requests"] for r in runs), "ok": sum(r["ok"] for r in runs),
            "output_tok_s": med(r["output_tok_s"] for r in runs),
            "ttft_ms": {k: med(r["ttft_ms"][k] for r in runs) for k in ("p50", "p99")},
            "rounds": runs}


def compare(model_dir: Path, vllm_python: str, concurrencies: list[int], prompt_len: int,
            max_tokens: int, threads: int, per_concurrency: int = 4,
            vllm_ready_s: float = 1200, rounds: int = 1) -> dict:
    """-> {"moed": {c: row}, "vllm": {c: row}, "ratio": {c: {...}}, "order": ...}; each
    concurrency sends per_concurrency x c requests (at least 8) to each server per round."""
    rng = random.Random(0)
    prompts = {c: [[rng.randrange(3, 1000) for _ in range(prompt_len)]
                   for _ in range(max(8, per_concurrency * c))] for c in concurrencies}
    logs = Path(tempfile.gettempdir())
    names = {"moed": model_dir.name, "vllm": "peer"}

    def up_moed() -> tuple[subprocess.Popen, str]:
        print(f"  serving: moed serve (engine.num_threads {threads})", flush=True)
        return start_server(str(model_dir), {"MOED_ENGINE_NUM_THREADS": str(threads)},
                            logs / "moed-serve-peer.log")

    def up_vllm() -> tuple[subprocess.Popen, str]:
        print(f"  serving: vLLM ({vllm_python}); its start-up compiles for minutes on 2 cores",
              flush=True)
        return start_vllm(vllm_python, model_dir, threads, logs / "vllm-serve-peer.log",
                          vllm_ready_s)

    res: dict = {"order": "sequential" if rounds == 1 else f"interleaved, {rounds} rounds"}
    if rounds == 1:
        for side, up in (("moed", up_moed), ("vllm", up_vllm)):
            proc, url = up()
            try:
                _warm(url, names[side], prompts)
                res[side] = {c: _one(url, names[side], ps, max_tokens, c, side)
                             for c, ps in prompts.items()}
            finally:
                _stop(proc)
        res["ratio"] = {c: _ratio(res["moed"][c], res["vllm"][c]) for c in concurrencies}
        return res
    procs: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        procs["vllm"] = up_vllm()       # the slow start first: moed's start then overlaps nothing
        procs["moed"] = up_moed()
        for side, (_, url) in procs.items():
            _warm(url, names[side], prompts)
        runs: dict[str, dict[int, list[dict]]] = {"moed": {}, "vllm": {}}
        for k in range(rounds):
            print(f"  round {k + 1} of {rounds}", flush=True)
            for c, ps in prompts.items():
                for side in (("moed", "vllm") if k % 2 == 0 else ("vllm", "moed")):
                    runs[side].setdefault(c, []).append(
                        _one(procs[side][1], names[side], ps, max_tokens, c, side))
    finally:
        for proc, _ in procs.values():
            _stop(proc)
    for side in ("moed", "vllm"):
        res[side] = {c: _median_run(runs[side][c]) for c in concurrencies}
    res["ratio"] = {}
    for c in concurrencies:
        per_round = [_ratio(m, v) for m, v in zip(runs["moed"][c], runs["vllm"][c])]
        res["ratio"][c] = {"output_tok_s": statistics.median(r["output_tok_s"] for r in per_round),
                           "ttft_p50": statistics.median(r["ttft_p50"] for r in per_round),
                           "moed_failed": sum(r["moed_failed"] for r in per_round),
                           "vllm_failed": sum(r["vllm_failed"] for r in per_round),
                           "per_round": per_round}
    return res
