"""[priority]: request priority classes (moed/api/priority.py, docs/priority.md).

A request's `priority` is vLLM's: an integer, lower runs first, default 0. A class is a name
for one value (`"interactive=0"`, `"batch=10"`); each API key may name its class in the key
file, and a request may ask for its class's value or a larger one (less urgent), never a
smaller one. Classes also label the per-class metrics, so their number is bounded.
"""
from __future__ import annotations

from dataclasses import dataclass

from moed.config.schema import ConfigError, _f, _short

MAX_CLASSES = 8          # metric labels and the gossiped per-class queue stay bounded
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1    # a request's priority (int32)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")


def parse_classes(entries: tuple[str, ...]) -> dict[str, int]:
    """("interactive=0", "batch=10") -> {"interactive": 0, "batch": 10}; ConfigError naming
    the entry for a malformed one, a repeated name or value."""
    out: dict[str, int] = {}
    for e in entries:
        name, sep, value = e.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not set(name) <= _NAME_CHARS or len(name) > 32:
            raise ConfigError(f"priority.classes: {_short(e)} is not NAME=PRIORITY (a name of "
                              f"at most 32 characters a-z, 0-9, _ or -)")
        try:
            v = int(value)
        except ValueError:
            raise ConfigError(f"priority.classes: {_short(e)}: the priority must be an "
                              f"integer") from None
        if not PRIORITY_MIN <= v <= PRIORITY_MAX:
            raise ConfigError(f"priority.classes: {_short(e)}: the priority must be in "
                              f"[{PRIORITY_MIN}, {PRIORITY_MAX}]")
        if name in out or v in out.values():
            raise ConfigError(f"priority.classes: {_short(e)} repeats a class name or value")
        out[name] = v
    return out


@dataclass(frozen=True)
class PriorityConfig:
    classes: tuple[str, ...] = _f(("interactive=0", "batch=10"), live=True,
                                  doc="the priority classes, NAME=PRIORITY (lower runs "
                                  "first; at most 8): what an API key's class in the key "
                                  "file names, and the priority_class label of the metrics")
    default_class: str = _f("interactive", live=True,
                            doc="the class of a request whose API key names none (and of "
                            "every request when no keys are configured): its priority is "
                            "the request's default and the most urgent it may ask for")

    def __post_init__(self) -> None:
        classes = parse_classes(self.classes)
        if not classes or len(classes) > MAX_CLASSES:
            raise ConfigError(f"priority.classes: between 1 and {MAX_CLASSES} classes, got "
                              f"{len(classes)}")
        if self.default_class not in classes:
            raise ConfigError(f"priority.default_class: {_short(self.default_class)} is not "
                              f"one of the classes ({', '.join(classes)})")

    @property
    def values(self) -> dict[str, int]:
        """Class name -> its priority."""
        return parse_classes(self.classes)
