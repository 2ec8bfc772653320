"""The rules across fields and sections: the one place that says which combinations of
settings a node refuses. `Config` applies `sections` whenever one is built (load, `serve`,
`check-config`, a reload, a rollback); the pre-flight (moed/preflight.py) applies `parallel`
and `tiers_disk`, which `serve` and `check-config` both run before anything starts; the
engine applies `tiers_need_prefix_caching` to the sections it is given alone.

A rule reads settings only: checks that read the world (a file, an import, a device) are the
pre-flight's. This module imports the sections, never `Config` (moed/config/root.py imports
it), so it reads a config through `NodeSettings`.
"""
from __future__ import annotations

from typing import Protocol

from moed.config.schema import ConfigError
from moed.config.sections import (CanaryConfig, ClusterConfig, EngineConfig, ExpertsConfig,
                                  KVEventsConfig,
                                  ModelConfig, ParallelConfig, ServerConfig, SpeculativeConfig,
                                  StructuredConfig, TiersConfig)


class NodeSettings(Protocol):
    """The sections the rules read (moed.config.Config has them all)."""
    @property
    def server(self) -> ServerConfig: ...
    @property
    def model(self) -> ModelConfig: ...
    @property
    def engine(self) -> EngineConfig: ...
    @property
    def cluster(self) -> ClusterConfig: ...
    @property
    def canary(self) -> CanaryConfig: ...
    @property
    def parallel(self) -> ParallelConfig: ...
    @property
    def tiers(self) -> TiersConfig: ...
    @property
    def kv_events(self) -> KVEventsConfig: ...
    @property
    def structured(self) -> StructuredConfig: ...
    @property
    def speculative(self) -> SpeculativeConfig: ...
    @property
    def experts(self) -> ExpertsConfig: ...


def sections(cfg: NodeSettings) -> None:
    """The rules across sections, in the order a ConfigError reports the first broken one."""
    if cfg.server.role != "router" and not cfg.model.path:
        raise ConfigError(f"model.path is required for role {cfg.server.role!r}")
    if cfg.server.role == "router" and cfg.parallel.ep_size > 1:
        raise ConfigError("parallel.ep_size: a router holds no model (expert parallelism "
                          "is for colocated, prefill and decode nodes)")
    if cfg.tiers.enabled and cfg.server.role == "router":
        raise ConfigError("tiers: a router holds no KV cache (KV tiers are for colocated, "
                          "prefill and decode nodes)")
    if cfg.tiers.peer_reuse:
        if cfg.server.role not in ("colocated", "prefill"):
            raise ConfigError("tiers.peer_reuse: cluster prefix reuse is for colocated "
                              f"and prefill nodes (not {cfg.server.role!r}: a decode node "
                              "gets its prompt KV from prefill nodes, which read peers' "
                              "cached prefixes themselves when they set it; the prompts a "
                              "decode node prefills itself are short, "
                              "transfer.local_prefill_max_tokens, not worth a lease round "
                              "trip)")
        if not cfg.cluster.enabled:
            raise ConfigError("tiers.peer_reuse needs cluster.enabled: peers' cached "
                              "prefixes are known from the gossip digest")
        if not cfg.engine.enable_prefix_caching:
            raise ConfigError("tiers.peer_reuse: peers' blocks become prefix-cached blocks; "
                              "it needs engine.enable_prefix_caching")
    if cfg.server.vllm_metrics_path and cfg.server.role == "router":
        raise ConfigError("server.vllm_metrics_path: a router has no engine whose queue and "
                          "KV cache those gauges report")
    if cfg.kv_events.active and cfg.server.role == "router":
        raise ConfigError("kv_events: a router holds no KV cache (KV events are published "
                          "by colocated, prefill and decode nodes)")
    if cfg.kv_events.active and not cfg.engine.enable_prefix_caching:
        raise ConfigError("kv_events: the events name prefix-cached blocks; they need "
                          "engine.enable_prefix_caching")
    tiers_need_prefix_caching(cfg.engine, cfg.tiers)
    if cfg.parallel.ep_size > 1 and \
            cfg.structured.mask_timeout_ms / 1000 >= cfg.parallel.collective_timeout_s / 2:
        raise ConfigError("structured.mask_timeout_ms must stay under half of "
                          "parallel.collective_timeout_s: a late token mask fails its "
                          "request, never the expert-parallel group")
    speculative(cfg)
    if cfg.model.batch_invariant and cfg.parallel.ep_size > 1:
        raise ConfigError("model.batch_invariant: not with parallel.ep_size > 1 (not measured)")
    experts(cfg)
    if cfg.server.role == "router" and cfg.canary.share > 0 and not cfg.canary.label:
        raise ConfigError("canary.share: a share needs canary.label (the canary's version "
                          "label)")
    if cfg.server.role == "router" and cfg.canary.label and not cfg.cluster.enabled:
        raise ConfigError("canary.label: canary routing needs membership (cluster.enabled): "
                          "static router.backends do not say which version they run")


MTP_MAX_K = 4     # chained drafts of one MTP layer, as vLLM's and SGLang's examples use 1-3


