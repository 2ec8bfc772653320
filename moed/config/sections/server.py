"""[server], [admission] and [trace]: the node's HTTP front, its queue bounds and its tracing."""
from __future__ import annotations

from dataclasses import dataclass

from moed.config.schema import ConfigError, _check_bounds, _choice, _f, _short

ROLES = ("colocated", "prefill", "decode", "router")
LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
PREFIX_CACHE_ISOLATION = ("shared", "api_key")      # moed.api.salt.ISOLATION
METRICS_ACCESS = ("open", "api_key", "operator")


@dataclass(frozen=True)
class ServerConfig:
    role: str = _f("colocated", doc="colocated | prefill | decode | router")
    host: str = _f("127.0.0.1")
    port: int = _f(8000, bounds=(0, 65535))
    node_name: str = _f("", doc="unique in the cluster; default: hostname-port")
    max_body_bytes: int = _f(4 * 1024 * 1024, live=True, bounds=(1, 1 << 30))
    request_timeout_s: float = _f(600.0, live=True, bounds=(0.001, 7 * 86400.0),
                                  doc="whole-request deadline")
    shutdown_grace_s: float = _f(30.0, live=True, bounds=(0, 86400),
                                 doc="drain: in-flight requests get this long")
    drain_migrate_after_s: float = _f(5.0, live=True, bounds=(0, 86400),
                                      doc="drain: after this long (at most the grace) requests "
                                      "relayed by a router with migration on end here and "
                                      "continue (streams) or are resubmitted on another node "
                                      "(docs/migration.md); 0 = off")
    api_keys_file: str = _f("", live=True, doc="one key per line; empty with api_keys_env = no auth")
    api_keys_env: str = _f("", live=True, doc="env var holding comma-separated keys")
    admin_token_file: str = _f("", live=True)
    admin_token_env: str = _f("", live=True)
    metrics_require_auth: bool = _f(False, live=True,
                                    doc="true = metrics_access \"api_key\" (kept for "
                                    "existing configs)")
    metrics_access: str = _f("open", live=True,
                             doc="who may read /metrics: open (anyone who reaches the port, "
                             "as Prometheus expects) | api_key (a tenant API key, the "
                             "metrics token or the admin token) | operator (the metrics "
                             "token or the admin token only: tenants never read the cache "
                             "counters)")
    cache_metrics_batch: int = _f(16, bounds=(1, 1 << 20),
                                  doc="the prefix-cache, KV-tier and peer-read counters in "
                                  "/metrics move only after this many more requests (one "
                                  "request's hit is not observable on a busy node; "
                                  "moed/obs/coarse.py); 1 = at once")
    metrics_token_file: str = _f("", live=True, doc="Bearer token(s) for /metrics only, one "
                                 "per line (a scraper's credential; the admin token also reads)")
    metrics_token_env: str = _f("", live=True, doc="env var holding comma-separated metrics "
                                "tokens")
    prefix_cache_isolation: str = _f("shared", live=True,
                                     doc="shared | api_key: with api_key, only requests "
                                     "made with the same API key share cached prefix "
                                     "blocks (moed/api/salt.py says why shared is the "
                                     "default)")
    vllm_metrics_path: str = _f("", doc="also export the vLLM-named gauges routers scrape "
                                "(vllm:num_requests_waiting, vllm:num_requests_running, "
                                "vllm:kv_cache_usage_perc, vllm:cache_config_info; "
                                "docs/metrics.md) at this path: /metrics appends them to "
                                "moed's own scrape, another path (e.g. /metrics/vllm) serves "
                                "them alone; empty = not exported")
    log_format: str = _f("json", live=True, doc="json | console")
    log_level: str = _f("info", live=True)
    # HTTP connection limits (slowloris, idle sockets, fd exhaustion): see moed/api/limits.py
    max_connections: int = _f(2048, bounds=(1, 1 << 20),
                              doc="open client connections. At the limit the connection "
                              "idle longest is closed to make room; a new one is shed only "
                              "when none is idle; the last slots serve probes only (/health, "
                              "/ready, /metrics). Keep it under the fd limit (LimitNOFILE) "
                              "with room for peers, KV and files")
    header_timeout_s: float = _f(10.0, bounds=(0.1, 3600),
                                 doc="a connection's first request line and headers must "
                                 "arrive within this long (later requests on it: "
                                 "keepalive_timeout_s)")
    body_timeout_s: float = _f(30.0, live=True, bounds=(0.1, 3600),
                               doc="a request body must be read in full within this long")
    keepalive_timeout_s: float = _f(15.0, bounds=(0.1, 3600),
                                    doc="an idle keep-alive connection is closed after "
                                    "this long")
    max_header_bytes: int = _f(16384, bounds=(1024, 1 << 20),
                               doc="longest request line or header field")
    max_headers: int = _f(100, bounds=(8, 10000), doc="most header fields in one request")
    state_dir: str = _f("", doc="where the node keeps state across restarts (the config "
                        "history); default: $STATE_DIRECTORY (systemd's StateDirectory=), "
                        "else nothing is kept across restarts")

    def __post_init__(self) -> None:
        _check_bounds("server", self)
        _choice("server.role", self.role, ROLES)
        _choice("server.log_format", self.log_format, LOG_FORMATS)
        _choice("server.log_level", self.log_level, LOG_LEVELS)
        p = self.vllm_metrics_path
        if p and (not p.startswith("/") or len(p) > 128 or not p.isascii()
                  or any(c.isspace() or c in "?#{}" for c in p)
                  or p in ("/health", "/ready", "/version") or p.startswith(("/v1/", "/admin/",
                                                                             "/internal/"))):
            raise ConfigError(f"server.vllm_metrics_path: {_short(p)} must be an absolute URL "
                              f"path of at most 128 characters, without spaces, ?, # or braces, "
                              f"that no other route of moed's API uses")
        _choice("server.prefix_cache_isolation", self.prefix_cache_isolation,
                PREFIX_CACHE_ISOLATION)
        _choice("server.metrics_access", self.metrics_access, METRICS_ACCESS)
        if self.metrics_auth == "operator" and not (
                self.metrics_token_file or self.metrics_token_env or self.admin_token_file
                or self.admin_token_env):
            raise ConfigError("server.metrics_access = \"operator\": nobody could read "
                              "/metrics; set server.metrics_token_file or metrics_token_env "
                              "(the scraper's token), or the admin token")

    @property
    def metrics_auth(self) -> str:
        """metrics_access, with the older metrics_require_auth = true read as "api_key"."""
        if self.metrics_require_auth and self.metrics_access == "open":
            return "api_key"
        return self.metrics_access


