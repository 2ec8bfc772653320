"""Reload diffing: what differs between two configs, and which of it a running node may
adopt without a restart (a field declared live=True, moed/config/schema.py `_f`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moed.config.root import Config


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
