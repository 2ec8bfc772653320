"""Request tracing (OpenTelemetry): the one owner of the SDK, and a small facade for the rest.

Off by default. With `trace.endpoint` set, `setup` builds a tracer provider exporting OTLP/HTTP
protobuf from a background thread (the SDK's BatchSpanProcessor: nothing on the event loop
waits for the collector). With it off, nothing here imports opentelemetry: every helper is a
no-op on a shared null span, so untraced requests pay one global read per call site and no
per-token work at all.

What the rest of the code calls (all safe when off):
    server_span(name, headers)   the HTTP request on this node, a child of the caller's W3C
                                 `traceparent` when it sent one (moed.api.middleware)
    span(name, kind=...)         a live child span of the current one, as a context manager
    record(name, start_ns, end)  a finished span from measured times (the engine's phases on
                                 a finish event, the prefill job's chunks: moed.api.generate,
                                 moed.roles.prefill), a child of the current span
    inject(headers)              put the current span's `traceparent` on an outgoing call
                                 (router proxy → decode, decode job RPC → prefill)
    log_ids()                    {trace_id, span_id} for the structlog contextvars

Sampling is parent-based: a caller's sampled flag is followed (so one request is traced on
every node or on none), a request without one is sampled at `trace.sampling_ratio`.
The node-to-node RPC signature (moed.api.internal) covers method, path and body, not headers:
adding `traceparent` keeps every signature valid (a forged traceparent can only mislabel a
trace, never reach a block).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping, MutableMapping

from moed.config import ConfigError

if TYPE_CHECKING:
    from moed.config import TraceConfig

# the SDK modules setup() needs: checked by the pre-flight, so a missing extra is a start error
REQUIRED = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
MAX_HEADERS_BYTES = 64 * 1024
_KINDS = ("internal", "server", "client")


class _NoSpan:
    """What every helper hands out when tracing is off (or the request is not sampled)."""

    recording = False

    def set(self, **attrs: Any) -> None:
        pass

    def error(self, kind: str, message: str = "") -> None:
        pass

    def __enter__(self) -> "_NoSpan":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


NO_SPAN = _NoSpan()


class Span:
    """A live span (tracing on): attributes and an error status; ended by its `with`."""

    recording = True

    def __init__(self, otel_span: Any, status: Any) -> None:
        self._span = otel_span
        self._status = status

    def set(self, **attrs: Any) -> None:
        for k, v in attrs.items():
            if v is not None:
                self._span.set_attribute(_key(k), v if isinstance(v, (str, bool, int, float))
                                         else str(v))

    def error(self, kind: str, message: str = "") -> None:
        """Mark the span failed with an error kind (an attribute, and the span's status)."""
        self._span.set_attribute("error.type", kind)
        self._span.set_status(self._status.Status(self._status.StatusCode.ERROR,
                                                  message[:200] or kind))


def _key(k: str) -> str:
    # moed's own attributes under one namespace; the semantic-convention ones kept as written
    return k if "." in k else f"moed.{k}"


class _Tracing:
    """The SDK objects of a node that traces (built by setup)."""

    def __init__(self, cfg: "TraceConfig", service: str, headers: dict[str, str]) -> None:
        from opentelemetry import context, trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import status
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.api, self.context, self.status = trace, context, status
        self.kinds = {"internal": trace.SpanKind.INTERNAL, "server": trace.SpanKind.SERVER,
                      "client": trace.SpanKind.CLIENT}
        self.propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sampling_ratio)))
        exporter = OTLPSpanExporter(endpoint=cfg.endpoint, headers=headers or None,
                                    timeout=cfg.export_timeout_s)
        self.provider.add_span_processor(BatchSpanProcessor(
            exporter, schedule_delay_millis=cfg.export_interval_ms,
            export_timeout_millis=cfg.export_timeout_s * 1000))
        self.tracer = self.provider.get_tracer("moed")


_on: _Tracing | None = None


def enabled() -> bool:
    return _on is not None


def read_headers(path: str) -> dict[str, str]:
    """trace.headers_file: one `Name: value` a line (blank lines and # comments skipped). A
    collector's API key lives here, never in the TOML."""
    if not path:
        return {}
    from moed.safefile import FileRefused, read_regular_file

    try:
        text = read_regular_file(path, MAX_HEADERS_BYTES).decode("utf-8")
    except (OSError, FileRefused, UnicodeDecodeError) as e:
        raise ConfigError(f"trace.headers_file: cannot read {path}: {e}") from None
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        ln = raw.strip()
        if not ln or ln.startswith("#"):
            continue
        name, sep, value = ln.partition(":")
        if not sep or not name.strip() or any(c in name for c in " \t"):
            raise ConfigError(f"trace.headers_file: {path} line {n} is not `Name: value`")
        out[name.strip()] = value.strip()
    return out


