"""OpsComponent: the node as a systemd citizen — sd_notify, watchdog, SIGHUP reload, admin API.

Lifecycle it reports to systemd (and to /metrics):
  constructed → STATUS=starting; add_routes → SIGHUP handler installed (a reload asked for while
  the model loads is deferred, never fatal: SIGHUP's default action would kill the process;
  one that came even earlier, while `moed serve` imported, was held by moed.ops.signals)
  → app ready (model loaded, cluster joined) → READY=1, watchdog pings start
  → SIGHUP: RELOADING=1 … READY=1 (moed_config_reloads_total{result}, moed_config_version)
  → SIGTERM or POST /admin/drain: STOPPING=1, moed_draining 1 → the app drains → exit 0.

Reload reaches other components without them importing this module: any component with a
`prepare_reload(old, new) -> commit | None` method is subscribed (see moed.ops.reload).
Every applied config (the one it started with, each applied reload or rollback) goes into the
config history (moed.ops.history); POST /admin/config/rollback applies an entry again through
the same reload path, and the membership's `config` hash follows the running config.
Placed last in the component list so it drains first (STOPPING=1 before anything else).
"""
from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Mapping, Protocol, runtime_checkable

import structlog

from moed import __version__
from moed.api import admin
from moed.api.auth import AuthConfigError, load_keys, split_classes
from moed.cluster.state import PROTOCOL
from moed.config import Config, ConfigError, diff, from_dict, load
from moed.engine.client import EngineClient
from moed.obs import metrics
from moed.ops.history import ConfigHistory, state_dir
from moed.ops.reload import (Commit, Reloader, ReloadOutcome, ReloadResult, describe, redact)
from moed.ops.sdnotify import Notifier, watchdog_interval, watchdog_loop
from moed.ops.signals import ignore_sighup, take_held_sighup

if TYPE_CHECKING:
    from moed.app import App

log = structlog.get_logger(__name__)




def load_key_source(file: str, env: str, what: str,
                    classes: Collection[str] | None = None) -> tuple[bytes, ...]:
    """server.<what>_file / _env (api_keys, admin_token) read, or a one-line ConfigError
    (moed.api.auth.load_keys reads only a regular file, without blocking). With `classes`
    (the API keys), each key's priority class must be one of them."""
    try:
        keys = load_keys(file, env)
        return keys if classes is None else split_classes(keys, classes)[0]
    except AuthConfigError as e:
        raise ConfigError(str(e).replace("api_keys", what)) from None
    except UnicodeEncodeError:           # the variable's bytes were not UTF-8 (PEP 383)
        raise ConfigError(f"server.{what}_env: variable {env} is not UTF-8 text") from None


@runtime_checkable
class Reloadable(Protocol):
    """A component that applies live config changes (moed.ops.reload: prepare, then commit)."""
    name: str

    def prepare_reload(self, old: Config, new: Config) -> Commit | None: ...


class EngineProgress:
    """Watchdog veto: False when the engine has running requests but finished no step for
    `stall_s` (a wedged forward thread). Waiting requests alone do not count: a decode node
    waits for remote KV, or a full KV cache, without stepping, and is not stuck."""

    def __init__(self, engine: EngineClient, stall_s: float, clock=time.monotonic) -> None:
        self._engine, self._stall_s, self._clock = engine, stall_s, clock
        self._steps, self._since = -1, clock()

    def __call__(self) -> bool:
        s = self._engine.stats()
        now = self._clock()
        if s.steps != self._steps or s.running == 0:
            self._steps, self._since = s.steps, now
            return True
        return now - self._since < self._stall_s


