"""The environment layer: MOED_<SECTION>_<FIELD> sets a field, e.g. MOED_SERVER_PORT=9000,
MOED_CLUSTER_SEEDS=a:1,b:2 (lists are comma-separated; moed/config/schema.py parses them).

Any other MOED_* variable is an error naming it and the closest valid name (a misspelt
setting must not be ignored), except the few moed reads itself (`OTHER_ENV`) and those the
config names as holding a secret (server.api_keys_env, admin_token_env, cluster.key_env).
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Collection, Mapping

from moed.config.root import section_types
from moed.config.schema import ConfigError

# MOED_* variables that moed reads and that are not config fields: the one list of them
# (anything else spelt MOED_* is taken for a misspelt setting and refused)
OTHER_ENV: Mapping[str, str] = {
    "MOED_CPU_KERNELS": "0 turns the native CPU kernels off (moed/model/kernels)",
    "MOED_KERNEL_CACHE": "where the native CPU kernels are built (moed/model/kernels)",
    "MOED_CPU_ISA": "auto (default), avx512bf16, avx512 or avx2: the native CPU kernels' variant (moed/model/kernels)",
    "MOED_CACHE_DIR": "`moed model init`'s tokenizer cache (moed/dev/bpe_train.py)",
    "MOED_BENCH_CACHE": "bench/engine.py's checkpoint cache",
}


# MOED_CPU_ISA's values (moed/model/kernels ISAS, plus auto): checked with the config, so a
# misspelt variant stops the node before the model loads (whether this CPU runs it is checked
# where the kernels load: kernels.IsaRefused).
CPU_ISA_VALUES = ("auto", "avx512bf16", "avx512", "avx2")


def env_name(section: str, key: str) -> str:
    """The environment variable of a config field: MOED_<SECTION>_<FIELD>."""
    return f"MOED_{section}_{key}".upper()


def env_fields() -> dict[str, tuple[str, str]]:
    """Each config field's variable name -> (section, field)."""
    return {env_name(sec, f.name): (sec, f.name)
            for sec, cls in section_types().items() for f in dataclasses.fields(cls)}


def env_overlay(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The MOED_<SECTION>_<FIELD> variables of `environ` as a nested dict (the other MOED_*
    names: `unknown_env`)."""
    fields = env_fields()
    out: dict[str, dict[str, str]] = {}
    for name, value in environ.items():
        if name in fields:
            sec, key = fields[name]
            out.setdefault(sec, {})[key] = value
    return out


def unknown_env(environ: Mapping[str, str], named: Collection[str] = ()) -> list[str]:
    """Each MOED_* variable that is no config field, not in OTHER_ENV and not `named` (by a
    *_env field), with the closest valid name when one is close."""
    fields = env_fields()
    valid = [*fields, *OTHER_ENV]
    out = []
    for name in sorted(environ):
        if not name.startswith("MOED_") or name in fields or name in OTHER_ENV or name in named:
            continue
        close = difflib.get_close_matches(name.upper(), valid, n=1)   # MOED_server_port too
        out.append(f"{name} (did you mean {close[0]}?)" if close
                   else f"{name} (no setting is named like it)")
    return out


def check_env(environ: Mapping[str, str], merged: Mapping[str, Mapping[str, Any]]) -> None:
    """Every MOED_* variable known (`unknown_env`, with the *_env fields of `merged`) and
    MOED_CPU_ISA one of CPU_ISA_VALUES; else a ConfigError naming them."""
    named = {v for values in merged.values() for k, v in values.items()
             if k.endswith("_env") and isinstance(v, str)}
    unknown = unknown_env(environ, named)
    if unknown:
        raise ConfigError(f"environment: unknown variable{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(unknown)}")
    isa = environ.get("MOED_CPU_ISA", "auto").strip().lower() or "auto"
    if isa not in CPU_ISA_VALUES:
        raise ConfigError(f"environment: MOED_CPU_ISA={isa!r}: not one of {', '.join(CPU_ISA_VALUES)}")
