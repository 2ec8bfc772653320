"""Canary routing (moed/balance/canary.py): the side a request takes, the fallback and the pin,
the per-version window and figures, the verdict; then the router's proxy doing it over real
loopback HTTP (share, header pin, per-attempt outcomes of a failing canary, per-version
metrics)."""
from __future__ import annotations

import asyncio
import json
import math
import random

import aiohttp
import pytest
from aiohttp import web

from moed.api.middleware import request_context
from moed.api.proxy import Proxy
from moed.balance import canary
from moed.balance.canary import Health, Outcome, Side, Thresholds, Window, figures, verdict
from moed.balance.candidate import Candidate
from moed.config import ConfigError, load
from moed.obs import metrics


def test_pin_header_values() -> None:
    assert canary.parse_pin(None) is None
    assert canary.parse_pin("1") is canary.parse_pin(" Canary ") is Side.CANARY
    assert canary.parse_pin("0") is canary.parse_pin("baseline") is Side.BASELINE
    with pytest.raises(ValueError, match="1/canary or 0/baseline"):
        canary.parse_pin("yes please")


def test_share_splits_by_the_draw_and_a_pin_wins() -> None:
    assert canary.choose_side(0.1, 0.05) is Side.CANARY
    assert canary.choose_side(0.1, 0.1) is Side.BASELINE
    assert canary.choose_side(0.0, 0.0) is Side.BASELINE
    assert canary.choose_side(1.0, 0.999) is Side.CANARY
    assert canary.choose_side(0.0, 0.0, Side.CANARY) is Side.CANARY
    rnd = random.Random(7)
    n = sum(canary.choose_side(0.1, rnd.random()) is Side.CANARY for _ in range(10000))
    assert abs(n - 1000) < 4.5 * math.sqrt(10000 * 0.1 * 0.9)


def test_candidates_for_a_side_fall_back_unless_pinned() -> None:
    a, b, c = (Candidate("a", "u", label="v1"), Candidate("b", "u", label="v2"),
               Candidate("c", "u", label=""))
    assert canary.candidates_for([a, b, c], "v2", Side.CANARY, False) == [b]
    assert canary.candidates_for([a, b, c], "v2", Side.BASELINE, False) == [a, c]
    assert canary.candidates_for([a, c], "v2", Side.CANARY, False) == [a, c]   # no canary left
    assert canary.candidates_for([a, c], "v2", Side.CANARY, True) == []        # pinned: none
    assert canary.candidates_for([a, b], "", Side.BASELINE, True) == [a, b]    # no canary set


def test_window_keeps_the_recent_and_is_bounded() -> None:
    w = Window(max_per_version=3)
    for t in range(5):
        w.add("v1", Outcome(float(t), error=t == 4))
    assert [o.at for o in w.recent("v1", now=4.0, window_s=10)] == [2.0, 3.0, 4.0]
    assert [o.at for o in w.recent("v1", now=13.5, window_s=10)] == [4.0]
    assert w.recent("v9", 0.0, 10) == [] and w.labels() == ["v1"]


def test_figures_and_quantiles() -> None:
    assert canary.quantile([], 0.5) is None
    assert canary.quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert canary.quantile([3.0, 1.0, 2.0, 4.0], 0.95) == 4.0
    f = figures([Outcome(0, False, 0.1, 0.01), Outcome(0, False, 0.3, None),
                 Outcome(0, True), Outcome(0, False, 0.2, 0.03)])
    assert (f.requests, f.errors, f.error_rate) == (4, 1, 0.25)
    assert (f.ttft_p50, f.itl_p50, f.itl_p95) == (0.2, 0.01, 0.03)
    assert figures([]) == canary.Figures()


def _fig(n: int, errors: int = 0, ttft: float = 0.1, itl: float = 0.01) -> canary.Figures:
    return figures([Outcome(0, i < errors, None if i < errors else ttft,
                            None if i < errors else itl) for i in range(n)])


def test_verdict_by_thresholds() -> None:
    th = Thresholds(min_requests=10, max_error_rate_increase=0.05, max_ttft_ratio=1.5,
                    max_itl_ratio=2.0)
    assert verdict(_fig(9), _fig(100), th).health is Health.INSUFFICIENT
    assert verdict(_fig(20), _fig(100), th) == canary.Verdict(Health.HEALTHY)
    bad = verdict(_fig(20, errors=2), _fig(100), th)             # 10% > 0% + 5%
    assert bad.health is Health.UNHEALTHY and "error rate 0.100" in bad.reasons[0]
    assert verdict(_fig(20, errors=2), _fig(100, errors=8), th).health is Health.HEALTHY
    slow = verdict(_fig(20, ttft=0.2, itl=0.03), _fig(100), th)  # 2x TTFT, 3x ITL
    assert slow.health is Health.UNHEALTHY and len(slow.reasons) == 2
    assert verdict(_fig(20, ttft=0.15), _fig(100), th).health is Health.HEALTHY   # at the limit
    assert verdict(_fig(20), canary.Figures(), th).health is Health.HEALTHY       # no baseline


def test_canary_config_is_validated() -> None:
    router = {"server": {"role": "router"}, "cluster": {"enabled": True, "insecure": True}}
    cfg = load(environ={}, overrides={**router, "canary": {"label": "v2", "share": 0.1}})
    assert Thresholds.of(cfg.canary) == Thresholds(20, 0.02, 1.5, 1.5)
    for bad, msg in (({"share": 0.1}, "needs canary.label"),
                     ({"label": "v 2"}, "not a version label"),
                     ({"label": "v2", "share": 1.5}, "canary.share"),
                     ({"label": "v2", "header": "X Bad"}, "not a header name")):
        with pytest.raises(ConfigError, match=msg):
            load(environ={}, overrides={**router, "canary": bad})
    with pytest.raises(ConfigError, match="needs membership"):
        load(environ={}, overrides={"server": {"role": "router"}, "canary": {"label": "v2"}})


