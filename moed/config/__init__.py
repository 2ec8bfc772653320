"""Configuration: frozen dataclasses per section, loaded as defaults < TOML < MOED_* env < flags.

Every field says whether it can change on a running node (`live`) or needs a restart; `diff`
uses that for SIGHUP reload. Unknown keys are errors. Secrets never live in the TOML: it names
a file or an environment variable that holds them.

The package (import from here; the modules are its layout, not its interface):
- schema.py: how a field is declared (`_f`: live, doc, bounds), parsed and checked; unknown
  sections and keys refused;
- sections/: the sections, one frozen dataclass per TOML table, each checking its own fields;
- rules.py: the rules across fields and sections, the one place for them (Config applies
  them when built; the pre-flight, `serve` and `check-config` apply the rest);
- root.py: `Config` (every section), `node_name`;
- env.py: the MOED_<SECTION>_<FIELD> layer and the refusal of any other MOED_* variable;
- loading.py: `load` (the layers into one checked Config) and `from_dict` (a stored config);
- reload.py: `diff` and `apply_live` (what a SIGHUP may change without a restart).
Files are read with moed/safefile.py's `read_regular_file` (never blocks on a FIFO or device).
"""
from moed.config.env import (CPU_ISA_VALUES, OTHER_ENV, check_env, env_fields, env_name,
                             env_overlay, unknown_env)
from moed.config.loading import MAX_CONFIG_BYTES, from_dict, load
from moed.config.reload import Change, apply_live, diff
from moed.config.root import Config, node_name, numeric_fields, section_types
from moed.config.rules import needs_cluster_key
from moed.config.schema import INT64, ConfigError
from moed.config.sections import (ATTENTION_BACKENDS, BALANCE_POLICIES, CANARY_HEADER_CHARS,
                                  KV_CACHE_DTYPES, KV_EVENT_FORMATS, KV_EVENT_PUBLISHERS,
                                  LABEL_CHARS, LOG_FORMATS, LOG_LEVELS, METRICS_ACCESS,
                                  MODEL_DTYPES, MS_DAY, MS_HOUR, PREFIX_CACHE_ISOLATION,
                                  PRIORITY_MAX, PRIORITY_MIN,
                                  ACT_QUANTIZATIONS, LM_HEAD_QUANTIZATIONS, QUANTIZATIONS, ROLES, TOOL_PARSERS,
                                  AdmissionConfig,
                                  BalanceConfig, CanaryConfig, ClusterConfig, EngineConfig,
                                  KVEventsConfig, ModelConfig, ParallelConfig, PriorityConfig,
                                  ReleaseConfig, RouterConfig, ServerConfig,
                                  SpeculativeConfig, StructuredConfig, TiersConfig, TraceConfig,
                                  TransferConfig)

__all__ = [
    "ATTENTION_BACKENDS", "BALANCE_POLICIES", "CANARY_HEADER_CHARS", "CPU_ISA_VALUES", "INT64",
    "KV_CACHE_DTYPES", "KV_EVENT_FORMATS", "KV_EVENT_PUBLISHERS", "LABEL_CHARS", "LOG_FORMATS",
    "LOG_LEVELS", "MAX_CONFIG_BYTES", "METRICS_ACCESS", "MODEL_DTYPES", "MS_DAY", "MS_HOUR",
    "OTHER_ENV", "PREFIX_CACHE_ISOLATION", "PRIORITY_MAX", "PRIORITY_MIN", "QUANTIZATIONS", "ROLES", "TOOL_PARSERS",
    "ACT_QUANTIZATIONS", "LM_HEAD_QUANTIZATIONS",
    "AdmissionConfig", "BalanceConfig", "CanaryConfig", "Change", "ClusterConfig", "Config",
    "ConfigError", "EngineConfig", "KVEventsConfig", "ModelConfig",
    "ParallelConfig", "PriorityConfig", "ReleaseConfig", "RouterConfig", "ServerConfig", "SpeculativeConfig",
    "StructuredConfig",
    "TiersConfig", "TraceConfig", "TransferConfig",
    "apply_live", "check_env", "diff", "env_fields", "env_name",
    "env_overlay", "from_dict", "load", "needs_cluster_key", "node_name", "numeric_fields",
    "section_types", "unknown_env",
]
