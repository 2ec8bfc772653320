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
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
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
    metrics_require_auth: bool = _f(False, live=True)
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

    def __post_init__(self) -> None:
        _check_bounds("server", self)
        _choice("server.role", self.role, ROLES)
        _choice("server.log_format", self.log_format, LOG_FORMATS)
        _choice("server.log_level", self.log_level, LOG_LEVELS)


@dataclass(frozen=True)
class ModelConfig:
    path: str = _f("", doc="Hugging Face checkpoint directory")
    served_name: str = _f("", doc="model id in the API; default: the directory name")
    dtype: str = _f("auto", doc="auto (from config.json) | bfloat16 | float32 | float16")
    device: str = _f("auto", doc="auto | cpu | cuda | cuda:N")
    max_model_len: int = _f(0, bounds=(0, 1 << 24),
                            doc="0 = the checkpoint's max_position_embeddings")

    def __post_init__(self) -> None:
        _check_bounds("model", self)
        _choice("model.dtype", self.dtype, MODEL_DTYPES)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"model.device: {_short(self.device)} is not auto, cpu, cuda "
                              f"or cuda:N")


@dataclass(frozen=True)
class EngineConfig:
    attention_backend: str = _f("auto", doc="auto | torch | flashinfer")
    block_size: int = _f(16, bounds=(1, 1024), doc="tokens per KV block")
    num_kv_blocks: int = _f(0, bounds=(0, 1 << 24), doc="0 = size from kv_cache_memory_mb")
    kv_cache_memory_mb: int = _f(512, bounds=(1, 1 << 24))
    enable_prefix_caching: bool = _f(True)
    max_num_seqs: int = _f(64, live=True, bounds=(1, 1 << 16), doc="running requests per step")
    max_num_batched_tokens: int = _f(512, live=True, bounds=(1, 1 << 24),
                                     doc="token budget per step (chunked prefill)")
    num_threads: int = _f(0, bounds=(0, 1024), doc="torch intra-op threads; 0 = torch default")

    def __post_init__(self) -> None:
        _check_bounds("engine", self)
        _choice("engine.attention_backend", self.attention_backend, ATTENTION_BACKENDS)


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
    "MOED_CACHE_DIR": "`moed model init`'s tokenizer cache (moed/model/bpe_train.py)",
    "MOED_BENCH_CACHE": "bench/engine.py's checkpoint cache",
}


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