def check(cfg: "TraceConfig") -> None:
    """What setup needs, without starting anything (moed.preflight): the extra importable,
    the headers file readable. ConfigError says which."""
    if not cfg.endpoint:
        return
    import importlib.util

    for mod in REQUIRED:
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigError(f"trace.endpoint is set but the OpenTelemetry SDK is not "
                              f"installed ({mod} missing): pip install -e '.[trace]' from a "
                              f"checkout, pip install 'moed[trace]' from an index, or leave "
                              f"trace.endpoint empty")
    read_headers(cfg.headers_file)


def setup(cfg: "TraceConfig", node: str) -> bool:
    """Start tracing per `cfg` (no-op when trace.endpoint is empty); True when on."""
    global _on
    if not cfg.endpoint:
        return False
    check(cfg)
    _on = _Tracing(cfg, cfg.service_name or node, read_headers(cfg.headers_file))
    return True


def shutdown(timeout_s: float = 5.0) -> None:
    """Export what is buffered (within `timeout_s`) and stop; blocking: call off the loop."""
    global _on
    t, _on = _on, None
    if t is not None:
        t.provider.force_flush(int(timeout_s * 1000))
        t.provider.shutdown()


def now_ns() -> int:
    return time.time_ns()


@contextlib.contextmanager
def _live(name: str, kind: str, parent: Any, attrs: Mapping[str, Any],
          start_ns: int | None) -> Iterator[Span | _NoSpan]:
    t = _on
    assert t is not None
    otel = t.tracer.start_span(name, context=parent, kind=t.kinds[kind], start_time=start_ns)
    if not otel.is_recording():            # not sampled: children and propagation still work
        token = t.context.attach(t.api.set_span_in_context(otel))
        try:
            yield NO_SPAN
        finally:
            t.context.detach(token)
        return
    sp = Span(otel, t.status)
    sp.set(**attrs)
    token = t.context.attach(t.api.set_span_in_context(otel))
    try:
        yield sp
    except BaseException as e:
        if isinstance(e, asyncio.CancelledError):
            sp.error("cancelled", "the caller went away")
        elif not isinstance(e, GeneratorExit):
            sp.error(type(e).__name__, str(e))
        raise
    finally:
        t.context.detach(token)
        otel.end()


def span(name: str, *, kind: str = "internal", start_ns: int | None = None,
         **attrs: Any) -> contextlib.AbstractContextManager[Span | _NoSpan]:
    """A child of the current span for the `with` block (NO_SPAN when off)."""
    if _on is None:
        return NO_SPAN
    return _live(name, kind, None, attrs, start_ns)


def server_span(name: str, headers: Mapping[str, str], **attrs: Any
                ) -> contextlib.AbstractContextManager[Span | _NoSpan]:
    """This node's span of one HTTP request: a child of the caller's `traceparent`, if any."""
    if _on is None:
        return NO_SPAN
    parent = _on.propagator.extract(carrier=headers) if "traceparent" in headers else None
    return _live(name, "server", parent, attrs, None)


def current() -> Any:
    """The current span when it is recorded (an opaque parent for `record`), else None."""
    if _on is None:
        return None
    sp = _on.api.get_current_span()
    return sp if sp.is_recording() else None


def record(name: str, start_ns: int, end_ns: int, *, parent: Any = None, **attrs: Any) -> None:
    """A finished child of `parent` (from `current()`; default: the current span), from
    measured times (wall-clock ns). Nothing when the parent is not recorded."""
    t = _on
    if t is None:
        return
    p = parent if parent is not None else t.api.get_current_span()
    if not p.is_recording():
        return
    otel = t.tracer.start_span(name, context=t.api.set_span_in_context(p), start_time=start_ns)
    Span(otel, t.status).set(**attrs)
    otel.end(end_time=max(end_ns, start_ns))


def recording() -> bool:
    """True when the current request is traced (so callers skip building attributes)."""
    return _on is not None and _on.api.get_current_span().is_recording()


def mark_error(kind: str, message: str = "") -> None:
    """Mark the current span failed (an error reported in-band, after the headers went)."""
    if recording():
        Span(_on.api.get_current_span(), _on.status).error(kind, message)   # type: ignore


def inject(headers: MutableMapping[str, str]) -> None:
    """Set `traceparent` (and `tracestate`) for an outgoing call from the current span."""
    if _on is not None:
        _on.propagator.inject(headers)


def log_ids() -> dict[str, str]:
    """{trace_id, span_id} of the current span when it is sampled, else {}."""
    if _on is None:
        return {}
    ctx = _on.api.get_current_span().get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return {}
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}


class TraceComponent:
    """A moed.app component: tracing from construction (before the site listens) to stop,
    where what is buffered is exported (off the loop, bounded)."""

    name = "trace"

    def __init__(self, cfg: "TraceConfig", node: str) -> None:
        setup(cfg, node)             # ConfigError (extra missing, bad headers file): no start
        self._timeout = cfg.export_timeout_s

    def add_routes(self, web_app: Any) -> None:
        pass

    async def start(self, app: Any) -> None:
        pass

    async def drain(self) -> None:
        pass

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(loop.run_in_executor(None, shutdown, self._timeout),
                                   self._timeout + 1.0)

    def prepare_reload(self, old: Any, new: Any) -> Any:
        return lambda: None          # [trace] fields need a restart (config.diff says so)
