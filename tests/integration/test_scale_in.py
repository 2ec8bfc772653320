"""Scale-in without a lost request: a router and two decode nodes (prompts prefilled locally)
in one gossip membership, a bounded load through the router, and `moed plan --watch`
against the router's /cluster. The load fits one node, so after --in-stable intervals the
planner's action hook drains the node with the least in-flight work (POST /admin/drain);
every request succeeds, the drained node exits 0, and the planner holds at one node after.
Long requests (streamed and not, far more tokens than the drain lasts) run on both nodes: the
drained node hands its share to the router after server.drain_migrate_after_s (a stream
continues elsewhere, a non-streamed request is resubmitted) and exits within that + 5 s, so
scale-in does not wait for max_tokens; every long request ends with all its tokens."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from moed_server import ADMIN_TOKEN, ROOT, ServerProcess, _wait_ready, free_port, start_server

pytestmark = pytest.mark.timeout(300)

KEY_ENV = "CLUSTER_KEY_HEX"
DRAIN_AFTER_S = 1.0
LONG = 2000            # tokens of a long request (the context is 2048): ~10 s on 2 cores
COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "32",
          "MOED_ENGINE_BLOCK_SIZE": "4", "MOED_MODEL_SERVED_NAME": "tiny",
          "MOED_TRANSFER_LOCAL_PREFILL_MAX_TOKENS": "100000",
          "MOED_CLUSTER_LOAD_UPDATE_INTERVAL_MS": "200", "MOED_SERVER_SHUTDOWN_GRACE_S": "30",
          "MOED_SERVER_DRAIN_MIGRATE_AFTER_S": str(DRAIN_AFTER_S)}

HOOK = '''import json, os, sys, urllib.request
url = sys.argv[1]
req = urllib.request.Request(url + "/admin/drain", data=b"", method="POST",
                             headers={"Authorization": "Bearer " + os.environ["PLAN_TOKEN"]})
with urllib.request.urlopen(req, timeout=10) as r:
    body = json.loads(r.read())
with open(sys.argv[2], "a") as f:
    f.write(json.dumps({"url": url, "node": sys.argv[3], "status": r.status,
                        "inflight": body.get("inflight")}) + "\\n")
sys.exit(0 if r.status == 202 else 1)
'''


def _alive(router: ServerProcess) -> dict[str, str]:
    members = json.loads(router.get("/cluster")[1])["members"]
    return {m["name"]: m["state"] for m in members}


def _wait_until(cond, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture()
def cluster(tiny_qwen3, tmp_path):
    key = os.urandom(32).hex()
    seed = free_port()
    base = {**COMMON, "MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_KEY_ENV": KEY_ENV,
            KEY_ENV: key, "MOED_CLUSTER_SEEDS": f"127.0.0.1:{seed}"}
    specs = [("R", "router", seed), ("D1", "decode", free_port()), ("D2", "decode", free_port())]
    servers: dict[str, ServerProcess] = {}
    try:
        for name, role, gossip in specs:            # start all, then wait: they load in parallel
            servers[name] = start_server(model=None if role == "router" else tiny_qwen3,
                                         role=role, log_dir=tmp_path, args=["--node-name", name],
                                         wait=None,
                                         env={**base, "MOED_CLUSTER_BIND_PORT": str(gossip)})
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 200)
        r = servers["R"]
        _wait_until(lambda: all(_alive(r).get(n) == "alive" for n in ("D1", "D2")), 30,
                    "the router to see both decode nodes alive")
        yield servers
    finally:
        for s in servers.values():
            s.stop(timeout=10)


def test_planner_drains_one_of_two_decode_nodes_without_losing_a_request(cluster, tmp_path
                                                                         ) -> None:
    r = cluster["R"]
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=60)
    results: list[tuple[str, int]] = []
    errors: list[str] = []
    stop = threading.Event()

    def worker(w: int) -> None:           # bounded: 2 workers, one request at a time each
        i = 0
        while not stop.is_set() and i < 200:
            try:
                raw = client.completions.with_raw_response.create(
                    model="tiny", prompt=[3 + (w * 31 + i * 7 + k) % 900 for k in range(24)],
                    max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
                c = raw.parse()
                assert c.choices[0].finish_reason == "length", c
                results.append((raw.headers["x-moed-backend"], c.usage.completion_tokens))
            except Exception as e:           # every failure is a lost request: the test fails
                errors.append(repr(e))
            i += 1

    def long(w: int) -> tuple[str, int, str | None]:   # (backend, tokens, finish)
        body = dict(model="tiny", prompt=[7 + w, 8, 9, 10], max_tokens=LONG, temperature=0,
                    extra_body={"ignore_eos": True})
        if w % 2 == 0:                                 # a stream: its tokens, then usage
            n, finish = 0, None
            with client.completions.with_streaming_response.create(
                    stream=True, stream_options={"include_usage": True}, **body) as raw:
                for c in raw.parse():
                    if c.usage is not None:
                        n = c.usage.completion_tokens
                    if c.choices and c.choices[0].finish_reason:
                        finish = c.choices[0].finish_reason
                return raw.headers["x-moed-backend"], n, finish
        raw = client.completions.with_raw_response.create(**body)
        c = raw.parse()
        return raw.headers["x-moed-backend"], c.usage.completion_tokens, \
            c.choices[0].finish_reason

    pool = cf.ThreadPoolExecutor(6)
    futures = [pool.submit(worker, w) for w in range(2)]
    _wait_until(lambda: {b for b, _ in results} == {"D1", "D2"}, 60, "load on both nodes")
    longs = [pool.submit(long, w) for w in range(4)]      # placed by load: both nodes get some

    log = tmp_path / "drained.jsonl"
    (tmp_path / "hook.py").write_text(HOOK)
    hook = f"{sys.executable} {tmp_path / 'hook.py'} {{url}} {log} {{node}}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    env.update({"PLAN_TOKEN": ADMIN_TOKEN})
    plan = subprocess.Popen(
        [sys.executable, "-m", "moed", "plan", "--url", r.url, "--token-env", "PLAN_TOKEN",
         "--watch", "--json", "--interval", "0.5", "--cooldown-in", "0", "--in-stable", "3",
         "--on-scale-in", hook, "--hook-timeout", "20"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_until(lambda: log.exists() and log.read_text().strip(), 60, "the drain hook")
        t_drain = time.monotonic()
        drained = json.loads(log.read_text().splitlines()[0])
        victim = cluster[drained["node"]]
        other = "D2" if drained["node"] == "D1" else "D1"
        assert drained["status"] == 202 and victim.url == drained["url"]
        assert not any(f.done() for f in longs), [f.result() for f in longs if f.done()]
        # drained, then exit 0 within drain_migrate_after_s + 5 s, long requests or not
        assert victim.proc.wait(DRAIN_AFTER_S + 5) == 0
        exit_s = time.monotonic() - t_drain
        n_at_exit = len(results)
        # the load carries on, on the other node alone
        _wait_until(lambda: len(results) >= n_at_exit + 6, 60, "requests after the drain")
        time.sleep(2.0)                   # a few more intervals: the planner holds at one node
    finally:
        stop.set()
        for f in futures:
            f.result(timeout=90)
        done = [f.result(timeout=120) for f in longs]
        pool.shutdown()
        plan.send_signal(signal.SIGTERM)
        out, err = plan.communicate(timeout=30)
    assert plan.returncode == 0, err
    assert errors == [], errors                                   # 0 requests lost
    assert all(n == 24 for _, n in results)
    assert [b for b, _ in results[n_at_exit + 2:]] and \
        all(b == other for b, _ in results[n_at_exit + 2:])
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    decode = [d for line in lines for d in line["roles"] if d["role"] == "decode"]
    actions = [d for d in decode if d["action"] != "hold"]
    assert [(d["action"], d["current"], d["desired"]) for d in actions] == [("in", 2, 1)], actions
    assert [n["name"] for n in actions[0]["drain"]] == [drained["node"]]
    assert decode[-1]["current"] == 1 and decode[-1]["action"] == "hold"
    assert len(log.read_text().splitlines()) == 1                 # one drain, never a second
    assert [(n, f) for _, n, f in done] == [(LONG, "length")] * 4     # every long one whole
    records = victim.log_records()
    events = [rec.get("event") for rec in records]
    assert "drain_requested" in events and "stopped" in events
    handed = [rec["streams"] for rec in records if rec.get("event") == "drain_handed_off"]
    assert handed and handed[0] >= 1, "the drained node held none of the long requests"
    print(f"\n{len(results)} requests, 0 lost; {drained['node']} drained with "
          f"{drained['inflight']} in flight, {handed[0]} handed over, exit 0 after "
          f"{exit_s:.1f} s\nplanner: {actions[0]['reason']}")
