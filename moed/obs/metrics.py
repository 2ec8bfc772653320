"""Every Prometheus metric moed exports, in one place. Names start with `moed_`; docs/metrics.md
lists them all (type, labels, meaning, vLLM equivalents).

Each metric belongs to one *area* registry, and a node serves only the areas of its role
(`render(role, cluster=...)` on GET /metrics), so e.g. a colocated node has no router gauge
for an alert to fire on:

    common    every role (process, HTTP, readiness, config)
    engine    colocated, prefill, decode: a model and an engine's step loop on this node
    transfer  prefill, decode: KV transfer and prefill jobs
    router    router
    cluster   any role with cluster.enabled (membership)

`REGISTRY` holds every area (tests and tools read it). Add a metric to your area's section
(never define one elsewhere) and keep label sets small and bounded (no request ids, no free
text). Every scrape passes `promtool check metrics`: counters are cumulative and end in
`_total` (prometheus_client appends it), nothing else does; `_created` series are off.
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info,
                               PlatformCollector, ProcessCollector, disable_created_metrics,
                               generate_latest)
from prometheus_client import CONTENT_TYPE_LATEST

disable_created_metrics()   # a _created series per counter/histogram child: a fifth of a scrape

COMMON = CollectorRegistry(auto_describe=True)
ENGINE = CollectorRegistry(auto_describe=True)
TRANSFER = CollectorRegistry(auto_describe=True)
ROUTER = CollectorRegistry(auto_describe=True)
CLUSTER = CollectorRegistry(auto_describe=True)
ROLE_AREAS: dict[str, tuple[CollectorRegistry, ...]] = {
    "colocated": (COMMON, ENGINE),
    "prefill": (COMMON, ENGINE, TRANSFER),
    "decode": (COMMON, ENGINE, TRANSFER),
    "router": (COMMON, ROUTER),
}

ProcessCollector(registry=COMMON)
PlatformCollector(registry=COMMON)

# Latency buckets (seconds): token-level (ITL) to whole requests; request phases start lower
# (an idle node queues a request for well under 10 ms).
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                  0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0, 320.0, 640.0)
_PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005) + _REQUEST_BUCKETS
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                   100000, 200000)

# ==== common: every role ===================================================================

HTTP_REQUESTS = Counter("moed_http_requests", "HTTP requests by route and status",
                        ["route", "status"], registry=COMMON)
HTTP_INFLIGHT = Gauge("moed_http_inflight_requests",
                      "Requests being served now (generations; proxied requests on a router)",
                      registry=COMMON)
READY = Gauge("moed_ready", "1 when /ready answers 200", registry=COMMON)
NODE_INFO = Info("moed_node", "Role, node name, version and config digest", registry=COMMON)

# ---- HTTP limits (moed.api.limits): connections, deadlines, descriptors ----
HTTP_CONNECTIONS = Gauge("moed_http_connections_open", "Client connections open now",
                         registry=COMMON)
HTTP_CONNECTIONS_SHED = Counter("moed_http_connections_shed",
                                "Connections closed at server.max_connections: limit = a new one "
                                "(nothing idle to close), idle_evicted = an idle one made room",
                                ["reason"], registry=COMMON)
HTTP_CONNECTIONS_TIMED_OUT = Counter("moed_http_connections_timed_out",
                                     "Connections closed by server.header_timeout_s (header) "
                                     "or server.body_timeout_s (body)", ["phase"],
                                     registry=COMMON)
HTTP_FD_EXHAUSTED = Counter("moed_http_fd_exhausted",
                            "Once-a-second probes that found no free file descriptor (the loop "
                            "then closes every new connection unseen)", registry=COMMON)

# ---- ops: reload, drain (moed.ops) ----
CONFIG_RELOADS = Counter("moed_config_reloads",
                         "SIGHUP config reloads by result (applied, unchanged, "
                         "restart_required, invalid)", ["result"], registry=COMMON)
CONFIG_VERSION = Gauge("moed_config_version",
                       "Running config version: 1 at start, +1 per reload that changed it",
                       registry=COMMON)
CONFIG_INFO = Info("moed_config", "Hash of the running config", registry=COMMON)
DRAINING = Gauge("moed_draining", "1 while the node drains (SIGTERM or POST /admin/drain)",
                 registry=COMMON)


# ==== engine/request: colocated, prefill, decode ===========================================
# Owned by the API/daemon helper. Observed by moed.api (per request), moed.app (per step) and
# the /metrics handler (engine stats snapshot).

# Per request, labelled with the served model (one per node: `set_model_name`); observe them
# through `request_series()`, which binds the label once.
TTFT = Histogram("moed_time_to_first_token_seconds",
                 "Time from request arrival to the first generated token", ["model_name"],
                 buckets=_REQUEST_BUCKETS, registry=ENGINE)
ITL = Histogram("moed_inter_token_latency_seconds", "Time between consecutive generated tokens",
                ["model_name"], buckets=_TOKEN_BUCKETS, registry=ENGINE)
E2E = Histogram("moed_e2e_request_latency_seconds", "Time from arrival to the last token",
                ["model_name"], buckets=_REQUEST_BUCKETS, registry=ENGINE)
QUEUE_TIME = Histogram("moed_request_queue_time_seconds",
                       "Engine: time from arrival to first scheduled (KV blocks allocated)",
                       ["model_name"], buckets=_PHASE_BUCKETS, registry=ENGINE)
PREFILL_TIME = Histogram("moed_request_prefill_time_seconds",
                         "Engine: time from first scheduled to the first token (on a decode "
                         "node: remote prefill and KV transfer)", ["model_name"],
                         buckets=_PHASE_BUCKETS, registry=ENGINE)
DECODE_TIME = Histogram("moed_request_decode_time_seconds",
                        "Engine: time from the first token to the finish", ["model_name"],
                        buckets=_PHASE_BUCKETS, registry=ENGINE)
REQUEST_PROMPT_TOKENS = Histogram("moed_request_prompt_tokens",
                                  "Prompt tokens per finished engine request", ["model_name"],
                                  buckets=_LENGTH_BUCKETS, registry=ENGINE)
REQUEST_GENERATION_TOKENS = Histogram("moed_request_generation_tokens",
                                      "Generated tokens per finished engine request",
                                      ["model_name"], buckets=_LENGTH_BUCKETS, registry=ENGINE)
PROMPT_TOKENS = Counter("moed_prompt_tokens", "Prompt tokens of finished engine requests",
                        ["model_name"], registry=ENGINE)
GENERATION_TOKENS = Counter("moed_generation_tokens", "Generated tokens", ["model_name"],
                            registry=ENGINE)
REQUESTS_FINISHED = Counter("moed_requests_finished",
                            "Engine requests (one per choice) by finish reason",
                            ["model_name", "finish_reason"], registry=ENGINE)

ADMISSION_REJECTED = Counter("moed_admission_rejected",
                             "Requests refused by admission control (429) or draining (503)",
                             ["reason"], registry=ENGINE)
CLIENT_DISCONNECTS = Counter("moed_client_disconnects",
                             "Requests aborted because the client went away", registry=ENGINE)
REQUEST_TIMEOUTS = Counter("moed_request_timeouts", "Requests aborted by request_timeout_s",
                           registry=ENGINE)
ADMISSION_PENDING = Gauge("moed_admission_pending_requests",
                          "Admitted engine requests that have not produced a first token yet",
                          registry=ENGINE)
ADMISSION_PENDING_TOKENS = Gauge("moed_admission_pending_prompt_tokens",
                                 "Prompt tokens of admitted requests without a first token yet",
                                 registry=ENGINE)
RUNNING = Gauge("moed_requests_running", "Requests the engine schedules every step",
                registry=ENGINE)
WAITING = Gauge("moed_requests_waiting", "Requests queued in the engine (incl. remote KV)",
                registry=ENGINE)
PREEMPTIONS = Counter("moed_preemptions", "Running requests preempted (KV freed, recomputed "
                      "later) because the KV cache ran out", registry=ENGINE)
BATCH_SIZE = Histogram("moed_batch_size", "Sequences per engine step", buckets=_BATCH_BUCKETS,
                       registry=ENGINE)
BATCH_TOKENS = Histogram("moed_batch_tokens", "Tokens per engine step",
                         buckets=_BATCH_BUCKETS + (1024, 2048, 4096, 8192), registry=ENGINE)
STEP_TIME = Histogram("moed_step_seconds", "Wall time of one engine step", buckets=_TOKEN_BUCKETS,
                      registry=ENGINE)
KV_BLOCKS_USED = Gauge("moed_kv_blocks_used", "KV cache blocks in use", registry=ENGINE)
KV_BLOCKS_FREE = Gauge("moed_kv_blocks_free", "KV cache blocks free", registry=ENGINE)
KV_BLOCKS_CAPACITY = Gauge("moed_kv_blocks_capacity", "KV cache blocks in the pool",
                           registry=ENGINE)
KV_USAGE = Gauge("moed_kv_cache_usage_ratio", "KV cache blocks in use / blocks in the pool "
                 "(0..1)", registry=ENGINE)
PREFIX_CACHE_HIT_RATE = Gauge("moed_prefix_cache_hit_rate",
                              "Prompt tokens found in the prefix cache / tokens looked up, "
                              "since start", registry=ENGINE)
PREFIX_CACHE_QUERIES = Counter("moed_prefix_cache_queried_tokens",
                               "Prompt tokens looked up in the prefix cache", registry=ENGINE)
PREFIX_CACHE_HITS = Counter("moed_prefix_cache_hit_tokens",
                            "Prompt tokens found in the prefix cache", registry=ENGINE)
MODEL_INFO = Info("moed_model", "The loaded model: architecture, dtype, device, attention backend, "
                  "and whether the native CPU kernels run (cpu_kernels on/off)", registry=ENGINE)


# Expert load (EPLB input, imbalance panel): one series per (MoE layer, expert) that ever got a
# token -- bounded by the model (layers x experts), no request data in labels.
EXPERT_TOKENS = Counter("moed_expert_tokens", "Tokens routed to each logical expert, per MoE "
                        "layer (a token counts once per expert of its top-k)",
                        ["layer", "expert"], registry=ENGINE)
EXPERT_IMBALANCE = Gauge("moed_expert_imbalance",
                         "Max / mean tokens per expert of a MoE layer over the last expert-load "
                         "window (~1 s of steps); 1.0 = perfectly balanced", ["layer"],
                         registry=ENGINE)


class RequestSeries:
    """The per-request metrics' children for one model (labels() costs a lock and a dict:
    bind once, not per token)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.ttft = TTFT.labels(model_name)
        self.itl = ITL.labels(model_name)
        self.e2e = E2E.labels(model_name)
        self.queue_time = QUEUE_TIME.labels(model_name)
        self.prefill_time = PREFILL_TIME.labels(model_name)
        self.decode_time = DECODE_TIME.labels(model_name)
        self.request_prompt_tokens = REQUEST_PROMPT_TOKENS.labels(model_name)
        self.request_generation_tokens = REQUEST_GENERATION_TOKENS.labels(model_name)
        self.prompt_tokens = PROMPT_TOKENS.labels(model_name)
        self.generation_tokens = GENERATION_TOKENS.labels(model_name)
        self._finished: dict[str, Counter] = {}

    def finished(self, reason: str) -> Counter:
        child = self._finished.get(reason)
        if child is None:
            child = self._finished[reason] = REQUESTS_FINISHED.labels(self.model_name, reason)
        return child


