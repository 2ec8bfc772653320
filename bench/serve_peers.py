"""moed serving against vLLM's CPU backend on the same checkpoint (bench/peers.py --vllm PY).

One server at a time on the same cores (both would otherwise halve each other): `moed serve`
on the checkpoint, then `PY -m vllm.entrypoints.openai.api_server` (vLLM's CPU build installed
in the interpreter PY; docs/benchmarks.md says how), each driven by bench/serve.py's load
(token-id prompts, streaming, ignore_eos, greedy) at each concurrency with the same prompts.
Per concurrency: output tok/s, TTFT p50/p99, requests refused or failed, and moed/vLLM ratios
(tok/s: > 1 moed faster; TTFT: < 1 moed sooner).
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
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


def _load(url: str, model: str, prompts: dict[int, list[list[int]]], max_tokens: int) -> dict:
    asyncio.run(drive(url, model, prompts[min(prompts)][:1], 4, 1, None, 600))   # warm-up
    out = {}
    for c, ps in prompts.items():
        out[c] = asyncio.run(drive(url, model, ps, max_tokens, c, None, 600))
        out[c]["load_after"] = load_average()
        r = out[c]
        print(f"    c={c:<3} ok {r['ok']}/{r['requests']}  {r['output_tok_s']:.1f} tok/s  TTFT "
              f"p50 {r['ttft_ms']['p50']:.0f} ms p99 {r['ttft_ms']['p99']:.0f} ms", flush=True)
    return out


def compare(model_dir: Path, vllm_python: str, concurrencies: list[int], prompt_len: int,
            max_tokens: int, threads: int, per_concurrency: int = 4,
            vllm_ready_s: float = 1200) -> dict:
    """-> {"moed": {c: drive()}, "vllm": {c: drive()}, "ratio": {c: {...}}}; each concurrency
    sends per_concurrency x c requests (at least 8)."""
    rng = random.Random(0)
    prompts = {c: [[rng.randrange(3, 1000) for _ in range(prompt_len)]
                   for _ in range(max(8, per_concurrency * c))] for c in concurrencies}
    logs = Path(tempfile.gettempdir())
    res: dict = {}
    print(f"  serving: moed serve (engine.num_threads {threads})", flush=True)
    proc, url = start_server(str(model_dir), {"MOED_ENGINE_NUM_THREADS": str(threads)},
                             logs / "moed-serve-peer.log")
    try:
        res["moed"] = _load(url, model_dir.name, prompts, max_tokens)
    finally:
        _stop(proc)
    print(f"  serving: vLLM ({vllm_python}); its start-up compiles for minutes on 2 cores",
          flush=True)
    proc, url = start_vllm(vllm_python, model_dir, threads, logs / "vllm-serve-peer.log",
                           vllm_ready_s)
    try:
        res["vllm"] = _load(url, "peer", prompts, max_tokens)
    finally:
        _stop(proc)
    nan = float("nan")
    res["ratio"] = {c: {"output_tok_s": m["output_tok_s"] / v["output_tok_s"] if v["output_tok_s"] else nan,
                        "ttft_p50": m["ttft_ms"]["p50"] / v["ttft_ms"]["p50"] if v["ok"] else nan,
                        "moed_failed": m["requests"] - m["ok"], "vllm_failed": v["requests"] - v["ok"]}
                    for c in concurrencies
                    for m, v in [(res["moed"][c], res["vllm"][c])]}
    return res
