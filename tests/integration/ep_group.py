"""Start an expert-parallel group of real `moed serve` processes (one per rank) on 127.0.0.1
with the harness (moed_server.start_server); shared by the EP integration tests."""
from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

from moed_server import ServerProcess, free_port


def launch_group(start: Callable[..., ServerProcess], model: Path, size: int, *,
                 args: Sequence[str] = (), env: dict[str, str] | None = None,
                 role: str = "colocated") -> list[ServerProcess]:
    """`size` ranks (size 1: a plain node), started, not waited for (see wait_ready)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    ep = [] if size == 1 else ["--ep-size", str(size), "--ep-init", init]
    env = {"MOED_BALANCE_CALIBRATION_STEPS": "0", **(env or {})}
    return [start(model=model, role=role, wait=None, env=env,
                  args=[*args, *ep, *([] if size == 1 else ["--ep-rank", str(r)])])
            for r in range(size)]


def start_group(start: Callable[..., ServerProcess], model: Path, size: int, *,
                ready_timeout: float = 90.0, **kw) -> list[ServerProcess]:
    """launch_group, then wait until every rank is ready."""
    ranks = launch_group(start, model, size, **kw)
    wait_ready(ranks, ready_timeout)
    return ranks


def wait_ready(ranks: Sequence[ServerProcess], ready_timeout: float = 90.0) -> None:
    deadline = time.monotonic() + ready_timeout
    for srv in ranks:
        while True:
            assert srv.alive, f"rank exited with {srv.proc.returncode}:\n{srv.tail()}"
            try:
                if srv.get("/ready", timeout=1.0)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"rank not ready in time:\n{srv.tail()}"
            time.sleep(0.1)
    return ranks


def complete(srv: ServerProcess, prompt: str, max_tokens: int, timeout: float = 60.0) -> tuple[int, dict]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(srv.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
