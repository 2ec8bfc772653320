"""The config's sections: one frozen dataclass per TOML table, each checking its own fields
(bounds, choices, formats) when built. Rules across sections: moed/config/rules.py."""
from moed.config.sections.cluster import (BALANCE_POLICIES, MS_DAY, MS_HOUR, BalanceConfig,
                                          ClusterConfig, RouterConfig, TransferConfig)
from moed.config.sections.experts import ExpertsConfig
from moed.config.sections.kv import (KV_EVENT_FORMATS, KV_EVENT_PUBLISHERS, KVEventsConfig,
                                     TiersConfig)
from moed.config.sections.model import (ATTENTION_BACKENDS, KV_CACHE_DTYPES, MODEL_DTYPES,
                                        ACT_QUANTIZATIONS, LM_HEAD_QUANTIZATIONS, QUANTIZATIONS, TOOL_PARSERS,
                                        EngineConfig, ModelConfig,
                                        ParallelConfig, StructuredConfig)
from moed.config.sections.priority import (MAX_CLASSES, PRIORITY_MAX, PRIORITY_MIN,
                                           PriorityConfig, parse_classes)
from moed.config.sections.release import (CANARY_HEADER_CHARS, LABEL_CHARS, CanaryConfig,
                                          ReleaseConfig)
from moed.config.sections.server import (LOG_FORMATS, LOG_LEVELS, METRICS_ACCESS,
                                         PREFIX_CACHE_ISOLATION, ROLES, AdmissionConfig,
                                         ServerConfig, TraceConfig)
from moed.config.sections.speculative import SPEC_METHODS, SpeculativeConfig

__all__ = [
    "ATTENTION_BACKENDS", "BALANCE_POLICIES", "CANARY_HEADER_CHARS", "KV_CACHE_DTYPES",
    "KV_EVENT_FORMATS", "KV_EVENT_PUBLISHERS", "LABEL_CHARS", "LOG_FORMATS", "LOG_LEVELS",
    "METRICS_ACCESS", "MODEL_DTYPES", "MS_DAY", "MS_HOUR", "PREFIX_CACHE_ISOLATION",
    "ACT_QUANTIZATIONS", "LM_HEAD_QUANTIZATIONS", "QUANTIZATIONS", "ROLES", "SPEC_METHODS", "TOOL_PARSERS",
    "MAX_CLASSES", "PRIORITY_MAX", "PRIORITY_MIN", "parse_classes",
    "AdmissionConfig", "BalanceConfig", "CanaryConfig", "ClusterConfig", "EngineConfig",
    "ExpertsConfig",
    "KVEventsConfig", "ModelConfig", "ParallelConfig", "PriorityConfig", "ReleaseConfig", "RouterConfig",
    "ServerConfig", "SpeculativeConfig", "StructuredConfig", "TiersConfig", "TraceConfig",
    "TransferConfig",
]
