"""Canary routing through a real router on 127.0.0.1: baseline A and canary B (two colocated
nodes of one build, told apart by release.version_label) behind router R with canary.share
0.1. Over 200 requests the share that reached the canary is within binomial bounds of 10%, the
per-version metrics exist and `moed canary` says healthy. Then a canary node configured to
fail joins (decode node C, label of the canary, whose only prefill peer is unreachable: every
request it takes ends in 503), the share is raised to 0.5 on SIGHUP, clients still succeed
(the router retries elsewhere) and the canary is reported unhealthy by its error rate."""
from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import urllib.error
import urllib.request

import pytest

from moed_server import ADMIN_TOKEN, ROOT, _wait_ready, free_port, start_server

from test_disagg import _wait_until

pytestmark = pytest.mark.timeout(300)

KEY_ENV = "CLUSTER_KEY_HEX"
N = 200
SHARE = 0.1
ROUTER = """
[server]
role = "router"
[cluster]
enabled = true
bind_port = {port}
seeds = ["127.0.0.1:{seed}"]
key_env = "{key_env}"
probe_interval_ms = 200
gossip_interval_ms = 50
[canary]
label = "next"
share = {share}
min_requests = 10
max_ttft_ratio = 100.0
max_itl_ratio = 100.0
"""


def binomial_bounds(n: int, p: float, alpha: float = 1e-4) -> tuple[int, int]:
    """[lo, hi] holding a Binomial(n, p) draw but with probability < alpha on each side."""
    pmf = [math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)]
    lo = next(k for k in range(n + 1) if sum(pmf[:k + 1]) >= alpha)
    hi = next(k for k in range(n, -1, -1) if sum(pmf[k:]) >= alpha)
    return lo, hi


@pytest.fixture(scope="module")
def canary_cluster(tiny_qwen3, tmp_path_factory):
    d = tmp_path_factory.mktemp("canary")
    key = os.urandom(32).hex()
    g = {n: free_port() for n in ("A", "B", "C", "R")}
    common = {"MOED_MODEL_SERVED_NAME": "tiny", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
              "MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_KEY_ENV": KEY_ENV, KEY_ENV: key,
              "MOED_CLUSTER_SEEDS": f"127.0.0.1:{g['A']}",
              "MOED_CLUSTER_PROBE_INTERVAL_MS": "200", "MOED_CLUSTER_GOSSIP_INTERVAL_MS": "50"}

    def node(name: str, role: str, label: str, **env: str):
        return start_server(model=tiny_qwen3, role=role, log_dir=d, wait=None,
                            env={**common, "MOED_CLUSTER_BIND_PORT": str(g[name]),
                                 "MOED_SERVER_NODE_NAME": name,
                                 "MOED_RELEASE_VERSION_LABEL": label, **env})

    conf = d / "router.toml"
    conf.write_text(ROUTER.format(port=g["R"], seed=g["A"], key_env=KEY_ENV, share=SHARE))
    servers: dict = {}
    ctx: dict = {}
    try:
        servers["A"] = node("A", "colocated", "base")
        servers["B"] = node("B", "colocated", "next")
        servers["R"] = start_server(role="router", config=conf, log_dir=d, wait=None,
                                    env={KEY_ENV: key, "MOED_SERVER_NODE_NAME": "R"})
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 150)
        ctx = {**servers, "_node": node, "_conf": conf, "_gossip": g, "_key": key}
        yield ctx
    finally:
        # the nodes a test adds to the context (the failing canary C) are stopped too
        for name, s in {**ctx, **servers}.items():
            if not name.startswith("_"):
                s.stop(timeout=10)


def _alive(router, names: set[str]) -> bool:
    status, body = router.get("/cluster")
    return status == 200 and names <= {m["name"] for m in json.loads(body)["members"]
                                       if m["state"] == "alive"}


