"""Issue 33, acceptance 1 literally: 40 concurrent greedy streams of 256 tokens through a router,
SIGKILL of one serving node at a random moment; how many streams end with exactly the tokens
of an undisturbed run, with no error event.

Setups: `colocated` (router + 2 colocated nodes) and `pd` (router + 1 prefill + 2 decode
nodes), each in float32, bf16, and bf16 with model.batch_invariant (`bfloat16-inv`). The peer in the same run is a second
undisturbed run: "undisturbed vs undisturbed" says how much of a difference is the batch's
doing (bf16 on this CPU: the kernel serving a matmul is chosen per row count) rather than the
migration's. Prints a table; saves bench/results/migration_concurrency.json (+ .png with
matplotlib).

    .venv/bin/python bench/migration_concurrency.py [--streams 40] [--tokens 256]
        [--setups colocated,pd] [--dtypes float32,bfloat16,bfloat16-inv] [--model DIR]
        [--signal kill|term] [--drain-after 1.0]

`--signal term` is acceptance 2 instead (e.g. `--streams 10 --tokens 2000 --signal term`): the
node gets SIGTERM, hands its streams to the router after server.drain_migrate_after_s
(`--drain-after`), and the table gains how long it took to exit.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import cpu_model, load_average, wait_ready  # noqa: E402

KEY = os.urandom(32).hex()
ADMIN = os.urandom(16).hex()       # the router's /cluster is an admin read


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(name: str, role: str, model: str | None, env: dict[str, str], log: Path
           ) -> tuple[subprocess.Popen, str]:
    port = _port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    full.update({"OMP_NUM_THREADS": "1", "MOED_ENGINE_NUM_THREADS": "1",
                 "MOED_SERVER_LOG_LEVEL": "warning", "MOED_MODEL_SERVED_NAME": "m",
                 "MOED_SERVER_NODE_NAME": name, "MOED_CLUSTER_KEY_ENV": "BENCH_KEY",
                 "BENCH_KEY": KEY, "MOED_SERVER_ADMIN_TOKEN_ENV": "BENCH_ADMIN",
                 "BENCH_ADMIN": ADMIN, **env})
    argv = [sys.executable, "-m", "moed", "serve", "--role", role, "--host", "127.0.0.1",
            "--port", str(port)] + (["--model", model] if model else [])
    proc = subprocess.Popen(argv, cwd=ROOT, env=full, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def start(setup: str, dtype: str, model: str, logs: Path, drain_after_s: float = 5.0
          ) -> dict[str, tuple]:
    g = {n: _port() for n in ("R", "A", "B", "P")}
    seed = f"127.0.0.1:{g['A']}"
    common = {"MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_SEEDS": seed,
              "MOED_CLUSTER_PROBE_INTERVAL_MS": "200", "MOED_CLUSTER_GOSSIP_INTERVAL_MS": "50"}
    node = {**common, "MOED_MODEL_DTYPE": dtype.removesuffix("-inv"),
            "MOED_MODEL_BATCH_INVARIANT": str(dtype.endswith("-inv")).lower(),
            "MOED_ENGINE_KV_CACHE_MEMORY_MB": "128",
            "MOED_SERVER_DRAIN_MIGRATE_AFTER_S": str(drain_after_s)}
    roles = {"A": "colocated", "B": "colocated"} if setup == "colocated" else \
        {"A": "decode", "B": "decode", "P": "prefill"}
    nodes = {}
    for name, role in roles.items():
        nodes[name] = _serve(name, role, model, {**node, "MOED_CLUSTER_BIND_PORT": str(g[name])},
                             logs / f"{setup}-{dtype}-{name}.log")
    nodes["R"] = _serve("R", "router", None, {**common, "MOED_CLUSTER_BIND_PORT": str(g["R"])},
                        logs / f"{setup}-{dtype}-R.log")
    for name, (proc, url) in nodes.items():
        why = wait_ready(url, proc, 300)
        if why:
            raise RuntimeError(f"{name} {why} (log in {logs})")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:      # the router sees every serving node alive
        req = urllib.request.Request(nodes["R"][1] + "/cluster",
                                     headers={"Authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            alive = {m["name"] for m in json.loads(r.read())["members"] if m["state"] == "alive"}
        if set(roles) <= alive:
            return nodes
        time.sleep(0.2)
    raise RuntimeError("the router did not see every node alive within 30 s")


class Stream(threading.Thread):
    """One SSE completion through the router: its token ids, errors and serving node."""

    def __init__(self, url: str, i: int, tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.ids, self.errors, self.done, self.backend = url, [], [], False, ""
        self.body = {"model": "m", "prompt": f"stream {i}: the quick brown fox {i * 7}",
                     "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                     "stream": True, "return_token_ids": True}

    def run(self) -> None:
        req = urllib.request.Request(self.url + "/v1/completions",
                                     data=json.dumps(self.body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                self.backend = resp.headers.get("X-Moed-Backend", "")
                for line in resp:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        self.done = True
                        continue
                    ev = json.loads(data)
                    if "error" in ev:
                        self.errors.append(ev["error"])
                    for c in ev.get("choices") or ():
                        self.ids.extend(c.get("token_ids") or ())
        except Exception as e:        # reported as an error of this stream
            self.errors.append({"exception": repr(e)})


def run(url: str, n: int, tokens: int, kill=None) -> list[Stream]:
    streams = [Stream(url, i, tokens) for i in range(n)]
    for s in streams:
        s.start()
    if kill is not None:
        kill(streams)
    for s in streams:
        s.join(600)
    return streams


def migrations(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("moed_router_migrations_total{"))


def cell(setup: str, dtype: str, a: argparse.Namespace, logs: Path) -> dict:
    nodes = start(setup, dtype, a.model, logs, a.drain_after)
    router = nodes["R"][1]
    try:
        base = run(router, a.streams, a.tokens)
        peer = run(router, a.streams, a.tokens)
        before = migrations(router)
        at = random.Random(a.seed).randint(16, a.tokens // 2)
        killed: list[str] = []
        sig = signal.SIGKILL if a.signal == "kill" else signal.SIGTERM
        t_sig: list[float] = []
        exited: list[float] = []

        def watch(proc: subprocess.Popen) -> None:    # when the signalled node's process ends
            try:
                proc.wait(120)
                exited.append(time.monotonic())
            except subprocess.TimeoutExpired:
                pass

        def kill(streams: list[Stream]) -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                live = [s for s in streams if s.is_alive() and len(s.ids) >= at and s.backend]
                if live:
                    killed.append(live[0].backend)
                    nodes[killed[0]][0].send_signal(sig)
                    t_sig.append(time.monotonic())
                    threading.Thread(target=watch, args=(nodes[killed[0]][0],), daemon=True).start()
                    return
                time.sleep(0.005)

        got = run(router, a.streams, a.tokens, kill)
        moved = migrations(router) - before
        if killed:
            nodes[killed[0]][0].wait(60)
            time.sleep(0.1)
        exit_s = exited[0] - t_sig[0] if exited and t_sig else None
    finally:
        for proc, _ in nodes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in nodes.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    full = [len(s.ids) == a.tokens and s.done and not s.errors for s in base]
    return {"setup": setup, "dtype": dtype, "streams": a.streams, "tokens": a.tokens,
            "killed": killed[0] if killed else None, "killed_at_tokens": at,
            "signal": a.signal, "drain_after_s": a.drain_after, "exit_s": exit_s,
            "undisturbed_whole": sum(full),
            "peer_identical": sum(p.ids == b.ids for p, b in zip(peer, base)),
            "killed_identical": sum(g.ids == b.ids and g.done and not g.errors
                                    for g, b in zip(got, base)),
            "killed_errors": sum(bool(g.errors) for g in got), "migrations": moved,
            "served_by_killed": sum(g.backend == (killed[0] if killed else "") for g in got)}


def plot(rows: list[dict], path: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no matplotlib"
    labels = [f"{r['setup']}\n{r['dtype']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.8 * len(rows) + 2, 3.5))
    ax.bar([i - 0.2 for i in x], [r["peer_identical"] for r in rows], 0.4,
           label="undisturbed vs undisturbed")
    ax.bar([i + 0.2 for i in x], [r["killed_identical"] for r in rows], 0.4,
           label="one node killed vs undisturbed")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel(f"identical streams (of {rows[0]['streams']})")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--setups", default="colocated,pd")
    ap.add_argument("--dtypes", default="float32,bfloat16,bfloat16-inv")
    ap.add_argument("--model", help="checkpoint (default: the tiny random qwen3_moe)")
    ap.add_argument("--seed", type=int, help="the kill moment's draw (default: random)")
    ap.add_argument("--signal", choices=("kill", "term"), default="kill",
                    help="SIGKILL (acceptance 1) or SIGTERM: a drain that hands streams over")
    ap.add_argument("--drain-after", type=float, default=5.0,
                    help="server.drain_migrate_after_s of the nodes (seconds)")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "bench" / "results" / "migration_concurrency.json")
    a = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="moed-migconc-"))
    if a.model is None:
        from moed.dev.checkpoint import init_checkpoint
        a.model = str(logs / "tiny")
        init_checkpoint(arch="qwen3_moe", out=Path(a.model), preset="tiny", seed=0)
    rows = []
    print(f"{'setup':10} {'dtype':9} {'undisturbed=peer':>16} {'killed=undisturbed':>18} "
          f"{'errors':>6} {'moved':>5}  killed")
    for setup in a.setups.split(","):
        for dtype in a.dtypes.split(","):
            r = cell(setup, dtype, a, logs)
            rows.append(r)
            print(f"{setup:10} {dtype:9} {r['peer_identical']:>13}/{a.streams} "
                  f"{r['killed_identical']:>15}/{a.streams} {r['killed_errors']:>6} "
                  f"{r['migrations']:>5.0f}  {r['killed']} at ~{r['killed_at_tokens']} tokens "
                  f"({r['served_by_killed']} streams there)"
                  + (f"; exited {r['exit_s']:.1f} s after SIGTERM" if r["exit_s"] is not None
                     and a.signal == "term" else ""), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(rows, a.out.with_suffix(".png"))
    a.out.write_text(json.dumps({"bench": "migration_concurrency", "cpu": cpu_model(),
                                 "load": load_average(), "rows": rows, "png": png}, indent=1))
    print(f"saved {a.out} ({png}); logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