class OpsComponent:
    name = "ops"

    def __init__(self, cfg: Config, config_path: str | Path | None = None,
                 overrides: Mapping[str, Mapping[str, Any]] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.cfg = cfg
        self._path = config_path
        self._overrides = overrides
        self._environ = os.environ if environ is None else environ
        self.notifier = Notifier.from_env(self._environ)
        self.notifier.status("starting")
        # The watchdog kills with SIGABRT (WatchdogSignal= in the units): dump every thread's
        # stack first, so the journal says where the event loop was stuck.
        if not faulthandler.is_enabled():
            faulthandler.enable()
        self._admin_tokens = load_key_source(cfg.server.admin_token_file,
                                             cfg.server.admin_token_env, "admin_token")
        self._app: App | None = None
        self.reloader: Reloader | None = None
        self._last: ReloadResult | None = None
        self._serving = False
        self._deferred_reload = False
        self._draining = False
        self.history: ConfigHistory | None = None

    # ---- Component protocol ----------------------------------------------------------------

    def add_routes(self, web_app: Any) -> None:
        admin.add_routes(web_app, admin.AdminHooks(
            tokens=lambda: self._admin_tokens, drain=self.request_drain, config=self.config_view,
            history=self.history_view, rollback=self.rollback, rebalance=self.request_rebalance))
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
        if take_held_sighup():    # one arrived while `moed serve` was still importing
            log.info("config_reload_deferred", reason="signal during process start")
            self._deferred_reload = True
        self.notifier.status("loading model" if self.cfg.server.role != "router" else "starting")

    async def start(self, app: App) -> None:
        self._app = app
        if self._path is None:   # the CLI tells the app what it loaded; SIGHUP loads it again
            self._path = getattr(app, "config_path", None)
            self._overrides = getattr(app, "config_overrides", None)
        self.reloader = Reloader(app.config, self._path, self._overrides,
                                 environ=lambda: self._environ,
                                 on_start=self.notifier.reloading, on_done=self._reloaded)
        self.reloader.subscribe("auth", self._prepare_auth)
        self.reloader.subscribe("logging", self._prepare_logging)
        self.reloader.subscribe("engine", self._prepare_engine)
        appliers = set()
        for c in app.components:
            if isinstance(c, Reloadable) and c is not self:
                self.reloader.subscribe(c.name, c.prepare_reload)
                appliers.add(c.name)
        self.reloader.subscribe("coverage", lambda old, new: self._check_coverage(
            old, new, appliers))
        self.history = await asyncio.to_thread(
            ConfigHistory.open, state_dir(app.config, self._environ),
            app.config.release.config_history)
        self.history.record(app.config, "start")
        metrics.CONFIG_HISTORY.set(len(self.history.entries()))
        metrics.RELEASE_INFO.info({"version": __version__, "label": app.config.release.label(),
                                   "model_id": getattr(app.state, "model_id", "") or "",
                                   "protocol": PROTOCOL})
        self._export_version()
        app.spawn(self._announce_ready(app), "sd-ready")

    async def drain(self) -> None:
        self._draining = True
        self._serving = False
        metrics.DRAINING.set(1)
        self.notifier.stopping()

    async def stop(self) -> None:
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)   # → SIG_DFL
            ignore_sighup()   # a reload asked for while stopping is moot, and must not kill
        except (RuntimeError, ValueError):
            pass
        self.notifier.status("stopped")
        self.notifier.close()
        if self.history is not None:
            try:
                await self.history.flush()
            except (TimeoutError, OSError) as e:
                log.warning("config_history_flush_failed", error=repr(e))
            self.history.close()

    # ---- readiness and watchdog ------------------------------------------------------------

    async def _announce_ready(self, app: App) -> None:
        await app.ready_event.wait()
        if self._draining:
            return
        self._serving = True
        self.notifier.ready(f"serving as {self.cfg.server.role} on port {app.port}")
        interval = watchdog_interval(self._environ)
        if interval:
            engine = getattr(app.state, "engine", None)
            healthy = EngineProgress(engine, stall_s=max(60.0, 4 * interval)) if engine else None
            app.spawn(watchdog_loop(self.notifier, interval, healthy), "sd-watchdog")
        if self._deferred_reload:
            self._on_sighup()

    # ---- reload ----------------------------------------------------------------------------

    def _on_sighup(self) -> None:
        if not self._serving or self.reloader is None:
            if not self._draining:
                log.info("config_reload_deferred", reason="still starting")
                self._deferred_reload = True
            return
        self._deferred_reload = False
        self.reloader.request()

    def _prepare_auth(self, old: Config, new: Config) -> Commit:
        s = new.server
        load_key_source(s.api_keys_file, s.api_keys_env, "api_keys",   # or the reload is invalid
                        new.priority.values)
        admin_tokens = load_key_source(s.admin_token_file, s.admin_token_env, "admin_token")
        load_key_source(s.metrics_token_file, s.metrics_token_env, "metrics_token")

        def commit() -> None:
            self._app.set_config(new)     # limits, timeouts, API keys (re-read) for the next request
            self._admin_tokens = admin_tokens
        return commit

    def _prepare_logging(self, old: Config, new: Config) -> Commit | None:
        a, b = old.server, new.server
        if (a.log_level, a.log_format) == (b.log_level, b.log_format):
            return None
        from moed.obs import log as obslog

        return lambda: obslog.configure(b.log_format, b.log_level, role=b.role,
                                        node=getattr(self._app, "node", ""))

    def _prepare_engine(self, old: Config, new: Config) -> Commit | None:
        engine = getattr(self._app.state, "engine", None)
        if engine is None or (old.engine == new.engine and old.balance == new.balance):
            return None
        # EngineClient.apply_config / Engine.apply_balance ([balance]: the prefill balancer):
        # adopted by the step loop at the next step boundary
        def commit() -> None:
            if old.engine != new.engine:
                engine.apply_config(new.engine)
            if old.balance != new.balance:
                engine.apply_balance(new.balance)
        return commit

    def _check_coverage(self, old: Config, new: Config, appliers: set[str]) -> None:
        """Log live changes that no running component applies (they wait for a restart)."""
        owners = {"cluster": {"cluster"}, "transfer": {"prefill", "decode"}}
        role = new.server.role
        for change in diff(old, new):
            section = change.key.split(".", 1)[0]
            if not change.live or section not in owners or owners[section] & appliers:
                continue
            if section == "transfer" and role not in ("prefill", "decode"):
                continue   # not used by this role at all
            if section == "cluster" and not new.cluster.enabled:
                continue
            log.warning("live_update_not_applied", key=change.key,
                        detail="no running component applies it yet; it takes effect on restart")
        return None

    def _reloaded(self, result: ReloadResult) -> None:
        self._last = result
        try:
            counter = metrics.CONFIG_ROLLBACKS if result.source == "rollback" else \
                metrics.CONFIG_RELOADS
            counter.labels(result=result.outcome.value).inc()
            if result.outcome is ReloadOutcome.APPLIED:
                self._applied(result)
            self._export_version()
        finally:   # RELOADING=1 was sent: without READY=1 the unit stays "reloading" for good
            if not self._draining:
                version = self.reloader.version if self.reloader else 1
                self.notifier.ready(f"serving, config v{version} ({result.outcome.value})")

    def _applied(self, result: ReloadResult) -> None:
        """A new running config: into the history, and its hash into the membership."""
        cfg = result.config
        if self.history is not None:
            self.history.resize(cfg.release.config_history)
            self.history.record(cfg, result.source)
            metrics.CONFIG_HISTORY.set(len(self.history.entries()))
        from moed.cluster.service import MembershipComponent

        cluster = next((c for c in self._app.components if isinstance(c, MembershipComponent)),
                       None)
        if cluster is not None and cluster.core is not None:
            try:
                cluster.update_meta(config=cfg.digest())
            except (RuntimeError, ValueError) as e:   # advisory: the reload itself stands
                log.warning("cluster_meta_update_failed", error=str(e))

    # ---- config history and rollback (admin) ---------------------------------------------------

    def history_view(self) -> dict[str, Any]:
        if self.history is None:
            return {"entries": [], "path": None, "running": self.cfg.digest()}
        running = self.reloader.config if self.reloader else self.cfg
        return {"running": running.digest(), "size": self.history.size,
                "path": str(self.history.path) if self.history.path else None,
                "entries": [{"hash": e.hash, "at": e.at,
                             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(e.at)),
                             "source": e.source,
                             "config": {sec: {k: redact(f"{sec}.{k}", v) for k, v in f.items()}
                                        for sec, f in e.config.items()
                                        if isinstance(f, dict)}}
                            for e in self.history.entries()]}

    def request_rebalance(self) -> tuple[int, dict[str, Any]]:
        """POST /admin/eplb/rebalance: the expert balancer decides at the group's next step
        (moed.parallel.runtime.EPRuntime.request_rebalance); (HTTP status, body)."""
        ep = getattr(self._app.state, "ep", None) if self._app is not None else None
        if ep is None:
            return 409, {"error": {"message": "This node is not an expert-parallel rank "
                                              "(parallel.ep_size = 1): it has no expert balancer.",
                                   "code": "not_expert_parallel"}}
        return ep.request_rebalance()

    def rollback(self, ref: str) -> tuple[int, dict[str, Any]]:
        """Apply the newest history entry with this hash (or unique hash prefix) through the
        reload path; (HTTP status, body)."""
        if self.reloader is None or self.history is None or not self._serving:
            return 503, {"error": {"message": "The node is starting or draining; retry.",
                                   "code": "not_ready"}}
        entry = self.history.find(ref)
        if entry is None:
            metrics.CONFIG_ROLLBACKS.labels(result="unknown_hash").inc()
            return 404, {"error": {"message": f"No config {ref} in the history (GET "
                                              f"/admin/config/history lists them).",
                                   "code": "unknown_hash"}}
        try:
            target = from_dict(entry.config, f"config history entry {entry.hash}")
        except ConfigError as e:     # e.g. written by another release, with other keys
            metrics.CONFIG_ROLLBACKS.labels(result="invalid").inc()
            return 409, {"result": "invalid", "target": entry.hash, "error": str(e)}
        log.info("config_rollback_requested", target=entry.hash, source="admin")
        result = self.reloader.apply_now(target)
        body: dict[str, Any] = {
            "result": result.outcome.value, "target": entry.hash,
            "hash": result.config.digest(), "version": self.reloader.version,
            "applied": describe(result.applied), "needs_restart": describe(result.needs_restart)}
        if result.error:
            body["error"] = result.error
        if result.outcome in (ReloadOutcome.APPLIED, ReloadOutcome.UNCHANGED):
            body["file_differs"] = self._file_differs(result.config)
            if body["file_differs"]:
                log.warning("config_rollback_file_differs", path=str(self._path or ""),
                            detail="the config file still says otherwise: the next reload "
                                   "reads it again; restore it (moed config show)")
            return 200, body
        return 409, body

    def _file_differs(self, running: Config) -> bool:
        """Whether a reload now would change the running config (the file was not restored)."""
        try:
            return bool(diff(running, load(self._path, environ=self._environ,
                                           overrides=self._overrides)))
        except ConfigError:
            return True

    def _export_version(self) -> None:
        version = self.reloader.version if self.reloader else 1
        cfg = self.reloader.config if self.reloader else self.cfg
        metrics.CONFIG_VERSION.set(version)
        metrics.CONFIG_INFO.info({"hash": cfg.digest(), "version": str(version)})

    # ---- admin hooks -----------------------------------------------------------------------

    def _engine_limits(self) -> dict[str, int]:
        """The limits the engine's scheduler uses now (a reload lands at the next step)."""
        engine = getattr(self._app.state, "engine", None) if self._app is not None else None
        return engine.limits() if engine is not None else {}

    def request_drain(self) -> dict[str, Any]:
        app = self._app
        if app is None:
            return {"status": "starting"}
        if not self._draining:
            log.info("drain_requested", source="admin")
            app.request_stop()
        return {"status": "draining", "inflight": app.state.inflight,
                "grace_s": app.config.server.shutdown_grace_s}

    def config_view(self) -> dict[str, Any]:
        cfg = self.reloader.config if self.reloader else self.cfg
        body: dict[str, Any] = {
            "version": self.reloader.version if self.reloader else 1,
            "hash": cfg.digest(),
            "path": str(self._path or ""),
            "config": {sec: {k: redact(f"{sec}.{k}", v) for k, v in fields.items()}
                       for sec, fields in cfg.to_dict().items()},
            "reloads": self.reloader.counts if self.reloader else {},
        }
        limits = self._engine_limits()
        if limits:
            body["engine_effective"] = limits
        if self._last is not None:
            body["last_reload"] = {"result": self._last.outcome.value, "error": self._last.error,
                                   "applied": describe(self._last.applied),
                                   "needs_restart": describe(self._last.needs_restart)}
        return body