def speculative(cfg: NodeSettings) -> None:
    """[speculative] against the node: drafts are verified where tokens are decoded. On a
    prefill node only `mtp` has a meaning: compute the MTP layer's KV over each prompt and
    send it (with the first draft) to decode nodes that draft with it (docs/speculative.md)."""
    sp = cfg.speculative
    if not sp.enabled:
        return
    if sp.method == "mtp" and sp.num_speculative_tokens > MTP_MAX_K:
        raise ConfigError(f"speculative.num_speculative_tokens {sp.num_speculative_tokens} "
                          f"with method mtp: the one MTP layer is chained for k > 1, at most "
                          f"{MTP_MAX_K} (each chained draft costs a pass of the layer and is "
                          f"accepted less often than the one before)")
    if sp.prompt_lookup_min > sp.prompt_lookup_max:
        raise ConfigError(f"speculative.prompt_lookup_min ({sp.prompt_lookup_min}) must not "
                          f"exceed speculative.prompt_lookup_max ({sp.prompt_lookup_max})")
    if cfg.server.role == "router" or (cfg.server.role == "prefill" and sp.method != "mtp"):
        raise ConfigError(f"speculative.method {sp.method}: speculation runs where tokens "
                          f"are decoded (colocated or decode nodes), not on a "
                          f"{cfg.server.role} node" + (
                              " (on a prefill node only method mtp is taken: it computes and "
                              "sends the MTP layer's KV for decode nodes that draft with it; "
                              "ngram needs nothing from it)"
                              if cfg.server.role == "prefill" else ""))
    # parallel.ep_size > 1 is served: drafts change only a rank's row counts, and the MTP
    # layer's MoE exchange is agreed each step (moed.parallel.agree)


def experts(cfg: NodeSettings) -> None:
    """[experts] against the node: what the cold-expert store (moed/model/cold) is built for."""
    if not cfg.experts.tiered:
        return
    if cfg.server.role == "router":
        raise ConfigError("experts.resident_bytes: a router holds no model")
    if cfg.parallel.eplb_interval_s > 0:
        # EPLB copies a moved slot's weights from a slot that holds them (this rank's or a
        # peer's, matched sends and receives); a tiered rank holds only part of its slots
        raise ConfigError("experts.resident_bytes with parallel.eplb_interval_s > 0 is not built "
                          "yet (the expert balancer moves slot weights between ranks from "
                          "resident slots; a tiered rank keeps most of its slots on disk): set "
                          "parallel.eplb_interval_s = 0 (static layouts and "
                          "parallel.redundant_experts work: each rank tiers its own slots)")
    if cfg.experts.prefetch_experts > 0 and cfg.parallel.ep_size > 1:
        raise ConfigError("experts.prefetch_experts under expert parallelism is not built yet "
                          "(a rank does not route the tokens its slots receive): set it to 0, "
                          "or -1 (auto: off under expert parallelism)")
    if cfg.speculative.method == "mtp":
        raise ConfigError("experts.resident_bytes with speculative.method mtp is not built yet "
                          "(the MTP layer's experts are not tiered)")
    if cfg.model.device not in ("auto", "cpu"):
        raise ConfigError(f"experts.resident_bytes: the cold-expert store runs on CPU nodes only "
                          f"so far (model.device is {cfg.model.device!r})")


def tiers_need_prefix_caching(engine: EngineConfig, tiers: TiersConfig) -> None:
    """KV tiers hold prefix-cached blocks: no tier without prefix caching."""
    if tiers.enabled and not engine.enable_prefix_caching:
        raise ConfigError("tiers: KV tiers hold prefix-cached blocks; they need "
                          "engine.enable_prefix_caching")


def parallel(cfg: NodeSettings) -> None:
    """[parallel] across its fields: a rank below the size, a rendezvous for a group. Checked
    by the pre-flight, not at load, so each field loads alone at its bounds."""
    p = cfg.parallel
    if p.ep_rank >= p.ep_size:
        raise ConfigError(f"parallel.ep_rank: {p.ep_rank} is not below parallel.ep_size "
                          f"{p.ep_size}")
    if p.ep_size == 1 and (p.redundant_experts or p.eplb_interval_s):
        key = "redundant_experts" if p.redundant_experts else "eplb_interval_s"
        raise ConfigError(f"parallel.{key}: the expert balancer places experts over the ranks "
                          f"of an expert-parallel group; it needs parallel.ep_size > 1")
    if p.ep_size > 1 and not p.ep_init:
        raise ConfigError(f"parallel.ep_init: ep_size {p.ep_size} needs rank 0's rendezvous, "
                          f"tcp://host:port (--ep-init)")


def tiers_disk(cfg: NodeSettings) -> None:
    """A disk tier needs a directory (whether the node can write it: the pre-flight)."""
    if cfg.tiers.disk_bytes > 0 and not cfg.tiers.disk_dir:
        raise ConfigError("tiers.disk_bytes: a disk tier needs tiers.disk_dir")


def needs_cluster_key(cfg: NodeSettings) -> bool:
    """Whether the node signs node-to-node calls (moed.app.build_components), so needs the
    cluster key (the pre-flight reads it; moed.api.internal refuses without it)."""
    return cfg.server.role in ("prefill", "decode") or cfg.cluster.enabled
