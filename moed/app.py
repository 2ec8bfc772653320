"""The daemon: wires the parts for a role, owns every background task, starts and drains.

How a component plugs in
------------------------
A component is any object with these four members (see `Component`; subclass `BaseComponent`
to get no-op defaults):

    name: str
    def add_routes(self, web: aiohttp.web.Application) -> None   # called once, before start
    async def start(self, app: App) -> None     # in list order, after the HTTP site is up
    async def drain(self) -> None               # readiness is already false: stop taking work
                                                # (membership: leave; router: stop picking)
    async def stop(self) -> None                # reverse order, after in-flight requests ended

Add yours in `build_components` below under your section (one line, gated on role/config).
Long-running work goes through `app.spawn(coro, name)`, never bare `create_task`: the app
cancels and awaits those tasks at exit. `app.state` (moed.api.state.ServerState) is what the
HTTP layer sees: engine, readiness, draining, in-flight count. `app.on_signal(sig, cb)` adds a
signal handler (SIGHUP reload). `app.ready_event` is set once the node is ready.

Lifecycle
---------
  start: HTTP site up (/health answers, /ready says 503 "starting")
       → components start in order (the engine loads the model)
       → ready (/ready 200, moed_ready 1)
  SIGTERM/SIGINT (or app.request_stop()):
       → ready false, draining (new /v1 requests: 503)
       → components drain (reverse order)
       → wait for in-flight requests up to server.shutdown_grace_s (a 2nd signal skips this)
       → HTTP site closed (remaining streams are cancelled, their engine requests aborted)
       → components stop (reverse order), spawned tasks cancelled → exit code 0
"""
from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Coroutine, Protocol, runtime_checkable

import structlog
from aiohttp import web

from moed import __version__
from moed.api import continuation, health, limits, openai
from moed.api.auth import load_keys, split_classes
from moed.api.middleware import auth, read_body, request_context
from moed.api.state import STATE, ServerState
from moed.balance import capacity
from moed.config import Config, needs_cluster_key, node_name
from moed.engine.stream import StepStats
from moed.obs import metrics

if TYPE_CHECKING:
    from moed.engine.engine import Engine

log = structlog.get_logger(__name__)


@runtime_checkable
class Component(Protocol):
    name: str

    def add_routes(self, web_app: web.Application) -> None: ...
    async def start(self, app: App) -> None: ...
    async def drain(self) -> None: ...
    async def stop(self) -> None: ...


