"""A rank dies under load: kill -9 one rank of an EP=2 decode group while the other serves
requests.
The survivor ends its in-flight requests with a 503 (retryable) within the collective timeout,
leaves membership (peers see "left", not a suspect) and exits 1; a router in front sends new
requests to another node; both ranks restarted form the group again and serve."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

from ep_group import complete
from moed_server import ServerProcess, free_port

KEY_ENV = "CLUSTER_KEY_HEX"
TIMEOUT_S = 5.0
ARGS = ["--kv-cache-memory", "8", "--served-model-name", "m"]


def _env(gossip_port: int, seed_port: int, key: str) -> dict[str, str]:
    return {"MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_BIND_PORT": str(gossip_port),
            "MOED_CLUSTER_SEEDS": f"127.0.0.1:{seed_port}", "MOED_CLUSTER_KEY_ENV": KEY_ENV,
            KEY_ENV: key, "MOED_PARALLEL_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)}


def _members(srv: ServerProcess) -> dict[str, str]:
    status, body = srv.get("/cluster", timeout=2.0)
    assert status == 200, body
    return {m["name"]: m["state"] for m in json.loads(body)["members"]}


def _until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except (OSError, AssertionError):
            pass
        time.sleep(0.1)
    return False


def _colocated_group(moed_server, model, size: int, timeout_s: float) -> list[ServerProcess]:
    """`size` colocated ranks under a short collective timeout, started and ready."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {"MOED_BALANCE_CALIBRATION_STEPS": "0",
           "MOED_PARALLEL_COLLECTIVE_TIMEOUT_S": str(timeout_s)}
    ranks = [moed_server(model=model, role="colocated", wait=None, env=env,
                         args=[*ARGS, "--ep-size", str(size), "--ep-rank", str(r), "--ep-init", init])
             for r in range(size)]
    for srv in ranks:
        assert _until(lambda: srv.get("/ready", timeout=1.0)[0] == 200, 90), srv.tail()
    return ranks


def _in_flight(srv: ServerProcess, prompt: str, n: int
               ) -> tuple[list[tuple[int, float]], list[threading.Thread]]:
    """n long generations on srv, running when this returns: (status, when it ended) of each
    lands in the list as it ends."""
    results: list[tuple[int, float]] = []

    def call() -> None:
        status, _ = complete(srv, prompt, 1500, timeout=60)
        results.append((status, time.monotonic()))

    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    assert _until(lambda: srv.metrics().get("moed_requests_running", 0) >= 1, 10), srv.tail()
    return results, threads


def test_kill_one_rank_under_load(moed_server, tiny_qwen3) -> None:
    key = os.urandom(32).hex()
    seed = free_port()
    router = moed_server(role="router", args=["--node-name", "router"], env=_env(seed, seed, key),
                         ready_timeout=30)
    other = moed_server(model=tiny_qwen3, role="colocated", args=[*ARGS, "--node-name", "other"],
                        env={**_env(free_port(), seed, key), "MOED_BALANCE_CALIBRATION_STEPS": "0"})

    a0, a1 = _group(moed_server, tiny_qwen3, seed, key, "a")
    names = {a0.url: "a-0", a1.url: "a-1"}
    assert _until(lambda: all(_members(router).get(n) == "alive" for n in ("a-0", "a-1", "other")),
                  20), _members(router)

    # load on rank 0: long generations in flight when rank 1 dies
    results, threads = _in_flight(a0, "tell me a long story", 3)
    killed = time.monotonic()
    a1.proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert len(results) == 3
    assert all(s == 503 for s, _ in results), results
    assert max(at for _, at in results) - killed <= TIMEOUT_S + 2.0, results
    assert a0.proc.wait(TIMEOUT_S + 15) == 1
    # it left membership on its way out (a graceful leave, not a suspect nobody answers for)
    assert _until(lambda: _members(router).get(names[a0.url]) == "left", 10), _members(router)
    assert any(r.get("event") == "ep_group_failed" for r in a0.log_records())

    # the router sends new requests elsewhere
    for _ in range(3):
        status, body = complete(router, "hello", 4)
        assert status == 200, body

    # both ranks restarted (as systemd would): the group forms again and serves
    b0, b1 = _group(moed_server, tiny_qwen3, seed, key, "a")
    for srv in (b0, b1):
        status, body = complete(srv, "hello again", 4)
        assert status == 200, body
    assert other.alive


def _group(moed_server, model, seed: int, key: str, tag: str) -> list[ServerProcess]:
    init = f"tcp://127.0.0.1:{free_port()}"
    # decode ranks prefilling locally (no prefill node needed for this test)
    ranks = [moed_server(model=model, role="decode", wait=None,
                         env={**_env(free_port(), seed, key), "MOED_BALANCE_CALIBRATION_STEPS": "0",
                              "MOED_TRANSFER_LOCAL_PREFILL_MAX_TOKENS": "4096"},
                         args=[*ARGS, "--node-name", f"{tag}-{r}", "--ep-size", "2",
                               "--ep-rank", str(r), "--ep-init", init]) for r in range(2)]
    for srv in ranks:
        assert _until(lambda: srv.get("/ready", timeout=1.0)[0] == 200, 90), srv.tail()
    return ranks


def test_a_stalled_rank_fails_the_group_within_the_timeout(moed_server, tiny_qwen3) -> None:
    """SIGSTOP (a hung rank, not a dead one): nothing closes a socket, so only the collective
    timeout can tell; the survivor's requests end 503 within it and the node exits 1."""
    timeout_s = 3.0
    ranks = _colocated_group(moed_server, tiny_qwen3, 2, timeout_s)
    r0, r1 = ranks
    results, threads = _in_flight(r0, "a story", 2)
    stalled = time.monotonic()
    r1.proc.send_signal(signal.SIGSTOP)
    try:
        for t in threads:
            t.join(30)
        assert [s for s, _ in results] == [503, 503], results
        waited = max(at for _, at in results) - stalled
        assert timeout_s - 0.5 <= waited <= timeout_s + 3.0, waited   # the timeout, not sooner
        assert r0.proc.wait(20) == 1
        failed = [r for r in r0.log_records() if r.get("event") == "ep_group_failed"]
        assert failed and "Timed out" in failed[0]["reason"], failed
    finally:
        r1.proc.send_signal(signal.SIGKILL)


def test_an_idle_group_notices_a_dead_rank(moed_server, tiny_qwen3) -> None:
    """kill -9 a rank while the group is idle (no collective would notice until work came):
    its heartbeat stops, its watcher (the rank before it) fails the group and says so in the
    store, and every survivor exits 1 within about the collective timeout."""
    timeout_s = 3.0
    ranks = _colocated_group(moed_server, tiny_qwen3, 3, timeout_s)
    status, body = complete(ranks[0], "hello", 4)
    assert status == 200, body
    time.sleep(1.5)                                   # every rank idle, beating
    killed = time.monotonic()
    ranks[2].proc.send_signal(signal.SIGKILL)
    for srv in ranks[:2]:
        assert srv.proc.wait(timeout_s + 15) == 1, srv.tail()
    assert time.monotonic() - killed <= timeout_s + 10
    reasons = [[r.get("reason", "") for r in srv.log_records() if r.get("event") == "ep_group_failed"]
               for srv in ranks[:2]]
    assert any("rank 2 silent" in r for r in reasons[1]), reasons     # its watcher
    assert any("rank 2 silent" in r for r in reasons[0]), reasons     # told through the store
