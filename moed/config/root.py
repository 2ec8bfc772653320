"""`Config`: the node's whole configuration, one field per section, checked across sections
(moed/config/rules.py) whenever one is built; and what is derived from it alone."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import typing
from dataclasses import dataclass, field
from typing import Any

from moed.config import rules
from moed.config.sections import (AdmissionConfig, BalanceConfig, CanaryConfig, ClusterConfig,
                                  EngineConfig, ExpertsConfig, KVEventsConfig, ModelConfig, ParallelConfig,
                                  PriorityConfig, ReleaseConfig, RouterConfig, ServerConfig,
                                  SpeculativeConfig,
                                  StructuredConfig, TiersConfig, TraceConfig, TransferConfig)


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
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    priority: PriorityConfig = field(default_factory=PriorityConfig)

    def __post_init__(self) -> None:
        rules.sections(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s.name: dataclasses.asdict(getattr(self, s.name)) for s in dataclasses.fields(self)}

    def digest(self) -> str:
        """Short stable hash of the effective config (exported on /metrics and /admin/config)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def node_name(cfg: Config) -> str:
    """This node's name in the cluster, logs and traces: server.node_name, else hostname-port."""
    return cfg.server.node_name or f"{socket.gethostname()}-{cfg.server.port}"


def section_types() -> dict[str, type]:
    """Section name -> its dataclass, in Config's order."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def numeric_fields() -> list[tuple[str, str, type, tuple[float, float] | None]]:
    """(section, field, int | float, bounds) for every number in the config (tests, docs)."""
    out = []
    for sec_name, cls in section_types().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float):
                out.append((sec_name, f.name, hints[f.name], f.metadata.get("bounds")))
    return out
