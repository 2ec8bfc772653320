"""Issue 33, acceptance 1 at concurrency (bounded for CI): router R + colocated nodes A and B on
127.0.0.1, 16 concurrent greedy streams of 64 tokens, SIGKILL of the node serving some of them
at a random moment under way: every stream ends with exactly the tokens of an undisturbed
concurrent run, no error event, one [DONE], and moed_router_migrations_total moved. Before
that (acceptance 2, shortened), SIGTERM of node C while it serves some of 10 concurrent
streams of 600 tokens: C exits within server.drain_migrate_after_s + 5 s and every stream
ends elsewhere identical to the undisturbed run.

The nodes run bf16 with model.batch_invariant and the default batch (engine.max_num_seqs =
64): a row's result then does not depend on the batch it is computed in (docs/migration.md,
"Identical at any concurrency"), so the undisturbed run, the disturbed one and the
continuation's forced decode steps agree whatever the steps' batches were. Without it they
do not on this CPU (the kernel serving a matmul is chosen per row count), which is why
test_migration.py runs one sequence per step. bench/migration_concurrency.py runs the literal
40 x 256, colocated and P/D."""
from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from moed_server import _wait_ready, free_port, start_server

from test_disagg import _wait_until
from test_migration import KEY_ENV, ROUTER, TENANT, Stream, _alive

pytestmark = pytest.mark.timeout(180)

N, TOKENS = 16, 64
# the hand-over comes 0.2 s after SIGTERM: short, so that a stream with 300 tokens left cannot
# finish first on a fast, quiet machine (with 1 s it sometimes did: no stream moved)
DRAIN_N, DRAIN_TOKENS, DRAIN_AFTER_S = 10, 600, 0.2


def _body(i: int, tokens: int = TOKENS) -> dict:
    body = {"model": "tiny", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    text = f"stream {i}: jumps over the lazy dog {i * 13}"
    if i % 4 == 3:
        return {**body, "messages": [{"role": "user", "content": text}]}
    return {**body, "prompt": text}


@pytest.fixture(scope="module")
def cluster(tiny_qwen3, tmp_path_factory):
    d = tmp_path_factory.mktemp("migrate_conc")
    key = os.urandom(32).hex()
    g = {n: free_port() for n in ("A", "B", "C", "R")}
    common = {"MOED_MODEL_SERVED_NAME": "tiny", "MOED_MODEL_DTYPE": "bfloat16",
              "MOED_MODEL_BATCH_INVARIANT": "true",
              "MOED_ENGINE_KV_CACHE_MEMORY_MB": "64",
              "MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_KEY_ENV": KEY_ENV, KEY_ENV: key,
              "MOED_CLUSTER_SEEDS": f"127.0.0.1:{g['A']}",
              "MOED_CLUSTER_PROBE_INTERVAL_MS": "200", "MOED_CLUSTER_GOSSIP_INTERVAL_MS": "50",
              "MOED_SERVER_API_KEYS_ENV": "TEST_TENANT_KEYS", "TEST_TENANT_KEYS": TENANT,
              "MOED_SERVER_DRAIN_MIGRATE_AFTER_S": str(DRAIN_AFTER_S)}
    conf = d / "router.toml"
    conf.write_text(ROUTER.format(port=g["R"], seed=g["A"], key_env=KEY_ENV))
    servers = {}
    try:
        for name in ("A", "B", "C"):
            servers[name] = start_server(
                model=tiny_qwen3, role="colocated", log_dir=d, wait=None,
                env={**common, "MOED_CLUSTER_BIND_PORT": str(g[name]),
                     "MOED_SERVER_NODE_NAME": name})
        servers["R"] = start_server(role="router", config=conf, log_dir=d, wait=None,
                                    env={KEY_ENV: key, "MOED_SERVER_NODE_NAME": "R",
                                         "MOED_SERVER_API_KEYS_ENV": "TEST_TENANT_KEYS",
                                         "TEST_TENANT_KEYS": TENANT})
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 150)
        _wait_until(lambda: _alive(servers["R"], {"A", "B", "C"}), 30,
                    "the router sees A, B and C", 0.1)
        yield servers
    finally:
        for s in servers.values():
            if s.alive:
                s.stop(timeout=10)


