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

from collections.abc import Mapping

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info,
                               PlatformCollector, ProcessCollector, disable_created_metrics,
                               generate_latest)
from prometheus_client import CONTENT_TYPE_LATEST

from moed.obs.coarse import CoarseTotals

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
CONFIG_ROLLBACKS = Counter("moed_config_rollbacks",
                           "Config rollbacks (POST /admin/config/rollback) by result (applied, "
                           "unchanged, restart_required, invalid, unknown_hash)", ["result"],
                           registry=COMMON)
CONFIG_HISTORY = Gauge("moed_config_history_entries",
                       "Applied configs kept in the config history (release.config_history)",
                       registry=COMMON)
RELEASE_INFO = Info("moed_release", "This node's release: moed version, version label, model "
                    "id (checkpoint hash; empty on a router) and node-to-node protocol range",
                    registry=COMMON)
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
GRAMMAR_REFUSED = Counter("moed_grammar_refused",
                          "Structured-output grammars refused before admission (400): "
                          "invalid, too_complex (a limit hit while compiling or probing), "
                          "timeout (over structured.compile_timeout_s)",
                          ["reason"], registry=ENGINE)
GRAMMAR_FAILED = Counter("moed_grammar_failed",
                         "Requests failed alone while generating because their grammar "
                         "overran: limit (an llguidance limit hit by a mask or token), "
                         "mask_timeout (mask still computing after structured.mask_timeout_ms)",
                         ["reason"], registry=ENGINE)
CLIENT_DISCONNECTS = Counter("moed_client_disconnects",
                             "Requests aborted because the client went away", registry=ENGINE)
REQUEST_TIMEOUTS = Counter("moed_request_timeouts", "Requests aborted by request_timeout_s",
                           registry=ENGINE)
# per priority class (moed/api/priority.py): the label is a [priority] class name, or "other"
# for a priority that is no class's value, so the series stay bounded whatever clients send
PRIORITY_REQUESTS = Counter("moed_priority_requests",
                            "HTTP generation requests by priority class and admission outcome: "
                            "admitted; rejected (429: over the admission bounds at "
                            "arrival); displaced (429 before its first token: a more urgent "
                            "arrival took its place)",
                            ["priority_class", "outcome"], registry=ENGINE)
PRIORITY_TTFT = Histogram("moed_priority_time_to_first_token_seconds",
                          "Time from request arrival to the first generated token, by "
                          "priority class", ["priority_class"], buckets=_REQUEST_BUCKETS,
                          registry=ENGINE)
PRIORITY_PENDING = Gauge("moed_priority_pending_requests",
                         "Admitted engine requests without a first token yet, by priority "
                         "class", ["priority_class"], registry=ENGINE)
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
# The step a streaming client's inter-token latency follows: ITL well above it is serving
# overhead (loop, detokenize, SSE), not the model.
DECODE_STEP_TIME = Histogram("moed_decode_step_seconds", "Wall time of one engine step that ran "
                             "decode tokens only (no prefill)", buckets=_TOKEN_BUCKETS, registry=ENGINE)
KV_BLOCKS_USED = Gauge("moed_kv_blocks_used", "KV cache blocks in use", registry=ENGINE)
KV_BLOCKS_FREE = Gauge("moed_kv_blocks_free", "KV cache blocks free", registry=ENGINE)
KV_BLOCKS_CACHED = Gauge("moed_kv_blocks_cached", "KV cache blocks registered under a prefix "
                         "hash (in use or free; what the GPU medium of the KV events holds)",
                         registry=ENGINE)
KV_BLOCKS_CAPACITY = Gauge("moed_kv_blocks_capacity", "KV cache blocks in the pool",
                           registry=ENGINE)