_MODEL_NAME = ""
_SERIES: RequestSeries | None = None


def set_model_name(name: str) -> None:
    """The served model name (the `model_name` label); set once the engine has loaded."""
    global _MODEL_NAME, _SERIES
    _MODEL_NAME, _SERIES = name, None


def request_series() -> RequestSeries:
    """The request metrics for this node's model (created on first use: no empty series)."""
    global _SERIES
    if _SERIES is None or _SERIES.model_name != _MODEL_NAME:
        _SERIES = RequestSeries(_MODEL_NAME)
    return _SERIES


_EXPERT_CHILDREN: dict[tuple[int, int], Counter] = {}


def observe_expert_load(load: object) -> None:
    """Fold one expert-load window ([layers, experts] token counts, e.g. a torch tensor) into
    the counters; layers that routed no token in the window (dense, idle) are left alone."""
    rows = load.tolist() if hasattr(load, "tolist") else load
    for layer, row in enumerate(rows):
        total = sum(row)
        if total <= 0:
            continue
        for expert, n in enumerate(row):
            if n:
                child = _EXPERT_CHILDREN.get((layer, expert))
                if child is None:   # labels() costs a lock and a dict; a big model has ~10k
                    child = _EXPERT_CHILDREN[layer, expert] = EXPERT_TOKENS.labels(
                        str(layer), str(expert))
                child.inc(n)
        EXPERT_IMBALANCE.labels(str(layer)).set(max(row) * len(row) / total)


