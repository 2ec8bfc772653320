"""Every role's real /metrics against promtool: `promtool check metrics` passes, each role
exports exactly its areas of moed/obs/metrics.py (no router gauge on an engine node, no engine
metrics on a router, ...), `promtool test rules conf/alerts_test.yml` passes, and the real
scrapes of four healthy idle nodes, held for an hour, fire no alert.

Nodes: colocated (one request served, no cluster), router + prefill + decode joined in one
cluster through the router's gossip port (the router's backend is the decode node; the decode
node's static prefill peer points nowhere). CI installs promtool (.ci/run); elsewhere these
tests skip when it is not on PATH."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from moed.obs import metrics
from moed_server import CLUSTER_KEY, parse_metrics, serve_process, free_port

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not on PATH (CI installs it: .ci/run; locally: the "
                             "`prometheus` Debian package ships /usr/bin/promtool)")

ENV = {"MOED_ENGINE_KV_CACHE_MEMORY_MB": "16", "MOED_MODEL_MAX_MODEL_LEN": "256",
       "MOED_MODEL_SERVED_NAME": "tiny"}
ROLES = ("colocated", "prefill", "decode", "router")


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def scrapes(tiny_qwen3, tmp_path_factory) -> dict[str, str]:
    """role -> the text of its GET /metrics."""
    logs = tmp_path_factory.mktemp("promtool-nodes")
    gossip = free_port()
    cluster = {"MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_SEEDS": f"127.0.0.1:{gossip}",
               "MOED_CLUSTER_KEY_ENV": "TEST_MOED_CLUSTER_KEY",
               "TEST_MOED_CLUSTER_KEY": CLUSTER_KEY}
    out: dict[str, str] = {}
    with serve_process(model=tiny_qwen3, env=ENV, log_dir=logs) as c:
        body = json.dumps({"model": "tiny", "prompt": "def main():", "max_tokens": 4}).encode()
        req = urllib.request.Request(c.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        out["colocated"] = c.get("/metrics")[1]
    with serve_process(role="router", env={**cluster, "MOED_CLUSTER_BIND_PORT": str(gossip)},
                       log_dir=logs) as r, \
            serve_process(model=tiny_qwen3, role="prefill", log_dir=logs, env={
                **ENV, **cluster, "MOED_CLUSTER_BIND_PORT": str(free_port())}) as p, \
            serve_process(model=tiny_qwen3, role="decode", log_dir=logs,
                          env={**ENV, **cluster, "MOED_CLUSTER_BIND_PORT": str(free_port()),
                               "MOED_TRANSFER_PREFILL_PEERS": "http://127.0.0.1:9"}) as d:
        assert _wait(lambda: r.metrics().get("moed_router_backends", 0) >= 1, 30), r.tail()
        assert _wait(lambda: all(n.metrics().get('moed_cluster_members{state="alive"}') == 3
                                 for n in (r, p, d)), 30)
        out.update(router=r.get("/metrics")[1], prefill=p.get("/metrics")[1],
                   decode=d.get("/metrics")[1])
    return out


def _families(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def _exposed(family) -> str:
    """The name a family's `# TYPE` line carries (prometheus_client appends these)."""
    return family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")


def _declared(role: str, cluster: bool) -> set[str]:
    return {_exposed(f) for area in metrics.areas(role, cluster=cluster) for f in area.collect()}


@pytest.mark.parametrize("role", ROLES)
def test_scrape_passes_promtool_check_metrics(scrapes, role) -> None:
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=scrapes[role], text=True,
                       capture_output=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), \
        f"{role}: {r.stdout}{r.stderr}"
    assert "_created" not in scrapes[role]


@pytest.mark.parametrize("role", ROLES)
def test_role_exports_exactly_its_areas(scrapes, role) -> None:
    got = {f for f in _families(scrapes[role]) if f.startswith("moed_")}
    want = {f for f in _declared(role, cluster=role != "colocated") if f.startswith("moed_")}
    assert got == want, f"{role}: extra {sorted(got - want)}, missing {sorted(want - got)}"
    engine, transfer = "moed_kv_blocks_used" in got, "moed_transfer_jobs_total" in got
    assert engine == (role != "router")
    assert transfer == (role in ("prefill", "decode"))
    assert ("moed_router_backends" in got) == (role == "router")
    assert ("moed_cluster_members" in got) == (role != "colocated")


def test_colocated_request_metrics_carry_the_model_name(scrapes) -> None:
    m = parse_metrics(scrapes["colocated"])
    assert m['moed_requests_finished_total{finish_reason="length",model_name="tiny"}'] == 1
    assert m['moed_request_generation_tokens_sum{model_name="tiny"}'] == 4
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens"):
        assert m[f'moed_{name}_count{{model_name="tiny"}}'] == 1, name
    assert m["moed_preemptions_total"] == 0


def test_alert_rules_unit_tests_pass() -> None:
    r = subprocess.run([PROMTOOL, "test", "rules", "conf/alerts_test.yml"], cwd=ROOT, text=True,
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _input_series(text: str, instance: str) -> list[dict[str, str]]:
    """A scrape as promtool input series: every sample held for an hour, one per minute."""
    series = [{"series": f'up{{job="moed", instance="{instance}"}}', "values": "1x60"}]
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        v = float(value)
        if not math.isfinite(v):
            continue
        name, _, labels = name_labels.partition("{")
        labels = labels.rstrip("}")
        extra = f'job="moed",instance="{instance}"'
        series.append({"series": f"{name}{{{labels + ',' if labels else ''}{extra}}}",
                       "values": f"{v!r}x60"})
    return series


def test_real_scrapes_of_healthy_nodes_fire_no_alert(scrapes, tmp_path) -> None:
    alerts = yaml.safe_load((ROOT / "conf/alerts.yml").read_text())
    names = [r["alert"] for g in alerts["groups"] for r in g["rules"]]
    shutil.copy(ROOT / "conf/alerts.yml", tmp_path / "alerts.yml")
    tests = []
    for role in ROLES:
        tests.append({"name": f"real {role} scrape", "interval": "1m",
                      "input_series": _input_series(scrapes[role], f"{role}:8000"),
                      "alert_rule_test": [{"eval_time": t, "alertname": a}
                                          for a in names for t in ("20m", "60m")]})
    (tmp_path / "t.yml").write_text(yaml.safe_dump(
        {"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": tests}))
    r = subprocess.run([PROMTOOL, "test", "rules", "t.yml"], cwd=tmp_path, text=True,
                       capture_output=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
