"""W3C traceparent through the router's proxy: off, the client's header reaches the node
unchanged; on, the node gets the router's per-attempt client span (same trace), whose parent
is the router's server span, a child of the client's span; a retried attempt gets its own."""
from __future__ import annotations

import aiohttp
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from moed.config import TraceConfig
from moed.obs import trace
from test_proxy import FakeNode, cluster  # noqa: F401  (the fixture)

TID, CLIENT = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TP = f"00-{TID}-{CLIENT}-01"


@pytest.fixture
def spans():
    trace.setup(TraceConfig(endpoint="http://127.0.0.1:9/v1/traces", export_timeout_s=0.1),
                "router-1")
    mem = InMemorySpanExporter()
    trace._on.provider.add_span_processor(SimpleSpanProcessor(mem))
    yield mem
    trace._on = None


async def _post(url: str) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"prompt": "x"},
                          headers={"traceparent": TP}) as r:
            await r.read()
            return r.status


async def test_off_the_clients_traceparent_passes_through(cluster) -> None:  # noqa: F811
    node = FakeNode("a")
    url, _ = await cluster(node)
    assert await _post(url) == 200
    assert node.headers[0]["traceparent"] == TP


async def test_on_each_attempt_is_a_client_span_the_node_continues(cluster, spans) -> None:  # noqa: F811
    busy, ok = FakeNode("busy", status=503), FakeNode("ok")
    url, _ = await cluster(busy, ok)
    for _ in range(4):                        # until the busy node has been tried first
        assert await _post(url) == 200
        if busy.hits:
            break
    assert busy.hits and ok.hits
    sent = [h["traceparent"] for h in busy.headers + ok.headers]
    assert all(tp.startswith(f"00-{TID}-") and tp.endswith("-01") and CLIENT not in tp
               for tp in sent)
    finished = spans.get_finished_spans()
    attempts = {f"{s.context.span_id:016x}": s for s in finished if s.name == "router.attempt"}
    servers = [s for s in finished if s.kind.name == "SERVER"]
    assert all(f"{s.parent.span_id:016x}" == CLIENT for s in servers)
    for tp in sent:                           # every header names an attempt span of ours
        a = attempts[tp.split("-")[2]]
        assert a.kind.name == "CLIENT" and any(a.parent.span_id == s.context.span_id
                                               for s in servers)
    outcomes = {a.attributes["moed.backend"]: a.attributes["moed.outcome"]
                for a in attempts.values()}
    assert outcomes[busy.url] == "refused" and outcomes[ok.url] == "streamed"