_SEEN: dict[Counter, float] = {}


def _advance(counter: Counter, total: float) -> None:
    """Move a counter to a cumulative total the engine keeps. A smaller total means a new
    engine (tests start several per process): count it from zero, never go backwards."""
    last = _SEEN.get(counter, 0.0)
    delta = total - last if total >= last else total
    if delta > 0:
        counter.inc(delta)
    _SEEN[counter] = total


def observe_kv(used: int, free: int) -> None:
    """KV pool occupancy (per step and on scrape)."""
    KV_BLOCKS_USED.set(used)
    KV_BLOCKS_FREE.set(free)
    KV_USAGE.set(used / (used + free) if used + free else 0.0)


def observe_engine_stats(stats: object) -> None:
    """Copy an EngineStats snapshot into the engine metrics (called on scrape)."""
    RUNNING.set(getattr(stats, "running", 0))
    WAITING.set(getattr(stats, "waiting", 0) + getattr(stats, "waiting_remote_kv", 0))
    observe_kv(getattr(stats, "kv_blocks_used", 0), getattr(stats, "kv_blocks_free", 0))
    KV_BLOCKS_CAPACITY.set(getattr(stats, "kv_blocks_total", 0))
    queries = getattr(stats, "prefix_cache_queries", 0)
    hits = getattr(stats, "prefix_cache_hits", 0)
    _advance(PREFIX_CACHE_QUERIES, queries)
    _advance(PREFIX_CACHE_HITS, hits)
    PREFIX_CACHE_HIT_RATE.set(hits / queries if queries else 0.0)
    _advance(PREEMPTIONS, (getattr(stats, "extra", None) or {}).get("preemptions", 0.0))


