"""A local prefill/decode cluster in one command: `python -m moed.dev.cluster` (`make cluster`).

One router, two prefill and two decode nodes on 127.0.0.1, each a `moed serve` with the
shipped conf/router.toml, conf/prefill.toml or conf/decode.toml, the way docs/cluster.md
("One host") starts them by hand: the second node of a role is the same file on the next HTTP
and gossip ports. A new work directory holds a fresh cluster key and admin token (run/, where
the files' relative paths point: the nodes run in it) and the logs. The demo checkpoint is
built if absent. The command waits until every node is ready and the router's /cluster shows
all five alive, prints the curl lines, and on Ctrl-C or SIGTERM stops the five (SIGTERM, then
SIGKILL after a grace). Every wait is bounded.

The planning (ports, arguments, environment) is pure and unit-tested
(tests/unit/dev/test_cluster.py); `main` does the I/O.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from moed.config import Config, load

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
LAYOUT = (("router", 1), ("prefill", 2), ("decode", 2))    # role, nodes of it
HOST = "127.0.0.1"
SECRETS = ("run/cluster.key", "run/admin-token")           # what the shipped files name


@dataclass(frozen=True)
class RoleFile:
    """What the planning needs from a shipped role file."""
    path: Path
    http_port: int
    gossip_port: int
    seeds: tuple[str, ...]


@dataclass(frozen=True)
class NodePlan:
    name: str                        # router, prefill-1, prefill-2, decode-1, decode-2
    role: str
    http_port: int
    gossip_port: int
    argv: tuple[str, ...]
    env: Mapping[str, str]           # only the overrides of this node (see child_env)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"


def read_role_file(path: Path) -> RoleFile:
    # environ={}: the shell's MOED_* must not change what the files say
    cfg = load(path, environ={})
    return RoleFile(path, cfg.server.port, cfg.cluster.bind_port, cfg.cluster.seeds)


def shift_seed(seed: str, offset: int) -> str:
    host, _, port = seed.rpartition(":")
    return f"{host}:{int(port) + offset}"


def plan(files: Mapping[str, RoleFile], model: Path, *, offset: int = 0,
         python: str = sys.executable,
         layout: Sequence[tuple[str, int]] = LAYOUT) -> list[NodePlan]:
    """Node i (0-based) of a role listens on its file's ports + i, all moved by `offset`; a
    node gets a flag or variable only where it differs from its file, so the first node of
    each role runs its file as shipped (offset 0)."""
    nodes: list[NodePlan] = []
    for role, count in layout:
        f = files[role]
        seeds = tuple(shift_seed(s, offset) for s in f.seeds)
        for i in range(count):
            http, gossip = f.http_port + i + offset, f.gossip_port + i + offset
            argv = [python, "-m", "moed", "serve", "--config", str(f.path)]
            if role != "router":
                argv += ["--model", str(model)]       # absolute: the nodes run in the work dir
            if http != f.http_port:
                argv += ["--port", str(http)]
            env: dict[str, str] = {}
            if gossip != f.gossip_port:
                env["MOED_CLUSTER_BIND_PORT"] = str(gossip)
            if seeds != f.seeds:
                env["MOED_CLUSTER_SEEDS"] = ",".join(seeds)
            name = role if count == 1 else f"{role}-{i + 1}"
            nodes.append(NodePlan(name, role, http, gossip, tuple(argv), env))
    ports = [p for n in nodes for p in (n.http_port, n.gossip_port)]
    if len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports):
        raise ValueError(f"the planned ports clash or are out of range: {sorted(ports)}")
    return nodes


def _config_var(name: str) -> bool:
    """MOED_<SECTION>_<FIELD>: a config override (MOED_CPU_KERNELS and the like are not)."""
    return any(name.startswith(f"MOED_{f.name.upper()}_") for f in dataclasses.fields(Config))


def child_env(base: Mapping[str, str], threads: int) -> dict[str, str]:
    """The environment every node starts from: the caller's without config overrides (a stray
    MOED_SERVER_PORT in the shell would break the plan), unbuffered output, and torch threads
    shared out among the four model nodes unless OMP_NUM_THREADS says otherwise."""
    env = {k: v for k, v in base.items() if not _config_var(k)}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def default_threads(cpus: int | None) -> int:
    return max(1, (cpus or 1) // 4)


def alive_urls(cluster: Mapping[str, Any]) -> set[str]:
    """HTTP addresses of the alive members in a /cluster answer."""
    return {m.get("http", "") for m in cluster.get("members", ()) if m.get("state") == "alive"}


def busy_ports(nodes: Sequence[NodePlan], host: str = HOST) -> list[str]:
    """'host:port (what)' for every planned port something else holds now. The TCP probe binds
    with SO_REUSEADDR as the nodes' listeners do (asyncio's create_server default): a port whose
    only users are TIME_WAIT connections of a cluster just stopped is free for them, and a
    listener still refuses it. (Not on UDP, where SO_REUSEADDR would share a bound port.)"""
    busy = []
    for n in nodes:
        for port, kinds in ((n.http_port, (socket.SOCK_STREAM,)),
                            (n.gossip_port, (socket.SOCK_STREAM, socket.SOCK_DGRAM))):
            for kind in kinds:
                with socket.socket(socket.AF_INET, kind) as s:
                    if kind == socket.SOCK_STREAM:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    try:
                        s.bind((host, port))
                    except OSError:
                        busy.append(f"{host}:{port} ({n.name})")
                        break
    return busy


# ---- I/O ---------------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(f"moed devcluster: {msg}", file=sys.stderr, flush=True)


def _http(url: str, token: str = "", timeout: float = 1.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def write_secrets(work: Path) -> str:
    """run/cluster.key and run/admin-token under `work` (0700 dir, 0600 files); the token."""
    run = work / "run"
    run.mkdir(mode=0o700, parents=True, exist_ok=True)
    run.chmod(0o700)                     # --work may name a directory that exists already
    token = secrets.token_hex(16)
    for rel, value in zip(SECRETS, (secrets.token_hex(32), token)):
        path = work / rel
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(value + "\n")
    return token


class Cluster:
    """The five child processes; `stop` always leaves none behind."""

    def __init__(self, nodes: Sequence[NodePlan], work: Path, base_env: Mapping[str, str],
                 stop: threading.Event) -> None:
        self.nodes, self.work, self.base_env, self.stop_requested = nodes, work, base_env, stop
        self.procs: dict[str, subprocess.Popen] = {}
        self.reported: set[str] = set()

    def log(self, name: str) -> Path:
        return self.work / "run" / f"{name}.log"

    def start(self) -> None:
        for n in self.nodes:                       # the router (a seed) first
            with open(self.log(n.name), "ab") as log:
                # own session: a terminal's Ctrl-C reaches only us; `stop` then drains them
                self.procs[n.name] = subprocess.Popen(
                    n.argv, cwd=self.work, env={**self.base_env, **n.env},
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)

    def exited(self) -> dict[str, int]:
        return {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            text = self.log(name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_up(self, token: str, timeout: float) -> str | None:
        """None once every node is ready and the router sees all alive; else why not."""
        router = next(n for n in self.nodes if n.role == "router")
        want = {n.url for n in self.nodes}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = self.exited()
            if dead:
                name, rc = next(iter(dead.items()))
                return (f"{name} exited with {rc} while starting; {self.log(name)}:\n"
                        f"{self.tail(name)}")
            if all(_http(n.url + "/ready")[0] == 200 for n in self.nodes):
                status, body = _http(router.url + "/cluster", token)
                try:
                    if status == 200 and want <= alive_urls(json.loads(body)):
                        return None
                except ValueError:             # a half-written answer: ask again
                    pass
            if self.stop_requested.wait(0.5):
                return "interrupted"
        pending = [n.name for n in self.nodes if _http(n.url + "/ready")[0] != 200]
        return (f"not up within {timeout:.0f} s (not ready: {', '.join(pending) or 'none'}; "
                f"or not all alive in the router's /cluster); logs: {self.work / 'run'}")

    def supervise(self) -> None:
        """Until a stop is asked for or every node is gone; a node that exits is reported
        (a drained node exits 0), the others keep serving."""
        while not self.stop_requested.wait(0.5):
            for name, rc in self.exited().items():
                if name not in self.reported:
                    self.reported.add(name)
                    _say(f"{name} exited with {rc} ({self.log(name)}); the others keep running")
            if len(self.reported) == len(self.procs):
                return

    def stop(self, grace: float, force: threading.Event) -> None:
        """SIGTERM (each node drains), SIGKILL what is left after `grace` or a second signal."""
        alive = [p for p in self.procs.values() if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            if force.wait(0.2):
                break
        for name, p in self.procs.items():
            if p.poll() is None:
                _say(f"{name} still running: SIGKILL")
                p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:      # unkillable (D state): say so, do not hang
                _say(f"{name} (pid {p.pid}) did not exit after SIGKILL")


def _build_model(model: Path, python: str, timeout: float, stop: threading.Event) -> str | None:
    _say(f"building the demo checkpoint in {model}")
    proc = subprocess.Popen([python, "-m", "moed", "model", "init", "--arch", "qwen3_moe",
                             "--preset", "tiny", "--out", str(model)], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if stop.wait(0.2) or time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            return "interrupted" if stop.is_set() else f"model init took over {timeout:.0f} s"
    return None if proc.returncode == 0 else f"moed model init exited with {proc.returncode}"


def _banner(nodes: Sequence[NodePlan], work: Path, model: Path, took: float) -> str:
    router = next(n for n in nodes if n.role == "router")
    req = json.dumps({"model": model.name, "prompt": "def fib(n):", "max_tokens": 16,
                      "stream": True})
    token = work / "run" / "admin-token"
    lines = [f"cluster up in {took:.1f} s: " + ", ".join(f"{n.name} {n.url}" for n in nodes),
             "try:",
             f"  curl -N {router.url}/v1/completions -H 'Content-Type: application/json' "
             f"-d '{req}'",
             f"  curl -s -H \"Authorization: Bearer $(cat {token})\" {router.url}/cluster",
             f"logs: {work / 'run'}/*.log; Ctrl-C (or SIGTERM) stops all {len(nodes)}"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moed.dev.cluster",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--work", type=Path, help="work directory: secrets and logs under run/ "
                   "(default: a new /tmp/moed-cluster-*)")
    p.add_argument("--model", type=Path, default=ROOT / "demo-model",
                   help="checkpoint directory, built with `moed model init` if absent "
                   "(default: %(default)s)")
    p.add_argument("--port-offset", type=int, default=0,
                   help="move every port of the shipped files by this much (they are taken)")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds for all five to be up (default: %(default)s)")
    p.add_argument("--grace", type=float, default=45.0, help="seconds between SIGTERM and "
                   "SIGKILL at the stop (default: %(default)s, above shutdown_grace_s)")
    p.add_argument("--threads", type=int, default=default_threads(os.cpu_count()),
                   help="OMP_NUM_THREADS for each node unless set (default: %(default)s)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop, force = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        (force if stop.is_set() else stop).set()    # a second one: skip the grace
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    files = {role: read_role_file(CONF / f"{role}.toml") for role, _ in LAYOUT}
    model = args.model.resolve()
    try:
        nodes = plan(files, model, offset=args.port_offset)
    except ValueError as e:
        _say(str(e))
        return 2
    busy = busy_ports(nodes)
    if busy:
        _say(f"in use: {', '.join(busy)}; stop what holds them or pass --port-offset "
             f"{args.port_offset + 1000}")
        return 2
    if not (model / "config.json").exists():
        err = _build_model(model, sys.executable, 300.0, stop)
        if err:
            _say(err)
            return 130 if err == "interrupted" else 1
    work = (args.work or Path(tempfile.mkdtemp(prefix="moed-cluster-"))).resolve()
    token = write_secrets(work)
    cluster = Cluster(nodes, work, child_env(os.environ, args.threads), stop)
    t0 = time.monotonic()
    try:
        _say(f"starting {', '.join(n.name for n in nodes)} in {work}")
        cluster.start()
        err = cluster.wait_up(token, args.ready_timeout)
        if err:
            _say(err)
            return 130 if err == "interrupted" else 1
        print(_banner(nodes, work, model, time.monotonic() - t0), flush=True)
        cluster.supervise()
        return 0
    finally:
        _say(f"stopping (SIGTERM, SIGKILL after {args.grace:.0f} s; Ctrl-C again: now)")
        cluster.stop(args.grace, force)
        _say("stopped: " + ", ".join(f"{k} {v}" for k, v in cluster.exited().items()))


if __name__ == "__main__":
    sys.exit(main())
