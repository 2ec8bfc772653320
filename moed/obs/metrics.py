"""Every Prometheus metric moed exports, in one place. Names start with `moed_`.

Metrics live in one registry (`REGISTRY`), served on GET /metrics. Each area has its own section
below; add a metric to your area's section (never define one elsewhere) and keep label sets
small and bounded (no request ids, no free text).

Sections: engine/request (API + engine), cluster (membership), transfer (KV transfer),
ops (process, config, reload, admin).
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info,
                               PlatformCollector, ProcessCollector, generate_latest)
from prometheus_client import CONTENT_TYPE_LATEST

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# Latency buckets (seconds): token-level (ITL) to whole requests.
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                  0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0, 320.0, 640.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# ==== engine/request =======================================================================
# Owned by the API/daemon helper. Observed by moed.api (per request) and moed.app (per step).

TTFT = Histogram("moed_time_to_first_token_seconds",
                 "Time from request arrival to the first generated token", buckets=_REQUEST_BUCKETS,
                 registry=REGISTRY)
ITL = Histogram("moed_inter_token_latency_seconds", "Time between consecutive generated tokens",
                buckets=_TOKEN_BUCKETS, registry=REGISTRY)
E2E = Histogram("moed_e2e_request_latency_seconds", "Time from arrival to the last token",
                buckets=_REQUEST_BUCKETS, registry=REGISTRY)
PROMPT_TOKENS = Counter("moed_prompt_tokens", "Prompt tokens of finished engine requests",
                        registry=REGISTRY)
GENERATION_TOKENS = Counter("moed_generation_tokens", "Generated tokens", registry=REGISTRY)
REQUESTS_FINISHED = Counter("moed_requests_finished",
                            "Engine requests (one per choice) by finish reason",
                            ["finish_reason"], registry=REGISTRY)
HTTP_REQUESTS = Counter("moed_http_requests", "HTTP requests by route and status",
                        ["route", "status"], registry=REGISTRY)
ADMISSION_REJECTED = Counter("moed_admission_rejected",
                             "Requests refused by admission control (429) or draining (503)",
                             ["reason"], registry=REGISTRY)
CLIENT_DISCONNECTS = Counter("moed_client_disconnects",
                             "Requests aborted because the client went away", registry=REGISTRY)
REQUEST_TIMEOUTS = Counter("moed_request_timeouts", "Requests aborted by request_timeout_s",
                           registry=REGISTRY)
HTTP_INFLIGHT = Gauge("moed_http_inflight_requests", "Generation requests being served now",
                      registry=REGISTRY)
ADMISSION_PENDING = Gauge("moed_admission_pending_requests",
                          "Admitted engine requests that have not produced a first token yet",
                          registry=REGISTRY)
ADMISSION_PENDING_TOKENS = Gauge("moed_admission_pending_prompt_tokens",
                                 "Prompt tokens of admitted requests without a first token yet",
                                 registry=REGISTRY)
RUNNING = Gauge("moed_requests_running", "Requests the engine schedules every step",
                registry=REGISTRY)
WAITING = Gauge("moed_requests_waiting", "Requests queued in the engine (incl. remote KV)",
                registry=REGISTRY)
BATCH_SIZE = Histogram("moed_batch_size", "Sequences per engine step", buckets=_BATCH_BUCKETS,
                       registry=REGISTRY)
BATCH_TOKENS = Histogram("moed_batch_tokens", "Tokens per engine step",
                         buckets=_BATCH_BUCKETS + (1024, 2048, 4096, 8192), registry=REGISTRY)
STEP_TIME = Histogram("moed_step_seconds", "Wall time of one engine step", buckets=_TOKEN_BUCKETS,
                      registry=REGISTRY)
KV_BLOCKS_USED = Gauge("moed_kv_blocks_used", "KV cache blocks in use", registry=REGISTRY)
KV_BLOCKS_FREE = Gauge("moed_kv_blocks_free", "KV cache blocks free", registry=REGISTRY)
KV_BLOCKS_TOTAL = Gauge("moed_kv_blocks_total", "KV cache blocks in the pool", registry=REGISTRY)
PREFIX_CACHE_HIT_RATE = Gauge("moed_prefix_cache_hit_rate",
                              "Prompt tokens found in the prefix cache / tokens looked up "
                              "(cumulative)", registry=REGISTRY)
PREFIX_CACHE_QUERIES = Gauge("moed_prefix_cache_queried_tokens",
                             "Prompt tokens looked up in the prefix cache (cumulative)",
                             registry=REGISTRY)
PREFIX_CACHE_HITS = Gauge("moed_prefix_cache_hit_tokens",
                          "Prompt tokens found in the prefix cache (cumulative)", registry=REGISTRY)
READY = Gauge("moed_ready", "1 when /ready answers 200", registry=REGISTRY)
NODE_INFO = Info("moed_node", "Role, node name, version and config digest", registry=REGISTRY)
MODEL_INFO = Info("moed_model", "The loaded model: architecture, dtype, device, attention backend, "
                  "and whether the native CPU kernels run (cpu_kernels on/off)", registry=REGISTRY)


# Expert load (EPLB input, imbalance panel): one series per (MoE layer, expert) that ever got a
# token -- bounded by the model (layers x experts), no request data in labels.
EXPERT_TOKENS = Counter("moed_expert_tokens", "Tokens routed to each logical expert, per MoE "
                        "layer (a token counts once per expert of its top-k)",
                        ["layer", "expert"], registry=REGISTRY)
EXPERT_IMBALANCE = Gauge("moed_expert_imbalance",
                         "Max / mean tokens per expert of a MoE layer over the last expert-load "
                         "window (~1 s of steps); 1.0 = perfectly balanced", ["layer"],
                         registry=REGISTRY)


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


def observe_engine_stats(stats: object) -> None:
    """Copy an EngineStats snapshot into the gauges (called per step and on scrape)."""
    RUNNING.set(getattr(stats, "running", 0))
    WAITING.set(getattr(stats, "waiting", 0) + getattr(stats, "waiting_remote_kv", 0))
    KV_BLOCKS_USED.set(getattr(stats, "kv_blocks_used", 0))
    KV_BLOCKS_FREE.set(getattr(stats, "kv_blocks_free", 0))
    KV_BLOCKS_TOTAL.set(getattr(stats, "kv_blocks_total", 0))
    queries = getattr(stats, "prefix_cache_queries", 0)
    hits = getattr(stats, "prefix_cache_hits", 0)
    PREFIX_CACHE_QUERIES.set(queries)
    PREFIX_CACHE_HITS.set(hits)
    PREFIX_CACHE_HIT_RATE.set(hits / queries if queries else 0.0)


# ---- HTTP limits (moed.api.limits): connections, deadlines, descriptors ----
HTTP_CONNECTIONS = Gauge("moed_http_connections_open", "Client connections open now",
                         registry=REGISTRY)
HTTP_CONNECTIONS_SHED = Counter("moed_http_connections_shed",
                                "Connections closed at server.max_connections: limit = a new one "
                                "(nothing idle to close), idle_evicted = an idle one made room",
                                ["reason"], registry=REGISTRY)
HTTP_CONNECTIONS_TIMED_OUT = Counter("moed_http_connections_timed_out",
                                     "Connections closed by server.header_timeout_s (header) "
                                     "or server.body_timeout_s (body)", ["phase"],
                                     registry=REGISTRY)
HTTP_FD_EXHAUSTED = Counter("moed_http_fd_exhausted",
                            "Once-a-second probes that found no free file descriptor (the loop "
                            "then closes every new connection unseen)", registry=REGISTRY)


# ==== cluster ==============================================================================
# Membership metrics (gossip helper) go here.
# Synced once a second from the protocol's counters by moed.cluster.service.

CLUSTER_MEMBERS = Gauge("moed_cluster_members", "Cluster members as this node sees them, by state",
                        ["state"], registry=REGISTRY)
CLUSTER_MESSAGES = Counter("moed_cluster_messages",
                           "Membership packets (UDP) and streams (push-pull), by direction",
                           ["direction", "kind"], registry=REGISTRY)
CLUSTER_DROPPED = Counter("moed_cluster_dropped",
                          "Membership packets dropped: auth, malformed, oversized, truncated, "
                          "version, stale_time, wrong_target", ["reason"], registry=REGISTRY)
CLUSTER_PROTOCOL = Counter("moed_cluster_protocol_events",
                           "Protocol events: probe_failures, refutes, suspicion_timeouts, "
                           "reprobes, last_chance_probes, join_attempts, stale_updates, "
                           "name_conflicts, transport errors and refused streams "
                           "(stream_auth, stream_version, stream_oversized, stream_stale_time, "
                           "stream_truncated, stream_timeouts, stream_busy)",
                           ["event"], registry=REGISTRY)
CLUSTER_MEMBER_EVENTS = Counter("moed_cluster_member_events",
                                "Member state changes seen (alive also counts metadata updates)",
                                ["state"], registry=REGISTRY)
CLUSTER_LOCAL_HEALTH = Gauge("moed_cluster_local_health",
                             "Lifeguard awareness score: 0 healthy; higher stretches timeouts",
                             registry=REGISTRY)


# ==== transfer =============================================================================
# KV transfer metrics (transfer helper) go here.
# Observed by moed.roles (prefill/decode) from TransferWorker results and job outcomes.

TRANSFER_BYTES = Counter("moed_transfer_bytes", "KV bytes written to peers (finished transfers)",
                         registry=REGISTRY)
TRANSFER_SECONDS = Histogram("moed_transfer_seconds", "Duration of one KV block transfer",
                             buckets=_TOKEN_BUCKETS, registry=REGISTRY)
TRANSFER_GBPS = Histogram("moed_transfer_throughput_gbps", "GB/s of one KV block transfer",
                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
                          registry=REGISTRY)
TRANSFER_FAILURES = Counter("moed_transfer_failures",
                            "Transfer and prefill-job failures by kind (peer_disconnected, "
                            "rpc_error, timeout, rejected, notif_mismatch, ...)", ["kind"],
                            registry=REGISTRY)
TRANSFER_JOBS_INFLIGHT = Gauge("moed_transfer_jobs_inflight",
                               "Prefill jobs in flight (prefill: held; decode: awaiting KV)",
                               ["role"], registry=REGISTRY)
TRANSFER_JOBS = Counter("moed_transfer_jobs", "Finished prefill jobs by role and result "
                        "(done, cancelled, expired, failed, retried)", ["role", "result"],
                        registry=REGISTRY)
TRANSFER_LEASES_EXPIRED = Counter("moed_transfer_leases_expired",
                                  "Prefill jobs dropped because their lease ran out",
                                  registry=REGISTRY)


# ==== ops ==================================================================================
# Reload, admin, watchdog metrics (ops helper) go here.
# Observed by moed.ops (reload, drain) and moed.api.proxy (router role).

CONFIG_RELOADS = Counter("moed_config_reloads",
                         "SIGHUP config reloads by result (applied, unchanged, "
                         "restart_required, invalid)", ["result"], registry=REGISTRY)
CONFIG_VERSION = Gauge("moed_config_version",
                       "Running config version: 1 at start, +1 per reload that changed it",
                       registry=REGISTRY)
CONFIG_INFO = Info("moed_config", "Hash of the running config", registry=REGISTRY)
DRAINING = Gauge("moed_draining", "1 while the node drains (SIGTERM or POST /admin/drain)",
                 registry=REGISTRY)
ROUTER_REQUESTS = Counter("moed_router_requests",
                          "Requests proxied by the router role by result (proxied, retried, "
                          "backend_refused, no_backend, failed_mid_stream, client_gone)",
                          ["result"], registry=REGISTRY)
ROUTER_RETRIES = Counter("moed_router_retries",
                         "Backend attempts that failed before the first byte and were retried "
                         "elsewhere", registry=REGISTRY)
ROUTER_BACKENDS = Gauge("moed_router_backends", "Serving nodes the router can pick now",
                        registry=REGISTRY)


def render() -> tuple[bytes, str]:
    """The exposition text and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
