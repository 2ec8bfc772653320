"""Rolling restart behind a router: a router and two serving nodes under a bounded streaming load
(the openai client, through the router); each node in turn is drained (one by POST /admin/drain,
one by SIGTERM as `systemctl restart` does), exits 0, is started again on its port, and rejoins
before the next one goes. Not one request is lost.

Two set-ups: decode nodes that get their prompts' KV from a prefill node over NIXL, behind a
router with a static backend list polled on /ready; and colocated nodes in one gossip cluster
with the router (a draining node leaves, a restarted one rejoins with a newer incarnation).
"""
from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from moed_server import free_port, start_server

pytestmark = pytest.mark.timeout(240)

NODE_TOML = """
[model]
served_name = "tiny"
[server]
admin_token_file = "{admin}"
shutdown_grace_s = 20
[engine]
kv_cache_memory_mb = 16
"""
TOKENS = 24
WORKERS = 4
MAX_REQUESTS = 3000    # bound on the load, whatever the machine's speed


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


PEERS_TOML = """
[transfer]
prefill_peers = ["http://127.0.0.1:{prefill}"]
"""
CLUSTER_TOML = """
[cluster]
enabled = true
bind_port = {port}
seeds = [{seeds}]
key_file = "{key}"
probe_interval_ms = 200
probe_timeout_ms = 100
gossip_interval_ms = 50
push_pull_interval_ms = 1000
load_update_interval_ms = 200
"""


def _router_backends(router) -> float:
    return router.metrics().get("moed_router_backends", -1)


@pytest.mark.parametrize("discovery", ["disaggregated", "membership"])
async def test_rolling_restart_loses_no_request(moed_server, tiny_qwen3, tmp_path: Path,
                                                discovery: str) -> None:
    """disaggregated: router (static backends) → decode D1, D2 → prefill P (NIXL KV transfer).
    membership: router and two colocated nodes in one gossip cluster."""
    admin = tmp_path / "admin"
    admin.write_text("adm\n")
    (tmp_path / "cluster.key").write_text("00112233445566778899aabbccddeeff\n")
    router_gossip, prefill_port = free_port(), free_port()
    node_kw = []
    for _ in range(2):
        toml = NODE_TOML.format(admin=admin)
        if discovery == "membership":
            toml += CLUSTER_TOML.format(port=free_port(), seeds=f'"127.0.0.1:{router_gossip}"',
                                        key=tmp_path / "cluster.key")
            node_kw.append({"model": tiny_qwen3, "toml": toml})
        else:
            node_kw.append({"model": tiny_qwen3, "role": "decode",
                            "toml": toml + PEERS_TOML.format(prefill=prefill_port)})
    if discovery == "membership":
        router = moed_server(role="router", toml=CLUSTER_TOML.format(
            port=router_gossip, seeds="", key=tmp_path / "cluster.key"))
        starts = [asyncio.to_thread(moed_server, **kw) for kw in node_kw]
    else:
        starts = [asyncio.to_thread(moed_server, **kw) for kw in node_kw] + [asyncio.to_thread(
            moed_server, model=tiny_qwen3, role="prefill", port=prefill_port,
            toml=NODE_TOML.format(admin=admin))]
    # All nodes load their model at once (in threads: the factory blocks until /ready).
    started = list(await asyncio.gather(*starts))
    nodes, prefill = started[:2], started[2:]
    if discovery == "disaggregated":
        urls = ", ".join(f'"{n.url}"' for n in nodes)
        router = moed_server(role="router", toml=f"[router]\nbackends = [{urls}]\n"
                                                 "health_interval_s = 0.2\n")
    _wait(lambda: _router_backends(router) == 2, 15, "router to see both nodes")

    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0,
                                timeout=60)
    results: list[tuple[int, str | None]] = []
    errors: list[str] = []
    stop = asyncio.Event()

    async def worker() -> None:
        while not stop.is_set() and len(results) + len(errors) < MAX_REQUESTS:
            try:
                n, finish = 0, None
                stream = await client.completions.create(
                    model="tiny", prompt="rolling", max_tokens=TOKENS, stream=True,
                    extra_body={"ignore_eos": True})
                async for chunk in stream:
                    for c in chunk.choices:
                        n += 1
                        finish = c.finish_reason or finish
                results.append((n, finish))
            except Exception as e:   # every failure is a lost request: recorded, asserted below
                errors.append(repr(e))

    load = [asyncio.create_task(worker()) for _ in range(WORKERS)]
    restarted: list = []     # started here, not by the fixture: stopped in the finally below
    try:
        await asyncio.sleep(1.0)
        served_before = len(results)
        for i, node in enumerate(list(nodes)):
            if i == 0:
                req = urllib.request.Request(node.url + "/admin/drain", data=b"", method="POST",
                                             headers={"Authorization": "Bearer adm"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    assert r.status == 202
            else:
                node.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(node.proc.wait, 60) == 0, node.tail()
            await asyncio.to_thread(_wait, lambda: _router_backends(router) == 1, 10,
                                    "router to drop the drained node")
            mid = len(results)                               # load keeps flowing on one node
            await asyncio.to_thread(_wait, lambda: len(results) >= mid + 2, 30,
                                    "requests to complete on the remaining node")
            nodes[i] = await asyncio.to_thread(start_server, **node_kw[i], port=node.port,
                                               log_dir=tmp_path / f"restart{i}")
            restarted.append(nodes[i])
            await asyncio.to_thread(_wait, lambda: _router_backends(router) == 2, 10,
                                    "router to take the restarted node back")
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*load), 90)
        await client.close()
        for n in restarted:
            n.stop(timeout=15)

    assert not errors, errors[:5]
    assert len(results) > served_before + 10
    assert all(r == (TOKENS, "length") for r in results), [r for r in results if r != (TOKENS, "length")][:5]
    if prefill:   # the decode nodes really got their KV from the prefill node
        jobs = prefill[0].metrics().get('moed_transfer_jobs_total{result="done",role="prefill"}', 0)
        assert jobs >= len(results), (jobs, len(results))
    m = router.metrics()
    assert m.get('moed_router_requests_total{result="no_backend"}', 0) == 0
    print(f"rolling restart ({discovery}): {len(results)} requests, {m.get('moed_router_retries_total', 0):.0f} "
          f"retried before the first byte, 0 lost")

