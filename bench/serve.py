"""Serving benchmark: a bounded streaming load against `moed serve`, with the engine as the peer.

    .venv/bin/python bench/serve.py                          # tiny model, starts its own server
    .venv/bin/python bench/serve.py --preset bench -n 32     # 288M-param random Qwen3-MoE
    .venv/bin/python bench/serve.py --model DIR -c 8 -n 64   # a given checkpoint
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000 --model-name tiny   # a running one

N requests (token-id prompts of --prompt-len, --max-tokens each, ignore_eos so lengths are
exact) are sent over HTTP/SSE with at most C in flight. Prints TTFT, ITL and end-to-end
p50/p99, output tok/s and request/s; when it started the server itself it then runs the same
prompts through the in-process engine (`Engine.generate`, no HTTP) as the peer and prints the
ratio. Results go to bench/results/serve.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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

from common import wait_ready  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


async def one(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
              max_tokens: int, headers: dict[str, str]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            return {"status": r.status, "error": (await r.text())[:200]}
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                stamps.append(time.perf_counter())
    if not stamps:
        return {"status": 200, "error": "no tokens"}
    return {"status": 200, "ttft": stamps[0] - t0, "e2e": stamps[-1] - t0,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "out_tokens": usage["completion_tokens"] if usage else len(stamps)}


async def drive(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                concurrency: int, api_key: str | None, timeout_s: float) -> dict:
    sem = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def bounded(p: list[int]) -> dict:
        async with sem:
            try:
                return await asyncio.wait_for(one(http, url, model, p, max_tokens, headers),
                                              timeout_s)
            except (asyncio.TimeoutError, aiohttp.ClientError) as e:
                return {"status": 0, "error": repr(e)}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[bounded(p) for p in prompts])
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200 and "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    out_tokens = sum(r["out_tokens"] for r in ok)
    return {
        "requests": len(prompts), "ok": len(ok),
        "errors": [r.get("error") or r["status"] for r in results if r not in ok][:5],
        "wall_s": wall, "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall, "req_s": len(ok) / wall,
        "ttft_ms": {"p50": pct(ttft, 50) * 1e3, "p99": pct(ttft, 99) * 1e3},
        "itl_ms": {"p50": pct(itl, 50) * 1e3, "p99": pct(itl, 99) * 1e3},
        "e2e_ms": {"p50": pct(e2e, 50) * 1e3, "p99": pct(e2e, 99) * 1e3},
    }


def engine_peer(model_dir: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                env: dict) -> dict:
    """Same prompts through the in-process engine, no HTTP, in waves of `concurrency` (the same
    batch size the HTTP load keeps in flight): the ceiling for the server."""
    from moed import config as mconfig
    from moed.engine.engine import Engine
    from moed.types import SamplingParams

    cfg = mconfig.load(None, environ=env, overrides={"model": {"path": model_dir}})
    engine = Engine.from_config(cfg)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def waves() -> tuple[float, list[list[int]]]:
        engine.generate(prompts[:1], sp)                  # warm-up
        t0 = time.perf_counter()
        outs: list[list[int]] = []
        for i in range(0, len(prompts), concurrency):
            outs += engine.generate(prompts[i:i + concurrency], sp)
        return time.perf_counter() - t0, outs

    # Engine.generate runs on the engine's step thread (the one from_config built it on, as the
    # server's steps do: one OpenMP pool, moed/engine/step_thread.py) whichever thread calls it.
    with ThreadPoolExecutor(1) as ex:
        wall, outs = ex.submit(waves).result()
    n = sum(len(o) for o in outs)
    return {"wall_s": wall, "output_tokens": n, "output_tok_s": n / wall}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, env: dict, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moed", "serve", "--model", model_dir,
                             "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT,
                            env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    why = wait_ready(url, proc, 180)
    if why is None:
        return proc, url
    proc.kill()
    raise SystemExit(f"server {why}; see {log_path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="benchmark a running server instead of starting one")
    ap.add_argument("--model", help="checkpoint dir (default: a random qwen3_moe of --preset)")
    ap.add_argument("--preset", default="tiny", choices=("tiny", "bench"),
                    help="size of the default random checkpoint (bench: 288M params)")
    ap.add_argument("--model-name", help="model id for --url (default: from /v1/models)")
    ap.add_argument("--api-key")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("-n", "--requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    ap.add_argument("--no-peer", action="store_true", help="skip the in-process engine peer")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve.json"))
    args = ap.parse_args()

    rng = random.Random(0)
    proc = None
    # the server's default thread choice (engine.num_threads auto) unless the caller set one
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ}
    model_dir = args.model
    try:
        if args.url:
            url = args.url.rstrip("/")
        else:
            if model_dir is None:
                model_dir = str(Path(tempfile.gettempdir()) / f"moed-bench-{args.preset}-qwen3")
                if not (Path(model_dir) / "config.json").exists():
                    from moed.dev.checkpoint import init_checkpoint
                    init_checkpoint("qwen3_moe", model_dir, preset=args.preset, seed=0)
            proc, url = start_server(model_dir, env, Path(tempfile.gettempdir()) / "moed-bench.log")
        req = urllib.request.Request(url + "/v1/models", headers=(
            {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}))
        with urllib.request.urlopen(req, timeout=10) as r:
            models = json.loads(r.read())["data"]
        model = args.model_name or models[0]["id"]
        vocab_hi = 1000
        prompts = [[rng.randrange(3, vocab_hi) for _ in range(args.prompt_len)]
                   for _ in range(args.requests)]
        # warm-up: one request (first-step allocation, lazy imports)
        asyncio.run(drive(url, model, prompts[:1], 4, 1, args.api_key, args.timeout))
        res = asyncio.run(drive(url, model, prompts, args.max_tokens, args.concurrency,
                                args.api_key, args.timeout))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    out = {"bench": "serve", "url": url, "model": model, "model_dir": model_dir, "concurrency": args.concurrency,
           "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "http": res}
    print(f"HTTP  c={args.concurrency} n={args.requests} prompt={args.prompt_len} "
          f"out={args.max_tokens}: ok {res['ok']}/{res['requests']}  "
          f"TTFT p50 {res['ttft_ms']['p50']:.1f} ms p99 {res['ttft_ms']['p99']:.1f} ms  "
          f"ITL p50 {res['itl_ms']['p50']:.1f} ms p99 {res['itl_ms']['p99']:.1f} ms  "
          f"output {res['output_tok_s']:.1f} tok/s  {res['req_s']:.2f} req/s")
    if res["errors"]:
        print("errors:", res["errors"])
    if proc is not None and not args.no_peer:
        peer = engine_peer(model_dir, prompts, args.max_tokens, args.concurrency, env)
        out["engine_peer"] = peer
        out["http_over_engine_tok_s"] = res["output_tok_s"] / peer["output_tok_s"]
        print(f"peer  in-process Engine.generate (waves of {args.concurrency}, no HTTP): "
              f"{peer['output_tok_s']:.1f} tok/s  -> HTTP/engine = "
              f"{out['http_over_engine_tok_s']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"saved {args.out}")
    return 0 if res["ok"] == res["requests"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