# ---- the proxy doing it ----------------------------------------------------------------------

class Node:
    """A loopback serving node: streams two chunks, or answers `status` with a JSON error."""

    def __init__(self, name: str, label: str, status: int = 200) -> None:
        self.name, self.label, self.status, self.hits = name, label, status, 0
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self._complete)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.status != 200:
            return web.json_response({"error": {"message": "no prefill"}}, status=self.status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(2):
            await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await asyncio.sleep(0.002)
        await resp.write(b"data: [DONE]\n\n")
        return resp


class Source:
    def __init__(self, cands: list[Candidate]) -> None:
        self.cands = cands

    def backends(self) -> list[Candidate]:
        return list(self.cands)

    def mark_failed(self, name: str) -> None:
        pass


@pytest.fixture
async def routed():
    runners: list[web.AppRunner] = []
    proxies: list[Proxy] = []

    async def serve(app: web.Application) -> str:
        r = web.AppRunner(app, shutdown_timeout=0.5)
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", 0).start()
        runners.append(r)
        return f"http://127.0.0.1:{r.addresses[0][1]}"

    async def make(nodes: list[Node], **canary_cfg):
        cands = [Candidate(n.name, await serve(n.app), "colocated", label=n.label) for n in nodes]
        cfg = load(environ={}, overrides={"server": {"role": "router"},
                                          "cluster": {"enabled": True, "insecure": True},
                                          "canary": canary_cfg})
        proxy = Proxy(Source(cands), lambda: cfg)
        await proxy.start()
        proxies.append(proxy)
        app = web.Application(middlewares=[request_context])
        proxy.add_routes(app)
        return await serve(app), proxy

    yield make
    for p in proxies:
        await p.close()
    for r in runners:
        await r.cleanup()


async def _post(s: aiohttp.ClientSession, url: str, headers: dict | None = None
                ) -> tuple[int, str, str]:
    async with s.post(url + "/v1/completions", json={"prompt": "x"}, headers=headers) as r:
        return r.status, r.headers.get("X-Moed-Version", ""), await r.text()


async def test_router_splits_by_share_and_pins_by_header(routed) -> None:
    base, can = Node("a", "v1"), Node("b", "v2")
    url, proxy = await routed([base, can], label="v2", share=0.25)
    async with aiohttp.ClientSession() as s:
        got = [await _post(s, url) for _ in range(200)]
        assert all(st == 200 for st, _, _ in got)
        n = sum(v == "v2" for _, v, _ in got)
        assert abs(n - 50) < 4.5 * math.sqrt(200 * 0.25 * 0.75), n     # binomial bounds
        assert can.hits == n and base.hits == 200 - n
        assert {(await _post(s, url, {"X-Moed-Canary": "1"}))[1] for _ in range(5)} == {"v2"}
        assert {(await _post(s, url, {"X-Moed-Canary": "0"}))[1] for _ in range(5)} == {"v1"}
        st, _, body = await _post(s, url, {"X-Moed-Canary": "maybe"})
        assert st == 400 and "bad_canary_header" in body
    rep = proxy.canary_report()
    assert rep["canary"]["requests"] == n + 5 and rep["baseline"]["requests"] == 200 - n + 5
    assert rep["canary"]["errors"] == 0 and rep["canary"]["ttft_p50_s"] > 0
    assert rep["canary"]["itl_p50_s"] > 0 and set(rep["versions"]) == {"v1", "v2"}
    assert rep["verdict"]["health"] in ("healthy", "unhealthy")     # latency is noisy here
    scrape = metrics.render("router")[0].decode()
    assert 'moed_router_version_attempts_total{result="ok",version="v2"}' in scrape
    assert 'moed_router_version_ttft_seconds_count{version="v1"}' in scrape
    assert 'moed_router_canary_requests_total{how="header",side="canary"}' in scrape


async def test_a_failing_canary_is_unhealthy_behind_the_retries(routed) -> None:
    base, can = Node("a", "f1"), Node("b", "f2", status=503)
    url, proxy = await routed([base, can], label="f2", share=0.5, min_requests=5,
                              max_ttft_ratio=1000.0, max_itl_ratio=1000.0)
    async with aiohttp.ClientSession() as s:
        got = [await _post(s, url) for _ in range(40)]
        # the client never sees the canary's 503s: the router retried them on the baseline
        assert all(st == 200 and v == "f1" for st, v, _ in got)
        st, _, body = await _post(s, url, {"X-Moed-Canary": "canary"})
        assert st == 503                 # pinned to the canary: nowhere else to go
    rep = proxy.canary_report()
    assert rep["canary"]["errors"] == rep["canary"]["requests"] == can.hits >= 5
    assert rep["verdict"]["health"] == "unhealthy"
    assert "error rate 1.000" in rep["verdict"]["reasons"][0]


async def test_no_canary_node_left_falls_back_to_the_baseline(routed) -> None:
    url, proxy = await routed([Node("a", "g1")], label="g2", share=1.0, min_requests=1)
    async with aiohttp.ClientSession() as s:
        assert (await _post(s, url))[:2] == (200, "g1")
    assert proxy.canary_report()["verdict"]["health"] == "insufficient_data"
    scrape = metrics.render("router")[0].decode()
    assert 'moed_router_canary_requests_total{how="fallback",side="baseline"}' in scrape