@dataclass(frozen=True)
class AdmissionConfig:
    max_waiting_requests: int = _f(256, live=True, bounds=(1, 1 << 20), doc="beyond this: 429")
    max_queued_prompt_tokens: int = _f(262144, live=True, bounds=(1, 1 << 32),
                                       doc="beyond this: 429")
    retry_after_s: int = _f(1, live=True, bounds=(0, 3600))

    def __post_init__(self) -> None:
        _check_bounds("admission", self)



@dataclass(frozen=True)
class TraceConfig:
    """Request tracing (moed/obs/trace.py, docs/tracing.md): OpenTelemetry spans exported over
    OTLP/HTTP protobuf; needs the `trace` extra. Off while endpoint is empty."""
    endpoint: str = _f("", doc="OTLP/HTTP traces URL, used as given (e.g. "
                       "http://127.0.0.1:4318/v1/traces); empty = tracing off")
    sampling_ratio: float = _f(1.0, bounds=(0.0, 1.0),
                               doc="share of requests traced that arrive without a "
                               "traceparent; a caller's sampled flag is always followed")
    service_name: str = _f("", doc="service.name of this node's spans; default: the node name")
    headers_file: str = _f("", doc="file of `Name: value` lines sent with every export (a "
                           "collector's API key); empty = none")
    export_interval_ms: int = _f(500, bounds=(10, 60000),
                                 doc="finished spans are batched and exported this often")
    export_timeout_s: float = _f(10.0, bounds=(0.1, 300.0),
                                 doc="one export's deadline; at stop, buffered spans get this "
                                 "long")

    def __post_init__(self) -> None:
        _check_bounds("trace", self)
        if self.endpoint:
            scheme, sep, rest = self.endpoint.partition("://")
            if scheme not in ("http", "https") or not sep or not rest or \
                    rest.startswith("/") or any(c.isspace() for c in self.endpoint):
                raise ConfigError(f"trace.endpoint: {_short(self.endpoint)} is not an "
                                  f"http(s):// URL")
        if len(self.service_name) > 128 or any(c.isspace() for c in self.service_name):
            raise ConfigError(f"trace.service_name: {_short(self.service_name)} must be at "
                              f"most 128 characters without spaces")
