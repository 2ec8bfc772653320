"""[cluster], [transfer], [router] and [balance]: membership, KV transfer, routing and the
prefill balancer."""
from __future__ import annotations

from dataclasses import dataclass

from moed.config.schema import ConfigError, _check_bounds, _choice, _f, _range, _short

MS_HOUR, MS_DAY = 3_600_000, 86_400_000


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
                             "re-probes keep 1 safe, see moed/cluster/suspicion.py)")
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
    migration_limit: int = _f(3, live=True, bounds=(0, 64),
                              doc="resubmissions of one stream whose node failed mid-way "
                              "(docs/migration.md); 0 = off: the stream ends with a "
                              "server_error event")
    migration_replay: str = _f("decode", live=True,
                               doc="how the next node recomputes the tokens already sent: "
                               "decode (one forced step each: greedy output identical to an "
                               "undisturbed run) | prefill (one prefill: fast, may round "
                               "differently)")

    def __post_init__(self) -> None:
        _check_bounds("router", self)
        for b in self.backends:
            if not b.startswith(("http://", "https://")):
                raise ConfigError(f"router.backends: {_short(b)} is not an http(s):// URL")
        for r in self.backend_roles:
            _choice("router.backend_roles", r, ("decode", "colocated", "prefill"))
        # moed.types.REPLAYS (config imports nothing of moed above it)
        _choice("router.migration_replay", self.migration_replay, ("decode", "prefill"))


BALANCE_POLICIES = ("tokens", "cost")


@dataclass(frozen=True)
class BalanceConfig:
    """The prefill balancer (moed/balance/step_time.py, cost.py): how each step's prefill is
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
