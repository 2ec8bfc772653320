"""Serving overhead at concurrency 1: the client's inter-token latency next to the engine's step.

    .venv/bin/python bench/itl_gap.py                        # bench preset, default threads
    .venv/bin/python bench/itl_gap.py --threads auto,2,2+pin # compare engine.num_threads
    .venv/bin/python bench/itl_gap.py --preset tiny -n 4     # quick

For each --threads setting (auto = engine.num_threads 0, the default; N = MOED_ENGINE_NUM_THREADS)
a real `moed serve` starts on 127.0.0.1 with OMP_NUM_THREADS unset (so the default is what is
measured), one streaming client sends -n requests one after another (token-id prompts,
ignore_eos), and the server's own mean decode step over exactly that window is read from
/metrics before and after (moed_decode_step_seconds: the engine's StepStats of every step that
ran decode tokens only; its _sum and _count deltas), with the server-side ITL histogram beside
it (moed_inter_token_latency_seconds). Prints the client's ITL (mean, median, p10/p90) beside the
step and mean ITL / mean step; the gap is what the loop, the executor hop, detokenizing and SSE
add per token. The settings run in rounds (the order flips each round) so load changes hit
each alike. JSON (with the load average, the threads the server chose and its RSS after load)
goes to bench/results/itl_gap.json. Issue 16's goal: ITL <= 1.15 x step with defaults.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import cores_available, cpu_model, load_average, rss_bytes, spread, wait_ready  # noqa: E402


def metric(text: str, name: str) -> float | None:
    """One unlabelled sample of a Prometheus text exposition, None when absent."""
    m = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+|NaN)$", text, re.M)
    return float(m.group(1)) if m else None


def metric_total(text: str, name: str) -> float | None:
    """The sum of a metric's samples over all their label sets, None when absent."""
    vals = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)
    return sum(float(v) for v in vals) if vals else None


def window_mean(before: str, after: str, histogram: str) -> float | None:
    """Mean of a histogram's observations between two scrapes (its _sum and _count deltas,
    over all label sets)."""
    s0, s1 = metric_total(before, histogram + "_sum"), metric_total(after, histogram + "_sum")
    c0, c1 = metric_total(before, histogram + "_count"), metric_total(after, histogram + "_count")
    if None in (s0, s1, c0, c1) or c1 <= c0:
        return None
    return (s1 - s0) / (c1 - c0)


def server_threads(log_text: str) -> int | None:
    """The torch thread count the server logged at start (engine_threads)."""
    m = re.search(r"engine_threads\b.*?torch_threads\"?[=:] ?(\d+)"
                  r"|torch_threads\"?[=:] ?(\d+).*?engine_threads", log_text)
    return int(m.group(1) or m.group(2)) if m else None


async def stream_one(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                     max_tokens: int) -> list[float]:
    """One streamed completion -> the arrival time of each token's chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    stamps: list[float] = []
    async with http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data: {") and b'"text"' in line:
                stamps.append(time.perf_counter())
    return stamps


async def sequential(url: str, model: str, prompts: list[list[int]], max_tokens: int
                     ) -> list[float]:
    """Requests one after another (concurrency 1) -> every inter-token gap, seconds."""
    gaps: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for p in prompts:
            s = await stream_one(http, url, model, p, max_tokens)
            gaps += [b - a for a, b in zip(s, s[1:])]
    return gaps


def parse_setting(s: str) -> tuple[str, bool]:
    """'auto' | 'N', optionally '+pin' (OMP_PROC_BIND=close, OMP_PLACES=cores) -> (threads, pin)."""
    n, plus, pin = s.partition("+")
    if (n != "auto" and not n.isdigit()) or (plus and pin != "pin"):
        raise ValueError(f"thread setting {s!r}: expected auto or a number, optionally +pin")
    return n, pin == "pin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`moed serve` in a subprocess; its log in a temp file."""

    def __init__(self, model_dir: str, threads: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items()
               if k != "OMP_NUM_THREADS" and not k.startswith("MOED_")}
        n, pin = parse_setting(threads)
        if n != "auto":
            env["MOED_ENGINE_NUM_THREADS"] = n
        if pin:     # OpenMP binds its threads to cores (libgomp also binds the initial thread)
            env.update(OMP_PROC_BIND="close", OMP_PLACES="cores")
        self.log_path = Path(tempfile.mkstemp(prefix="moed-itl-", suffix=".log")[1])
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moed", "serve", "--model", model_dir, "--host",
                 "127.0.0.1", "--port", str(self.port)], cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        why = wait_ready(self.url, self.proc, timeout_s)
        if why:
            raise SystemExit(f"server {why}; see {self.log_path}")

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_setting(model_dir: str, threads: str, prompts: list[list[int]], max_tokens: int) -> dict:
    srv = Server(model_dir, threads)
    try:
        srv.wait_ready()
        rss = rss_bytes(srv.proc.pid)
        model = json.loads(srv.get("/v1/models"))["data"][0]["id"]
        asyncio.run(sequential(srv.url, model, prompts[:1], 8))            # warm-up
        before, text0 = load_average(), srv.get("/metrics")
        gaps = asyncio.run(sequential(srv.url, model, prompts, max_tokens))
        text = srv.get("/metrics")
        step = window_mean(text0, text, "moed_decode_step_seconds")
        server_itl = window_mean(text0, text, "moed_inter_token_latency_seconds")
        recent = metric(text, "moed_capacity_decode_step_seconds")
        itl = spread([g * 1e3 for g in gaps])
        return {"threads_setting": threads,
                "torch_threads": server_threads(srv.log_path.read_text(errors="replace")),
                "rss_after_load_bytes": rss, "load_before": before, "load_after": load_average(),
                "itl_ms": itl, "engine_decode_step_ms": None if step is None else step * 1e3,
                "server_itl_ms": None if server_itl is None else server_itl * 1e3,
                "recent_decode_step_ms": None if recent is None else recent * 1e3,
                "itl_over_step": None if not step else itl["mean"] / (step * 1e3)}
    finally:
        srv.stop()
        srv.log_path.unlink(missing_ok=True)


