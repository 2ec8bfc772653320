"""ServerState: what the HTTP layer needs from the daemon, owned and updated by moed.app.

moed.api never imports moed.app; the app builds one ServerState, keeps it current (readiness,
draining, reloaded config and keys) and stores it on the aiohttp application under STATE.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from aiohttp import web

from moed.api.admission import Admission
from moed.api.grammar_pool import GrammarPool
from moed.api.offload import Offload
from moed.config import Config
from moed.engine.client import EngineClient

if TYPE_CHECKING:
    from moed.api.internal import InternalAuth
    from moed.balance.capacity import Capacity
    from moed.parallel.runtime import EPRuntime


@dataclass
class ServerState:
    config: Config
    engine: EngineClient | None = None    # None on the router role
    api_keys: tuple[bytes, ...] = ()
    key_classes: tuple[str, ...] = ()     # each API key's priority class ("" = the default)
    metrics_tokens: tuple[bytes, ...] = ()   # server.metrics_token_file/_env: /metrics only
    ready: bool = False                   # /ready: started, model loaded, not draining
    draining: bool = False
    model_name: str = ""
    model_id: str = ""                    # moed.model.identity: the checkpoint's hash
    created: int = field(default_factory=lambda: int(time.time()))
    inflight: int = 0
    internal_auth: InternalAuth | None = None     # node-to-node calls
    # why this node cannot take work although started ("" = it can): the router's, when no
    # serving node is alive (moed.roles.router); /ready answers 503 with it
    unready_reason: Callable[[], str] | None = None
    # this node's capacity signals now (moed.balance.capacity.Capacity; set by moed.app for a
    # node with an engine): /metrics and the gossip load vector read them
    capacity: Callable[[], Capacity] | None = None
    # this rank's expert-parallel runtime (moed.parallel.runtime.EPRuntime; None when ep_size = 1)
    ep: EPRuntime | None = None
    admission: Admission = field(init=False)
    offload: Offload = field(init=False, default_factory=Offload)   # O(prompt) work, off the loop
    grammar: GrammarPool = field(init=False)      # structured outputs' compilation, apart
    _idle: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    # drain: each live stream a router may migrate, by its hand-off (moed.api.generate)
    handoffs: set[Callable[[], None]] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        a = self.config.admission
        self.admission = Admission(a.max_waiting_requests, a.max_queued_prompt_tokens,
                                   self.config.engine.max_num_seqs)
        st = self.config.structured
        self.grammar = GrammarPool(st.compile_workers, st.compile_queue,
                                   st.compile_queue_timeout_s, st.compile_timeout_s)
        self._idle.set()

    def set_config(self, cfg: Config) -> None:
        self.config = cfg
        self.admission.reconfigure(cfg.admission.max_waiting_requests,
                                   cfg.admission.max_queued_prompt_tokens,
                                   cfg.engine.max_num_seqs)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one in-flight request (drain waits for the count to reach zero)."""
        self.inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True if every in-flight request finished within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return self.inflight == 0


STATE: web.AppKey[ServerState] = web.AppKey("moed_state", ServerState)
# Per-request values the handlers leave for the access log (moed.api.middleware).
REQUEST_ID = web.RequestKey("moed_request_id", str)
USAGE = web.RequestKey("moed_usage", tuple)          # (prompt_tokens, completion_tokens)
PRIORITY = web.RequestKey("moed_priority", tuple)    # (priority, its class label)
FINISH = web.RequestKey("moed_finish", str)          # finish reasons, "client_disconnect", ...