# ==== cluster: any role with cluster.enabled ===============================================
# Membership metrics (gossip helper) go here.
# Synced once a second from the protocol's counters by moed.cluster.service.

CLUSTER_MEMBERS = Gauge("moed_cluster_members", "Cluster members as this node sees them, by state",
                        ["state"], registry=CLUSTER)
CLUSTER_MESSAGES = Counter("moed_cluster_messages",
                           "Membership packets (UDP) and streams (push-pull), by direction",
                           ["direction", "kind"], registry=CLUSTER)
CLUSTER_DROPPED = Counter("moed_cluster_dropped",
                          "Membership packets dropped: auth, malformed, oversized, truncated, "
                          "version, stale_time, wrong_target", ["reason"], registry=CLUSTER)
CLUSTER_PROTOCOL = Counter("moed_cluster_protocol_events",
                           "Protocol events: probe_failures, refutes, suspicion_timeouts, "
                           "reprobes, last_chance_probes, join_attempts, stale_updates, "
                           "name_conflicts, transport errors and refused streams "
                           "(stream_auth, stream_version, stream_oversized, stream_stale_time, "
                           "stream_truncated, stream_timeouts, stream_busy)",
                           ["event"], registry=CLUSTER)
CLUSTER_MEMBER_EVENTS = Counter("moed_cluster_member_events",
                                "Member state changes seen (alive also counts metadata updates)",
                                ["state"], registry=CLUSTER)
