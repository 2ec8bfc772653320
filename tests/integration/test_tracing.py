"""Request tracing across nodes (issue 19, acceptance 1): a real OTLP/HTTP receiver on
127.0.0.1 decodes the protobuf exports of a router R, a decode node D and a prefill node P;
one streamed request with a client traceparent yields one trace with spans from all three,
every parent link resolving inside the trace (the root's to the client's span), covering
>= 95% of the wall time the client measured. With tracing off nothing imports OpenTelemetry."""
from __future__ import annotations

import asyncio
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from aiohttp import web

from moed_server import _wait_ready, free_port, start_server

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
          "MOED_ENGINE_BLOCK_SIZE": "4", "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "16",
          "MOED_MODEL_SERVED_NAME": "tiny", "MOED_BALANCE_POLICY": "tokens",
          "MOED_TRACE_EXPORT_INTERVAL_MS": "50", "MOED_TRACE_EXPORT_TIMEOUT_S": "5"}


class Receiver:
    """An OTLP/HTTP trace collector: POST /v1/traces, protobuf ExportTraceServiceRequest."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
        self._pb = pb
        self.port = free_port()
        self.spans: list[dict] = []
        self.bad: list[str] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "receiver did not start"

    async def _traces(self, request: web.Request) -> web.Response:
        if request.headers.get("Content-Type") != "application/x-protobuf":
            self.bad.append(request.headers.get("Content-Type", ""))
        msg = self._pb.ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        with self._lock:
            for rs in msg.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "service": attrs.get("service.name", ""), "name": s.name,
                            "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano, "kind": s.kind,
                            "attrs": {a.key: _value(a.value) for a in s.attributes}})
        return web.Response(body=self._pb.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def of(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["trace"] == trace_id]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _union(intervals: list[tuple[int, int]]) -> int:
    total, cur = 0, None
    for s, e in sorted(intervals):
        if cur is None or s > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (cur[1] - cur[0] if cur else 0)


@pytest.fixture(scope="module")
def traced(tiny_qwen3, tmp_path_factory):
    rx = Receiver()
    endpoint = {"MOED_TRACE_ENDPOINT": f"http://127.0.0.1:{rx.port}/v1/traces"}
    log_dir = tmp_path_factory.mktemp("tracing")
    servers: dict = {}
    try:
        pp, dp = free_port(), free_port()
        servers["P"] = start_server(model=tiny_qwen3, role="prefill", port=pp, log_dir=log_dir,
                                    env={**COMMON, **endpoint, "MOED_SERVER_NODE_NAME": "P"},
                                    wait=None)
        servers["D"] = start_server(model=tiny_qwen3, role="decode", port=dp, log_dir=log_dir,
                                    env={**COMMON, **endpoint, "MOED_SERVER_NODE_NAME": "D",
                                         "MOED_TRANSFER_PREFILL_PEERS":
                                             f"http://127.0.0.1:{pp}"}, wait=None)
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 150)
        servers["R"] = start_server(role="router", log_dir=log_dir,
                                    env={**endpoint, "MOED_SERVER_NODE_NAME": "R",
                                         "MOED_TRACE_EXPORT_INTERVAL_MS": "50",
                                         "MOED_ROUTER_BACKENDS": f"http://127.0.0.1:{dp}"})
        yield rx, servers
    finally:
        for s in servers.values():
            s.stop(timeout=10)
        rx.close()


def test_one_request_one_trace_across_three_nodes(traced) -> None:
    rx, servers = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    rnd = random.Random(19)
    prompt = [rnd.randrange(3, 1000) for _ in range(120)]      # ~8 prefill chunks on P
    t0 = time.perf_counter()
    with requests.post(servers["R"].url + "/v1/completions", stream=True, timeout=60,
                       headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 32,
                             "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200, r.text
        body = b"".join(r.iter_content(None))
    wall_ns = (time.perf_counter() - t0) * 1e9
    assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    assert r.headers["X-Moed-Backend"]

    deadline = time.monotonic() + 15                      # batched exports: wait for all three
    want = {"R", "D", "P"}
    while time.monotonic() < deadline:
        spans = rx.of(trace_id)
        names = {(s["service"], s["name"]) for s in spans}
        if {s["service"] for s in spans} >= want and ("D", "engine.decode") in names and \
                ("P", "kv.write") in names and ("R", "POST /v1/{tail}") in names:
            break
        time.sleep(0.1)
    spans = rx.of(trace_id)
    assert not rx.bad, rx.bad
    assert {s["service"] for s in spans} == want, sorted((s["service"], s["name"]) for s in spans)
    assert {s["trace"] for s in rx.spans} == {trace_id}, "other requests (probes) were traced"
    by_id = {s["id"]: s for s in spans}
    assert len(by_id) == len(spans)
    roots = [s for s in spans if s["parent"] not in by_id]
    assert [(r["service"], r["parent"]) for r in roots] == [("R", client_span)], roots
    root = roots[0]

    def parent(s: dict) -> dict:
        return by_id[s["parent"]]

    def chain(s: dict) -> list[str]:
        out = []
        while s is not root:
            out.append(f'{s["service"]}:{s["name"]}')
            s = parent(s)
        return out
    # the path R → D → P, each server span a child of the caller's client span
    d_server = next(s for s in spans if s["service"] == "D" and s["kind"] == 2)
    p_server = next(s for s in spans if s["service"] == "P" and s["kind"] == 2)
    assert parent(d_server)["name"] == "router.attempt" and parent(d_server)["service"] == "R"
    assert parent(p_server)["name"] == "prefill.remote" and parent(p_server)["service"] == "D"
    assert parent(parent(p_server)) is d_server
    # children nest in time within their parents (one clock: loopback). A server span may
    # outlast its caller's client span a little: the caller stops at the last byte, the
    # server after its own bookkeeping (access log, cleanup)
    for s in spans:
        assert s["start"] <= s["end"]
        if s is not root:
            p = parent(s)
            late = 2_000_000 if s["service"] == p["service"] else 100_000_000
            assert p["start"] - 2_000_000 <= s["start"] and s["end"] <= p["end"] + late, \
                (chain(s), s["start"] - p["start"], p["end"] - s["end"])

    names = [(s["service"], s["name"]) for s in spans]
    for want_span in [("D", "request.prepare"), ("D", "admission"), ("D", "engine.queue"),
                      ("D", "engine.prefill"), ("D", "engine.decode"), ("D", "stream.client"),
                      ("P", "engine.queue"), ("P", "prefill.chunk"), ("P", "kv.write")]:
        assert want_span in names, (want_span, sorted(names))
    chunks = [s for s in spans if s["name"] == "prefill.chunk"]
    assert len(chunks) >= 4 and sum(s["attrs"]["moed.tokens"] for s in chunks) == len(prompt)
    writes = [s for s in spans if s["name"] == "kv.write"]
    assert sum(s["attrs"]["moed.bytes"] for s in writes) > 0
    assert all(parent(s) is p_server for s in chunks + writes)
    decode = next(s for s in spans if s["name"] == "engine.decode")
    assert decode["attrs"]["moed.completion_tokens"] == 32
    assert decode["attrs"]["moed.finish_reason"] == "length"
    assert d_server["attrs"]["http.response.status_code"] == 200
    assert d_server["attrs"]["moed.finish_reason"] == "length"

    # coverage: the root spans >= 95% of what the client measured; on the decode node (where
    # the request's time goes) its phase spans cover >= 95% of its server span
    root_ns = root["end"] - root["start"]
    print(f"\nwall {wall_ns / 1e6:.1f} ms, root {root_ns / 1e6:.1f} ms, {len(spans)} spans")
    for s in sorted(spans, key=lambda s: s["start"]):
        print(f'  {(s["start"] - root["start"]) / 1e6:8.1f} +{(s["end"] - s["start"]) / 1e6:7.1f}'
              f' ms  {" " * 2 * (len(chain(s)))}{s["service"]}:{s["name"]}')
    assert root_ns >= 0.95 * wall_ns, (root_ns, wall_ns)
    phases = [(s["start"], s["end"]) for s in spans
              if s["service"] == "D" and parent(s) is d_server]
    covered = _union([(max(a, d_server["start"]), min(b, d_server["end"])) for a, b in phases])
    assert covered >= 0.95 * (d_server["end"] - d_server["start"]), \
        (covered, d_server["end"] - d_server["start"])

    # capacity signals after the request: P measured its prefill rate, D its decode steps
    # and the request's queue vs compute time (D's compute = the remote prefill)
    pm, dm = servers["P"].metrics(), servers["D"].metrics()
    assert pm["moed_capacity_prefill_tokens_per_second"] > 0
    assert pm["moed_capacity_queue_seconds"] >= 0 and pm["moed_capacity_compute_seconds"] > 0
    assert dm["moed_capacity_decode_step_seconds"] > 0
    assert 0 <= dm["moed_capacity_queue_seconds"] < dm["moed_capacity_compute_seconds"]
    assert dm["moed_capacity_compute_seconds"] >= (decode["start"] - d_server["start"]) / 1e9 \
        - 0.5
    assert pm["moed_capacity_predicted_ttft_seconds"] > 0
    assert pm["moed_capacity_left_prompt_tokens"] >= 0

    # the trace id is on the request's log lines on every node
    for name in ("R", "D", "P"):
        recs = [rec for rec in servers[name].log_records() if rec.get("trace_id") == trace_id]
        assert recs, f"{name}: no log line with the trace id"


def test_tracing_off_imports_no_opentelemetry(tmp_path) -> None:
    """A router and a decode app built with [trace] off, and the serving modules imported:
    no opentelemetry module in sys.modules (one process per check: nothing imported before)."""
    code = (
        "import sys, asyncio\n"
        "from moed import config\n"
        "import moed.app, moed.cli, moed.api.middleware, moed.api.proxy, moed.api.openai\n"
        "import moed.roles.decode, moed.roles.prefill, moed.obs.trace as tr\n"
        "cfg = config.from_dict({'server': {'role': 'router'}, "
        "'router': {'backends': ['http://127.0.0.1:9']}}, 'test')\n"
        "async def main():\n"
        "    app = moed.app.App(cfg)\n"
        "    assert not tr.enabled()\n"
        "    with tr.span('x') as s, tr.server_span('y', {'traceparent': 'z'}):\n"
        "        tr.inject({}); tr.record('z', 0, 1); assert not s.recording\n"
        "asyncio.run(main())\n"
        "bad = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "print('OTEL', bad)\n"
        "sys.exit(1 if bad else 0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "OTEL []" in out.stdout, out.stdout + out.stderr
