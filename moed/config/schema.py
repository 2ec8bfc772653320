"""The schema framework: how a config field is declared, parsed and checked.

A field is `_f(default, live=..., doc=..., bounds=...)`: `live` says whether it may change on
a running node (SIGHUP, moed/config/reload.py) or needs a restart. Every number has bounds
(`bounds=(lo, hi)`, required by `_f`): a value outside them, NaN or infinity is refused, so no
typo (max_num_seqs = 10**20) reaches a running node. Values from the TOML file, the
environment and the command line are converted to the field's type here (`_coerce`), and a
section or key no section declares is refused (`_merge`): a misspelt setting is an error.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import field
from typing import Any, Mapping

INT64 = (-(1 << 63), (1 << 63) - 1)


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


def _merge(sections: Mapping[str, type], base: dict[str, dict[str, Any]],
           overlay: Mapping[str, Any], source: str, from_env: bool = False) -> None:
    """`overlay`'s values into `base`, each converted to its field's type; an unknown section
    or key is a ConfigError naming `source` and the known names."""
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
