"""GET /cluster on a real colocated node with cluster.enabled off (the default a newcomer runs):
once ready, the one-node view in membership's shape, which `moed plan` reads; without the
admin token a 401 that names it (never 503 "Node is starting." on a ready node)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from moed_server import ADMIN_TOKEN, ROOT

pytestmark = pytest.mark.timeout(180)


def test_a_lone_colocated_node_answers_cluster(moed_server, tiny_qwen3: Path,
                                                tmp_path: Path) -> None:
    srv = moed_server(model=tiny_qwen3, role="colocated", args=["--node-name", "solo-1"])
    status, text = srv.get("/cluster")                   # the harness's admin token
    assert status == 200, text
    view = json.loads(text)
    assert view["self"] == "solo-1" and view["counts"]["alive"] == 1
    [me] = view["members"]
    assert (me["name"], me["state"], me["role"], me["http"]) == (
        "solo-1", "alive", "colocated", srv.url)
    assert me["model"] == tiny_qwen3.name and me["load"]["free_kv_blocks"] > 0

    status, text = srv.get("/cluster", headers={})        # no credential
    err = json.loads(text)["error"]
    assert status == 401 and err["code"] == "missing_admin_token"
    assert "takes the admin token" in err["message"] and ADMIN_TOKEN not in text
    status, _ = srv.get("/cluster", headers={"Authorization": "Bearer nope"})
    assert status == 401

    # the operator's planner reads a lone node as it reads a cluster
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "moed", "plan", "--url", srv.url,
                        "--token-file", str(token)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "colocated 1 -> 1" in r.stdout + r.stderr


def test_a_router_with_static_backends_answers_cluster_too(moed_server) -> None:
    srv = moed_server(role="router", args=["--node-name", "r-solo"])
    status, text = srv.get("/cluster")
    assert status == 200, text
    [me] = json.loads(text)["members"]
    assert (me["name"], me["state"], me["role"]) == ("r-solo", "alive", "router")
    assert me["load"]["running"] == 0 and me["layout"] == ""      # no engine, no KV
