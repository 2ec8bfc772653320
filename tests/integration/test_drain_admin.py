"""POST /admin/drain on a real node: admin token required; readiness false and new requests 503
at once; the in-flight stream finishes; the process exits 0. GET /admin/config shows the running
config with secret-ish fields redacted."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.timeout(120)


def _post(url: str, token: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def test_admin_drain(moed_server, tiny_qwen3, tmp_path: Path) -> None:
    (tmp_path / "admin").write_text("tok-1\ntok-2\n")
    srv = moed_server(model=tiny_qwen3, toml=f'[server]\nadmin_token_file = "{tmp_path / "admin"}"\n'
                      '[model]\nserved_name = "tiny"\n[engine]\nkv_cache_memory_mb = 16\n')
    status, body = srv.get("/admin/config", headers={"Authorization": "Bearer tok-2"})
    cfg = json.loads(body)
    assert status == 200 and cfg["version"] == 1 and len(cfg["hash"]) == 12
    assert cfg["config"]["server"]["admin_token_file"] == "<redacted>"

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    stream = await client.completions.create(model="tiny", prompt="drain", max_tokens=150,
                                             stream=True, extra_body={"ignore_eos": True})
    it = stream.__aiter__()
    first = await it.__anext__()

    assert _post(srv.url + "/admin/drain")[0] == 401
    assert _post(srv.url + "/admin/drain", "wrong")[0] == 401
    assert srv.get("/ready")[0] == 200                      # refused drains changed nothing
    status, body = _post(srv.url + "/admin/drain", "tok-1")
    assert status == 202 and body["status"] == "draining" and body["inflight"] == 1
    assert srv.get("/ready")[0] == 503
    with pytest.raises(openai.APIStatusError) as e:
        await client.completions.create(model="tiny", prompt="late", max_tokens=2)
    assert e.value.status_code == 503
    assert _post(srv.url + "/admin/drain", "tok-1")[0] == 202   # idempotent: no forced stop

    n, finish = len(first.choices), None
    async for chunk in it:
        n += len(chunk.choices)
        finish = chunk.choices[0].finish_reason if chunk.choices else finish
    assert (n, finish) == (150, "length")                   # the in-flight stream completed
    t0 = time.monotonic()
    assert await asyncio.to_thread(srv.proc.wait, 30) == 0
    assert time.monotonic() - t0 < 20
    events = [r["event"] for r in srv.log_records()]
    assert events.index("drain_requested") < events.index("draining") < events.index("stopped")
    await client.close()
