"""Issue acceptance 1 with real processes: `moed serve --role router` nodes on 127.0.0.1
joined through one seed over real UDP (HMAC key from the environment). Times are printed
(pytest -s); deadlines are generous so a loaded CI box does not flake."""
from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import time

from moed_server import ServerProcess, _wait_ready, free_port

KEY_ENV = "CLUSTER_KEY_HEX"


def _env(gossip_port: int, seed_port: int, key: str) -> dict[str, str]:
    return {"MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_BIND_PORT": str(gossip_port),
            "MOED_CLUSTER_SEEDS": f"127.0.0.1:{seed_port}", "MOED_CLUSTER_KEY_ENV": KEY_ENV,
            KEY_ENV: key}


def _cluster(srv: ServerProcess) -> dict[str, dict]:
    status, body = srv.get("/cluster", timeout=2.0)
    assert status == 200, body
    return {m["name"]: m for m in json.loads(body)["members"]}


def _wait(cond, timeout: float, poll: float = 0.05) -> float | None:
    """Seconds until cond() held, or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if cond():
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(poll)
    return None


def _sees(observers, name: str, state: str) -> bool:
    return all(_cluster(o).get(name, {}).get("state") == state for o in observers)


def test_real_nodes_join_detect_crash_leave_and_restart(moed_server) -> None:
    key = os.urandom(32).hex()
    gossip = [free_port() for _ in range(4)]
    names = [f"node{i}" for i in range(4)]

    def start(i: int, wait: str | None = "ready") -> ServerProcess:
        return moed_server(role="router", args=["--node-name", names[i]],
                           env=_env(gossip[i], gossip[0], key), ready_timeout=30, wait=wait)

    nodes = [start(i, wait=None) for i in range(4)]     # the four start at once
    for n in nodes:
        _wait_ready(n, "/ready", time.monotonic() + 30, started=True)
    joined = _wait(lambda: all(sum(m["state"] == "alive" for m in _cluster(n).values()) == 4
                               for n in nodes), 15.0)
    assert joined is not None, [_cluster(n) for n in nodes]
    print(f"\n4 nodes: every /cluster shows all alive {joined:.2f} s after the last was ready")
    view = _cluster(nodes[1])
    assert view["node3"]["role"] == "router"
    assert view["node3"]["http"] == nodes[3].url

    # kill -9, measured from the kill to every survivor showing it dead; then restart it
    detect = []
    for victim in (3, 2, 3):
        survivors = [n for i, n in enumerate(nodes) if i != victim]
        inc = _cluster(survivors[0])[names[victim]]["incarnation"]
        nodes[victim].proc.send_signal(signal.SIGKILL)
        nodes[victim].proc.wait(5)
        t = _wait(lambda: _sees(survivors, names[victim], "dead"), 20.0)
        assert t is not None, f"{names[victim]} not marked dead"
        detect.append(t)
        nodes[victim] = start(victim)
        back = _wait(lambda: _sees(survivors, names[victim], "alive") and
                     _cluster(survivors[0])[names[victim]]["incarnation"] > inc, 15.0)
        assert back is not None, f"{names[victim]} did not come back with a higher incarnation"
    print(f"kill -9 → dead on every survivor after {[round(t, 2) for t in detect]} s, "
          f"median {statistics.median(detect):.2f} s")

    # graceful stop: peers mark it left at once (no suspicion)
    leaver = nodes[1]
    leaver.send_signal(signal.SIGTERM)
    t_left = _wait(lambda: _sees([nodes[0], nodes[2], nodes[3]], "node1", "left"), 10.0)
    assert t_left is not None
    print(f"graceful stop → left on every peer after {t_left:.2f} s")
    assert leaver.proc.wait(15) == 0

    # gauges are synced once a second
    assert _wait(lambda: nodes[0].metrics().get('moed_cluster_members{state="left"}') == 1,
                 10.0) is not None
    metrics = nodes[0].metrics()
    assert metrics['moed_cluster_messages_total{direction="received",kind="packet"}'] > 0

    # bad packets at a real node: dropped and counted, the node keeps serving
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for data in (os.urandom(64), b"\x01" + os.urandom(100), os.urandom(5000), b"\x01"):
            s.sendto(data, ("127.0.0.1", gossip[0]))
    dropped = lambda r: nodes[0].metrics().get(f'moed_cluster_dropped_total{{reason="{r}"}}', 0)  # noqa: E731
    assert _wait(lambda: dropped("auth") >= 1 and dropped("oversized") >= 1 and
                 dropped("truncated") >= 1, 10.0) is not None
    assert _sees([nodes[2], nodes[3]], "node0", "alive")
    records = nodes[0].log_records()
    assert any(r.get("event") == "member_state" and r.get("member") == "node1" and
               r.get("new") == "left" for r in records)


def test_node_without_key_refuses_to_start(moed_server) -> None:
    srv = moed_server(role="router", env={"MOED_CLUSTER_ENABLED": "true",
                                          "MOED_CLUSTER_BIND_PORT": str(free_port())},
                      wait=None)
    assert srv.proc.wait(30) == 2
    assert "no cluster key" in srv.logs()
