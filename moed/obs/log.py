"""structlog setup: JSON lines by default, a console renderer on request.

Every line carries the node's `role` and `node` (static for the process) and whatever is bound in
structlog's contextvars; the HTTP middleware binds `request_id` for the life of one request, so
engine or API lines logged inside it carry it too. Standard-library loggers (aiohttp, asyncio)
go through the same renderer so the output stays one format.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_static: dict[str, str] = {}


def _add_static(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    for k, v in _static.items():
        event.setdefault(k, v)
    return event


def configure(fmt: str = "json", level: str = "info", *, role: str = "", node: str = "",
              stream: TextIO | None = None) -> None:
    """Install the process-wide logging pipeline. Safe to call again (e.g. on reload)."""
    _static.clear()
    if role:
        _static["role"] = role
    if node:
        _static["node"] = node
    stream = stream or sys.stderr
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_static,
    ]
    renderer: Any = (structlog.dev.ConsoleRenderer(colors=False) if fmt == "console"
                     else structlog.processors.JSONRenderer())
    num_level = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.processors.StackInfoRenderer(),
                    structlog.processors.format_exc_info,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(num_level)
    # aiohttp's own access log is replaced by ours (moed.api.middleware).
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
