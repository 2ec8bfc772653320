"""The roles' prompt sources (moed.engine.prompts.PromptSource): how a request's prompt KV
comes on a node that does not simply compute it. A role component gives its source to the
engine once, as the node starts.

    RemotePrefill   a decode node: a prefill node writes the prompt's KV (moed.roles.decode)
    PeerReuse       `tiers.peer_reuse`: a peer's cached prefix is read first, the request
                    parked meanwhile (moed.roles.kvshare)
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from moed.engine.prompts import PendingPrompt

if TYPE_CHECKING:
    from moed.roles.decode import DecodeComponent
    from moed.roles.kvshare import KVShareComponent

log = structlog.get_logger(__name__)


class RemotePrefill:
    """A decode node's PromptSource (moed.engine.prompts): prompts are prefilled remotely,
    except short ones, prefill-only ones and those that want prompt logprobs."""

    def __init__(self, role: DecodeComponent) -> None:
        self._role = role

    def admit(self, pending: PendingPrompt) -> None:
        if pending.prefill_only or pending.params.prompt_logprobs is not None or \
                len(pending.prompt_token_ids) <= self._role.cfg.transfer.local_prefill_max_tokens:
            # short prompts: a remote round trip (and the prefill node's queue) costs more
            # TTFT than the few tokens cost this node's decode steps. Prompt logprobs (echo
            # with logprobs): the logits of every prompt position are needed, and a prefill
            # node sends only KV, so this node computes the prompt itself
            pending.submit()
            return
        pending.submit(remote_kv=True)
        self._role.launch(pending.request_id, pending.prompt_token_ids, pending.params,
                          pending.stream)

    def cancel(self, request_id: str) -> None:
        self._role.cancel(request_id)


class PeerReuse:
    """A node's PromptSource (moed.engine.prompts) with `tiers.peer_reuse`: a peer's cached
    prefix is brought in before the request is scheduled. The request waits parked while its
    prefetch runs (which never fails it: any failure recomputes), then goes to the scheduler;
    an abort cancels the wait (a read in flight finishes on its own, moed.roles.kvshare)."""

    def __init__(self, share: KVShareComponent) -> None:
        self._share = share
        self._waiting: dict[str, asyncio.Task] = {}

    def admit(self, pending: PendingPrompt) -> None:
        if pending.prefill_only or pending.params.prompt_logprobs is not None:
            # prompt logprobs need every prompt position's logits: nothing to reuse then
            pending.submit()
            return
        rid = pending.request_id
        task = asyncio.create_task(self._prefetched(pending), name=f"kv-peer-prefetch-{rid}")
        self._waiting[rid] = task
        task.add_done_callback(lambda t: self._waiting.pop(rid, None)
                               if self._waiting.get(rid) is t else None)

    async def _prefetched(self, pending: PendingPrompt) -> None:
        try:
            await self._share.prefetch(pending.request_id, pending.prompt_token_ids,
                                       pending.params.cache_salt)
        except asyncio.CancelledError:
            raise           # aborted: the engine ends the parked request
        except Exception:   # prefetch never raises; if it did, the prompt is computed here
            log.exception("kv_peer_prefetch_crashed", request_id=pending.request_id)
        pending.submit()

    def cancel(self, request_id: str) -> None:
        task = self._waiting.pop(request_id, None)
        if task is not None:
            task.cancel()