def _run(base: str, kill=None, n: int = N, tokens: int = TOKENS) -> list[dict]:
    streams = [Stream(base, _body(i, tokens)) for i in range(n)]
    for s in streams:
        s.start()
    if kill is not None:
        kill(streams)
    for s in streams:
        s.join(60)
        assert not s.is_alive(), "stream did not end within 60 s"
        assert s.error is None, repr(s.error)
    return [s.result() for s in streams]


def test_a_sigterm_drain_moves_concurrent_streams_identical(cluster) -> None:
    """Runs first (it needs three nodes): C drains by SIGTERM while serving streams."""
    r = cluster["R"]
    base = _run(r.url, n=DRAIN_N, tokens=DRAIN_TOKENS)
    t_term: list[float] = []

    def term(streams: list[Stream]) -> None:
        _wait_until(lambda: any(s.backend == "C" and 20 <= s.tokens() < DRAIN_TOKENS // 2
                                for s in streams), 30, "a stream under way on C", 0.01)
        cluster["C"].proc.send_signal(signal.SIGTERM)
        t_term.append(time.monotonic())

    got = _run(r.url, term, n=DRAIN_N, tokens=DRAIN_TOKENS)
    assert cluster["C"].proc.wait(timeout=DRAIN_AFTER_S + 5) == 0
    exit_s = time.monotonic() - t_term[0]
    for i, (a, b) in enumerate(zip(base, got)):
        assert not b["errors"] and b["done"], (i, b["errors"])
        assert b["ids"] == a["ids"] and b["usage"] == a["usage"], i
    moved = [x for x in r.log_records() if x.get("event") == "router_stream_migrated"
             and x["from_node"] == "C"]
    assert moved and all(x["reason"] == "drain" for x in moved)
    print(f"\n{DRAIN_N} streams x {DRAIN_TOKENS} tokens: SIGTERM of C, {len(moved)} moved, "
          f"C gone within {exit_s:.1f} s, {DRAIN_N}/{DRAIN_N} identical")


def test_concurrent_greedy_streams_survive_a_killed_node_identical(cluster) -> None:
    r = cluster["R"]
    base = _run(r.url)
    for res in base:
        assert res["done"] and not res["errors"] and len(res["ids"]) == TOKENS
    before = sum(v for k, v in r.metrics().items()
                 if k.startswith("moed_router_migrations_total{"))
    rng = random.Random()
    at = rng.randint(8, TOKENS // 2)         # the random moment: a stream this far under way
    killed: list[str] = []

    def kill(streams: list[Stream]) -> None:
        # the victim is the node of the stream the wait found under way (a stream picked by
        # tokens >= at alone could be one about to finish: killed with nothing left on it,
        # no stream moved)
        under: list[str] = []

        def under_way() -> bool:
            under[:] = [s.backend for s in streams if s.is_alive() and at <= s.tokens() < TOKENS - 8]
            return bool(under)
        _wait_until(under_way, 30, "a stream under way", 0.01)
        cluster[under[0]].proc.send_signal(signal.SIGKILL)
        killed.append(under[0])

    got = _run(r.url, kill)
    for i, (a, b) in enumerate(zip(base, got)):
        assert not b["errors"] and b["done"], (i, b["errors"])
        assert b["ids"] == a["ids"] and b["text"] == a["text"], (i, at)
        assert b["usage"] == a["usage"] and b["finish"] == ["length"], i
    moved = [x for x in r.log_records() if x.get("event") == "router_stream_migrated"
             and x["from_node"] == killed[0]]
    after = sum(v for k, v in r.metrics().items()
                if k.startswith("moed_router_migrations_total{"))
    assert moved and after - before == len(moved)
    print(f"\n{N} streams x {TOKENS} tokens, {killed[0]} killed at ~{at} tokens: {len(moved)} "
          f"migrated, {N}/{N} identical to the undisturbed run; "
          f"{json.dumps([x['tokens_sent'] for x in moved])} tokens sent before the move")
