"""Loading: defaults < TOML file < MOED_* environment < command-line overrides, into a
checked `Config`; and a Config from a stored dict (the config history).

The file must be a regular file of UTF-8 text of at most MAX_CONFIG_BYTES (moed/safefile.py):
a FIFO or device is refused without being opened, so neither a start nor a SIGHUP ever blocks.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

from moed.config.env import check_env, env_overlay
from moed.config.root import Config, section_types
from moed.config.schema import ConfigError, _merge
from moed.safefile import FileRefused, read_regular_file

MAX_CONFIG_BYTES = 1 << 20          # a config file is a few KiB; more is a mistake (or /dev/zero)


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


def load(path: str | Path | None = None, *, environ: Mapping[str, str] | None = None,
         overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """Build the effective config. Raises ConfigError with a message fit for an operator."""
    env = os.environ if environ is None else environ
    sections = section_types()
    merged: dict[str, dict[str, Any]] = {}
    if path:
        p = Path(path)
        _merge(sections, merged, _read_toml(p), str(p))
    _merge(sections, merged, env_overlay(env), "environment", from_env=True)
    if overrides:
        _merge(sections, merged, {k: {kk: vv for kk, vv in v.items() if vv is not None}
                                  for k, v in overrides.items()}, "command line")
    check_env(env, merged)      # after every layer: any of them may name a variable (*_env)
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
    sections = section_types()
    merged: dict[str, dict[str, Any]] = {}
    _merge(sections, merged, data, source)
    try:
        return Config(**{name: cls(**merged.get(name, {})) for name, cls in sections.items()})
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {e}") from None
