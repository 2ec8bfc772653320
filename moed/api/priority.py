"""Request priority (pure): a request's `priority` against its API key's class, and the bounded
class label the metrics and logs use.

vLLM's field: an integer, lower runs first, default 0. moed is multi-tenant, so a request's
priority is capped by its key's class (the key file names it; `priority.default_class` for a
key that names none and when no keys are configured): the request's default is its class's
value, and it may ask for that value or a larger one (less urgent), never a smaller one — a
request asking for more than its key allows is refused with a 400 (`priority_not_allowed`),
not clamped, so a field is never silently something else than what was sent.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from moed.api.auth import key_class
from moed.api.errors import APIError
from moed.config import PRIORITY_MAX, PRIORITY_MIN, PriorityConfig

OTHER = "other"        # the label of a priority that is no class's value (bounded cardinality)


def resolve(requested: int | None, class_name: str, classes: Mapping[str, int]) -> int:
    """The request's priority: its class's value when it sent none; what it sent when that is
    no more urgent than its class allows; else APIError(400)."""
    cap = classes[class_name]
    if requested is None:
        return cap
    if requested < cap:
        raise APIError(400, f"'priority' {requested} is more urgent than this API key's class "
                            f"'{class_name}' allows (at least {cap}; lower runs first)",
                       param="priority", code="priority_not_allowed")
    return requested


def class_label(priority: int, classes: Mapping[str, int]) -> str:
    """The class whose value `priority` is, else OTHER: a metric label never holds a raw
    integer, so a client cannot grow the series."""
    for name, value in classes.items():
        if value == priority:
            return name
    return OTHER


def for_request(requested: int | None, token: bytes | None, keys: tuple[bytes, ...],
                key_classes: tuple[str, ...], cfg: PriorityConfig, continuation: bool = False
                ) -> tuple[int, str]:
    """(the request's priority, its class label): `requested` against the class of the API key
    `token` (priority.default_class when the key names none or no keys are configured). A
    migrated stream's continuation keeps what its first node resolved: the body's priority,
    or the default class's (its call carries the cluster's signature, not the tenant's key)."""
    classes = cfg.values
    klass = (key_class(token, keys, key_classes) if token is not None and keys else "") \
        or cfg.default_class
    if continuation:
        priority = classes[cfg.default_class] if requested is None else requested
    else:
        priority = resolve(requested, klass, classes)
    return priority, class_label(priority, classes)


def routing_priority(parsed: Mapping[str, Any] | None, body: bytes, token: bytes | None,
                     keys: tuple[bytes, ...], key_classes: tuple[str, ...],
                     cfg: PriorityConfig) -> int:
    """The priority a router places a request by (the serving node checks and refuses): the
    body's integer `priority`, else its key's class's value. `parsed`: the body when the
    caller has parsed it already; otherwise it is parsed only when it names the field."""
    if parsed is None and b'"priority"' in body:
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            parsed = None
    v = parsed.get("priority") if isinstance(parsed, Mapping) else None
    if isinstance(v, int) and not isinstance(v, bool) and PRIORITY_MIN <= v <= PRIORITY_MAX:
        return v
    return for_request(None, token, keys, key_classes, cfg)[0]
