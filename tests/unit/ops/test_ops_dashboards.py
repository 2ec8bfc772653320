"""The Grafana dashboard and the Prometheus alert rules parse, and every moed_* / process_*
series they query is one that moed/obs/metrics.py exports (a renamed metric breaks this test)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import yaml

from moed.obs import metrics

ROOT = Path(__file__).resolve().parents[3]
SERIES = re.compile(r"\b((?:moed|process)_[a-z0-9_]+)")
# no _created: moed turns those series off (moed/obs/metrics.py)
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("_sum", "_count"), "info": ("_info",), "gauge": ("",)}


def exported_series() -> set[str]:
    names = set()
    for family in metrics.REGISTRY.collect():
        names |= {family.name + s for s in _SUFFIXES.get(family.type, ("",))}
    return names


def _exprs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "query", "definition") and isinstance(v, str):
                yield v
            else:
                yield from _exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _exprs(v)


def _balanced(expr: str) -> bool:
    depth = 0
    for ch in re.sub(r'"[^"]*"', "", expr):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def _check(exprs: list[str]) -> set[str]:
    assert exprs
    known = exported_series()
    used = set()
    for e in exprs:
        assert _balanced(e), e
        used |= set(SERIES.findall(e))
    missing = used - known
    assert not missing, f"not exported by moed/obs/metrics.py: {sorted(missing)}"
    return used


def test_dashboard_queries_exported_metrics() -> None:
    dash = json.loads((ROOT / "conf/grafana-dashboard.json").read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    used = _check(list(_exprs(dash)))
    # The areas the issue asks for are all on it.
    for must in ("moed_time_to_first_token_seconds_bucket", "moed_inter_token_latency_seconds_bucket",
                 "moed_generation_tokens_total", "moed_batch_size_sum", "moed_kv_blocks_used",
                 "moed_request_queue_time_seconds_bucket",
                 "moed_request_prefill_time_seconds_bucket",
                 "moed_request_decode_time_seconds_bucket", "moed_preemptions_total",
                 "moed_kv_cache_usage_ratio"):
        assert must in used, must


def test_alert_rules_are_valid_and_query_exported_metrics() -> None:
    doc = yaml.safe_load((ROOT / "conf/alerts.yml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, r
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"]
        if "for" in r:
            assert re.fullmatch(r"\d+[smh]", r["for"])
    _check([r["expr"] for r in rules])
