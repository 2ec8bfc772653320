"""Colocated vs disaggregated (1 prefill + 1 decode) on this machine, under a mixed load.

Short prompts stream continuously (a few concurrent clients) while long prompts arrive at a
fixed interval. For the SHORT requests we report TTFT and inter-token latency p50/p99: in the
colocated server their decode steps share the step loop with the long prompts' prefill chunks;
with disaggregation the long prefills run on the prefill node and only their KV arrives.
A third setup prefills prompts of at most --local-prefill tokens on the decode node itself.
All setups run in the same invocation on the same checkpoint; results side by side and in
bench/results/disagg.json.

    .venv/bin/python bench/disagg.py [--model DIR] [--duration 20] [--long-tokens 1024]
                                     [--local-prefill 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import wait_ready  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_KEY = os.urandom(32).hex()


def _serve(model: str, role: str, port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    full.update({"OMP_NUM_THREADS": "1", "MOED_ENGINE_NUM_THREADS": "1",
                 "MOED_SERVER_LOG_LEVEL": "warning", "MOED_MODEL_SERVED_NAME": "m",
                 # prefill/decode nodes sign their job calls with the cluster secret
                 "MOED_CLUSTER_KEY_ENV": "BENCH_CLUSTER_KEY", "BENCH_CLUSTER_KEY": _KEY, **env})
    return subprocess.Popen([sys.executable, "-m", "moed", "serve", "--role", role, "--model",
                             model, "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT,
                            env=full, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    why = wait_ready(f"http://127.0.0.1:{port}", proc, timeout)
    if why:
        raise RuntimeError(f"server on {port} {why}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


async def _stream_one(client: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    times: list[float] = []
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            times.append(time.perf_counter())
    if not times:
        raise RuntimeError("no tokens")
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


async def _load(url: str, a: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    rnd = random.Random(0)
    ttft: list[float] = []
    itl: list[float] = []
    longs: list[float] = []
    end = time.monotonic() + a.duration

    async def short_loop() -> None:
        while time.monotonic() < end:
            p = [rnd.randrange(3, 1000) for _ in range(a.short_tokens)]
            t, gaps = await _stream_one(client, p, a.short_max_tokens)
            ttft.append(t)
            itl.extend(gaps)

    async def long_loop() -> None:
        tasks = []
        while time.monotonic() < end:
            p = [rnd.randrange(3, 1000) for _ in range(a.long_tokens)]
            tasks.append(asyncio.create_task(_stream_one(client, p, 1)))
            await asyncio.sleep(a.long_interval)
        for t in tasks:
            longs.append((await t)[0])

    await _stream_one(client, [5, 6, 7], 2)        # warm-up
    await asyncio.gather(long_loop(), *(short_loop() for _ in range(a.short_clients)))
    await client.close()

    def q(xs: list[float], p: float) -> float:
        return statistics.quantiles(xs, n=100)[int(p) - 1] if len(xs) >= 2 else float("nan")

    return {"short_requests": len(ttft), "long_requests": len(longs),
            "ttft_p50_ms": 1e3 * q(ttft, 50), "ttft_p99_ms": 1e3 * q(ttft, 99),
            "itl_p50_ms": 1e3 * q(itl, 50), "itl_p99_ms": 1e3 * q(itl, 99),
            "long_ttft_p50_ms": 1e3 * q(longs, 50)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="", help="checkpoint dir (default: a random 'bench' one)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per setup")
    ap.add_argument("--short-clients", type=int, default=3)
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--short-max-tokens", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--long-interval", type=float, default=2.0)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens (chunk size)")
    ap.add_argument("--local-prefill", type=int, default=64,
                    help="also run 1P+1D with transfer.local_prefill_max_tokens=N (0: skip)")
    ap.add_argument("--out", default="bench/results/disagg.json")
    a = ap.parse_args()
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    model = a.model
    if not model:
        model = str(out_dir / "bench-qwen3_moe")
        if not (Path(model) / "config.json").exists():
            sys.path.insert(0, str(ROOT))
            from moed.dev.checkpoint import init_checkpoint
            init_checkpoint(arch="qwen3_moe", out=model, preset="bench", seed=0)
    env = {"MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": str(a.budget),
           "MOED_ENGINE_KV_CACHE_MEMORY_MB": "256"}
    results: dict[str, Any] = {"args": vars(a)}

    c = _port()
    procs = [_serve(model, "colocated", c, env, out_dir / "disagg-colocated.log")]
    try:
        _wait_ready(c, procs[0])
        results["colocated"] = asyncio.run(_load(f"http://127.0.0.1:{c}", a))
    finally:
        _stop(procs)

    setups = {"disagg": 0, "disagg_local": a.local_prefill} if a.local_prefill else {"disagg": 0}
    for name, local in setups.items():
        p, d = _port(), _port()
        procs = [_serve(model, "prefill", p, env, out_dir / f"{name}-prefill.log"),
                 _serve(model, "decode", d, {**env, "MOED_TRANSFER_PREFILL_PEERS":
                                             f"http://127.0.0.1:{p}",
                                             "MOED_TRANSFER_LOCAL_PREFILL_MAX_TOKENS": str(local)},
                        out_dir / f"{name}-decode.log")]
        try:
            for port, proc in ((p, procs[0]), (d, procs[1])):
                _wait_ready(port, proc)
            results[name] = asyncio.run(_load(f"http://127.0.0.1:{d}", a))
        finally:
            _stop(procs)

    cols = [("colocated", "colocated"), ("disagg", "1P+1D")]
    if a.local_prefill:
        cols.append(("disagg_local", f"local<={a.local_prefill}"))
    print(f"short: {a.short_tokens}-token prompts x {a.short_clients} streaming clients, "
          f"{a.short_max_tokens} tokens each; long: {a.long_tokens}-token prompts every "
          f"{a.long_interval}s; {a.duration}s per setup; chunk budget {a.budget}")
    print(f"{'metric (short requests)':<26}" + "".join(f" {t:>12}" for _, t in cols))
    for k in ("short_requests", "long_requests", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
              "itl_p99_ms", "long_ttft_p50_ms"):
        print(f"{k:<26}" + "".join(f" {results[c][k]:>12.1f}" for c, _ in cols))
    Path(a.out).write_text(json.dumps(results, indent=2))
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
