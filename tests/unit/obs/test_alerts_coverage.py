"""conf/alerts_test.yml covers conf/alerts.yml: every alert has a case where it fires and is
checked silent on the healthy nodes of all four roles, and every input series is one its
instance's role really exports (so a healthy fixture cannot hide a role-leak like a router
gauge on an engine node). promtool runs the file in tests/integration/test_metrics_promtool.py."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from moed.obs import metrics

ROOT = Path(__file__).resolve().parents[3]
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "info": ("_info",), "gauge": ("",)}


def _load() -> tuple[list[str], list[dict]]:
    alerts = yaml.safe_load((ROOT / "conf/alerts.yml").read_text())
    tests = yaml.safe_load((ROOT / "conf/alerts_test.yml").read_text())
    assert tests["rule_files"] == ["alerts.yml"]
    return [r["alert"] for g in alerts["groups"] for r in g["rules"]], tests["tests"]


def _series_names(role: str) -> set[str]:
    out = {"up"}
    for area in metrics.areas(role, cluster=True):
        for f in area.collect():
            out |= {f.name + s for s in _SUFFIXES.get(f.type, ("",))}
    return out


def _parse(series: str) -> tuple[str, dict[str, str]]:
    name, _, rest = series.partition("{")
    return name, dict(re.findall(r'(\w+)="([^"]*)"', rest))


def test_every_alert_fires_somewhere_and_stays_silent_on_healthy_nodes() -> None:
    names, tests = _load()
    fires = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c.get("exp_alerts")}
    assert set(names) == fires, f"no firing case: {sorted(set(names) - fires)}"
    healthy = next(t for t in tests if t["name"].startswith("healthy"))
    silent = {c["alertname"] for c in healthy["alert_rule_test"] if not c.get("exp_alerts")}
    assert set(names) <= silent, f"not checked on healthy nodes: {sorted(set(names) - silent)}"
    roles = {_parse(s["series"])[1]["role"] for s in healthy["input_series"]
             if s["series"].startswith("moed_node_info")}
    assert roles == {"colocated", "prefill", "decode", "router"}


def test_input_series_are_ones_their_role_exports() -> None:
    _, tests = _load()
    healthy = next(t for t in tests if t["name"].startswith("healthy"))
    role_of = {}
    for s in healthy["input_series"]:
        name, labels = _parse(s["series"])
        if name == "moed_node_info":
            role_of[labels["instance"]] = labels["role"]
    for t in tests:
        for s in t["input_series"]:
            name, labels = _parse(s["series"])
            role = role_of[labels["instance"]]
            assert name in _series_names(role), f"{t['name']}: {role} does not export {name}"