class InProcess:
    """The same checkpoint in this process, no HTTP: Engine.generate at batch 1 on a worker
    thread (like the server's step executor), timed by the engine's StepStats. The step a
    server cannot beat at that thread count."""

    def __init__(self, model_dir: str) -> None:
        sys.path.insert(0, str(ROOT))
        from moed import config as mconfig
        from moed.engine.engine import Engine

        cfg = mconfig.load(None, environ={}, overrides={"model": {"path": model_dir}})
        self.engine = Engine.from_config(cfg)
        self._steps: list[float] | None = None
        self.engine.subscribe_step(self._on_step)

    def _on_step(self, st) -> None:  # noqa: ANN001
        if self._steps is not None and st.num_decode_tokens and not st.num_prefill_tokens:
            self._steps.append(st.step_seconds)

    def decode_steps_ms(self, threads: str, prompts: list[list[int]], max_tokens: int) -> dict:
        import torch

        from moed.engine.build import step_threads
        from moed.types import SamplingParams

        t = parse_setting(threads)[0]      # pinning cannot change in a running process
        n = int(t) if t != "auto" else step_threads(0, cores_available(), {})[0]
        torch.set_num_threads(n)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self._steps = []
        try:
            with ThreadPoolExecutor(1) as ex:
                for p in prompts:
                    ex.submit(self.engine.generate, [p], sp).result()
            return {"torch_threads": n, **spread([x * 1e3 for x in self._steps])}
        finally:
            self._steps = None


def fmt(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: a random qwen3_moe of --preset)")
    ap.add_argument("--preset", default="bench", choices=("tiny", "bench"))
    ap.add_argument("--threads", default="auto",
                    help="comma-separated engine.num_threads settings: auto or a number, "
                         "each optionally +pin (OpenMP threads bound to cores)")
    ap.add_argument("-n", "--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-peer", action="store_true",
                    help="skip the in-process engine (no HTTP) at each thread setting")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "itl_gap.json"))
    a = ap.parse_args()
    settings = [s.strip() for s in a.threads.split(",") if s.strip()]
    for s in settings:
        try:
            parse_setting(s)
        except ValueError as e:
            ap.error(f"--threads: {e}")
    if a.max_tokens < 2:
        ap.error("--max-tokens must be >= 2 (an inter-token gap needs two tokens)")
    model_dir = a.model
    if model_dir is None:
        model_dir = str(Path(tempfile.gettempdir()) / f"moed-bench-{a.preset}-qwen3")
        if not (Path(model_dir) / "config.json").exists():
            sys.path.insert(0, str(ROOT))
            from moed.dev.checkpoint import init_checkpoint
            init_checkpoint("qwen3_moe", model_dir, preset=a.preset, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    print(f"CPU: {cpu_model()}, {cores_available()} cores available, load {load_average()}",
          flush=True)
    peer = None if a.no_peer else InProcess(model_dir)
    runs = []
    for r in range(a.rounds):
        for s in settings if r % 2 == 0 else settings[::-1]:
            res = run_setting(model_dir, s, prompts, a.max_tokens)
            res["round"] = r
            runs.append(res)
            st, itl = res["engine_decode_step_ms"], res["itl_ms"]
            print(f"threads {s:>4} (torch {res['torch_threads']}): client ITL mean "
                  f"{itl['mean']:.1f} ms (median {itl['median']:.1f}, p10 {itl['p10']:.1f}, "
                  f"p90 {itl['p90']:.1f})  server: ITL {fmt(res['server_itl_ms'])} ms, "
                  f"decode step (mean, same window) {fmt(st)} ms  "
                  f"ITL/step {res['itl_over_step'] or float('nan'):.2f}  "
                  f"load {res['load_before'][0]:.1f}->{res['load_after'][0]:.1f}  "
                  f"RSS {res['rss_after_load_bytes'] / 2**20:.0f} MiB", flush=True)
            if peer is not None:
                ref = res["in_process_step_ms"] = peer.decode_steps_ms(s, prompts, a.max_tokens)
                res["itl_over_in_process_step"] = res["itl_ms"]["mean"] / ref["mean"]
                print(f"  in-process engine, torch {ref['torch_threads']} threads, no HTTP: "
                      f"decode step mean {ref['mean']:.1f} ms (median {ref['median']:.1f}, "
                      f"p10 {ref['p10']:.1f}, p90 {ref['p90']:.1f})  server ITL / this "
                      f"{res['itl_over_in_process_step']:.2f}", flush=True)
    out = {"bench": "itl_gap", "model_dir": model_dir, "preset": a.preset, "cpu": cpu_model(),
           "cores_available": cores_available(), "prompt_len": a.prompt_len,
           "max_tokens": a.max_tokens, "requests": a.requests, "runs": runs,
           "load_average": load_average()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"saved {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