def _send(url: str, stream: bool, prompt: str, headers: dict | None = None,
          max_tokens: int = 2) -> tuple[int, str]:
    """(status, the serving node's version label) of one completion through the router."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "stream": stream, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status, r.headers.get("X-Moed-Version", "")
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, e.headers.get("X-Moed-Version", "")


def _canary_cli(url: str, token: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    return subprocess.run([sys.executable, "-m", "moed", "canary", "--url", url,
                           "--token-file", str(token)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)


def _report(router) -> dict:
    status, body = router.get("/admin/canary",
                              headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 200, body
    return json.loads(body)


def test_share_reaches_the_canary_within_binomial_bounds(canary_cluster, tmp_path) -> None:
    r = canary_cluster["R"]
    _wait_until(lambda: _alive(r, {"A", "B"}), 30, "router sees A and B", 0.1)
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: _send(r.url, True, f"canary {i}"), range(N)))
    assert all(status == 200 for status, _ in got), got
    n = sum(label == "next" for _, label in got)
    lo, hi = binomial_bounds(N, SHARE)
    assert lo <= n <= hi, (n, lo, hi)
    assert {label for _, label in got} == {"base", "next"}
    m = r.metrics()
    assert m['moed_router_version_attempts_total{result="ok",version="next"}'] == n
    assert m['moed_router_version_attempts_total{result="ok",version="base"}'] == N - n
    assert m['moed_router_version_ttft_seconds_count{version="next"}'] == n
    # one gap per pair of reads with tokens (two tokens may arrive in one read)
    assert 0 < m['moed_router_version_itl_seconds_count{version="base"}'] <= N - n
    assert m['moed_router_canary_requests_total{how="share",side="canary"}'] == n
    rep = _report(r)
    assert rep["canary"]["requests"] == n and rep["baseline"]["requests"] == N - n
    assert rep["canary"]["ttft_p50_s"] > 0 and rep["verdict"]["health"] == "healthy", rep
    token = tmp_path / "admin"
    token.write_text(ADMIN_TOKEN)
    cli = _canary_cli(r.url, token)
    assert cli.returncode == 0 and "verdict: healthy" in cli.stdout, cli.stdout + cli.stderr
    # a request may choose its side with the header; a value that is neither is refused
    assert [_send(r.url, False, "pin", {"X-Moed-Canary": "1"}) for _ in range(3)] == \
        [(200, "next")] * 3
    assert [_send(r.url, False, "pin", {"X-Moed-Canary": "baseline"}) for _ in range(3)] == \
        [(200, "base")] * 3
    assert _send(r.url, False, "pin", {"X-Moed-Canary": "perhaps"})[0] == 400


def test_a_failing_canary_is_reported_unhealthy(canary_cluster, tmp_path) -> None:
    c, r = canary_cluster, canary_cluster["R"]
    dead = f"http://127.0.0.1:{free_port()}"          # nothing listens there
    c["C"] = c["_node"]("C", "decode", "next", MOED_TRANSFER_PREFILL_PEERS=dead)
    _wait_ready(c["C"], "/ready", time.monotonic() + 150)
    _wait_until(lambda: _alive(r, {"A", "B", "C"}), 30, "router sees C", 0.1)
    c["_conf"].write_text(ROUTER.format(port=c["_gossip"]["R"], seed=c["_gossip"]["A"],
                                        key_env=KEY_ENV, share=0.5))
    before = r.metrics().get('moed_config_reloads_total{result="applied"}', 0)
    r.send_signal(signal.SIGHUP)
    _wait_until(lambda: r.metrics().get('moed_config_reloads_total{result="applied"}', 0)
                > before, 15, "router reloaded", 0.05)
    assert _report(r)["share"] == 0.5
    failed_before = r.metrics().get('moed_router_version_attempts_total{result="error",'
                                    'version="next"}', 0)
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: _send(r.url, False, f"failing canary {i} " * 4),
                            range(60)))
    assert all(status == 200 for status, _ in got), got     # retried on a healthy node
    errors = r.metrics()['moed_router_version_attempts_total{result="error",version="next"}']
    assert errors - failed_before >= 5                      # C failed its share
    c_503 = c["C"].metrics().get('moed_http_requests_total{route="/v1/completions",status="503"}')
    assert c_503 and c_503 >= errors - failed_before
    rep = _report(r)
    assert rep["verdict"]["health"] == "unhealthy", rep
    assert any(x.startswith("error rate") for x in rep["verdict"]["reasons"]), rep
    assert rep["versions"]["next"]["errors"] >= 5 and rep["versions"]["base"]["errors"] == 0
    token = tmp_path / "admin"
    token.write_text(ADMIN_TOKEN)
    cli = _canary_cli(r.url, token)
    assert cli.returncode == 1 and "verdict: unhealthy" in cli.stdout, cli.stdout + cli.stderr
    _wait_until(lambda: r.metrics().get('moed_router_canary_health{label="next"}') == 0, 10,
                "health gauge follows", 0.2)
