"""The preStop hook of deploy/kubernetes (base/bin/drain.py) against a real node: it drains
through the admin API, an in-flight stream finishes, and the hook returns only once the node's
HTTP port has closed, i.e. every request is done (kubelet's SIGTERM after the hook would
otherwise skip the grace); the node then exits 0. Without a valid admin token the hook fails
at once and leaves the node serving (kubelet's SIGTERM then drains)."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.timeout(120)

HOOK = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base" / "bin" / "drain.py"


def hook(url: str, token_file: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    env.update(DRAIN_URL=url, DRAIN_DELAY_S="0.2", MOED_SERVER_ADMIN_TOKEN_FILE=str(token_file))
    return subprocess.Popen([sys.executable, str(HOOK)], env=env, stderr=subprocess.PIPE, text=True)


async def test_prestop_hook_drains_and_waits_for_the_exit(moed_server, tiny_qwen3,
                                                          tmp_path: Path) -> None:
    token = tmp_path / "admin-token"
    token.write_text("tok-k8s\n")
    srv = moed_server(model=tiny_qwen3, toml=f'[server]\nadmin_token_file = "{token}"\n'
                      '[model]\nserved_name = "tiny"\n[engine]\nkv_cache_memory_mb = 16\n')
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    stream = await client.completions.create(model="tiny", prompt="drain", max_tokens=150,
                                             stream=True, extra_body={"ignore_eos": True})
    it = stream.__aiter__()
    first = await it.__anext__()

    proc = hook(srv.url, token)
    n = len(first.choices)
    async for chunk in it:
        n += len(chunk.choices)
    assert n == 150                                     # the in-flight stream completed
    rc = await asyncio.to_thread(proc.wait, 60)
    err = proc.stderr.read()
    assert rc == 0, err
    assert "draining" in err
    with pytest.raises(OSError):                        # closed when the hook returned
        socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
    assert await asyncio.to_thread(srv.proc.wait, 30) == 0
    events = [r["event"] for r in srv.log_records()]
    assert events.index("drain_requested") < events.index("draining") < events.index("stopped")
    await client.close()


def test_prestop_hook_without_the_admin_token_fails_and_leaves_the_node(
        moed_server, tiny_qwen3, tmp_path: Path) -> None:
    token = tmp_path / "admin-token"
    token.write_text("tok-k8s\n")
    srv = moed_server(model=tiny_qwen3, toml=f'[server]\nadmin_token_file = "{token}"\n'
                      '[engine]\nkv_cache_memory_mb = 16\n')
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    for bad in (wrong, tmp_path / "missing"):
        proc = hook(srv.url, bad)
        assert proc.wait(30) == 1
        assert srv.get("/ready")[0] == 200 and srv.alive