KV_BYTES_PER_TOKEN = Gauge("moed_kv_cache_bytes_per_token", "KV cache bytes one token takes "
                           "across all layers (engine.kv_cache_dtype fp8: half of bf16's)",
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
# KV tiers below the KV tensor (moed/kvcache/tiers): tier = host (L2) | disk (L3)
TIER_CAPACITY = Gauge("moed_kv_tier_capacity_bytes", "Capacity of a KV tier below the KV tensor",
                      ["tier"], registry=ENGINE)
TIER_USED = Gauge("moed_kv_tier_used_bytes", "Bytes of KV blocks a tier holds", ["tier"],
                  registry=ENGINE)
TIER_BLOCKS = Gauge("moed_kv_tier_blocks", "KV blocks a tier holds", ["tier"], registry=ENGINE)
TIER_HITS = Counter("moed_kv_tier_hit_blocks", "Prompt blocks missing from L1 found in this tier",
                    ["tier"], registry=ENGINE)
TIER_MISSES = Counter("moed_kv_tier_miss_blocks", "Prompt blocks missing from L1 looked up in "
                      "this tier and not found", ["tier"], registry=ENGINE)
TIER_LOADS = Counter("moed_kv_tier_loaded_blocks", "KV blocks loaded from this tier into L1",
                     ["tier"], registry=ENGINE)
TIER_LOAD_BYTES = Counter("moed_kv_tier_loaded_bytes", "Bytes loaded from this tier into L1",
                          ["tier"], registry=ENGINE)
TIER_CORRUPT = Counter("moed_kv_tier_corrupt_blocks", "Stored blocks that failed their checks "
                       "(truncated, bit-flipped, another layout): skipped and removed",
                       ["tier"], registry=ENGINE)
TIER_WRITE_ERRORS = Counter("moed_kv_tier_write_errors", "Block writes the medium refused "
                            "(e.g. disk full): the block is recomputed when needed", ["tier"],
                            registry=ENGINE)
TIER_IGNORED = Counter("moed_kv_tier_ignored_files", "Entries in the disk tier's directory that "
                       "are not regular files (a FIFO, a directory, a symlink), met at start "
                       "or by a load: left in place, never read", ["tier"], registry=ENGINE)
TIER_READ_TIMEOUTS = Counter("moed_kv_tier_read_timeouts", "Loads abandoned because a block "
                             "read made no progress for tiers.read_timeout_s: the request "
                             "recomputed", ["tier"], registry=ENGINE)
TIER_BANDWIDTH = Gauge("moed_kv_tier_read_bandwidth_bytes_per_second", "Measured read bandwidth "
                       "of a tier (what load-or-recompute predicts from)", ["tier"],
                       registry=ENGINE)
TIER_DECISIONS = Counter("moed_kv_tier_decisions", "Requests whose prompt had blocks below L1, "
                         "by load-or-recompute decision", ["decision"], registry=ENGINE)
TIER_SLOWER = Counter("moed_kv_tier_slower_than_recompute", "Loads whose request waited longer "
                      "for the blocks (until collected at a step boundary) than the predicted "
                      "recompute of the same blocks (goal: 0)", registry=ENGINE)
# cluster prefix reuse (moed/roles/kvshare.py): a colocated or prefill node READs a peer's
# cached blocks
PEER_LOOKUPS = Counter("moed_kv_peer_lookups", "Prompts whose prefix a peer advertises beyond "
                       "what this node holds, by load-or-recompute decision", ["decision"],
                       registry=ENGINE)
PEER_HITS = Counter("moed_kv_peer_hits", "Peer reads that landed blocks in this node's KV "
                    "tensor", registry=ENGINE)
PEER_READ_BLOCKS = Counter("moed_kv_peer_read_blocks", "KV blocks read from peers",
                           registry=ENGINE)
PEER_READ_BYTES = Counter("moed_kv_peer_read_bytes", "Bytes read from peers over NIXL",
                          registry=ENGINE)
PEER_FAILURES = Counter("moed_kv_peer_failures", "Peer reads given up (the request "
                        "recomputed), by reason", ["reason"], registry=ENGINE)
PEER_LEASES = Counter("moed_kv_peer_leases_granted", "Leases this node granted to peers "
                      "reading its cached blocks", registry=ENGINE)
PEER_LENT_BLOCKS = Gauge("moed_kv_peer_lent_blocks", "Blocks pinned for peers' reads now",
                         registry=ENGINE)
KV_EVENT_BATCHES = Counter("moed_kv_event_batches", "KV-event batches (kv_events, one per engine "
                           "step with KV changes) by outcome: sent on the PUB socket, or "
                           "dropped (publisher queue full or send failed)", ["outcome"],
                           registry=ENGINE)
# Speculative decoding ([speculative], docs/speculative.md), vLLM's spec_decode counters
SPEC_DRAFTS = Counter("moed_spec_decode_num_drafts", "Drafts verified (one per speculating "
                      "request per step)", registry=ENGINE)
SPEC_DRAFT_TOKENS = Counter("moed_spec_decode_num_draft_tokens", "Draft tokens verified",
                            registry=ENGINE)
SPEC_ACCEPTED = Counter("moed_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                        registry=ENGINE)
SPEC_ACCEPTED_POS = Counter("moed_spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                            "accepted by their position in the draft (0 = the first)",
                            ["position"], registry=ENGINE)
SPEC_STEPS = Counter("moed_spec_decode_steps", "Decode steps by the per-step switch's decision "
                     "(draft: the step may draft, plain: it may not) and its reason (warmup, "
                     "winner, explore)", ["decision", "reason"], registry=ENGINE)
MODEL_INFO = Info("moed_model", "The loaded model: architecture, dtype, device, attention backend, "
                  "whether the native CPU kernels run (cpu_kernels on/off) and the weights' "
                  "quantization (fp8/int8/int4/none)", registry=ENGINE)


# Expert load (EPLB input, imbalance panel): one series per (MoE layer, expert) that ever got a
# token -- bounded by the model (layers x experts), no request data in labels.
EXPERT_TOKENS = Counter("moed_expert_tokens", "Tokens routed to each logical expert, per MoE "
                        "layer (a token counts once per expert of its top-k)",
                        ["layer", "expert"], registry=ENGINE)
EXPERT_IMBALANCE = Gauge("moed_expert_imbalance",
                         "Max / mean tokens per expert of a MoE layer over the last expert-load "
                         "window (~1 s of steps); 1.0 = perfectly balanced", ["layer"],
                         registry=ENGINE)

# ---- the prefill balancer's cost model (moed.balance.cost, moed.engine.balancing) ----
COST_COEFFICIENT = Gauge("moed_cost_model_coefficient",
                         "Fitted step-time coefficient, seconds per unit of its term: overhead "
                         "(per step), prefill_tokens, attention_pairs, decode_seqs, "
                         "experts_touched, prefill_context, verified_positions", ["term"], registry=ENGINE)
COST_ERROR = Gauge("moed_cost_model_error_ratio",
                   "|predicted - measured| / measured step time over the last 1024 steps",
                   ["stat"], registry=ENGINE)
COST_STEPS = Counter("moed_cost_model_steps", "Engine steps the cost model was fitted on "
                     "(calibration included)", registry=ENGINE)
BALANCE_QUEUED_TOKENS = Gauge("moed_balance_queued_prompt_tokens",
                              "Prompt tokens still to compute, per length bucket (0 = the "
                              "shortest; balance.bucket_edges); cost policy only", ["bucket"],
                              registry=ENGINE)

# ---- capacity signals (moed.balance.capacity; docs/tracing.md: what an autoscaler reads);
# -1 = not measured yet. Set on scrape, like the engine stats.
CAPACITY_QUEUED_TOKENS = Gauge("moed_capacity_queued_prompt_tokens",
                               "Prompt tokens queued in the engine, still to compute (every "
                               "policy; incl. requests waiting for KV)", registry=ENGINE)
CAPACITY_PREFILL_TPS = Gauge("moed_capacity_prefill_tokens_per_second",
                             "Measured prompt tokens computed per second of engine step, "
                             "recent steps with prefill", registry=ENGINE)
CAPACITY_DECODE_STEP = Gauge("moed_capacity_decode_step_seconds",
                             "Measured mean time of a recent engine step that decoded",
                             registry=ENGINE)
CAPACITY_QUEUE_TIME = Gauge("moed_capacity_queue_seconds",
                            "Recent requests' mean wait from arrival to first scheduled",
                            registry=ENGINE)
CAPACITY_COMPUTE_TIME = Gauge("moed_capacity_compute_seconds",
                              "Recent requests' mean first scheduled -> first token (prefill "
                              "compute; decode node: remote prefill incl. transfer)",
                              registry=ENGINE)
CAPACITY_PREDICTED_TTFT = Gauge("moed_capacity_predicted_ttft_seconds",
                                "Predicted TTFT of a new prompt of balance.bucket_edges[0] "
                                "tokens given the queued work", registry=ENGINE)
CAPACITY_LEFT_TOKENS = Gauge("moed_capacity_left_prompt_tokens",
                             "Prompt tokens this node can still take and keep that prediction "
                             "within balance.ttft_targets_ms[0]: max(0, target - predicted) x "
                             "prefill tok/s", registry=ENGINE)
CAPACITY_ITL_HEADROOM = Gauge("moed_capacity_itl_headroom_ratio",
                              "1 - decode step time / balance.itl_target_ms (negative: steps "
                              "slower than the ITL target)", registry=ENGINE)


# Expert parallelism (moed/parallel): what this rank exchanges with its group, and what it holds.
EP_INFO = Gauge("moed_ep_rank_info", "1, labelled with this node's expert-parallel group "
                "(its rendezvous address), rank and size", ["group", "rank", "size"],
                registry=ENGINE)
EP_ROWS_SENT = Counter("moed_ep_tokens_dispatched", "Token-expert choices this rank sent to "
                       "other ranks' experts (summed over MoE layers)", registry=ENGINE)
EP_ROWS_RECEIVED = Counter("moed_ep_tokens_received", "Token-expert choices other ranks sent "
                           "to this rank's experts (summed over MoE layers)", registry=ENGINE)
EP_COLLECTIVE_TIME = Histogram("moed_ep_collective_seconds", "Time per engine step inside the "
                               "group's collectives (agreement and every MoE layer's "
                               "exchanges; waiting for slower ranks included)",
                               buckets=_PHASE_BUCKETS, registry=ENGINE)
EP_RESIDENT_EXPERT_BYTES = Gauge("moed_ep_resident_expert_bytes", "Bytes of expert weights this "
                                 "process holds, summed over the tensors it keeps (all MoE "
                                 "layers, redundant slots included)", registry=ENGINE)
EP_EXPERT_SLOTS = Gauge("moed_ep_expert_slots", "Expert slots this rank holds per MoE layer, "
                        "and how many of them are redundant (replicas; after a rebalance the "
                        "mean over MoE layers)", ["kind"],
                        registry=ENGINE)
# Cold experts (moed/model/cold): routed-expert weights kept resident by heat, the rest on disk.
EXPERT_WEIGHT_HITS = Counter("moed_expert_weight_hits", "Expert reads (an expert run by an MoE "
                             "layer in a step) whose weights were resident", registry=ENGINE)
EXPERT_WEIGHT_MISSES = Counter("moed_expert_weight_misses", "Expert reads whose weights had to "
                               "be read from disk first, the step waiting", registry=ENGINE)
EXPERT_WEIGHT_RESIDENT_BYTES = Gauge("moed_expert_weight_resident_bytes", "Routed-expert weight "
                                     "bytes per tier: resident (held in the kernels' layout), "
                                     "staged (read ahead, not installed yet), disk (the rest, in "
                                     "the checkpoint)", ["tier"], registry=ENGINE)
EXPERT_WEIGHT_MOVED_BYTES = Counter("moed_expert_weight_moved_bytes", "Expert-weight bytes "
                                    "brought into resident slots: miss (read while a step "
                                    "waited), promote (read ahead, installed between steps) or "
                                    "prefetch (predicted a layer ahead)",
                                    ["kind"], registry=ENGINE)
EXPERT_WEIGHT_MISS_STALL = Counter("moed_expert_weight_miss_stall_seconds", "Seconds steps "
                                   "waited for expert weights read on a miss", registry=ENGINE)
EXPERT_WEIGHT_READ_FAILURES = Counter("moed_expert_weight_read_failures", "Expert-weight reads "
                                      "that failed (miss: the step's requests failed; promote: "
                                      "dropped; prefetch: read again as a miss)", ["kind"],
                                      registry=ENGINE)
EXPERT_WEIGHT_PREFETCHES = Counter("moed_expert_weight_prefetches", "Layer-ahead prefetch reads "
                                   "of predicted experts: ready (complete when the layer needed "
                                   "the expert), waited (the step waited for it in flight), "
                                   "unused (read, not routed to: a wrong prediction), cached (not read: "
                                   "the page cache held it)",
                                   ["result"], registry=ENGINE)
EXPERT_WEIGHT_PREFETCH_WAIT = Counter("moed_expert_weight_prefetch_wait_seconds", "Seconds steps "
                                      "waited for prefetch reads still in flight", registry=ENGINE)
EPLB_BALANCEDNESS = Gauge("moed_eplb_balancedness", "Per MoE layer, at the last expert-balancer "
                          "decision: mean / max rank load under the group's load window, for the "
                          "map in use then (before) and the map chosen (after); 1 = even",
                          ["layer", "when"], registry=ENGINE)
EPLB_REBALANCES = Counter("moed_eplb_rebalances", "Expert-balancer decisions: applied (some "
                          "layer's map changed, all its layers now switched) or unchanged",
                          ["outcome"], registry=ENGINE)
EPLB_BYTES_MOVED = Counter("moed_eplb_expert_bytes_moved", "Expert weight bytes this rank wrote "
                           "into its slots in rebalances: from a peer rank or a local slot",
                           ["source"], registry=ENGINE)
EPLB_DURATION = Histogram("moed_eplb_rebalance_seconds", "A rebalance, from the decision to the "
                          "last layer switched (steps run in between)",
                          buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
                          registry=ENGINE)
EPLB_LAYERS_PENDING = Gauge("moed_eplb_layers_pending", "MoE layers whose new expert map is "
                            "decided but not applied yet (a rebalance under way)",
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


_STEP_CHILDREN: dict[tuple[str, str], Counter] = {}


def count_spec_step(decision: str, reason: str) -> None:
    """One speculative decode step in SPEC_STEPS (the engine counts every step: labels() takes a
    lock and builds a key, so each child is looked up once)."""
    child = _STEP_CHILDREN.get((decision, reason))
    if child is None:
        child = _STEP_CHILDREN[decision, reason] = SPEC_STEPS.labels(decision, reason)
    child.inc()


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
    KV_USAGE.set(_kv_usage(used, free))


def _kv_usage(used: int, free: int) -> float:
    return used / (used + free) if used + free else 0.0


def _waiting(stats: object) -> int:
    extra = getattr(stats, "extra", None) or {}
    return (getattr(stats, "waiting", 0) + getattr(stats, "waiting_remote_kv", 0)
            + int(extra.get("waiting_tier_kv", 0)))


# the prefix cache's and the tiers' counters, released in batches of requests (moed.obs.coarse)
_CACHE_GATE = CoarseTotals(16)


def observe_engine_stats(stats: object, cache_batch: int = 16) -> None:
    """Copy an EngineStats snapshot into the engine metrics (called on scrape). The counters
    that tell whether a prompt's prefix was cached move in batches of `cache_batch` requests
    (server.cache_metrics_batch)."""
    RUNNING.set(getattr(stats, "running", 0))
    extra = getattr(stats, "extra", None) or {}
    WAITING.set(_waiting(stats))
    observe_kv(getattr(stats, "kv_blocks_used", 0), getattr(stats, "kv_blocks_free", 0))
    KV_BLOCKS_CAPACITY.set(getattr(stats, "kv_blocks_total", 0))
    KV_BLOCKS_CACHED.set(extra.get("kv_blocks_cached", 0))
    _CACHE_GATE.batch = cache_batch
    cache = _CACHE_GATE.update(int(extra.get("prefix_cache_requests", 0)), {
        "queries": getattr(stats, "prefix_cache_queries", 0),
        "hits": getattr(stats, "prefix_cache_hits", 0),
        **{k: v for k, v in extra.items() if k in _TIER_GATED}})
    queries, hits = cache["queries"], cache["hits"]
    _advance(PREFIX_CACHE_QUERIES, queries)
    _advance(PREFIX_CACHE_HITS, hits)
    PREFIX_CACHE_HIT_RATE.set(hits / queries if queries else 0.0)
    _advance(PREEMPTIONS, extra.get("preemptions", 0.0))
    observe_cost(extra)
    observe_tiers({**extra, **{k: v for k, v in cache.items() if k in _TIER_GATED}})


_TIER_GAUGES = (("capacity_bytes", TIER_CAPACITY), ("used_bytes", TIER_USED),
                ("blocks", TIER_BLOCKS), ("bandwidth_bytes_per_s", TIER_BANDWIDTH))
_TIER_COUNTERS = (("hits", TIER_HITS), ("misses", TIER_MISSES), ("loads", TIER_LOADS),
                  ("load_bytes", TIER_LOAD_BYTES), ("corrupt", TIER_CORRUPT),
                  ("write_errors", TIER_WRITE_ERRORS), ("ignored", TIER_IGNORED),
                  ("read_timeouts", TIER_READ_TIMEOUTS))
# the tier keys that say whether a prompt's blocks were found (batched with the prefix cache's)
_TIER_GATED = frozenset({f"tier_{t}_{k}" for t in ("host", "disk")
                         for k in ("hits", "misses", "loads", "load_bytes")}
                        | {"tier_decisions_load", "tier_decisions_recompute"})


def observe_tiers(extra: dict) -> None:
    """The KV tiers' state (EngineStats.extra's tier_* keys, moed.kvcache.tiers.TieredCache.stats)."""
    for tier in ("host", "disk"):
        if f"tier_{tier}_capacity_bytes" not in extra:
            continue
        for key, gauge in _TIER_GAUGES:
            gauge.labels(tier).set(extra[f"tier_{tier}_{key}"])
        for key, counter in _TIER_COUNTERS:
            _advance(counter.labels(tier), extra[f"tier_{tier}_{key}"])
    if "tier_decisions_load" in extra:
        for d in ("load", "recompute"):
            _advance(TIER_DECISIONS.labels(d), extra[f"tier_decisions_{d}"])
        _advance(TIER_SLOWER, extra["tier_slower_than_recompute"])


_PEER_TOTALS = {"hits": PEER_HITS, "read_blocks": PEER_READ_BLOCKS,
                "read_bytes": PEER_READ_BYTES, "leases": PEER_LEASES}
_PEER_LABELLED = {"lookups": PEER_LOOKUPS, "failures": PEER_FAILURES}


def observe_peer(totals: Mapping[str, float]) -> None:
    """Cluster prefix reuse's running totals (moed.roles.kvshare, released in batches of
    requests): "hits", "read_blocks", "read_bytes", "leases", "lookups:<decision>",
    "failures:<reason>"."""
    for key, total in totals.items():
        kind, _, label = key.partition(":")
        labelled = _PEER_LABELLED.get(kind)
        _advance(labelled.labels(label) if labelled is not None else _PEER_TOTALS[kind], total)


def observe_capacity(c: object, queued_tokens: int) -> None:
    """A moed.balance.capacity.Capacity snapshot into the capacity gauges (on scrape)."""
    CAPACITY_QUEUED_TOKENS.set(queued_tokens)
    for gauge, name in ((CAPACITY_PREFILL_TPS, "prefill_tps"),
                        (CAPACITY_DECODE_STEP, "decode_step_s"), (CAPACITY_QUEUE_TIME, "queue_s"),
                        (CAPACITY_COMPUTE_TIME, "compute_s"),
                        (CAPACITY_PREDICTED_TTFT, "predicted_ttft_s"),
                        (CAPACITY_LEFT_TOKENS, "capacity_tokens"),
                        (CAPACITY_ITL_HEADROOM, "itl_headroom")):
        gauge.set(getattr(c, name))


def observe_cost(extra: dict) -> None:
    """The cost model's fit and the balancer's queue (EngineStats.extra's cost_* keys)."""
    for key, value in extra.items():
        if key.startswith("cost_coef_"):
            COST_COEFFICIENT.labels(key[len("cost_coef_"):]).set(value)
        elif key.startswith("cost_queued_tokens_b"):
            BALANCE_QUEUED_TOKENS.labels(key[len("cost_queued_tokens_b"):]).set(value)
    if "cost_error_p50" in extra:
        COST_ERROR.labels("p50").set(extra["cost_error_p50"])
        COST_ERROR.labels("p90").set(extra["cost_error_p90"])
    if "cost_samples" in extra:
        _advance(COST_STEPS, extra["cost_samples"])


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
CLUSTER_INCOMPATIBLE = Gauge("moed_cluster_incompatible_members",
                             "Alive members this node must not work with, by reason: protocol "
                             "(no common node-to-node protocol version), model or layout (a "
                             "prefill/decode pair on another checkpoint or KV layout)",
                             ["reason"], registry=CLUSTER)
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
TRANSFER_PREFILL_CHOICES = Counter("moed_transfer_prefill_choices",
                                   "Decode node: how each prefill job's node was chosen (cost: "
                                   "predicted finish time of the advertised queue and cost "
                                   "model; fewest_jobs: no candidate advertises a fitted model)",
                                   ["how"], registry=TRANSFER)
TRANSFER_LEASES_EXPIRED = Counter("moed_transfer_leases_expired",
                                  "Prefill jobs dropped because their lease ran out",
                                  registry=TRANSFER)


# ==== router ===============================================================================
# Observed by moed.api.proxy and moed.roles.router.

ROUTER_REQUESTS = Counter("moed_router_requests",
                          "Requests proxied by the router role by result (proxied, retried, "
                          "backend_refused, no_backend, saturated, failed_mid_stream, "
                          "client_gone)",
                          ["result"], registry=ROUTER)
ROUTER_RETRIES = Counter("moed_router_retries",
                         "Backend attempts that failed before the first byte and were retried "
                         "elsewhere", registry=ROUTER)
ROUTER_MIGRATIONS = Counter("moed_router_migrations",
                            "Streams moved to another node after theirs failed mid-way or "
                            "drained, by reason (connection, error_event, node_dead, drain; "
                            "docs/migration.md)",
                            ["reason"], registry=ROUTER)
ROUTER_BACKENDS = Gauge("moed_router_backends", "Serving nodes the router can pick now",
                        registry=ROUTER)
ROUTER_PLACEMENTS = Counter("moed_router_placements",
                            "Placement decisions by reason (moed.balance.router.place): "
                            "affinity (a node holding part of the prompt's prefix), overloaded "
                            "(a holder was passed over for load), load (no holder), saturated "
                            "(every node at its limit: 429)", ["reason"], registry=ROUTER)

# Per version label of the serving node (release.version_label): the canary vs baseline row.
# Labels are bounded by the versions running at once (an operator's choice, a handful).
ROUTER_VERSION_ATTEMPTS = Counter("moed_router_version_attempts",
                                  "Backend attempts by the serving node's version label and "
                                  "result: ok, error (connect failure, 5xx, cut mid-stream), "
                                  "refused (429), client_error (other 4xx)",
                                  ["version", "result"], registry=ROUTER)
ROUTER_VERSION_TTFT = Histogram("moed_router_version_ttft_seconds",
                                "Streamed responses: time from forwarding to the first token, "
                                "by the serving node's version label", ["version"],
                                buckets=_REQUEST_BUCKETS, registry=ROUTER)
ROUTER_VERSION_ITL = Histogram("moed_router_version_itl_seconds",
                               "Streamed responses: time between consecutive chunks of tokens, "
                               "by the serving node's version label", ["version"],
                               buckets=_TOKEN_BUCKETS, registry=ROUTER)
ROUTER_CANARY_REQUESTS = Counter("moed_router_canary_requests",
                                 "Requests by the side chosen (canary, baseline) and how "
                                 "(share, header, fallback: the chosen side had no node)",
                                 ["side", "how"], registry=ROUTER)
ROUTER_CANARY_HEALTH = Gauge("moed_router_canary_health",
                             "The canary verdict over canary.window_s, every 5 s: 1 healthy, "
                             "0 unhealthy, -1 too few canary attempts (canary.min_requests); "
                             "one series, for the canary's label (none without canary.label)",
                             ["label"], registry=ROUTER)


# ==== vLLM's names (server.vllm_metrics_path) ==============================================
# The gauges the Gateway API Inference Extension's endpoint picker scrapes from a vLLM server
# (its default metric specs), set from the same values as moed's own on each scrape. Not an
# area of any role: they are served only when server.vllm_metrics_path is set, and their
# colons fail promtool's lint, so moed's own /metrics stays clean unless the path is /metrics.

VLLM = CollectorRegistry(auto_describe=True)
VLLM_WAITING = Gauge("vllm:num_requests_waiting", "Requests waiting (moed_requests_waiting)",
                     ["model_name", "engine"], registry=VLLM)
VLLM_RUNNING = Gauge("vllm:num_requests_running", "Requests running "
                     "(moed_requests_running)", ["model_name", "engine"], registry=VLLM)
VLLM_KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1 (a ratio, despite "
                      "the name: moed_kv_cache_usage_ratio)", ["model_name", "engine"],
                      registry=VLLM)
VLLM_CACHE_CONFIG = Gauge("vllm:cache_config_info", "1, labelled with the KV cache's block "
                          "size and blocks (moed_kv_blocks_capacity)",
                          ["model_name", "engine", "block_size", "num_gpu_blocks"],
                          registry=VLLM)


def render_vllm(stats: object, block_size: int) -> bytes:
    """The vLLM-named gauges from an EngineStats snapshot, by the same functions as moed's own
    (observe_engine_stats)."""
    labels = (_MODEL_NAME, "0")
    VLLM_WAITING.labels(*labels).set(_waiting(stats))
    VLLM_RUNNING.labels(*labels).set(getattr(stats, "running", 0))
    VLLM_KV_USAGE.labels(*labels).set(_kv_usage(getattr(stats, "kv_blocks_used", 0),
                                                getattr(stats, "kv_blocks_free", 0)))
    VLLM_CACHE_CONFIG.clear()       # one series: its labels are the pool's shape
    VLLM_CACHE_CONFIG.labels(*labels, str(block_size),
                             str(getattr(stats, "kv_blocks_total", 0))).set(1)
    return generate_latest(VLLM)


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
