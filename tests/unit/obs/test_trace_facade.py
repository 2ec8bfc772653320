"""moed.obs.trace: the facade's no-op when off, W3C traceparent in and out, parent links,
measured spans, error attributes, sampling, and the [trace] config and pre-flight checks."""
from __future__ import annotations

import asyncio
import importlib.util

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from moed import config
from moed.config import ConfigError, TraceConfig
from moed.obs import trace

TID, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture
def spans():
    """Tracing on (an exporter to a closed port, never reached) plus an in-memory copy."""
    assert trace.setup(TraceConfig(endpoint="http://127.0.0.1:9/v1/traces",
                                   export_timeout_s=0.1), "node-a")
    mem = InMemorySpanExporter()
    trace._on.provider.add_span_processor(SimpleSpanProcessor(mem))
    yield mem
    trace._on = None          # no shutdown: the batch exporter would try the closed port


def test_off_every_helper_is_a_no_op() -> None:
    assert not trace.enabled() and trace._on is None
    with trace.server_span("GET /x", {"traceparent": f"00-{TID}-{PARENT}-01"}) as s, \
            trace.span("child") as c:
        assert s is trace.NO_SPAN and c is trace.NO_SPAN and not s.recording
        headers: dict = {}
        trace.inject(headers)
        assert headers == {} and trace.log_ids() == {} and trace.current() is None
        trace.record("x", 0, 1)
        s.set(a=1)
        s.error("kind")
    assert not trace.setup(TraceConfig(), "n")          # no endpoint: stays off


def test_traceparent_in_becomes_the_parent_and_goes_out_on_calls(spans) -> None:
    with trace.server_span("POST /v1/completions", {"traceparent": f"00-{TID}-{PARENT}-01"},
                           request_id="r1") as server:
        assert server.recording
        ids = trace.log_ids()
        with trace.span("prefill.remote", kind="client", peer="p") as client:
            out: dict = {}
            trace.inject(out)
            client.set(bytes=123)
        parent = trace.current()
        trace.record("engine.queue", 1_000, 5_000, parent=parent, tokens=7)
    by = {s.name: s for s in spans.get_finished_spans()}
    srv, cli, q = by["POST /v1/completions"], by["prefill.remote"], by["engine.queue"]
    assert f"{srv.context.trace_id:032x}" == TID and f"{srv.parent.span_id:016x}" == PARENT
    assert srv.parent.is_remote and srv.kind.name == "SERVER" and cli.kind.name == "CLIENT"
    assert cli.parent.span_id == srv.context.span_id and q.parent.span_id == srv.context.span_id
    assert ids == {"trace_id": TID, "span_id": f"{srv.context.span_id:016x}"}
    # the outgoing header names the client span, same trace, sampled
    assert out["traceparent"] == f"00-{TID}-{cli.context.span_id:016x}-01"
    assert cli.attributes["moed.bytes"] == 123 and srv.attributes["moed.request_id"] == "r1"
    assert (q.start_time, q.end_time) == (1_000, 5_000) and q.attributes["moed.tokens"] == 7
    assert srv.resource.attributes["service.name"] == "node-a"


def test_unsampled_caller_is_followed_and_propagated(spans) -> None:
    with trace.server_span("GET /a", {"traceparent": f"00-{TID}-{PARENT}-00"}) as s:
        assert not s.recording and trace.log_ids() == {} and not trace.recording()
        out: dict = {}
        trace.inject(out)
        trace.record("x", 0, 1)
    assert out["traceparent"].startswith(f"00-{TID}-") and out["traceparent"].endswith("-00")
    assert spans.get_finished_spans() == ()


def test_a_malformed_traceparent_starts_a_new_trace(spans) -> None:
    with trace.server_span("GET /a", {"traceparent": "00-zz-yy-01"}) as s:
        assert s.recording
    (srv,) = spans.get_finished_spans()
    assert srv.parent is None


def test_errors_and_cancellation_are_attributes(spans) -> None:
    with pytest.raises(ValueError):
        with trace.span("kv.write"):
            raise ValueError("boom")

    async def cancelled() -> None:
        with trace.span("stream.client"):
            await asyncio.sleep(10)
    async def main() -> None:
        t = asyncio.ensure_future(cancelled())
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
    asyncio.run(main())
    with trace.span("marked") as s:
        s.error("prefill_failed", "no prefill node")
    by = {s.name: s for s in spans.get_finished_spans()}
    assert by["kv.write"].attributes["error.type"] == "ValueError"
    assert by["kv.write"].status.status_code.name == "ERROR"
    assert by["stream.client"].attributes["error.type"] == "cancelled"
    assert by["marked"].attributes["error.type"] == "prefill_failed"


def test_sampling_ratio_zero_traces_nothing_without_a_caller_decision() -> None:
    trace.setup(TraceConfig(endpoint="http://127.0.0.1:9/v1/traces", sampling_ratio=0.0,
                            export_timeout_s=0.1), "n")
    try:
        with trace.server_span("GET /a", {}) as s:
            assert not s.recording
        with trace.server_span("GET /b", {"traceparent": f"00-{TID}-{PARENT}-01"}) as s:
            assert s.recording                    # the caller sampled it: followed
    finally:
        trace._on = None


@pytest.mark.parametrize("bad", ["ftp://x", "http://", "127.0.0.1:4318", "http:///v1",
                                 "http://a b"])
def test_endpoint_must_be_an_http_url(bad) -> None:
    with pytest.raises(ConfigError, match="trace.endpoint"):
        TraceConfig(endpoint=bad)


def test_unknown_and_out_of_range_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown key trace.ratio"):
        config.from_dict({"server": {"role": "router"}, "trace": {"ratio": 1}}, "t")
    with pytest.raises(ConfigError, match="trace.sampling_ratio"):
        config.from_dict({"server": {"role": "router"}, "trace": {"sampling_ratio": 2}}, "t")
    with pytest.raises(ConfigError, match="trace.service_name"):
        TraceConfig(service_name="two words")


def test_missing_extra_is_a_clear_start_error(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("opentelemetry") else
                        real(name, *a))
    with pytest.raises(ConfigError) as e:
        trace.check(TraceConfig(endpoint="http://127.0.0.1:4318/v1/traces"))
    # a newcomer runs from a checkout, where `moed[trace]` names no package: both lines
    assert "pip install -e '.[trace]' from a checkout" in str(e.value)
    assert "pip install 'moed[trace]' from an index" in str(e.value)
    trace.check(TraceConfig())                       # off: nothing is needed


def test_docs_give_the_checkout_install_line() -> None:
    """docs/tracing.md's install lines: the checkout's (editable, the one a fresh clone needs)
    and the index's; the extra they name exists in pyproject.toml."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    doc = (root / "docs/tracing.md").read_text()
    assert "pip install -e '.[trace]'" in doc and "pip install 'moed[trace]'" in doc
    assert "\ntrace = [" in (root / "pyproject.toml").read_text()   # (tomllib: 3.11+)


def test_headers_file(tmp_path) -> None:
    f = tmp_path / "h"
    f.write_text("# collector\nAuthorization: Bearer abc\n\nx-tenant:  t1 \n")
    assert trace.read_headers(str(f)) == {"Authorization": "Bearer abc", "x-tenant": "t1"}
    f.write_text("no colon here\n")
    with pytest.raises(ConfigError, match="line 1"):
        trace.read_headers(str(f))
    with pytest.raises(ConfigError, match="cannot read"):
        trace.check(TraceConfig(endpoint="http://c:4318/v1/traces",
                                headers_file=str(tmp_path / "missing")))
