"""moed/obs/metrics.py: each role serves only its areas, the exposition follows promtool's
naming rules (the promtool run itself is tests/integration/test_metrics_promtool.py), the
engine's cumulative totals become counters that never go back, the request metrics carry
the served model's name, and docs/metrics.md lists exactly the metrics there are."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from moed.obs import metrics
from moed.types import EngineStats

ROOT = Path(__file__).resolve().parents[3]
ROLES = ("colocated", "prefill", "decode", "router")


def _types(role: str | None, cluster: bool = False) -> dict[str, str]:
    text = metrics.render(role, cluster=cluster)[0].decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def _has(types: dict[str, str], prefix: str) -> bool:
    return any(n.startswith(prefix) for n in types)


@pytest.mark.parametrize("role", ROLES)
def test_a_role_serves_only_its_areas(role: str) -> None:
    t = _types(role)
    assert {"moed_ready", "moed_http_requests_total", "process_cpu_seconds_total"} <= set(t)
    assert ("moed_router_backends" in t) == (role == "router")
    assert _has(t, "moed_kv_") == _has(t, "moed_time_to_first_token") == (role != "router")
    assert _has(t, "moed_transfer_") == (role in ("prefill", "decode"))
    assert not _has(t, "moed_cluster_")
    assert _has(_types(role, cluster=True), "moed_cluster_")


def test_every_metric_is_in_one_area_and_every_area_in_a_role() -> None:
    seen: dict[str, int] = {}
    for area in (metrics.COMMON, metrics.ENGINE, metrics.TRANSFER, metrics.ROUTER,
                 metrics.CLUSTER):
        for f in area.collect():
            seen[f.name] = seen.get(f.name, 0) + 1
    assert seen and all(n == 1 for n in seen.values())
    assert set(seen) == {f.name for f in metrics.REGISTRY.collect()}
    served = {id(a) for areas in metrics.ROLE_AREAS.values() for a in areas}
    assert served | {id(metrics.CLUSTER)} == {id(a) for a in (
        metrics.COMMON, metrics.ENGINE, metrics.TRANSFER, metrics.ROUTER, metrics.CLUSTER)}


def test_exposition_follows_promtools_naming_rules() -> None:
    text = metrics.render()[0].decode()
    assert "_created" not in text
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    for name, kind in _types(None, cluster=True).items():
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        assert helps.get(name, "").strip(), f"{name}: no help"
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), f"{name}: a {kind} ending in _total"
        if kind != "histogram":
            assert not name.endswith(("_bucket", "_count", "_sum")), name


def _sample(name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_engine_totals_become_counters_that_never_go_back() -> None:
    names = ("moed_prefix_cache_queried_tokens_total", "moed_prefix_cache_hit_tokens_total",
             "moed_preemptions_total")

    def feed(q: int, h: int, p: int) -> list[float]:
        metrics.observe_engine_stats(EngineStats(
            prefix_cache_queries=q, prefix_cache_hits=h, kv_blocks_total=10, kv_blocks_used=4,
            kv_blocks_free=6, extra={"preemptions": float(p)}), cache_batch=1)
        return [_sample(n) for n in names]

    base = feed(10**9, 10**8, 10**6)           # past whatever earlier tests left
    assert feed(10**9, 10**8, 10**6) == base   # a scrape with no news adds nothing
    now = feed(10**9 + 50, 10**8 + 20, 10**6 + 3)
    assert [a - b for a, b in zip(now, base)] == [50, 20, 3]
    after_restart = feed(7, 2, 1)              # a new engine starts from zero: count it all
    assert [a - b for a, b in zip(after_restart, now)] == [7, 2, 1]
    assert _sample("moed_kv_blocks_capacity") == 10
    assert _sample("moed_kv_cache_usage_ratio") == pytest.approx(0.4)


def test_cache_counters_move_only_in_batches_of_requests() -> None:
    """A prompt's prefix hit (and its tier loads) is not observable alone: the counters move
    once 4 more requests (cache_batch) have looked up the cache, by their sum."""
    names = ("moed_prefix_cache_hit_tokens_total", "moed_kv_tier_loaded_blocks_total")

    def feed(requests: int, hits: int) -> list[float]:
        tiers = {f"tier_host_{k}": 0.0 for k in ("capacity_bytes", "used_bytes", "blocks",
                                                 "bandwidth_bytes_per_s", "hits", "misses",
                                                 "load_bytes", "corrupt", "write_errors",
                                                 "ignored", "read_timeouts")}
        metrics.observe_engine_stats(EngineStats(
            prefix_cache_queries=10 * requests, prefix_cache_hits=hits,
            extra={"prefix_cache_requests": float(requests), **tiers,
                   "tier_host_loads": float(hits)}), cache_batch=4)
        return [_sample(n, {"tier": "host"} if "tier" in n else None) for n in names]

    feed(0, 0)                          # an engine from zero: releases nothing yet
    base = feed(4, 0)
    for r, h in ((5, 16), (6, 16), (7, 16)):    # a hit of 16 tokens, then 2 more requests
        assert feed(r, h) == base, r
    assert [a - b for a, b in zip(feed(8, 16), base)] == [16, 16]


def test_request_metrics_carry_the_served_model_name() -> None:
    metrics.set_model_name("unit-model")
    try:
        m = metrics.request_series()
        assert metrics.request_series() is m
        m.ttft.observe(0.2)
        m.finished("stop").inc()
        m.queue_time.observe(0.001)
        assert _sample("moed_time_to_first_token_seconds_count", {"model_name": "unit-model"}) == 1
        assert _sample("moed_requests_finished_total",
                       {"model_name": "unit-model", "finish_reason": "stop"}) == 1
        assert _sample("moed_request_queue_time_seconds_bucket",
                       {"model_name": "unit-model", "le": "0.001"}) == 1
    finally:
        metrics.set_model_name("")
    assert metrics.request_series().model_name == ""


def test_docs_list_exactly_the_exported_metrics() -> None:
    doc = (ROOT / "docs/metrics.md").read_text()
    renamed = doc[doc.index("## Renamed metrics"):doc.index("## From vLLM")]
    old = set(re.findall(r"^\| `(moed_[a-z0-9_]+)`", renamed, re.M))   # names before renames
    exposed = set(_types(None, cluster=True))
    moed = {n for n in exposed if n.startswith("moed_")}
    tables = set(re.findall(r"^\| `(moed_[a-z0-9_]+)`", doc.replace(renamed, ""), re.M))
    assert tables == moed, f"undocumented {sorted(moed - tables)}, stale {sorted(tables - moed)}"
    assert old and not old & exposed
    # every other moed_ name the page mentions exists (histogram suffixes allowed)
    for name in set(re.findall(r"\bmoed_[a-z0-9_]+", doc.replace(renamed, ""))):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in exposed or base in exposed, name


def test_decode_step_histogram_counts_decode_only_steps() -> None:
    from moed.app import _observe_step
    from moed.engine.stream import StepStats

    def step(prefill: int, decode: int, seconds: float) -> StepStats:
        return StepStats(step=1, batch_size=1, num_prefill_tokens=prefill, num_decode_tokens=decode,
                         num_sampled=1, num_finished=0, num_preempted=0, step_seconds=seconds,
                         forward_seconds=seconds, running=1, waiting=0, kv_blocks_used=1, kv_blocks_free=9)

    before = (_sample("moed_decode_step_seconds_count"), _sample("moed_decode_step_seconds_sum"),
              _sample("moed_step_seconds_count"))
    for s in (step(0, 4, 0.01), step(128, 3, 0.5), step(128, 0, 0.4), step(0, 2, 0.03)):
        _observe_step(s)
    assert _sample("moed_decode_step_seconds_count") - before[0] == 2        # mixed + prefill left out
    assert _sample("moed_decode_step_seconds_sum") - before[1] == pytest.approx(0.04)
    assert _sample("moed_step_seconds_count") - before[2] == 4