CLUSTER_LOCAL_HEALTH = Gauge("moed_cluster_local_health",
                             "Lifeguard awareness score: 0 healthy; higher stretches timeouts",
                             registry=CLUSTER)


# ==== transfer: prefill, decode ============================================================
# KV transfer metrics (transfer helper) go here.
# Observed by moed.roles (prefill/decode) from TransferWorker results and job outcomes.

TRANSFER_BYTES = Counter("moed_transfer_bytes", "KV bytes written to peers (finished transfers)",
                         registry=TRANSFER)
TRANSFER_SECONDS = Histogram("moed_transfer_seconds", "Duration of one KV block transfer",
                             buckets=_TOKEN_BUCKETS, registry=TRANSFER)
TRANSFER_GBPS = Histogram("moed_transfer_throughput_gbps", "GB/s of one KV block transfer",
                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
                          registry=TRANSFER)
TRANSFER_FAILURES = Counter("moed_transfer_failures",
                            "Transfer and prefill-job failures by kind (peer_disconnected, "
                            "rpc_error, timeout, rejected, notif_mismatch, ...)", ["kind"],
                            registry=TRANSFER)
TRANSFER_JOBS_INFLIGHT = Gauge("moed_transfer_jobs_inflight",
                               "Prefill jobs in flight (prefill: held; decode: awaiting KV)",
                               ["role"], registry=TRANSFER)
TRANSFER_JOBS = Counter("moed_transfer_jobs", "Finished prefill jobs by role and result "
                        "(done, cancelled, expired, failed, retried)", ["role", "result"],
                        registry=TRANSFER)
TRANSFER_LEASES_EXPIRED = Counter("moed_transfer_leases_expired",
                                  "Prefill jobs dropped because their lease ran out",
                                  registry=TRANSFER)


# ==== router ===============================================================================
# Observed by moed.api.proxy and moed.roles.router.

ROUTER_REQUESTS = Counter("moed_router_requests",
                          "Requests proxied by the router role by result (proxied, retried, "
                          "backend_refused, no_backend, failed_mid_stream, client_gone)",
                          ["result"], registry=ROUTER)
ROUTER_RETRIES = Counter("moed_router_retries",
                         "Backend attempts that failed before the first byte and were retried "
                         "elsewhere", registry=ROUTER)
ROUTER_BACKENDS = Gauge("moed_router_backends", "Serving nodes the router can pick now",
                        registry=ROUTER)


# Every area, for tests and tools (a name used in two areas fails here, at import).
REGISTRY = CollectorRegistry(auto_describe=True)
for _area in (COMMON, ENGINE, TRANSFER, ROUTER, CLUSTER):
    REGISTRY.register(_area)


def areas(role: str | None = None, *, cluster: bool = False) -> tuple[CollectorRegistry, ...]:
    """The registries a node of `role` serves (None: every area)."""
    if role is None:
        return (REGISTRY,)
    return ROLE_AREAS.get(role, (COMMON,)) + ((CLUSTER,) if cluster else ())


def render(role: str | None = None, *, cluster: bool = False) -> tuple[bytes, str]:
    """The exposition text of `role`'s areas (None: all of them) and its content type."""
    return b"".join(generate_latest(r) for r in areas(role, cluster=cluster)), CONTENT_TYPE_LATEST
