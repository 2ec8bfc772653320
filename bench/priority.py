"""Priority classes under a batch flood: interactive TTFT alone, beside a 10x flood of
batch-class requests, and beside the same flood sent without a class (the peer: every request
of one priority, what a node without priority classes does).

    .venv/bin/python bench/priority.py                       # the demo model, ~2.5 minutes
    .venv/bin/python bench/priority.py --phase-s 20 --interactive 1
    .venv/bin/python bench/priority.py --max-num-seqs 8 --max-waiting 6   # seats and 429s

One colocated `moed serve` (models/stdlib-ds3-tiny unless --model), two API keys: an
interactive one (the default class) and a batch one (`batch`, in the key file). Each phase
runs for --phase-s seconds: --interactive closed-loop interactive streams (a short prompt,
--inter-tokens tokens), and in the flood phases --flood x as many closed-loop batch streams
(longer prompts, more tokens). Every stream is an SSE request over aiohttp. Printed: the
interactive TTFT p50/p99 per phase (n: served; not: refused or failed) and the ratios
flood/alone (acceptance: <= 1.5 with priority) and flood-without-priority/alone; the batch
outcomes per flood phase: served, 429 (refused at arrival or displaced before its first token)
and failed mid-stream (an error event or a broken stream after a 200: must be 0). Results:
bench/results/priority.json and .png (--out).
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
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import cpu_model, load_average, quantile, wait_ready  # noqa: E402

INTER_KEY, BATCH_KEY = "sk-bench-interactive", "sk-bench-batch"


async def stream(http: aiohttp.ClientSession, url: str, key: str, prompt: list[int],
                 max_tokens: int) -> dict:
    """One streaming completion -> {"outcome": served | 429 | failed, "ttft": s}."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    t0 = time.perf_counter()
    ttft = None
    try:
        async with http.post(url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status == 429:
                code = (await r.json()).get("error", {}).get("code", "")
                return {"outcome": "429", "code": code}
            if r.status != 200:
                return {"outcome": "failed", "why": f"http {r.status}"}
            done = False
            async for raw in r.content:
                line = raw.strip()
                if line == b"data: [DONE]":
                    done = True
                    break
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"outcome": "failed", "why": chunk["error"].get("code"), "ttft": ttft}
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - t0
            if not done:
                return {"outcome": "failed", "why": "no [DONE]", "ttft": ttft}
            return {"outcome": "served", "ttft": ttft, "e2e": time.perf_counter() - t0}
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {"outcome": "failed", "why": repr(e)[:80], "ttft": ttft}


async def closed_loop(http: aiohttp.ClientSession, url: str, key: str, prompt_len: int,
                      max_tokens: int, until: float, rng: random.Random, vocab: int,
                      out: list[dict], pause_s: float) -> None:
    while time.perf_counter() < until:
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        res = await stream(http, url, key, prompt, max_tokens)
        res["t"] = time.perf_counter()
        out.append(res)
        if res["outcome"] == "429":
            await asyncio.sleep(1.0)       # Retry-After
        elif pause_s:
            await asyncio.sleep(pause_s)


async def phase(url: str, args: argparse.Namespace, flood_key: str | None, vocab: int,
                seed: int) -> dict:
    rng = random.Random(seed)
    until = time.perf_counter() + args.phase_s
    inter: list[dict] = []
    batch: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=args.phase_s + 120)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
        tasks = [closed_loop(http, url, INTER_KEY, args.inter_prompt, args.inter_tokens, until,
                             random.Random(rng.random()), vocab, inter, args.inter_pause_s)
                 for _ in range(args.interactive)]
        if flood_key is not None:
            tasks += [closed_loop(http, url, flood_key, args.batch_prompt, args.batch_tokens,
                                  until, random.Random(rng.random()), vocab, batch, 0.0)
                      for _ in range(args.flood * args.interactive)]
        await asyncio.gather(*tasks)
    ttft = [r["ttft"] for r in inter if r["outcome"] == "served"]
    count = {k: sum(1 for r in batch if r["outcome"] == k) for k in ("served", "429", "failed")}
    return {"interactive": {"served": len(ttft),
                            "not_served": len(inter) - len(ttft),
                            "ttft_ms": {"p50": quantile(ttft, 0.5) * 1e3,
                                        "p99": quantile(ttft, 0.99) * 1e3},
                            "ttft_s": ttft},
            "batch": count,
            "batch_429_codes": sorted({r.get("code", "") for r in batch if r["outcome"] == "429"}),
            "batch_failures": [r.get("why") for r in batch if r["outcome"] == "failed"][:5]}


