"""Where a new request's prompt KV comes from: a strategy chosen once, when the node is built.

`Engine.add_request` checks a request (a ValueError is the caller's 400), gives it its stream
and hands a `PendingPrompt` to the node's `PromptSource`, which decides how the prompt's KV
comes before the scheduler sees the request:

    LocalPrompts    computed here (colocated and prefill nodes; the default)
    RemotePrefill   a prefill node writes it (moed.roles.sources, for moed.roles.decode)
    PeerReuse       a peer's cached prefix is read first (moed.roles.sources, moed.roles.kvshare)

A source may hold a request parked (not yet scheduled) while it works, e.g. a peer read; an
abort then reaches `PromptSource.cancel` and the engine ends the parked request's stream.
`submit` after an abort (or shutdown) does nothing. `add_request` has one signature and
returns the stream at once on every node.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from moed.engine.stream import RequestStream
from moed.types import SamplingParams

Submit = Callable[[str, bool], None]     # (request_id, remote_kv) -> the scheduler's inbox


class PendingPrompt:
    """A checked request with its stream, not yet scheduled."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams, prefill_only: bool, stream: RequestStream,
                 submit: Submit) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.prefill_only = prefill_only
        self.stream = stream
        self._submit = submit

    def submit(self, *, remote_kv: bool = False) -> None:
        """Schedule it. remote_kv: blocks for the whole prompt are allocated and the request
        waits for its KV (`stream.kv_blocks` resolves to them, then
        `complete_remote_prefill`); see moed.engine.engine."""
        self._submit(self.request_id, remote_kv)


class PromptSource(Protocol):
    def admit(self, pending: PendingPrompt) -> None:
        """Decide how the prompt's KV comes; call pending.submit (now or later)."""
    def cancel(self, request_id: str) -> None:
        """The request was aborted: stop whatever works for it (it may be gone already)."""


class LocalPrompts:
    """Every prompt computed here."""

    def admit(self, pending: PendingPrompt) -> None:
        pending.submit()

    def cancel(self, request_id: str) -> None:
        pass