class BaseComponent:
    """No-op defaults for the Component protocol."""

    name = "component"

    def add_routes(self, web_app: web.Application) -> None:
        pass

    async def start(self, app: App) -> None:
        pass

    async def drain(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def served_model_name(cfg: Config) -> str:
    return cfg.model.served_name or (Path(cfg.model.path).name if cfg.model.path else "")


class EngineComponent(BaseComponent):
    """Loads the model and runs the engine's step loop (colocated, prefill, decode roles)."""

    name = "engine"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.engine: Engine | None = None

    def add_routes(self, web_app: web.Application) -> None:
        openai.add_routes(web_app)
        continuation.add_routes(web_app)    # a migrated stream resumes here (router only)

    async def start(self, app: App) -> None:
        t0 = time.perf_counter()
        log.info("model_loading", path=self.cfg.model.path)
        # Off the loop (the weights take seconds to minutes): /health keeps answering. The
        # build and the calibration run on the engine's step thread (Engine.from_config), this
        # thread only waits. torch was imported by the pre-flight checks, before listening.
        self.engine = await asyncio.to_thread(_build_engine, self.cfg)
        self.engine.subscribe_step(_observe_step)
        self.engine.subscribe_expert_load(metrics.observe_expert_load)
        _expert_parallel(self.engine, app)
        await self.engine.start()
        app.state.engine = self.engine
        # capacity signals for /metrics and gossip, from the live engine and the live
        # [balance] targets
        app.state.capacity = lambda: capacity.of_engine(app.state.engine, app.config.balance)
        app.state.model_name = served_model_name(self.cfg)
        from moed.model.identity import model_id   # membership compares it (P/D pairs)
        app.state.model_id = await asyncio.to_thread(model_id, self.cfg.model.path)
        metrics.set_model_name(app.state.model_name)
        metrics.MODEL_INFO.info(self.engine.model_info())
        metrics.KV_BYTES_PER_TOKEN.set(self.engine.kv_bytes_per_token)
        log.info("model_loaded", model=app.state.model_name,
                 max_model_len=self.engine.max_model_len,
                 load_s=round(time.perf_counter() - t0, 2))

    async def drain(self) -> None:
        if self.engine is not None:     # expert parallelism: the ranks of a group stop together
            self.engine.expect_group_end()

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()


def _expert_parallel(engine: Engine, app: App) -> None:
    """Resident expert bytes (from the tensors held) for any engine; an EP rank's group
    metrics, and its group failure → app.fail (leave membership, exit 1; moed/parallel)."""
    held = engine.runner.resident_expert_bytes()
    metrics.EP_RESIDENT_EXPERT_BYTES.set(held)
    ep = engine.ep
    if ep is not None:
        app.state.ep = ep           # POST /admin/eplb/rebalance (moed.ops.daemon)
        ep.publish_metrics(held)
        engine.on_group_failure = app.fail
        log.info("ep_rank_ready", resident_expert_bytes=held, **ep.describe())


def _build_engine(cfg: Config) -> Engine:
    from moed.engine.engine import Engine   # lazy: the router role never imports torch

    from moed.model.grammar import GrammarLimits, set_default_limits
    st = cfg.structured         # every grammar compiler of this process gets the budget
    set_default_limits(GrammarLimits(
        compile_timeout_s=st.compile_timeout_s, probe_tokens=st.probe_tokens,
        probe_depth=st.probe_depth, max_grammar_size=st.max_grammar_size,
        initial_lexer_fuel=st.initial_lexer_fuel, step_lexer_fuel=st.step_lexer_fuel,
        step_max_items=st.step_max_items, max_items_in_row=st.max_items_in_row,
        max_lexer_states=st.max_lexer_states))
    engine = Engine.from_config(cfg)
    # the cost model's calibration (a few synthetic steps) before /ready: the first requests
    # are budgeted from a fitted model (balance.calibration_steps; moed.engine.balancing).
    # Not on an expert-parallel rank: its forward passes need the whole group in step.
    if cfg.balance.policy == "cost" and engine.ep is None:
        engine.calibrate(cfg.balance.calibration_steps)
    return engine


def _observe_step(step: StepStats) -> None:
    """Engine per-step hook (moed.engine.stream.StepStats) → metrics. Runs on the event loop."""
    metrics.BATCH_SIZE.observe(step.batch_size)
    metrics.BATCH_TOKENS.observe(step.num_prefill_tokens + step.num_decode_tokens)
    metrics.STEP_TIME.observe(step.step_seconds)
    if step.num_decode_tokens and not step.num_prefill_tokens:
        metrics.DECODE_STEP_TIME.observe(step.step_seconds)
    capacity.METER.on_step(step.num_prefill_tokens, step.num_decode_tokens, step.step_seconds)
    metrics.RUNNING.set(step.running)
    metrics.WAITING.set(step.waiting)
    metrics.observe_kv(step.kv_blocks_used, step.kv_blocks_free)


def build_components(cfg: Config) -> list[Component]:
    """The components of a node, in start order, by role and config."""
    role = cfg.server.role
    comps: list[Component] = []
    # ---- tracing (OpenTelemetry), first: on before any request is served, flushed last ----
    if cfg.trace.endpoint:
        from moed.obs.trace import TraceComponent   # raises ConfigError: the extra missing
        comps.append(TraceComponent(cfg.trace, node_name(cfg)))
    # ---- node-to-node auth: the cluster secret signs /internal/* and /cluster calls ----
    if needs_cluster_key(cfg):
        from moed.api.internal import InternalAuth   # raises ConfigError: no key
        comps.append(InternalAuth.from_config(cfg, node_name(cfg)))
    # ---- engine (daemon helper) ----
    if role in ("colocated", "prefill", "decode"):
        comps.append(EngineComponent(cfg))
    # ---- cluster (gossip helper): membership when cfg.cluster.enabled ----
    if cfg.cluster.enabled:
        from moed.cluster.service import MembershipComponent   # raises ConfigError: no key
        comps.append(MembershipComponent(cfg))
    else:                    # GET /cluster still answers: this node alone (moed.cluster.solo)
        from moed.cluster.solo import SoloClusterComponent
        comps.append(SoloClusterComponent(cfg))
    # ---- transfer (transfer helper): prefill/decode role components ----
    if role in ("prefill", "decode"):
        from moed.roles import role_component   # after the engine: it wraps/hooks it
        comps.append(role_component(cfg, node_name(cfg)))
    # ---- cluster prefix reuse: READ peers' cached prompt blocks, lend ours (docs/kv-tiers.md) ----
    if cfg.tiers.peer_reuse:
        from moed.roles.kvshare import KVShareComponent   # after membership: it reads the view
        comps.append(KVShareComponent(cfg, node_name(cfg)))
    # ---- ops (ops helper): sd_notify/watchdog, SIGHUP reload, /admin, router proxy ----
    if role == "router":
        from moed.roles.router import RouterComponent
        comps.append(RouterComponent(cfg))
    from moed.ops.daemon import OpsComponent   # last: it drains first (STOPPING=1)
    comps.append(OpsComponent(cfg))
    return comps


def api_keys(cfg: Config) -> tuple[tuple[bytes, ...], tuple[str, ...]]:
    """The tenant API keys and each key's priority class ("" = priority.default_class)."""
    return split_classes(load_keys(cfg.server.api_keys_file, cfg.server.api_keys_env),
                         cfg.priority.values)


class App:
    def __init__(self, cfg: Config, components: list[Component] | None = None, *,
                 config_path: str | None = None,
                 overrides: dict[str, dict[str, Any]] | None = None) -> None:
        self.config = cfg
        self.config_path = config_path    # what SIGHUP re-reads (with overrides on top, as at start)
        self.config_overrides = overrides
        self.node = node_name(cfg)
        self.components: list[Component] = (build_components(cfg) if components is None
                                             else list(components))
        keys, classes = api_keys(cfg)
        self.state = ServerState(config=cfg, api_keys=keys, key_classes=classes,
                                 metrics_tokens=load_keys(cfg.server.metrics_token_file,
                                                          cfg.server.metrics_token_env))
        # client_max_size is fixed here; request_context re-binds each request to the live
        # server.max_body_bytes, so a reload can raise the limit as well as lower it
        self.web = web.Application(middlewares=[request_context, auth, read_body],
                                   client_max_size=cfg.server.max_body_bytes)
        self.web[STATE] = self.state
        health.add_routes(self.web)
        self.ready_event = asyncio.Event()
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._signals: list[tuple[int, Callable[[], None]]] = []
        self._runner: web.AppRunner | None = None
        self._started: list[Component] = []
        self._exit_code = 0
        self.port: int = cfg.server.port

    # ---- wiring API for components ----

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Run a background task owned by the app (cancelled and awaited at exit)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", task=task.get_name(),
                      error=repr(task.exception()))

    def on_signal(self, sig: int, callback: Callable[[], None]) -> None:
        self._signals.append((sig, callback))

    def set_config(self, cfg: Config) -> None:
        """Adopt a (reloaded) config: limits, keys and timeouts apply to the next request."""
        self.config = cfg
        self.state.set_config(cfg)
        self.state.api_keys, self.state.key_classes = api_keys(cfg)
        self.state.metrics_tokens = load_keys(cfg.server.metrics_token_file,
                                              cfg.server.metrics_token_env)

    def fail(self, reason: str) -> None:
        """A component found, after start, that this node must not run (e.g. its cluster name
        is taken): stop, and exit non-zero."""
        log.error("node_failed", reason=reason)
        self._exit_code = 1
        self.request_stop()

    def request_stop(self) -> None:
        if self._stop.is_set():
            log.warning("second_stop_signal", action="skipping the grace period")
            self._force.set()
        self._stop.set()

    # ---- lifecycle ----

    async def start(self) -> None:
        """Bring the HTTP site up, start components, become ready."""
        for c in self.components:
            c.add_routes(self.web)
        self._runner = web.AppRunner(self.web, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        # connection limits, header/keep-alive deadlines, JSON parser errors (moed.api.limits)
        site = limits.GuardedSite(self._runner, self.config.server,
                                  lambda: self.state.config.server)
        await site.start()
        self.spawn(limits.watch_fds(site.guard), "fd-watch")
        addrs = self._runner.addresses
        if addrs:
            self.port = addrs[0][1]
        metrics.NODE_INFO.info({"role": self.config.server.role, "node": self.node,
                                "version": __version__, "config_digest": self.config.digest()})
        log.info("listening", host=self.config.server.host, port=self.port)
        for c in self.components:
            await c.start(self)
            self._started.append(c)
        self.state.ready = True
        self.ready_event.set()
        metrics.READY.set(1)
        log.info("ready", components=[c.name for c in self.components])

    async def _hand_off_after(self, delay: float) -> None:
        """Drain: streams a router relays for migration end here after `delay` and continue
        elsewhere (server.drain_migrate_after_s), instead of holding the node to their end."""
        await asyncio.sleep(delay)
        streams = list(self.state.handoffs)
        for hand_off in streams:
            hand_off()
        log.info("drain_handed_off", streams=len(streams))

    async def drain(self) -> None:
        """Stop taking work, let in-flight requests finish (up to the grace), stop everything."""
        grace = self.config.server.shutdown_grace_s
        self.state.ready = False
        self.state.draining = True
        metrics.READY.set(0)
        log.info("draining", inflight=self.state.inflight, grace_s=grace)
        for c in reversed(self._started):
            await _quietly(c.drain(), f"{c.name}.drain")
        idle_wait = asyncio.ensure_future(self.state.wait_idle(grace))
        force_wait = asyncio.ensure_future(self._force.wait())
        hand = self.config.server.drain_migrate_after_s
        handing = asyncio.ensure_future(self._hand_off_after(min(hand, grace))) if hand else None
        await asyncio.wait({idle_wait, force_wait}, return_when=asyncio.FIRST_COMPLETED)
        force_wait.cancel()
        idle_wait.cancel()
        if handing is not None:
            handing.cancel()
        if self.state.inflight:
            log.warning("grace_expired", inflight=self.state.inflight)
        if self._runner is not None:
            await self._runner.cleanup()
        self.state.offload.shutdown()
        self.state.grammar.shutdown()
        for c in reversed(self._started):
            await _quietly(c.stop(), f"{c.name}.stop")
        self._started.clear()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5.0)
        log.info("stopped")

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT, then drain. Returns the process exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        for sig, cb in self._signals:
            loop.add_signal_handler(sig, cb)
        try:
            starting = asyncio.ensure_future(self.start())
            stopping = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():          # signalled while loading: give up the start
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            elif starting.exception() is not None:
                stopping.cancel()
                log.error("start_failed", error=str(starting.exception()),
                          exc_info=starting.exception())
                await self.drain()
                return 1
            await self._stop.wait()
            await self.drain()
            return self._exit_code
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, *(s for s, _ in self._signals)):
                loop.remove_signal_handler(sig)
            # The exit code is decided; a SIGTERM during the last teardown (thread joins,
            # transfer agents closing) must not turn a clean exit into a death by signal.
            # SIGKILL (systemd's TimeoutStopSec) still ends a teardown that hangs.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


async def _quietly(aw: Awaitable[Any], what: str) -> None:
    try:
        await aw
    except Exception as e:     # one component failing to stop must not block the rest
        log.error("component_error", step=what, error=repr(e))