def start(model: str, keys_file: Path, log: Path, extra_env: dict[str, str]
          ) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MOED_SERVER_API_KEYS_FILE": str(keys_file),
           "MOED_MODEL_SERVED_NAME": "bench", "MOED_SERVER_LOG_LEVEL": "warning", **extra_env}
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "moed", "serve", "--model", model,
                                 "--config", str(ROOT / "conf/moed.toml"), "--host", "127.0.0.1",
                                 "--port", str(port)], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    why = wait_ready(url, proc, 180)
    if why is not None:
        proc.kill()
        raise SystemExit(f"server {why}; see {log}")
    return proc, url


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in (("alone", "interactive alone"),
                        ("flood_priority", "+ 10x batch flood (batch class)"),
                        ("flood_no_priority", "+ 10x flood, no class (peer)")):
        xs = sorted(result[name]["interactive"]["ttft_s"])
        if xs:
            ax.plot([x * 1e3 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))],
                    label=label)
    ax.set_xscale("log")
    ax.set_xlabel("interactive TTFT (ms, log)")
    ax.set_ylabel("share of requests")
    ax.set_title("Interactive TTFT under a batch flood (bench/priority.py)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models/stdlib-ds3-tiny"))
    ap.add_argument("--phase-s", type=float, default=40.0, help="seconds per phase")
    ap.add_argument("--interactive", type=int, default=2, help="interactive streams")
    ap.add_argument("--flood", type=int, default=10, help="batch streams per interactive one")
    ap.add_argument("--inter-prompt", type=int, default=48)
    ap.add_argument("--inter-tokens", type=int, default=16)
    ap.add_argument("--inter-pause-s", type=float, default=0.2,
                    help="think time between one stream's interactive requests")
    ap.add_argument("--batch-prompt", type=int, default=128)
    ap.add_argument("--batch-tokens", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="engine.max_num_seqs (0: conf/moed.toml's): fewer seats than streams "
                    "makes the flood take seats an interactive request needs")
    ap.add_argument("--max-waiting", type=int, default=0,
                    help="admission.max_waiting_requests (0: conf/moed.toml's): a bound the "
                    "flood reaches, so batch requests are refused or displaced (429)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/priority.json"))
    args = ap.parse_args()

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    tmp = Path(tempfile.mkdtemp(prefix="moed-bench-priority-"))
    keys = tmp / "api-keys"
    keys.write_text(f"{INTER_KEY}\n{BATCH_KEY} batch\n")
    env = {}
    if args.max_num_seqs:
        env["MOED_ENGINE_MAX_NUM_SEQS"] = str(args.max_num_seqs)
    if args.max_waiting:
        env["MOED_ADMISSION_MAX_WAITING_REQUESTS"] = str(args.max_waiting)
    proc, url = start(args.model, keys, tmp / "server.log", env)
    try:
        result: dict = {"load_before": load_average()}
        for name, key, seed in (("alone", None, 1), ("flood_priority", BATCH_KEY, 2),
                                ("flood_no_priority", INTER_KEY, 3)):
            print(f"phase {name}: {args.phase_s:g} s", flush=True)
            result[name] = asyncio.run(phase(url, args, key, vocab, seed))
        result["load_after"] = load_average()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    alone = result["alone"]["interactive"]["ttft_ms"]
    rows = []
    for name in ("alone", "flood_priority", "flood_no_priority"):
        t = result[name]["interactive"]["ttft_ms"]
        rows.append((name, t["p50"], t["p99"], t["p99"] / alone["p99"],
                     result[name]["interactive"]["served"],
                     result[name]["interactive"]["not_served"], result[name]["batch"]))
    print(f"\ninteractive TTFT, {args.interactive} stream(s); flood = {args.flood}x batch streams;"
          f" {env or 'conf/moed.toml limits'}; load {result['load_before']} -> "
          f"{result['load_after']}; {cpu_model()}")
    for name in ("flood_priority", "flood_no_priority"):
        if result[name]["batch_429_codes"]:
            print(f"{name}: 429 codes {result[name]['batch_429_codes']}")
    print(f"{'phase':<20}{'p50 ms':>9}{'p99 ms':>9}{'p99/alone':>11}{'n':>6}{'not':>5}"
          f"  batch outcomes")
    for name, p50, p99, ratio, n, missed, b in rows:
        print(f"{name:<20}{p50:9.1f}{p99:9.1f}{ratio:11.2f}{n:6d}{missed:5d}  "
              f"{b if name != 'alone' else ''}")
    result["ratio_p99_flood_priority"] = rows[1][3]
    result["ratio_p99_flood_no_priority"] = rows[2][3]
    result["args"] = vars(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"\nresults: {out} and {out.with_suffix('.png')}")
    failed = result["flood_priority"]["batch"]["failed"]
    if failed:
        print(f"batch requests failed mid-stream: {failed} "
              f"{result['flood_priority']['batch_failures']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
