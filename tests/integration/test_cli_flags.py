"""`moed serve MODEL` with the flags vLLM operators know, on a real process: each flag is seen
to take effect through the API (the key on /v1, /v1/models, /admin/config, /metrics) or the
node's own log. And the loader's progress: a `shard_loaded` info line per shard always, a
progress bar only for console logs on a terminal. Every wait has a deadline.
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from moed_server import ADMIN_HEADERS, ROOT

pytestmark = pytest.mark.timeout(180)

KEY = "sk-flags-" + os.urandom(6).hex()
FLAGS = {"--served-model-name": "tiny-chat", "--max-model-len": "512", "--max-num-seqs": "3",
         "--max-num-batched-tokens": "96", "--kv-cache-memory": "2", "--block-size": "32",
         "--dtype": "float32", "--device": "cpu", "--attention-backend": "torch",
         "--node-name": "flags-node", "--quantization": "int8"}


def _complete(url: str, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"model": "tiny-chat", "prompt": "hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_serve_flags_take_effect_through_the_api(moed_server, tiny_qwen3: Path) -> None:
    from moed.model.runner import auto_num_blocks
    from moed.model.hf_config import load_spec

    args = [str(tiny_qwen3), "--api-key", KEY]          # MODEL positional, as `vllm serve`
    for flag, value in FLAGS.items():
        args += [flag, value]
    srv = moed_server(args=args)                       # the harness adds --host and --port
    bearer = {"Authorization": f"Bearer {KEY}"}

    # --api-key: required on /v1, the right one accepted
    assert srv.get("/v1/models")[0] == 401
    assert srv.get("/v1/models", headers={"Authorization": "Bearer not-it"})[0] == 401
    assert _complete(srv.url, None)[0] == 401
    status, text = srv.get("/v1/models", headers=bearer)
    assert status == 200
    # --served-model-name, --max-model-len
    assert [(m["id"], m["max_model_len"]) for m in json.loads(text)["data"]] == [("tiny-chat", 512)]
    status, body = _complete(srv.url, KEY)
    assert status == 200 and body["model"] == "tiny-chat", body

    # the scheduler's limits and the config as the node holds them; the key itself nowhere
    status, text = srv.get("/admin/config", headers=ADMIN_HEADERS)
    assert status == 200 and KEY not in text
    view = json.loads(text)
    assert view["engine_effective"] == {"max_num_seqs": 3, "max_num_batched_tokens": 96}
    cfg = view["config"]
    assert (cfg["model"]["served_name"], cfg["model"]["max_model_len"]) == ("tiny-chat", 512)
    assert (cfg["engine"]["kv_cache_memory_mb"], cfg["engine"]["block_size"]) == (2, 32)

    # --dtype, --device, --attention-backend: what serves; --node-name
    metrics = srv.get("/metrics")[1]
    info = next(ln for ln in metrics.splitlines() if ln.startswith("moed_model_info{"))
    assert all(f'{k}="{v}"' in info for k, v in
               (("dtype", "float32"), ("device", "cpu"), ("backend", "torch"), ("quantization", "int8"))), info
    assert 'node="flags-node"' in metrics

    # --kv-cache-memory and --block-size: the pool the runner built from them
    records = srv.log_records()
    ready = next(r for r in records if r.get("event") == "model_runner_ready")
    expect = auto_num_blocks(load_spec(tiny_qwen3), 32, "float32", 2)
    assert (ready["num_blocks"], ready["block_size"]) == (expect, 32)

    # one info line per shard (JSON logs: no progress bar)
    shards = [r for r in records if r.get("event") == "shard_loaded"]
    assert shards and shards[0]["level"] == "info"
    assert {"shard", "index", "of", "bytes", "seconds", "mb_per_s"} <= set(shards[0])
    assert shards[0]["bytes"] == (tiny_qwen3 / shards[0]["shard"]).stat().st_size
    logs = srv.logs()
    assert "loading weights" not in logs and KEY not in logs
    assert srv.stop() == 0


# ---- the progress bar: console logs on a terminal only ------------------------------------

LOAD = ("import sys; from moed.obs import log; log.configure(sys.argv[2]); "
        "from moed.model.loader import load_weights; from moed.model.hf_config import load_spec; "
        "load_weights(sys.argv[1], load_spec(sys.argv[1]))")


def _load_output(model: Path, fmt: str, tty: bool, timeout: float = 60.0) -> str:
    """What loading `model` writes to stderr, on a 120-column pseudo-terminal or a pipe."""
    argv = [sys.executable, "-c", LOAD, str(model), fmt]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MOED_")},
           "OMP_NUM_THREADS": "1"}
    if not tty:
        r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
        assert r.returncode == 0, r.stderr
        return r.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:              # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(max(1.0, deadline - time.monotonic())) == 0, out[-2000:]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return out.decode(errors="replace")


def test_progress_bar_only_for_console_logs_on_a_terminal(tiny_qwen3: Path) -> None:
    shown = _load_output(tiny_qwen3, "console", tty=True)
    assert "loading weights" in shown and "shard_loaded" in shown, shown
    for fmt, tty in (("json", True), ("console", False)):
        out = _load_output(tiny_qwen3, fmt, tty)
        assert "shard_loaded" in out and "loading weights" not in out, (fmt, tty, out)
