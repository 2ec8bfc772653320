"""The roles' prompt sources (moed.engine.prompts): the decode node's RemotePrefill and the
peer reader's PeerReuse decide, per request, how its prompt's KV comes."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from moed.engine.prompts import PendingPrompt
from moed.engine.stream import RequestStream
from moed.roles.sources import PeerReuse, RemotePrefill
from moed.types import SamplingParams


def _pending(rid: str, n: int, submits: list, *, prefill_only: bool = False,
             params: SamplingParams | None = None) -> PendingPrompt:
    return PendingPrompt(rid, list(range(n)), params or SamplingParams(max_tokens=2),
                         prefill_only, RequestStream(rid, lambda _r: None),
                         lambda r, remote: submits.append((r, remote)))


class Role:
    def __init__(self, local_max: int) -> None:
        self.cfg = SimpleNamespace(transfer=SimpleNamespace(local_prefill_max_tokens=local_max))
        self.launched: list[str] = []
        self.cancelled: list[str] = []

    def launch(self, rid, prompt, params, stream) -> None:
        self.launched.append(rid)

    def cancel(self, rid) -> None:
        self.cancelled.append(rid)


def test_remote_prefill_sends_long_prompts_away_and_keeps_the_rest_here() -> None:
    role, submits = Role(local_max=8), []
    src = RemotePrefill(role)           # type: ignore[arg-type]
    src.admit(_pending("short", 8, submits))
    src.admit(_pending("long", 9, submits))
    src.admit(_pending("job", 50, submits, prefill_only=True))
    src.admit(_pending("echo", 50, submits, params=SamplingParams(prompt_logprobs=1)))
    assert submits == [("short", False), ("long", True), ("job", False), ("echo", False)]
    assert role.launched == ["long"]
    src.cancel("long")
    assert role.cancelled == ["long"]


class Share:
    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.asked: list[str] = []
        self.fail = False

    async def prefetch(self, rid, tokens, salt="") -> None:
        self.asked.append(rid)
        await self.go.wait()
        if self.fail:
            raise RuntimeError("a bug")


async def test_peer_reuse_parks_until_the_prefetch_ends_and_an_abort_cancels_it() -> None:
    share, submits = Share(), []
    src = PeerReuse(share)              # type: ignore[arg-type]
    src.admit(_pending("job", 40, submits, prefill_only=True))
    assert submits == [("job", False)] and share.asked == []    # a job: no reuse here
    src.admit(_pending("a", 40, submits))
    src.admit(_pending("b", 40, submits))
    await asyncio.sleep(0)
    assert share.asked == ["a", "b"] and submits == [("job", False)]      # both parked
    src.cancel("b")                     # aborted while its prefetch runs: never submitted
    share.go.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert submits == [("job", False), ("a", False)]


async def test_peer_reuse_computes_the_prompt_when_its_prefetch_breaks() -> None:
    share, submits = Share(), []
    share.fail = True
    share.go.set()
    src = PeerReuse(share)              # type: ignore[arg-type]
    src.admit(_pending("x", 40, submits))
    for _ in range(5):
        await asyncio.sleep(0)
    assert submits == [("x", False)]
