"""The balancer across a real cluster on 127.0.0.1: a router (with the checkpoint's tokenizer,
for prefix affinity), two prefill and two decode nodes in one gossip membership (real UDP,
HMAC key, real NIXL). A bounded mixed load through the openai client all succeeds and spreads
over both decode nodes; the decode nodes choose prefill nodes by the gossiped cost state; a
repeated prefix goes to the node that holds it; after kill -9 of one decode node every new
request succeeds and, once membership has noticed, lands on the other."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import signal
import time

import openai
import pytest

from moed_server import ServerProcess, _wait_ready, free_port, start_server

pytestmark = pytest.mark.timeout(300)

KEY_ENV = "CLUSTER_KEY_HEX"
COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
          "MOED_ENGINE_BLOCK_SIZE": "4", "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "64",
          "MOED_MODEL_SERVED_NAME": "tiny", "MOED_BALANCE_CALIBRATION_STEPS": "12",
          "MOED_CLUSTER_LOAD_UPDATE_INTERVAL_MS": "200"}
DETECT_S = 15.0          # kill -9 → the router's view no longer has the node alive


def _metric_sum(srv: ServerProcess, prefix: str) -> float:
    return sum(v for k, v in srv.metrics().items() if k.startswith(prefix))


def _wait_until(cond, timeout: float, what: str, step: float = 0.2) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if cond():
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(router: ServerProcess) -> dict[str, str]:
    members = json.loads(router.get("/cluster")[1])["members"]
    return {m["name"]: m["state"] for m in members}


@pytest.fixture()
def cluster(tiny_qwen3, tmp_path):
    key = os.urandom(32).hex()
    seed = free_port()
    base = {**COMMON, "MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_KEY_ENV": KEY_ENV,
            KEY_ENV: key, "MOED_CLUSTER_SEEDS": f"127.0.0.1:{seed}"}
    specs = [("R", "router", seed), ("P1", "prefill", free_port()),
             ("P2", "prefill", free_port()), ("D1", "decode", free_port()),
             ("D2", "decode", free_port())]
    servers: dict[str, ServerProcess] = {}
    try:
        for name, role, gossip in specs:       # start all, then wait: they load in parallel
            # the router: the checkpoint's tokenizer only (model.path; no weights are read)
            model = {"MOED_MODEL_PATH": str(tiny_qwen3)} if role == "router" else {}
            servers[name] = start_server(model=None if model else tiny_qwen3, role=role,
                                         log_dir=tmp_path, args=["--node-name", name],
                                         wait=None, env={**base, **model,
                                                         "MOED_CLUSTER_BIND_PORT": str(gossip)})
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 200)     # R: once a decode node is alive
        r = servers["R"]
        _wait_until(lambda: all(_alive(r).get(n) == "alive" for n in ("P1", "P2", "D1", "D2")),
                    30, "the router to see every node alive")
        yield servers
    finally:
        for s in servers.values():
            s.stop(timeout=10)


def _complete(client: openai.OpenAI, prompt, max_tokens: int) -> str:
    """One completion through the router; -> the decode node that served it."""
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt,
                                                      max_tokens=max_tokens, temperature=0)
    r = raw.parse()
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == max_tokens
    return raw.headers["x-moed-backend"]


def test_mixed_load_spreads_affinity_sticks_and_kill_fails_over(cluster) -> None:
    r, d1, d2 = cluster["R"], cluster["D1"], cluster["D2"]
    assert r.get("/ready")[0] == 200
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=60)
    rnd = random.Random(7)
    shared = [rnd.randrange(3, 1000) for _ in range(48)]

    # ---- a bounded mixed load: 36 requests, 6 at a time; token ids and text, short and long,
    # half of them sharing a 48-token prefix
    def job(i: int) -> str:
        tail = [rnd.randrange(3, 1000) for _ in range(8 + (i * 13) % 90)]
        prompt = (shared + tail) if i % 2 else tail
        if i % 6 == 5:
            prompt = f"request {i}: " + " ".join(str(t) for t in tail[:30])
        return _complete(client, prompt, 2 + i % 5)

    with cf.ThreadPoolExecutor(6) as pool:
        served = list(pool.map(job, range(36), timeout=240))
    assert len(served) == 36
    assert set(served) == {"D1", "D2"}, served
    for d in (d1, d2):           # per-node metrics agree: both decode nodes finished requests
        assert _metric_sum(d, "moed_requests_finished_total") >= 1
    # the decode nodes chose prefill nodes by the gossiped cost state (both prefill nodes
    # advertise a calibrated model)
    assert _metric_sum(d1, 'moed_transfer_prefill_choices_total{how="cost"}') + \
        _metric_sum(d2, 'moed_transfer_prefill_choices_total{how="cost"}') >= 30

    # ---- prefix affinity: one long prompt, then its repeats (one at a time, an idle
    # cluster) all go to the node that served it
    long = [rnd.randrange(3, 1000) for _ in range(120)]
    first = _complete(client, long, 2)
    time.sleep(1.0)                             # a few load ticks: the digest is gossiped
    before = r.metrics().get('moed_router_placements_total{reason="affinity"}', 0)
    again = [_complete(client, long + [5 + k], 2) for k in range(4)]
    assert again == [first] * 4, (first, again)
    assert r.metrics()['moed_router_placements_total{reason="affinity"}'] >= before + 4

    # ---- kill -9 one decode node under load: every new request succeeds (the router retries
    # a refused connection before any byte reached the client) and, within the membership's
    # detection time, all land on the other node
    victim, other = (d1, "D2") if first == "D1" else (d2, "D1")
    victim_name = "D1" if victim is d1 else "D2"
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(5)
    t0 = time.monotonic()
    after: list[tuple[float, str]] = []
    detected: float | None = None
    while time.monotonic() - t0 < DETECT_S + 5:
        with cf.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda i: _complete(client, [rnd.randrange(3, 1000)
                                                             for _ in range(20)], 2),
                                range(3), timeout=60))
        after += [(time.monotonic() - t0, g) for g in got]
        if detected is None and _alive(r).get(victim_name) != "alive":
            detected = time.monotonic() - t0
        if detected is not None and time.monotonic() - t0 > detected + 1.0:
            break
    assert detected is not None and detected <= DETECT_S, (detected, after)
    assert all(g == other for _, g in after), after      # no request reached the dead node
    assert [g for t, g in after if t > detected] and \
        all(g == other for t, g in after if t > detected)
    _wait_until(lambda: r.metrics().get("moed_router_backends") == 1, 5, "one backend left")
    print(f"\nkill -9 {victim_name}: router view changed after {detected:.2f} s; "
          f"{len(after)} requests after the kill, all on {other}")
