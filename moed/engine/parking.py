"""Remote-KV parking: a request whose prompt KV is written by another node (a prefill node,
moed.roles.decode) waits here with its whole prompt's blocks allocated, in
WAITING_REMOTE_KV, until the KV has arrived (`unpark`) or it ends (`drop`)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from moed.engine.request import Request
from moed.engine.seating import take_blocks
from moed.kvcache.manager import KVCacheManager, PrefixHit
from moed.types import RequestState

# the engine's: hands the allocated block ids to whoever writes the prompt's KV
OnAllocated = Callable[[Request, list[int]], None]


class RemoteKVParking:
    def __init__(self, kv: KVCacheManager, on_allocated: OnAllocated | None = None) -> None:
        self._kv = kv
        self._on_allocated = on_allocated
        self._parked: dict[str, Request] = {}
        self.view: Mapping[str, Request] = MappingProxyType(self._parked)

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, req: Request, hit: PrefixHit) -> bool:
        """Allocate the whole prompt (after its prefix hit) and park; False: no room now (the
        caller keeps it WAITING)."""
        if not self._kv.can_allocate_prompt(hit, req.num_tokens):
            return False
        alloc = take_blocks(self._kv, req, hit, req.num_tokens, RequestState.WAITING_REMOTE_KV,
                            count_cached=True)
        self._parked[req.request_id] = req
        if self._on_allocated is not None:
            self._on_allocated(req, list(alloc.block_ids))
        return True

    def unpark(self, request_id: str) -> Request:
        """The prompt's KV has been written: every prompt token counts as computed."""
        req = self._parked.pop(request_id, None)
        if req is None:
            raise KeyError(f"no request {request_id!r} is waiting for remote KV")
        req.num_computed_tokens = req.num_tokens
        self._kv.commit(request_id, req.token_ids, req.num_computed_tokens)
        return req

    def drop(self, request_id: str) -> None:
        """It ended while parked (the caller frees its blocks)."""
        del self._parked[request_id]
