"""moed.dev.cluster's planning: ports, arguments and environment of the five nodes (no processes)."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from moed.dev import cluster as devcluster
from moed.dev.cluster import RoleFile, alive_urls, child_env, plan, read_role_file

ROOT = Path(__file__).resolve().parents[3]
MODEL = Path("/models/demo-model")


def _files() -> dict[str, RoleFile]:
    return {role: read_role_file(ROOT / "conf" / f"{role}.toml") for role, _ in devcluster.LAYOUT}


def test_shipped_files_give_the_guides_table() -> None:
    """docs/cluster.md's table: router 8000/7946, prefill 8100+8101 / 7947+7948, decode
    8200+8201 / 7949+7950; every node seeds from the router, prefill-1 and decode-1."""
    nodes = plan(_files(), MODEL, python="py")
    assert [(n.name, n.role, n.http_port, n.gossip_port) for n in nodes] == [
        ("router", "router", 8000, 7946),
        ("prefill-1", "prefill", 8100, 7947), ("prefill-2", "prefill", 8101, 7948),
        ("decode-1", "decode", 8200, 7949), ("decode-2", "decode", 8201, 7950)]
    seeds = {f"127.0.0.1:{n.gossip_port}" for n in nodes if n.name in ("router", "prefill-1",
                                                                       "decode-1")}
    assert all(set(f.seeds) == seeds for f in _files().values())


def test_first_node_of_each_role_runs_its_file_as_shipped() -> None:
    by_name = {n.name: n for n in plan(_files(), MODEL, python="py")}
    assert by_name["router"].argv == ("py", "-m", "moed", "serve", "--config",
                                      str(ROOT / "conf/router.toml"))
    assert by_name["router"].env == {}
    for name in ("prefill-1", "decode-1"):
        n = by_name[name]
        assert n.argv[-2:] == ("--model", str(MODEL)) and n.env == {}
    p2 = by_name["prefill-2"]
    assert p2.argv[-2:] == ("--port", "8101") and p2.env == {"MOED_CLUSTER_BIND_PORT": "7948"}
    d2 = by_name["decode-2"]
    assert d2.argv[-2:] == ("--port", "8201") and d2.env == {"MOED_CLUSTER_BIND_PORT": "7950"}
    assert d2.url == "http://127.0.0.1:8201"


def test_offset_moves_every_port_and_the_seeds() -> None:
    nodes = plan(_files(), MODEL, offset=1000, python="py")
    assert [n.http_port for n in nodes] == [9000, 9100, 9101, 9200, 9201]
    assert [n.gossip_port for n in nodes] == [8946, 8947, 8948, 8949, 8950]
    for n in nodes:
        assert n.argv[n.argv.index("--port") + 1] == str(n.http_port)
        assert n.env["MOED_CLUSTER_BIND_PORT"] == str(n.gossip_port)
        assert n.env["MOED_CLUSTER_SEEDS"] == "127.0.0.1:8946,127.0.0.1:8947,127.0.0.1:8949"


def test_clashing_or_impossible_ports_are_refused() -> None:
    files = _files()
    files["decode"] = RoleFile(files["decode"].path, 8101, 7960, files["decode"].seeds)
    with pytest.raises(ValueError, match="clash"):
        plan(files, MODEL)                        # decode-1 on prefill-2's HTTP port
    with pytest.raises(ValueError, match="out of range"):
        plan(_files(), MODEL, offset=60000)


def test_child_env_drops_config_overrides_and_shares_threads() -> None:
    env = child_env({"PATH": "/bin", "MOED_SERVER_PORT": "1", "MOED_CLUSTER_SEEDS": "x:1",
                     "MOED_CPU_KERNELS": "0", "MOED_KERNEL_CACHE": "/c"}, threads=2)
    assert env == {"PATH": "/bin", "MOED_CPU_KERNELS": "0", "MOED_KERNEL_CACHE": "/c",
                   "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
    assert child_env({"OMP_NUM_THREADS": "8"}, threads=1)["OMP_NUM_THREADS"] == "8"
    assert [devcluster.default_threads(c) for c in (None, 1, 2, 8, 64)] == [1, 1, 1, 2, 16]


def test_alive_urls_reads_a_cluster_answer() -> None:
    answer = {"members": [{"http": "http://127.0.0.1:8000", "state": "alive"},
                          {"http": "http://127.0.0.1:8201", "state": "left"},
                          {"http": "http://127.0.0.1:8200", "state": "suspect"}]}
    assert alive_urls(answer) == {"http://127.0.0.1:8000"}
    assert alive_urls({}) == set()


def test_busy_ports_names_the_node() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
        node = devcluster.NodePlan("decode-2", "decode", taken, taken, (), {})
        # the gossip port (the same one here) is busy too: each port is named once per use
        assert devcluster.busy_ports([node]) == [f"127.0.0.1:{taken} (decode-2)"] * 2


def test_secrets_land_where_the_shipped_files_point(tmp_path: Path) -> None:
    token = devcluster.write_secrets(tmp_path)
    files = _files()
    cfgs = [devcluster.load(f.path, environ={}) for f in files.values()]
    assert {(c.cluster.key_file, c.server.admin_token_file) for c in cfgs} == {
        devcluster.SECRETS}
    assert (tmp_path / "run/admin-token").read_text() == token + "\n"
    key = (tmp_path / "run/cluster.key").read_text().strip()
    assert len(bytes.fromhex(key)) == 32
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "run/cluster.key").stat().st_mode & 0o777 == 0o600


def test_busy_ports_ignores_time_wait_but_not_a_listener() -> None:
    """Right after a cluster stops, its ports sit in TIME_WAIT for ~60 s; the nodes bind with
    SO_REUSEADDR (asyncio's default), so such a port is free for them and must read free."""
    with socket.socket() as lsn:
        lsn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as a node's listener
        lsn.bind(("127.0.0.1", 0))
        lsn.listen()
        port = lsn.getsockname()[1]
        node = devcluster.NodePlan("router", "router", port, port, (), {})
        assert devcluster.busy_ports([node]) == [f"127.0.0.1:{port} (router)"] * 2
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        served, _ = lsn.accept()
        served.close()           # the server side closes first: TIME_WAIT lands on `port`
        client.recv(1)           # the FIN arrived
        client.close()
    assert _time_wait_on(port), "the test needs a TIME_WAIT connection on the port"
    assert devcluster.busy_ports([node]) == []


def _time_wait_on(port: int) -> bool:
    """Whether the kernel lists a TIME_WAIT socket whose local port is `port` (state 06)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return any(int(r[1].split(":")[1], 16) == port and r[3] == "06" for r in rows)
