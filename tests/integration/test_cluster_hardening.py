"""Gossip hardening with real `moed serve --role router` processes on 127.0.0.1:
- push-pull streams without credentials cannot make a node buffer what they announce
  (32 connections each announcing 8 MB: RSS growth stays small, the node keeps serving and
  gossiping with a legit peer);
- a second process with a live member's node name refuses to join and exits non-zero, and
  the holder keeps its entry.
Figures are printed (pytest -s); every wait is bounded."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from moed_server import ServerProcess, free_port

from moed.cluster import wire

pytestmark = pytest.mark.timeout(120)

KEY_ENV, ADMIN_ENV, ADMIN = "CLUSTER_KEY_HEX", "ADMIN_TOKEN", "hardening-admin-token"
MB = 1024 * 1024


def _env(gossip_port: int, key: str, seed_port: int | None = None) -> dict[str, str]:
    env = {"MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_BIND_PORT": str(gossip_port),
           "MOED_CLUSTER_KEY_ENV": KEY_ENV, KEY_ENV: key,
           "MOED_CLUSTER_PUSH_PULL_INTERVAL_MS": "500",
           "MOED_SERVER_ADMIN_TOKEN_ENV": ADMIN_ENV, ADMIN_ENV: ADMIN}
    if seed_port is not None:
        env["MOED_CLUSTER_SEEDS"] = f"127.0.0.1:{seed_port}"
    return env


def _wait(cond, timeout: float, what: str, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def _members(srv: ServerProcess) -> list[tuple]:
    status, body = srv.get("/cluster", timeout=2.0, headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 200, body
    return [(m["name"], m["state"], m["addr"], m["incarnation"])
            for m in json.loads(body)["members"]]


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _flood(port: int, conns: int, announce: int, seconds: float) -> int:
    """`conns` connections, each opening with a header that announces `announce` bytes
    (no valid MAC: a made-up one, or none at all as in the old 4-byte framing), then
    sending as much of that as the socket takes. Returns the bytes the node accepted."""
    heads = [wire.frame_header(wire.Keyring(os.urandom(32)), announce, int(time.time() * 1000)),
             wire.frame_header(wire.Keyring(os.urandom(32)), wire.MAX_STREAM,
                               int(time.time() * 1000)),
             announce.to_bytes(4, "big")]
    socks, left = [], {}
    for i in range(conns):
        s = socket.create_connection(("127.0.0.1", port), timeout=2.0)
        s.sendall(heads[i % len(heads)])
        s.setblocking(False)
        socks.append(s)
        left[s] = announce
    chunk, sent = bytes(256 * 1024), 0
    deadline = time.monotonic() + seconds
    while left and time.monotonic() < deadline:
        for s in list(left):
            try:
                n = s.send(chunk[:left[s]])
            except BlockingIOError:
                continue
            except OSError:                     # the node closed it: refused
                del left[s]
                continue
            sent += n
            left[s] -= n
            if not left[s]:
                del left[s]
        time.sleep(0.005)
    for s in socks:
        s.close()
    return sent


def test_unauthenticated_streams_cannot_grow_memory(moed_server) -> None:
    key = os.urandom(32).hex()
    g_a, g_b = free_port(), free_port()
    a = moed_server(role="router", args=["--node-name", "flooded"], env=_env(g_a, key),
                    ready_timeout=30)
    b = moed_server(role="router", args=["--node-name", "peer"], env=_env(g_b, key, g_a),
                    ready_timeout=30)
    _wait(lambda: a.metrics().get('moed_cluster_members{state="alive"}') == 2, 15,
          "the peer to join")
    streams = 'moed_cluster_messages_total{direction="received",kind="stream"}'
    time.sleep(1.0)                                     # settle after start and join
    pid = a.proc.pid
    with open(f"/proc/{pid}/clear_refs", "w") as f:     # reset VmHWM: the peak from now on
        f.write("5")
    before = _kib(pid, "VmRSS")
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _kib(pid, "VmRSS"))
            time.sleep(0.02)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        accepted = _flood(g_a, 32, 8 * MB, seconds=5.0)
        time.sleep(1.0)
    finally:
        stop.set()
        sampler.join(5)
    after, hwm = _kib(pid, "VmRSS"), _kib(pid, "VmHWM")
    growth = max(peak[0], hwm, after) - before
    print(f"\n32 connections announcing 8 MB each ({accepted / MB:.1f} MB taken by the "
          f"sockets): RSS {before / 1024:.1f} MB before, peak {max(peak[0], hwm) / 1024:.1f} MB, "
          f"{after / 1024:.1f} MB after: growth {growth / 1024:.1f} MB")
    assert growth < 20 * 1024, f"RSS grew by {growth} KiB"

    assert a.get("/health")[0] == 200
    def refused() -> dict[str, float]:
        m = a.metrics()
        return {e: m.get(f'moed_cluster_protocol_events_total{{event="{e}"}}', 0)
                for e in ("stream_auth", "stream_oversized", "stream_version", "stream_busy")}
    _wait(lambda: sum(refused().values()) >= 32, 10, "the refused streams to be counted")
    counts = refused()
    assert sum(counts.values()) == 32 and all(counts[e] >= 1 for e in list(counts)[:3]), counts
    print(f"refused streams: {counts}")
    # the legit peer's push-pulls (every 500 ms) still get through, and it is still alive
    received = a.metrics().get(streams, 0)
    _wait(lambda: a.metrics().get(streams, 0) >= received + 2, 10, "push-pull with the peer")
    assert ("peer", "alive") in [m[:2] for m in _members(a)]
    assert ("flooded", "alive") in [m[:2] for m in _members(b)]


def test_a_duplicate_node_name_refuses_to_join(moed_server) -> None:
    key = os.urandom(32).hex()
    g_a, g_b = free_port(), free_port()
    holder = moed_server(role="router", args=["--node-name", "dup"], env=_env(g_a, key),
                         ready_timeout=30)
    view = _members(holder)
    assert view == [("dup", "alive", f"127.0.0.1:{g_a}", view[0][3])]
    dup = moed_server(role="router", args=["--node-name", "dup"], env=_env(g_b, key, g_a),
                      wait=None)
    code = dup.proc.wait(30)
    assert code != 0, dup.tail()
    taken = [r for r in dup.log_records() if r.get("event") == "cluster_name_taken"]
    assert taken and taken[0]["holder"] == f"127.0.0.1:{g_a}", dup.tail()
    assert any(r.get("event") == "start_failed" for r in dup.log_records())
    print(f"\nduplicate exited {code}: {taken[0]}")

    assert holder.get("/health")[0] == 200
    assert _members(holder) == view                    # same address, same incarnation
    conflicts = [r for r in holder.log_records() if r.get("event") == "cluster_name_conflict"]
    assert conflicts and conflicts[0]["intruder"] == f"127.0.0.1:{g_b}"
    assert conflicts[0]["addr"] == f"127.0.0.1:{g_a}"
