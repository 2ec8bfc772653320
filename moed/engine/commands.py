"""Typed commands into the step loop's inbox (one writer: only the loop applies them, at a step
boundary). Each has exactly one handler in `Engine._HANDLERS`."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moed.config import EngineConfig
from moed.engine.request import Request


@dataclass(frozen=True)
class AddRequest:
    request: Request


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class CompleteRemotePrefill:
    """Decode role: the prompt's KV is in place; token one was sampled on the prefill node."""
    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: Sequence[tuple[int, float]] | None = None
    draft: int | None = None        # the prefill node's MTP draft for the position after it


@dataclass(frozen=True)
class ReleaseKV:
    """Prefill role: the held KV has been sent; free it."""
    request_id: str


@dataclass(frozen=True)
class ApplyConfig:
    config: EngineConfig


@dataclass(frozen=True)
class CallAtBoundary:
    fn: Callable[[], Any]
    future: asyncio.Future


Command = AddRequest | Abort | CompleteRemotePrefill | ReleaseKV | ApplyConfig | CallAtBoundary
