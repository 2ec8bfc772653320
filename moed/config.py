"""Configuration: frozen dataclasses per section, loaded as defaults < TOML < MOED_* env < flags.

Every field says whether it can change on a running node (`live`) or needs a restart; `diff`
uses that for SIGHUP reload. Unknown keys are errors. Secrets never live in the TOML: it names
a file or an environment variable that holds them.

Environment: MOED_<SECTION>_<FIELD>, e.g. MOED_SERVER_PORT=9000, MOED_CLUSTER_SEEDS=a:1,b:2.
Any other MOED_* variable is an error naming it and the closest valid name (a misspelt
setting must not be ignored), except the few moed reads itself (`OTHER_ENV`) and those the
config names as holding a secret (server.api_keys_env, admin_token_env, cluster.key_env).

Every number has bounds (`bounds=(lo, hi)` on its field, required by `_f`): a value outside
them, NaN or infinity is refused, so no typo (max_num_seqs = 10**20) reaches a running node.
The file must be a regular file of UTF-8 text of at most MAX_CONFIG_BYTES (`read_regular_file`):
a FIFO or device is refused without being opened, so neither a start nor a SIGHUP ever blocks.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import stat
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping

ROLES = ("colocated", "prefill", "decode", "router")
LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
MODEL_DTYPES = ("auto", "bfloat16", "float32", "float16")
QUANTIZATIONS = ("", "fp8", "int8", "int4")     # moed.model.quant.formats.ONLINE, "" = none/checkpoint's
TOOL_PARSERS = ("auto", "none", "qwen", "mistral")   # moed.model.tool_parsers.PARSER_SETTINGS
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")       # moed.model.kv_layout.kv_cache_dtype
PREFIX_CACHE_ISOLATION = ("shared", "api_key")      # moed.api.salt.ISOLATION
METRICS_ACCESS = ("open", "api_key", "operator")
MAX_CONFIG_BYTES = 1 << 20          # a config file is a few KiB; more is a mistake (or /dev/zero)
INT64 = (-(1 << 63), (1 << 63) - 1)
MS_HOUR, MS_DAY = 3_600_000, 86_400_000


class ConfigError(ValueError):
    """A config file, variable or flag is wrong; the message says which and why."""


def _f(default: Any, *, live: bool = False, doc: str = "",
       bounds: tuple[float, float] | None = None, **kw: Any) -> Any:
    """A config field. live=True: may change on SIGHUP without a restart. A number needs
    bounds=(lo, hi), inclusive: a field cannot be added without deciding its sane range."""
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for sequence defaults")
    numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
    if numeric != (bounds is not None):
        raise TypeError("a numeric field needs bounds=(lo, hi); other fields take none")
    if bounds is not None and not (INT64[0] <= bounds[0] <= default <= bounds[1] <= INT64[1]):
        raise TypeError(f"default {default} outside bounds {bounds} (or bounds beyond 64 bits)")
    meta: dict[str, Any] = {"live": live, "doc": doc}
    if bounds is not None:
        meta["bounds"] = bounds
    return field(default=default, metadata=meta, **kw)


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
class ModelConfig:
    path: str = _f("", doc="Hugging Face checkpoint directory")
    served_name: str = _f("", doc="model id in the API; default: the directory name")
    dtype: str = _f("auto", doc="auto (from config.json) | bfloat16 | float32 | float16")
    device: str = _f("auto", doc="auto | cpu | cuda | cuda:N")
    max_model_len: int = _f(0, bounds=(0, 1 << 24),
                            doc="0 = the checkpoint's max_position_embeddings")
    tool_parser: str = _f("auto", doc="format of the model's tool calls: auto (from the chat "
                                      "template, then model_type) | qwen | mistral | none")
    quantization: str = _f("", doc="weights quantized at load (vLLM's --quantization): fp8 "
                                   "(128x128 blocks) | int8 (per output channel) | int4 (groups "
                                   "of quantization_group_size); \"\" = the checkpoint's own "
                                   "(quantization_config) or none")
    quantization_group_size: int = _f(128, bounds=(2, 1 << 16),
                                      doc="input columns per int4 scale (model.quantization int4)")

    def __post_init__(self) -> None:
        _check_bounds("model", self)
        _choice("model.dtype", self.dtype, MODEL_DTYPES)
        _choice("model.tool_parser", self.tool_parser, TOOL_PARSERS)
        _choice("model.quantization", self.quantization, QUANTIZATIONS)
        if self.quantization_group_size % 2:
            raise ConfigError(f"model.quantization_group_size: {self.quantization_group_size} "
                              f"is odd; two int4 values share a byte")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device: {_short(self.device)} is not auto, cpu, cuda "
                              f"or cuda:N")


@dataclass(frozen=True)
class EngineConfig:
    attention_backend: str = _f("auto", doc="auto | torch | flashinfer")
    block_size: int = _f(16, bounds=(1, 1024), doc="tokens per KV block")
    num_kv_blocks: int = _f(0, bounds=(0, 1 << 24),
                            doc="0 = size from kv_cache_memory_fraction or kv_cache_memory_mb")
    kv_cache_memory_mb: int = _f(512, bounds=(1, 1 << 24),
                                 doc="KV cache size in MB (unless the fraction is set)")
    kv_cache_memory_fraction: float = _f(0.0, bounds=(0, 0.95),
                                         doc="KV cache = this share of the memory still "
                                         "available at start beside the weights (host "
                                         "MemAvailable capped by the cgroup; free GPU memory); "
                                         "0 = use kv_cache_memory_mb")
    kv_cache_dtype: str = _f("auto", doc="auto: the model's dtype | fp8 (= fp8_e4m3: float8 "
                                         "e4m3, a fixed scale of 1.0 per layer, half the bytes "
                                         "of bf16; vLLM's fp8_e5m2 is refused)")
    enable_prefix_caching: bool = _f(True)
    max_num_seqs: int = _f(64, live=True, bounds=(1, 1 << 16), doc="running requests per step")
    max_num_batched_tokens: int = _f(512, live=True, bounds=(1, 1 << 24),
                                     doc="token budget per step (chunked prefill)")
    num_threads: int = _f(0, bounds=(0, 1024),
                          doc="torch intra-op threads of the step; 0 = auto: OMP_NUM_THREADS "
                              "if set, else the cores this process may use minus one")

    def __post_init__(self) -> None:
        _check_bounds("engine", self)
        _choice("engine.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ConfigError("engine.kv_cache_dtype: fp8_e5m2 is not supported; moed's fp8 KV "
                              "cache is e4m3 (fp8 or fp8_e4m3)")
        _choice("engine.kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.num_kv_blocks and self.kv_cache_memory_fraction:
            raise ConfigError("engine.kv_cache_memory_fraction: set it or engine.num_kv_blocks, "
                              "not both (each sizes the KV cache)")


@dataclass(frozen=True)
class AdmissionConfig:
    max_waiting_requests: int = _f(256, live=True, bounds=(1, 1 << 20), doc="beyond this: 429")
    max_queued_prompt_tokens: int = _f(262144, live=True, bounds=(1, 1 << 32),
                                       doc="beyond this: 429")
    retry_after_s: int = _f(1, live=True, bounds=(0, 3600))

    def __post_init__(self) -> None:
        _check_bounds("admission", self)


@dataclass(frozen=True)
class ClusterConfig:
    enabled: bool = _f(False, doc="join the gossip membership")
    bind_host: str = _f("127.0.0.1")
    bind_port: int = _f(7946, bounds=(0, 65535))
    advertise_host: str = _f("", doc="default: bind_host")
    seeds: tuple[str, ...] = _f((), live=True, doc="host:port of any members")
    key_file: str = _f("", live=True, doc="HMAC key (hex or raw bytes)")
    key_env: str = _f("", live=True)
    secondary_key_file: str = _f("", live=True, doc="also accepted, during key rotation")
    insecure: bool = _f(False, doc="allow running without a cluster key")
    probe_interval_ms: int = _f(1000, live=True, bounds=(1, MS_HOUR))
    probe_timeout_ms: int = _f(500, live=True, bounds=(1, MS_HOUR))
    indirect_checks: int = _f(3, live=True, bounds=(0, 64))
    gossip_interval_ms: int = _f(200, live=True, bounds=(1, MS_HOUR))
    gossip_nodes: int = _f(3, live=True, bounds=(1, 1024))
    push_pull_interval_ms: int = _f(30000, live=True, bounds=(1, MS_DAY))
    suspicion_mult: int = _f(1, live=True, bounds=(1, 100),
                             doc="min suspicion = mult * log10(n) * probe "
                             "interval (memberlist LAN: 4; Lifeguard confirmations and "
                             "re-probes keep 1 safe, see moed/cluster/swim.py)")
    suspicion_max_timeout_mult: int = _f(6, live=True, bounds=(1, 100),
                                         doc="max suspicion = this * min")
    suspicion_confirmations: int = _f(2, live=True, bounds=(0, 64),
                                      doc="independent suspecters that bring "
                                      "the timeout down to its min (Lifeguard k)")
    suspicion_reprobes: int = _f(4, live=True, bounds=(0, 64),
                                 doc="members that re-probe a fresh suspect at once (0 = off)")
    join_retry_ms: int = _f(1000, live=True, bounds=(1, MS_HOUR),
                            doc="while alone, knock on the seeds this often")
    dead_reclaim_ms: int = _f(30000, live=True, bounds=(1, 7 * MS_DAY),
                              doc="forget dead/left members after this")
    replay_window_ms: int = _f(120000, live=True, bounds=(0, 1 << 31),
                               doc="drop packets stamped further from our clock (0 = off)")
    retransmit_mult: int = _f(4, live=True, bounds=(1, 64))
    awareness_max_multiplier: int = _f(8, live=True, bounds=(1, 64))
    load_update_interval_ms: int = _f(1000, live=True, bounds=(1, MS_HOUR))

    def __post_init__(self) -> None:
        _check_bounds("cluster", self)
        for s in self.seeds:
            if ":" not in s:
                raise ConfigError(f"cluster.seeds: {_short(s)} is not host:port")


@dataclass(frozen=True)
class TransferConfig:
    backend: str = _f("nixl", doc="KV transfer backend for prefill/decode roles")
    prefill_peers: tuple[str, ...] = _f((), live=True,
                                        doc="static prefill node URLs when membership is off")
    lease_s: float = _f(30.0, live=True, bounds=(0.001, 86400),
                        doc="a prefill job's lease: held while the decode "
                        "node's job stream stays open, at most this long (or its deadline)")
    prefill_timeout_s: float = _f(60.0, live=True, bounds=(0.001, 86400))
    max_prefill_retries: int = _f(2, live=True, bounds=(0, 16))
    peer_error_cooldown_s: float = _f(5.0, live=True, bounds=(0, 3600),
                                      doc="half-open retry after failures")
    local_prefill_max_tokens: int = _f(0, live=True, bounds=(0, 1 << 24),
                                       doc="decode role: prompts up to this many "
                                       "tokens are prefilled locally (0 = always remote)")

    def __post_init__(self) -> None:
        _check_bounds("transfer", self)
        _choice("transfer.backend", self.backend, ("nixl",))
        for u in self.prefill_peers:
            if not u.startswith(("http://", "https://")):
                raise ConfigError(f"transfer.prefill_peers: {_short(u)} is not an http(s):// URL")


@dataclass(frozen=True)
class RouterConfig:
    """The router role (no model): picks a live serving node and proxies /v1/* to it."""
    backends: tuple[str, ...] = _f((), live=True,
                                   doc="static backend base URLs when membership is off")
    backend_roles: tuple[str, ...] = _f(("decode", "colocated"), live=True,
                                        doc="membership roles the router sends requests to")
    health_interval_s: float = _f(0.5, live=True, bounds=(0.001, 3600),
                                  doc="static backends: /ready poll period")
    connect_timeout_s: float = _f(2.0, live=True, bounds=(0.001, 3600))
    max_attempts: int = _f(3, live=True, bounds=(1, 16),
                           doc="backends tried before the first byte is sent")
    max_connections: int = _f(1024, bounds=(1, 1 << 20),
                              doc="pooled connections to all backends together")

    def __post_init__(self) -> None:
        _check_bounds("router", self)
        for b in self.backends:
            if not b.startswith(("http://", "https://")):
                raise ConfigError(f"router.backends: {_short(b)} is not an http(s):// URL")
        for r in self.backend_roles:
            _choice("router.backend_roles", r, ("decode", "colocated", "prefill"))


BALANCE_POLICIES = ("tokens", "cost")


@dataclass(frozen=True)
class BalanceConfig:
    """The prefill balancer (moed/balance/budget.py, cost.py): how each step's prefill is
    budgeted. "tokens": engine.max_num_batched_tokens per step, first come first served
    (vLLM's shape). "cost": each step gets a time budget from the attention cost model fitted
    on this node's own steps; prompts are ordered by slack to their length bucket's TTFT
    target; engine.max_num_batched_tokens stays the hard cap on one step's tokens."""
    policy: str = _f("cost", live=True, doc="tokens | cost")
    itl_target_ms: float = _f(100.0, live=True, bounds=(1.0, 60000.0),
                              doc="cost policy: a step with decodes takes at most this long "
                              "(prefill fills what the decodes leave)")
    prefill_step_ms: float = _f(0.0, live=True, bounds=(0.0, 600000.0),
                                doc="cost policy: chunks of prompts that do not finish in a "
                                "step fill at most this long (and at most itl_target_ms); a "
                                "step without decodes may grow to half the smallest TTFT "
                                "target to finish whole prompts; 0 = the smallest TTFT "
                                "target / 4")
    bucket_edges: tuple[int, ...] = _f((512, 4096, 32768), live=True,
                                       doc="prompt length bucket edges (tokens), increasing; "
                                       "N edges make N + 1 buckets, the last unbounded")
    ttft_targets_ms: tuple[float, ...] = _f((500.0, 2000.0, 10000.0, 60000.0), live=True,
                                            doc="TTFT target per bucket (one more than "
                                            "bucket_edges): orders prompts, sizes early "
                                            "rejection")
    max_partial_prefills: int = _f(4, live=True, bounds=(1, 1024),
                                   doc="cost policy: prompts whose prefill is under way at once")
    reject_over_target: float = _f(0.0, live=True, bounds=(0.0, 1000.0),
                                   doc="cost policy: refuse (429) a request whose predicted "
                                   "TTFT exceeds this many times its bucket's target; 0 = only "
                                   "when it exceeds server.request_timeout_s")
    forgetting: float = _f(0.995, bounds=(0.5, 1.0),
                           doc="the cost model's RLS forgetting factor (1 = never forget)")
    calibration_steps: int = _f(12, bounds=(0, 1000),
                                doc="synthetic steps run before /ready so the first requests "
                                "are budgeted from a fitted model (0 = none: the token budget "
                                "applies until enough real steps were measured)")
    # node choice and placement (moed/balance/prefill.py, router.py; docs/cluster.md)
    prefill_choices: int = _f(2, live=True, bounds=(1, 64),
                              doc="decode node: prefill nodes drawn at random per job, the one "
                              "predicted to finish it first wins (power of d choices)")
    affinity_weight: float = _f(2.0, live=True, bounds=(0.0, 1000.0),
                                doc="router: queued requests a fully cached prompt is worth "
                                "when placing it (prefix affinity); 0 = off")
    prefix_digest_size: int = _f(16, live=True, bounds=(0, 32),
                                 doc="cached leading-block hashes a node gossips for prefix "
                                 "affinity (8 bytes each); 0 = none")
    router_max_waiting: int = _f(64, live=True, bounds=(0, 1 << 20),
                                 doc="router: a node with this many waiting requests (its "
                                 "report + this router's unanswered ones) is saturated; all "
                                 "saturated → 429 with Retry-After; 0 = no limit")

    def __post_init__(self) -> None:
        _check_bounds("balance", self)
        _choice("balance.policy", self.policy, BALANCE_POLICIES)
        edges = self.bucket_edges
        if len(edges) > 7:             # the gossip carries at most 8 buckets (cluster.state)
            raise ConfigError(f"balance.bucket_edges: at most 7 edges, got {len(edges)}")
        if any(not 1 <= e <= (1 << 30) for e in edges) or list(edges) != sorted(set(edges)):
            raise ConfigError(f"balance.bucket_edges: {_short(edges)} must be strictly "
                              f"increasing token counts in [1, 2^30]")
        if len(self.ttft_targets_ms) != len(edges) + 1:
            raise ConfigError(f"balance.ttft_targets_ms: {len(edges)} bucket edges need "
                              f"{len(edges) + 1} targets, got {len(self.ttft_targets_ms)}")
        for t in self.ttft_targets_ms:
            _range("balance.ttft_targets_ms", t, 1.0, 86_400_000.0)


LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-")


def _label(name: str, value: str) -> None:
    """A version label travels in gossip and in metric labels: short, plain characters."""
    if len(value) > 64 or not set(value) <= LABEL_CHARS:
        raise ConfigError(f"{name}: {_short(value)} is not a version label (at most 64 of "
                          f"A-Z a-z 0-9 . _ + -)")


@dataclass(frozen=True)
class ReleaseConfig:
    """What this node says about its release (membership, per-version metrics) and how much
    config history it keeps (moed/ops/history.py)."""
    version_label: str = _f("", doc="this node's version in membership, canary routing and "
                            "per-version metrics; default: the moed version. Set it to tell "
                            "two processes of one build apart (canary vs baseline)")
    config_history: int = _f(20, live=True, bounds=(1, 1000),
                             doc="applied configs kept (start, reloads, rollbacks), newest last")

    def label(self) -> str:
        """The version label this node advertises."""
        from moed import __version__
        return self.version_label or __version__

    def __post_init__(self) -> None:
        _check_bounds("release", self)
        _label("release.version_label", self.version_label)


CANARY_HEADER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")


@dataclass(frozen=True)
class CanaryConfig:
    """The router role's canary split (moed/balance/canary.py): a share of requests, or those
    that ask with a header, go to the nodes whose version label is `label`; the rest to the
    others (the baseline). /admin/canary and `moed canary` compare the two over `window_s`."""
    label: str = _f("", live=True, doc="version label of the canary nodes; empty = no canary")
    share: float = _f(0.0, live=True, bounds=(0.0, 1.0),
                      doc="fraction of requests sent to the canary (0..1)")
    header: str = _f("X-Moed-Canary", live=True,
                     doc="request header that picks the side: 1/canary or 0/baseline "
                     "(anything else: 400); empty = not read")
    window_s: float = _f(300.0, live=True, bounds=(1.0, 86400.0),
                         doc="canary figures cover the requests of this last stretch")
    min_requests: int = _f(20, live=True, bounds=(1, 1 << 20),
                           doc="canary attempts in the window before a verdict is given")
    max_error_rate_increase: float = _f(0.02, live=True, bounds=(0.0, 1.0),
                                        doc="unhealthy when the canary's error rate exceeds "
                                        "the baseline's by more than this")
    max_ttft_ratio: float = _f(1.5, live=True, bounds=(1.0, 1000.0),
                               doc="unhealthy when the canary's median TTFT exceeds the "
                               "baseline's by this factor")
    max_itl_ratio: float = _f(1.5, live=True, bounds=(1.0, 1000.0),
                              doc="unhealthy when the canary's median inter-token latency "
                              "exceeds the baseline's by this factor")

    def __post_init__(self) -> None:
        _check_bounds("canary", self)
        _label("canary.label", self.label)
        if self.header and (len(self.header) > 64 or not set(self.header) <= CANARY_HEADER_CHARS):
            raise ConfigError(f"canary.header: {_short(self.header)} is not a header name")


@dataclass(frozen=True)
class ParallelConfig:
    """Expert parallelism (moed/parallel, docs/parallel.md): ep_size `moed serve` processes,
    one per rank, each with its own HTTP port, scheduler and KV cache, hold the experts
    between them; attention is data parallel. The group's ranks must agree on every field."""
    ep_size: int = _f(1, bounds=(1, 1024), doc="ranks in the expert-parallel group; 1 = off")
    ep_rank: int = _f(0, bounds=(0, 1023), doc="this process's rank, 0 .. ep_size-1")
    ep_init: str = _f("", doc="tcp://host:port of rank 0's rendezvous (rank 0 listens "
                      "there); required when ep_size > 1")
    collective_timeout_s: float = _f(30.0, bounds=(0.1, 3600),
                                     doc="a peer silent this long in a step's exchange fails "
                                     "the group: in-flight requests end 503, the node exits 1")
    rendezvous_timeout_s: float = _f(300.0, bounds=(1, 86400),
                                     doc="how long a starting rank waits for the others")
    rank_memory_mb: int = _f(0, bounds=(0, 1 << 30),
                             doc="memory this rank may use for weights (dense + its experts) "
                             "and KV blocks; a start that does not fit is refused (0 = no check)")
    redundant_experts: int = _f(0, bounds=(0, 1024),
                                doc="extra expert slots per rank per MoE layer, beyond "
                                "ceil(experts / ep_size): replicas of hot experts (EPLB)")
    eplb_interval_s: float = _f(0.0, bounds=(0, 7 * 86400),
                                doc="seconds between expert-balancer decisions over the group's "
                                "expert-load window (0 = the initial layout is kept)")
    eplb_min_gain: float = _f(0.01, bounds=(0, 1),
                              doc="a layer's map changes only if its predicted balancedness "
                              "gain exceeds this")
    eplb_layers_per_step: int = _f(1, bounds=(1, 1024),
                                   doc="MoE layers whose new expert map is applied per step "
                                   "while a rebalance is under way")
    eplb_step_mb: float = _f(2.0, bounds=(0, 1 << 20),
                             doc="expert-weight MB a rank sends, receives or copies per step "
                             "while a rebalance is under way (at least one expert; a layer "
                             "switches once all its experts are in); 0 = whole layers")

    def __post_init__(self) -> None:
        # the checks across fields (ep_rank < ep_size, ep_init given) are the pre-flight's
        # (moed/preflight.py: parallel), so each field loads alone at its bounds
        _check_bounds("parallel", self)
        if self.ep_init:
            host, _, port = self.ep_init.removeprefix("tcp://").rpartition(":")
            if not self.ep_init.startswith("tcp://") or not host or not port.isdigit() \
                    or not 0 < int(port) < 65536:
                raise ConfigError(f"parallel.ep_init: {_short(self.ep_init)} is not "
                                  f"tcp://host:port")


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


@dataclass(frozen=True)
class TiersConfig:
    """KV tiers below the engine's KV tensor (moed/kvcache/tiers, docs/kv-tiers.md): L2 host
    memory and L3 local disk, each with a capacity in bytes; 0 turns a tier off."""
    host_bytes: int = _f(0, bounds=(0, 1 << 50), doc="L2 host-memory tier capacity; 0 = off")
    disk_bytes: int = _f(0, bounds=(0, 1 << 56), doc="L3 disk tier capacity; 0 = off")
    disk_dir: str = _f("", doc="directory of the L3 block files (a subdirectory per KV "
                       "layout and checkpoint); required with disk_bytes; kept across restarts")
    disk_io: str = _f("auto", doc="how L3 payloads are read and written: nixl (NIXL's POSIX "
                      "backend) | file (pread/pwrite) | auto (nixl when it loads, else file)")
    write_through: bool = _f(False, doc="also copy each block below when it is first "
                             "completed (hot data), not only when L1 evicts it")
    load_threads: int = _f(2, bounds=(1, 64), doc="threads that read L2/L3 payloads for "
                           "loads (as many spares stand in for threads stuck in a read)")
    read_timeout_s: float = _f(5.0, bounds=(0.001, 3600.0), doc="a load whose block read "
                               "makes no progress this long is abandoned: the request "
                               "recomputes")
    host_bandwidth_mbps: float = _f(5000.0, bounds=(0.001, 1e9),
                                    doc="L2 read bandwidth assumed until measured (MB/s)")
    disk_bandwidth_mbps: float = _f(500.0, bounds=(0.001, 1e9),
                                    doc="L3 read bandwidth assumed until measured (MB/s)")
    recompute_us_per_token: float = _f(100.0, bounds=(0.0, 1e9),
                                       doc="prefill time per token assumed by load-or-recompute "
                                       "until the cost model is fitted (microseconds)")
    reuse_half_life_s: float = _f(60.0, bounds=(0.001, 1e9),
                                  doc="eviction: a block's reuse count counts half after this "
                                  "long unused")
    peer_reuse: bool = _f(False, doc="cluster prefix reuse (colocated and prefill nodes): a "
                          "prompt prefix another colocated or prefill node caches (its gossip "
                          "digest) is READ from it over NIXL when that is predicted faster than "
                          "recomputing; this node also lends its cached blocks to peers "
                          "(POST /internal/kv/lease)")
    peer_bandwidth_mbps: float = _f(1000.0, bounds=(0.001, 1e9),
                                    doc="peer READ bandwidth (MB/s) assumed until "
                                    "measured")

    def __post_init__(self) -> None:
        # across fields (disk_bytes needs disk_dir, a writable one): moed/preflight.py: tiers
        _check_bounds("tiers", self)
        _choice("tiers.disk_io", self.disk_io, ("auto", "nixl", "file"))

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0


KV_EVENT_PUBLISHERS = ("zmq", "null")
KV_EVENT_FORMATS = ("map", "array")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KV-events stream (moed/kvcache/events.py, docs/kv-events.md): the blocks this
    node's KV tiers store and drop, published over ZMQ in vLLM's wire format for prefix-aware
    routers (llm-d's precise prefix-cache scorer, Dynamo's KV router). The field names are
    vLLM's `--kv-events-config` keys; that flag takes the same JSON."""
    enable_kv_cache_events: bool = _f(False, doc="publish KV block events")
    publisher: str = _f("", doc="zmq | null; empty: zmq when enable_kv_cache_events, else null")
    endpoint: str = _f("tcp://*:5557", doc="the PUB socket: bound when it holds * or :: (or "
                       "is ipc:// or inproc://), else connected (vLLM's rule); on an "
                       "expert-parallel rank the port is offset by the rank")
    replay_endpoint: str = _f("", doc="the ROUTER socket that replays buffered batches from "
                              "a sequence number (always bound); empty = no replay")
    buffer_steps: int = _f(10_000, bounds=(1, 10_000_000),
                           doc="batches kept for replay (one batch per engine step at most)")
    hwm: int = _f(100_000, bounds=(1, 1 << 31), doc="the PUB socket's send high-water mark")
    max_queue_size: int = _f(100_000, bounds=(1, 10_000_000),
                             doc="batches waiting for the publisher thread; beyond it a batch "
                             "is dropped and counted (moed_kv_event_batches_total)")
    topic: str = _f("", doc="the first frame of every message (subscribers filter on it)")
    event_format: str = _f("map", doc="moed's addition to vLLM's keys: map (each event a map "
                           "tagged by type, as vLLM sends since its PR #42892) | array (the "
                           "positional arrays earlier vLLM sent, for consumers not yet updated)")

    def __post_init__(self) -> None:
        _check_bounds("kv_events", self)
        _choice("kv_events.event_format", self.event_format, KV_EVENT_FORMATS)
        if self.publisher:
            _choice("kv_events.publisher", self.publisher, KV_EVENT_PUBLISHERS)
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            if v and not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"kv_events.{name}: {_short(v)} is not a tcp://, ipc:// or "
                                  f"inproc:// ZMQ endpoint")
        if self.active and not self.endpoint:
            raise ConfigError("kv_events.endpoint: publishing needs an endpoint")

    @property
    def active(self) -> bool:
        """Events are published (vLLM: enabled and the publisher is not null)."""
        return self.enable_kv_cache_events and self.publisher in ("", "zmq")


@dataclass(frozen=True)
class StructuredConfig:
    """Structured outputs' budget (moed/model/grammar.py, docs/api.md): grammars compile on
    their own pool before admission, under a time budget and llguidance's limits; a request
    whose grammar overruns them is a 400 `grammar_too_complex`, alone."""
    compile_workers: int = _f(2, bounds=(1, 64), doc="threads that compile grammars (apart "
                              "from the parse/tokenize pool)")
    compile_queue: int = _f(32, bounds=(1, 4096), doc="compilations waiting for a worker; "
                            "beyond this: 429 grammar_busy")
    compile_queue_timeout_s: float = _f(10.0, bounds=(0.01, 3600.0), doc="a compilation not "
                                        "started within this: 429 grammar_busy")
    compile_timeout_s: float = _f(2.0, bounds=(0.01, 600.0), doc="one grammar's compile and "
                                  "probe budget (wall clock): past it, 400 grammar_too_complex")
    mask_timeout_ms: int = _f(100, bounds=(1, 60000), doc="a request whose token mask is still "
                              "computing this long after it began is failed alone (400 "
                              "grammar_too_complex)")
    mask_workers: int = _f(2, bounds=(1, 64), doc="threads that compute token masks while the "
                           "forward pass runs")
    probe_tokens: int = _f(8, bounds=(1, 1024), doc="tokens tried at each of the compile "
                           "probe's first step")
    probe_depth: int = _f(3, bounds=(1, 64), doc="steps the compile probe walks")
    max_grammar_size: int = _f(500_000, bounds=(1, 1 << 32), doc="llguidance: symbols in the "
                               "grammar's productions")
    initial_lexer_fuel: int = _f(1_000_000, bounds=(1, 1 << 40), doc="llguidance: lexer "
                                 "construction fuel (~50k/ms)")
    step_lexer_fuel: int = _f(200_000, bounds=(1, 1 << 40), doc="llguidance: one mask's lexer "
                              "fuel (~14k/ms)")
    step_max_items: int = _f(50_000, bounds=(1, 1 << 32), doc="llguidance: Earley items per "
                             "mask (~20k/ms)")
    max_items_in_row: int = _f(2_000, bounds=(1, 1 << 32), doc="llguidance: items in one "
                               "Earley row (a schema of many optional properties hits it)")
    max_lexer_states: int = _f(250_000, bounds=(1, 1 << 32), doc="llguidance: lexer states "
                               "per grammar, shared by its requests (~1-2 kB each)")

    def __post_init__(self) -> None:
        _check_bounds("structured", self)


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    structured: StructuredConfig = field(default_factory=StructuredConfig)

    def __post_init__(self) -> None:
        if self.server.role != "router" and not self.model.path:
            raise ConfigError(f"model.path is required for role {self.server.role!r}")
        if self.server.role == "router" and self.parallel.ep_size > 1:
            raise ConfigError("parallel.ep_size: a router holds no model (expert parallelism "
                              "is for colocated, prefill and decode nodes)")
        if self.tiers.enabled and self.server.role == "router":
            raise ConfigError("tiers: a router holds no KV cache (KV tiers are for colocated, "
                              "prefill and decode nodes)")
        if self.tiers.peer_reuse:
            if self.server.role not in ("colocated", "prefill"):
                raise ConfigError("tiers.peer_reuse: cluster prefix reuse is for colocated "
                                  f"and prefill nodes (not {self.server.role!r}: a decode node "
                                  "gets its prompt KV from prefill nodes, which read peers' "
                                  "cached prefixes themselves when they set it; the prompts a "
                                  "decode node prefills itself are short, "
                                  "transfer.local_prefill_max_tokens, not worth a lease round "
                                  "trip)")
            if not self.cluster.enabled:
                raise ConfigError("tiers.peer_reuse needs cluster.enabled: peers' cached "
                                  "prefixes are known from the gossip digest")
            if not self.engine.enable_prefix_caching:
                raise ConfigError("tiers.peer_reuse: peers' blocks become prefix-cached blocks; "
                                  "it needs engine.enable_prefix_caching")
        if self.server.vllm_metrics_path and self.server.role == "router":
            raise ConfigError("server.vllm_metrics_path: a router has no engine whose queue and "
                              "KV cache those gauges report")
        if self.kv_events.active and self.server.role == "router":
            raise ConfigError("kv_events: a router holds no KV cache (KV events are published "
                              "by colocated, prefill and decode nodes)")
        if self.kv_events.active and not self.engine.enable_prefix_caching:
            raise ConfigError("kv_events: the events name prefix-cached blocks; they need "
                              "engine.enable_prefix_caching")
        if self.tiers.enabled and not self.engine.enable_prefix_caching:
            raise ConfigError("tiers: KV tiers hold prefix-cached blocks; they need "
                              "engine.enable_prefix_caching")
        if self.parallel.ep_size > 1 and \
                self.structured.mask_timeout_ms / 1000 >= self.parallel.collective_timeout_s / 2:
            raise ConfigError("structured.mask_timeout_ms must stay under half of "
                              "parallel.collective_timeout_s: a late token mask fails its "
                              "request, never the expert-parallel group")
        if self.server.role == "router" and self.canary.share > 0 and not self.canary.label:
            raise ConfigError("canary.share: a share needs canary.label (the canary's version "
                              "label)")
        if self.server.role == "router" and self.canary.label and not self.cluster.enabled:
            raise ConfigError("canary.label: canary routing needs membership (cluster.enabled): "
                              "static router.backends do not say which version they run")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s.name: dataclasses.asdict(getattr(self, s.name)) for s in dataclasses.fields(self)}

    def digest(self) -> str:
        """Short stable hash of the effective config (exported on /metrics and /admin/config)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


# ---- validation helpers ------------------------------------------------------------------

def _short(value: Any, limit: int = 80) -> str:
    """repr() for an error message: one line, bounded (a 1 MiB list must not become the log)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: {_short(value)} is not one of {', '.join(allowed)}")


def _range(name: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):   # also refuses NaN: every comparison with it is false
        raise ConfigError(f"{name}: must be in [{lo}, {hi}], got {_short(value)}")


def _check_bounds(section: str, values: Any) -> None:
    """Every numeric field of a section within its `bounds` (see `_f`)."""
    for f in dataclasses.fields(values):
        bounds = f.metadata.get("bounds")
        if bounds is not None:
            _range(f"{section}.{f.name}", getattr(values, f.name), *bounds)


def numeric_fields() -> list[tuple[str, str, type, tuple[float, float] | None]]:
    """(section, field, int | float, bounds) for every number in the config (tests, docs)."""
    out = []
    for sec_name, cls in _sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float):
                out.append((sec_name, f.name, hints[f.name], f.metadata.get("bounds")))
    return out


# ---- reading files -----------------------------------------------------------------------

class FileRefused(Exception):
    """`read_regular_file` will not read this path; str() says why (a FIFO, too large, …)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "an unknown kind"


def _check_regular(st: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"not a regular file ({_kind(st.st_mode)})")
    if st.st_size > limit:
        raise FileRefused(f"too large ({st.st_size} bytes, at most {limit})")


def check_regular_file(path: str | Path, limit: int) -> None:
    """FileRefused if `path` exists but is not a regular file of at most `limit` bytes. A stat
    only, for readers that open the file themselves; a missing or unreadable path passes (the
    reader then says so in its own words)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return
    _check_regular(st, limit)


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed), at most `limit` of them.

    Never blocks: anything but a regular file (a FIFO, /dev/zero, a directory) is refused from
    its stat, before it is opened; the open is O_NONBLOCK and fstat checks the file it opened
    (the path may have been swapped meanwhile), and the read stops at limit + 1 bytes (a file
    that grows, or a /proc file whose size says 0). Raises FileRefused, or OSError (missing,
    permission denied) and ValueError (a NUL in the path) from the system.
    """
    _check_regular(os.stat(path), limit)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _check_regular(os.fstat(fd), limit)
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(1 << 16, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise FileRefused(f"too large (more than {limit} bytes)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_toml(p: Path) -> dict[str, Any]:
    """A config file's tables; every way it can be wrong is a one-line ConfigError."""
    try:
        raw = read_regular_file(p, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except FileRefused as e:
        raise ConfigError(f"{p}: {e}") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    except ValueError as e:              # e.g. an embedded NUL in the path
        raise ConfigError(f"{p}: cannot read: {e}") from None
    try:
        text = raw.decode("utf-8")       # TOML is UTF-8, whatever the locale says
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text at byte {e.start}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    except (ValueError, RecursionError) as e:  # tomllib's limits: > 4300 digits, deep nesting
        raise ConfigError(f"{p}: not valid TOML: {type(e).__name__}: {e}") from None


# ---- loading -----------------------------------------------------------------------------

def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _utf8(where: str, value: str) -> str:
    # A non-UTF-8 environment variable or argument arrives with lone surrogates in it (PEP
    # 383): refuse it here, not later in whatever encodes it (a log line, a gossip packet).
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text at character {e.start}") from None
    return value


def _number(where: str, tp: type, value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {_short(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    if tp is int and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    try:
        return tp(value)
    except OverflowError:                # float(10**400)
        raise ConfigError(f"{where}: out of range, got {_short(value)}") from None


def _coerce(where: str, tp: Any, value: Any, from_env: bool) -> Any:
    """Check/convert one value to the field's type; strings from env are parsed. A number's
    bounds (all within 64 bits) are checked by its section (`_check_bounds`)."""
    origin = typing.get_origin(tp)
    if origin is tuple and typing.get_args(tp)[0] in (int, float):
        num = typing.get_args(tp)[0]
        if from_env and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list of numbers, got {_short(value)}")
        return tuple(_coerce(where, num, v, from_env) for v in value)
    if origin is tuple:
        if from_env and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {_short(value)}")
        return tuple(_utf8(where, v) for v in value)
    if tp is bool:
        if from_env and isinstance(value, str):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {_short(value)}")
        return value
    if tp is int or tp is float:
        if from_env and isinstance(value, str):
            try:
                value = tp(value)
            except ValueError:           # also an int of more than 4300 digits
                raise ConfigError(f"{where}: expected a number, got {_short(value)}") from None
        return _number(where, tp, value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_short(value)}")
        return _utf8(where, value)
    raise ConfigError(f"{where}: unsupported type {tp}")


def _merge(base: dict[str, dict[str, Any]], overlay: Mapping[str, Any], source: str,
           from_env: bool = False) -> None:
    sections = _sections()
    for sec_name, values in overlay.items():
        if sec_name not in sections:
            raise ConfigError(f"{source}: unknown section [{sec_name}] "
                              f"(known: {', '.join(sections)})")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: [{sec_name}] must be a table")
        hints = typing.get_type_hints(sections[sec_name])
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(f"{source}: unknown key {sec_name}.{key} "
                                  f"(known: {', '.join(hints)})")
            base.setdefault(sec_name, {})[key] = _coerce(
                f"{source}: {sec_name}.{key}", hints[key], value, from_env)


# MOED_* variables that moed reads and that are not config fields: the one list of them
# (anything else spelt MOED_* is taken for a misspelt setting and refused)
OTHER_ENV: Mapping[str, str] = {
    "MOED_CPU_KERNELS": "0 turns the native CPU kernels off (moed/model/kernels)",
    "MOED_KERNEL_CACHE": "where the native CPU kernels are built (moed/model/kernels)",
    "MOED_CPU_ISA": "auto (default), avx512bf16 or avx2: the native CPU kernels' variant (moed/model/kernels)",
    "MOED_CACHE_DIR": "`moed model init`'s tokenizer cache (moed/model/bpe_train.py)",
    "MOED_BENCH_CACHE": "bench/engine.py's checkpoint cache",
}


# MOED_CPU_ISA's values (moed/model/kernels ISAS, plus auto): checked with the config, so a
# misspelt variant stops the node before the model loads (whether this CPU runs it is checked
# where the kernels load: kernels.IsaRefused).
CPU_ISA_VALUES = ("auto", "avx512bf16", "avx2")


def env_name(section: str, key: str) -> str:
    """The environment variable of a config field: MOED_<SECTION>_<FIELD>."""
    return f"MOED_{section}_{key}".upper()


def _env_fields() -> dict[str, tuple[str, str]]:
    return {env_name(sec, f.name): (sec, f.name)
            for sec, cls in _sections().items() for f in dataclasses.fields(cls)}


def env_overlay(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The MOED_<SECTION>_<FIELD> variables of `environ` as a nested dict (the other MOED_*
    names: `unknown_env`)."""
    fields = _env_fields()
    out: dict[str, dict[str, str]] = {}
    for name, value in environ.items():
        if name in fields:
            sec, key = fields[name]
            out.setdefault(sec, {})[key] = value
    return out


def unknown_env(environ: Mapping[str, str], named: Collection[str] = ()) -> list[str]:
    """Each MOED_* variable that is no config field, not in OTHER_ENV and not `named` (by a
    *_env field), with the closest valid name when one is close."""
    fields = _env_fields()
    valid = [*fields, *OTHER_ENV]
    out = []
    for name in sorted(environ):
        if not name.startswith("MOED_") or name in fields or name in OTHER_ENV or name in named:
            continue
        close = difflib.get_close_matches(name.upper(), valid, n=1)   # MOED_server_port too
        out.append(f"{name} (did you mean {close[0]}?)" if close
                   else f"{name} (no setting is named like it)")
    return out


def _check_env(environ: Mapping[str, str], merged: Mapping[str, Mapping[str, Any]]) -> None:
    named = {v for values in merged.values() for k, v in values.items()
             if k.endswith("_env") and isinstance(v, str)}
    unknown = unknown_env(environ, named)
    if unknown:
        raise ConfigError(f"environment: unknown variable{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(unknown)}")
    isa = environ.get("MOED_CPU_ISA", "auto").strip().lower() or "auto"
    if isa not in CPU_ISA_VALUES:
        raise ConfigError(f"environment: MOED_CPU_ISA={isa!r}: not one of {', '.join(CPU_ISA_VALUES)}")


def load(path: str | Path | None = None, *, environ: Mapping[str, str] | None = None,
         overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """Build the effective config. Raises ConfigError with a message fit for an operator."""
    env = os.environ if environ is None else environ
    merged: dict[str, dict[str, Any]] = {}
    if path:
        p = Path(path)
        _merge(merged, _read_toml(p), str(p))
    _merge(merged, env_overlay(env), "environment", from_env=True)
    if overrides:
        _merge(merged, {k: {kk: vv for kk, vv in v.items() if vv is not None}
                        for k, v in overrides.items()}, "command line")
    _check_env(env, merged)     # after every layer: any of them may name a variable (*_env)
    sections = _sections()
    try:
        built = {name: cls(**merged.get(name, {})) for name, cls in sections.items()}
        return Config(**built)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def from_dict(data: Mapping[str, Any], source: str) -> Config:
    """A Config from `to_dict()`'s shape (e.g. a config history entry), checked like a file:
    unknown sections or keys, wrong types and values out of range are ConfigErrors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: not a table of sections")
    merged: dict[str, dict[str, Any]] = {}
    _merge(merged, data, source)
    try:
        return Config(**{name: cls(**merged.get(name, {})) for name, cls in _sections().items()})
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {e}") from None


# ---- reload diff -------------------------------------------------------------------------

@dataclass(frozen=True)
class Change:
    key: str          # "section.field"
    old: Any
    new: Any
    live: bool


def diff(old: Config, new: Config) -> list[Change]:
    """Every field that differs, with whether it may apply live."""
    changes: list[Change] = []
    for sec in dataclasses.fields(Config):
        a, b = getattr(old, sec.name), getattr(new, sec.name)
        for f in dataclasses.fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            if va != vb:
                changes.append(Change(f"{sec.name}.{f.name}", va, vb, bool(f.metadata.get("live"))))
    return changes


def apply_live(old: Config, new: Config) -> Config:
    """The config a running node adopts: `new`'s live fields, `old`'s restart-only fields."""
    sections = {}
    for sec in dataclasses.fields(Config):
        a, b = getattr(old, sec.name), getattr(new, sec.name)
        live = {f.name: getattr(b, f.name) for f in dataclasses.fields(a) if f.metadata.get("live")}
        sections[sec.name] = dataclasses.replace(a, **live)
    return Config(**sections)
