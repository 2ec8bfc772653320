"""Config history and rollback on a real `moed serve` process: reload A → B, roll back to A
with `moed config rollback` (POST /admin/config/rollback); the running config's hash is A's
again, the history (API, CLI and the file in the state directory) has three entries, streams
in flight live through every step, and `moed config show` gives back A as a file."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from moed_server import ADMIN_TOKEN, ROOT, serve_process

pytestmark = pytest.mark.timeout(180)

CONF = """
[model]
served_name = "tiny"
[server]
state_dir = "{state}"
[engine]
kv_cache_memory_mb = 16
[admission]
max_waiting_requests = {waiting}
"""


def _cli(*args: str, token: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    return subprocess.run([sys.executable, "-m", "moed", *args, "--token-file", str(token)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)


async def _stream(client: openai.AsyncOpenAI, started: asyncio.Event) -> tuple[int, str | None]:
    n, finish = 0, None
    stream = await client.completions.create(model="tiny", prompt="roll back", max_tokens=300,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        for c in chunk.choices:
            n += 1 if c.text is not None else 0
            finish = c.finish_reason or finish
        started.set()
    return n, finish


async def test_reload_then_rollback_keeps_streams_and_history(tiny_qwen3, tmp_path: Path) -> None:
    state, conf, token = tmp_path / "state", tmp_path / "node.toml", tmp_path / "admin"
    token.write_text(ADMIN_TOKEN + "\n")
    conf.write_text(CONF.format(state=state, waiting=8))
    with serve_process(model=tiny_qwen3, config=conf, log_dir=tmp_path) as srv:
        def admin(path: str) -> dict:
            status, body = srv.get(path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert status == 200, body
            return json.loads(body)

        def reloads(result: str) -> float:
            return srv.metrics().get(f'moed_config_reloads_total{{result="{result}"}}', 0.0)

        hash_a = admin("/admin/config")["hash"]
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                                    timeout=120)
        started = [asyncio.Event() for _ in range(3)]
        streams = [asyncio.create_task(_stream(client, s)) for s in started]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)

        conf.write_text(CONF.format(state=state, waiting=4))            # B
        before = reloads("applied")
        srv.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while reloads("applied") <= before:
            assert time.monotonic() < deadline, srv.tail()
            await asyncio.sleep(0.05)
        b = admin("/admin/config")
        hash_b = b["hash"]
        assert hash_b != hash_a and b["config"]["admission"]["max_waiting_requests"] == 4
        assert not any(t.done() for t in streams), "streams ended before the rollback"

        r = await asyncio.to_thread(_cli, "config", "rollback", hash_a, "--url", srv.url,
                                    token=token)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"running {hash_a}" in r.stdout and "max_waiting_requests: 4 -> 8" in r.stdout
        assert "config file still says otherwise" in r.stderr        # the file says B
        now = admin("/admin/config")
        assert now["hash"] == hash_a and now["config"]["admission"]["max_waiting_requests"] == 8

        results = await asyncio.gather(*streams)
        assert results == [(300, "length")] * 3                          # none dropped or cut

        hist = admin("/admin/config/history")
        assert [(e["hash"], e["source"]) for e in hist["entries"]] == [
            (hash_a, "start"), (hash_b, "reload"), (hash_a, "rollback")]
        assert hist["running"] == hash_a
        listing = await asyncio.to_thread(_cli, "config", "history", "--url", srv.url,
                                          token=token)
        assert listing.returncode == 0 and len(listing.stdout.splitlines()) == 3
        assert listing.stdout.splitlines()[-1].endswith("rollback  <- running")
        refused = await asyncio.to_thread(_cli, "config", "rollback", "0000beef", "--url",
                                          srv.url, token=token)
        assert refused.returncode == 2 and "No config 0000beef" in refused.stderr
        rollbacks = [r for r in srv.log_records() if r.get("event") == "config_reloaded"
                     and r.get("source") == "rollback"]
        assert len(rollbacks) == 1 and rollbacks[0]["config_hash"] == hash_a

        # the file on disk: three entries (written behind the event loop: poll briefly)
        path = state / "config-history.json"
        deadline = time.monotonic() + 5
        while True:
            entries = json.loads(path.read_text())["entries"] if path.exists() else []
            if len(entries) == 3 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert [e["hash"] for e in entries] == [hash_a, hash_b, hash_a]
        shown = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "moed", "config", "show", hash_a,
                             "--state-dir", str(state)], cwd=ROOT, capture_output=True,
            text=True, timeout=30)
        assert shown.returncode == 0, shown.stderr
        restored = tmp_path / "restored.toml"
        restored.write_text(shown.stdout)
        from moed.config import load
        assert load(restored, environ={}).digest() == hash_a
        assert srv.stop(signal.SIGTERM) == 0
