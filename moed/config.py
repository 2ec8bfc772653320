"""Configuration: frozen dataclasses per section, loaded as defaults < TOML < MOED_* env < flags.

Every field says whether it can change on a running node (`live`) or needs a restart; `diff`
uses that for SIGHUP reload. Unknown keys are errors. Secrets never live in the TOML: it names
a file or an environment variable that holds them.

Environment: MOED_<SECTION>_<FIELD>, e.g. MOED_SERVER_PORT=9000, MOED_CLUSTER_SEEDS=a:1,b:2.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

ROLES = ("colocated", "prefill", "decode", "router")


class ConfigError(ValueError):
    """A config file, variable or flag is wrong; the message says which and why."""


def _f(default: Any, *, live: bool = False, doc: str = "", **kw: Any) -> Any:
    """A config field. live=True: may change on SIGHUP without a restart."""
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for sequence defaults")
    return field(default=default, metadata={"live": live, "doc": doc}, **kw)


@dataclass(frozen=True)
class ServerConfig:
    role: str = _f("colocated", doc="colocated | prefill | decode | router")
    host: str = _f("127.0.0.1")
    port: int = _f(8000)
    node_name: str = _f("", doc="unique in the cluster; default: hostname-port")
    max_body_bytes: int = _f(4 * 1024 * 1024, live=True)
    request_timeout_s: float = _f(600.0, live=True, doc="whole-request deadline")
    shutdown_grace_s: float = _f(30.0, live=True, doc="drain: in-flight requests get this long")
    api_keys_file: str = _f("", live=True, doc="one key per line; empty with api_keys_env = no auth")
    api_keys_env: str = _f("", live=True, doc="env var holding comma-separated keys")
    admin_token_file: str = _f("", live=True)
    admin_token_env: str = _f("", live=True)
    metrics_require_auth: bool = _f(False, live=True)
    log_format: str = _f("json", live=True, doc="json | console")
    log_level: str = _f("info", live=True)

    def __post_init__(self) -> None:
        _choice("server.role", self.role, ROLES)
        _choice("server.log_format", self.log_format, ("json", "console"))
        _choice("server.log_level", self.log_level, ("debug", "info", "warning", "error"))
        _range("server.port", self.port, 0, 65535)
        _positive("server.max_body_bytes", self.max_body_bytes)
        _positive("server.request_timeout_s", self.request_timeout_s)
        _range("server.shutdown_grace_s", self.shutdown_grace_s, 0, 86400)


@dataclass(frozen=True)
class ModelConfig:
    path: str = _f("", doc="Hugging Face checkpoint directory")
    served_name: str = _f("", doc="model id in the API; default: the directory name")
    dtype: str = _f("auto", doc="auto (from config.json) | bfloat16 | float32 | float16")
    device: str = _f("auto", doc="auto | cpu | cuda | cuda:N")
    max_model_len: int = _f(0, doc="0 = the checkpoint's max_position_embeddings")

    def __post_init__(self) -> None:
        _choice("model.dtype", self.dtype, ("auto", "bfloat16", "float32", "float16"))
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device: {self.device!r} is not auto, cpu, cuda or cuda:N")
        _range("model.max_model_len", self.max_model_len, 0, 1 << 24)


@dataclass(frozen=True)
class EngineConfig:
    attention_backend: str = _f("auto", doc="auto | torch | flashinfer")
    block_size: int = _f(16, doc="tokens per KV block")
    num_kv_blocks: int = _f(0, doc="0 = size from kv_cache_memory_mb")
    kv_cache_memory_mb: int = _f(512)
    enable_prefix_caching: bool = _f(True)
    max_num_seqs: int = _f(64, live=True, doc="running requests per step")
    max_num_batched_tokens: int = _f(512, live=True, doc="token budget per step (chunked prefill)")
    num_threads: int = _f(0, doc="torch intra-op threads; 0 = torch default")

    def __post_init__(self) -> None:
        _choice("engine.attention_backend", self.attention_backend, ("auto", "torch", "flashinfer"))
        _range("engine.block_size", self.block_size, 1, 1024)
        _range("engine.num_kv_blocks", self.num_kv_blocks, 0, 1 << 24)
        _positive("engine.kv_cache_memory_mb", self.kv_cache_memory_mb)
        _positive("engine.max_num_seqs", self.max_num_seqs)
        _positive("engine.max_num_batched_tokens", self.max_num_batched_tokens)
        _range("engine.num_threads", self.num_threads, 0, 1024)


@dataclass(frozen=True)
class AdmissionConfig:
    max_waiting_requests: int = _f(256, live=True, doc="beyond this: 429")
    max_queued_prompt_tokens: int = _f(262144, live=True, doc="beyond this: 429")
    retry_after_s: int = _f(1, live=True)

    def __post_init__(self) -> None:
        _positive("admission.max_waiting_requests", self.max_waiting_requests)
        _positive("admission.max_queued_prompt_tokens", self.max_queued_prompt_tokens)
        _range("admission.retry_after_s", self.retry_after_s, 0, 3600)


@dataclass(frozen=True)
class ClusterConfig:
    enabled: bool = _f(False, doc="join the gossip membership")
    bind_host: str = _f("127.0.0.1")
    bind_port: int = _f(7946)
    advertise_host: str = _f("", doc="default: bind_host")
    seeds: tuple[str, ...] = _f((), live=True, doc="host:port of any members")
    key_file: str = _f("", live=True, doc="HMAC key (hex or raw bytes)")
    key_env: str = _f("", live=True)
    secondary_key_file: str = _f("", live=True, doc="also accepted, during key rotation")
    insecure: bool = _f(False, doc="allow running without a cluster key")
    probe_interval_ms: int = _f(1000, live=True)
    probe_timeout_ms: int = _f(500, live=True)
    indirect_checks: int = _f(3, live=True)
    gossip_interval_ms: int = _f(200, live=True)
    gossip_nodes: int = _f(3, live=True)
    push_pull_interval_ms: int = _f(30000, live=True)
    suspicion_mult: int = _f(1, live=True, doc="min suspicion = mult * log10(n) * probe "
                             "interval (memberlist LAN: 4; Lifeguard confirmations and "
                             "re-probes keep 1 safe, see moed/cluster/swim.py)")
    suspicion_max_timeout_mult: int = _f(6, live=True, doc="max suspicion = this * min")
    suspicion_confirmations: int = _f(2, live=True, doc="independent suspecters that bring "
                                      "the timeout down to its min (Lifeguard k)")
    suspicion_reprobes: int = _f(4, live=True, doc="members that re-probe a fresh suspect "
                                 "at once (0 = off)")
    join_retry_ms: int = _f(1000, live=True, doc="while alone, knock on the seeds this often")
    dead_reclaim_ms: int = _f(30000, live=True, doc="forget dead/left members after this")
    replay_window_ms: int = _f(120000, live=True, doc="drop packets stamped further from "
                               "our clock (0 = off)")
    retransmit_mult: int = _f(4, live=True)
    awareness_max_multiplier: int = _f(8, live=True)
    load_update_interval_ms: int = _f(1000, live=True)

    def __post_init__(self) -> None:
        _range("cluster.bind_port", self.bind_port, 0, 65535)
        for s in self.seeds:
            if ":" not in s:
                raise ConfigError(f"cluster.seeds: {s!r} is not host:port")
        for name in ("probe_interval_ms", "probe_timeout_ms", "gossip_interval_ms",
                     "push_pull_interval_ms", "suspicion_mult", "retransmit_mult",
                     "awareness_max_multiplier", "load_update_interval_ms", "gossip_nodes",
                     "suspicion_max_timeout_mult"):
            _positive(f"cluster.{name}", getattr(self, name))
        _range("cluster.indirect_checks", self.indirect_checks, 0, 64)
        for name in ("suspicion_confirmations", "suspicion_reprobes", "replay_window_ms"):
            _range(f"cluster.{name}", getattr(self, name), 0, 1 << 31)
        _positive("cluster.join_retry_ms", self.join_retry_ms)
        _positive("cluster.dead_reclaim_ms", self.dead_reclaim_ms)


@dataclass(frozen=True)
class TransferConfig:
    backend: str = _f("nixl", doc="KV transfer backend for prefill/decode roles")
    prefill_peers: tuple[str, ...] = _f((), live=True,
                                        doc="static prefill node URLs when membership is off")
    lease_s: float = _f(30.0, live=True, doc="a prefill job's lease: held while the decode "
                        "node's job stream stays open, at most this long (or its deadline)")
    prefill_timeout_s: float = _f(60.0, live=True)
    max_prefill_retries: int = _f(2, live=True)
    peer_error_cooldown_s: float = _f(5.0, live=True, doc="half-open retry after failures")
    local_prefill_max_tokens: int = _f(0, live=True, doc="decode role: prompts up to this many "
                                       "tokens are prefilled locally (0 = always remote)")

    def __post_init__(self) -> None:
        _positive("transfer.lease_s", self.lease_s)
        _positive("transfer.prefill_timeout_s", self.prefill_timeout_s)
        _range("transfer.max_prefill_retries", self.max_prefill_retries, 0, 16)
        _choice("transfer.backend", self.backend, ("nixl",))
        _range("transfer.local_prefill_max_tokens", self.local_prefill_max_tokens, 0, 1 << 24)
        for u in self.prefill_peers:
            if not u.startswith(("http://", "https://")):
                raise ConfigError(f"transfer.prefill_peers: {u!r} is not an http(s):// URL")


@dataclass(frozen=True)
class RouterConfig:
    """The router role (no model): picks a live serving node and proxies /v1/* to it."""
    backends: tuple[str, ...] = _f((), live=True,
                                   doc="static backend base URLs when membership is off")
    backend_roles: tuple[str, ...] = _f(("decode", "colocated"), live=True,
                                        doc="membership roles the router sends requests to")
    health_interval_s: float = _f(0.5, live=True, doc="static backends: /ready poll period")
    connect_timeout_s: float = _f(2.0, live=True)
    max_attempts: int = _f(3, live=True, doc="backends tried before the first byte is sent")
    max_connections: int = _f(1024, doc="pooled connections to all backends together")

    def __post_init__(self) -> None:
        for b in self.backends:
            if not b.startswith(("http://", "https://")):
                raise ConfigError(f"router.backends: {b!r} is not an http(s):// URL")
        for r in self.backend_roles:
            _choice("router.backend_roles", r, ("decode", "colocated", "prefill"))
        _positive("router.health_interval_s", self.health_interval_s)
        _positive("router.connect_timeout_s", self.connect_timeout_s)
        _range("router.max_attempts", self.max_attempts, 1, 16)
        _positive("router.max_connections", self.max_connections)


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        if self.server.role != "router" and not self.model.path:
            raise ConfigError(f"model.path is required for role {self.server.role!r}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s.name: dataclasses.asdict(getattr(self, s.name)) for s in dataclasses.fields(self)}

    def digest(self) -> str:
        """Short stable hash of the effective config (exported on /metrics and /admin/config)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


# ---- validation helpers ------------------------------------------------------------------

def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(allowed)}")


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name}: must be > 0, got {value}")


def _range(name: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):
        raise ConfigError(f"{name}: must be in [{lo}, {hi}], got {value}")


# ---- loading -----------------------------------------------------------------------------

def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _coerce(where: str, tp: Any, value: Any, from_env: bool) -> Any:
    """Check/convert one value to the field's type; strings from env are parsed."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        if from_env and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        return tuple(value)
    if tp is bool:
        if from_env and isinstance(value, str):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int or tp is float:
        if from_env and isinstance(value, str):
            try:
                value = tp(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if tp is int and (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
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


def env_overlay(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """MOED_<SECTION>_<FIELD> variables as a nested dict. Unknown MOED_ names are errors."""
    sections = _sections()
    out: dict[str, dict[str, str]] = {}
    for name, value in environ.items():
        if not name.startswith("MOED_"):
            continue
        rest = name[5:].lower()
        sec = next((s for s in sections if rest.startswith(s + "_")), None)
        if sec is None:
            continue  # MOED_* names outside config sections (e.g. tools) are not ours
        out.setdefault(sec, {})[rest[len(sec) + 1:]] = value
    return out


def load(path: str | Path | None = None, *, environ: Mapping[str, str] | None = None,
         overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """Build the effective config. Raises ConfigError with a message fit for an operator."""
    merged: dict[str, dict[str, Any]] = {}
    if path:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot read: {e}") from None
        _merge(merged, data, str(p))
    _merge(merged, env_overlay(os.environ if environ is None else environ), "environment",
           from_env=True)
    if overrides:
        _merge(merged, {k: {kk: vv for kk, vv in v.items() if vv is not None}
                        for k, v in overrides.items()}, "command line")
    sections = _sections()
    try:
        built = {name: cls(**merged.get(name, {})) for name, cls in sections.items()}
        return Config(**built)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


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
