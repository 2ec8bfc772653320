"""SIGHUP reload: re-read the config file and environment, validate, apply what may change live.

Two layers:
- `plan_reload` is pure-ish (reads the file): path + environment + running Config → ReloadResult
  saying which changes apply live, which need a restart (and are left as they were), or why the
  new config is invalid (then nothing changes). `plan_change` is the same for a Config given
  whole (a rollback to a config history entry, moed.ops.history).
- `Reloader` owns the running config and its version; `reload_now` (SIGHUP) and `apply_now`
  (rollback) take the same path through the subscribers. Components subscribe with a two-phase
  hook: `prepare(old, new)` checks what only the component can check (e.g. the API-key file is
  readable) and returns a `commit()` that only stores values; the engine's commit hands the new
  values to its step loop, which adopts them at the next step boundary. If any prepare fails,
  no commit runs: an invalid reload changes nothing. SIGHUPs arriving during a reload coalesce
  into one more reload afterwards, so a burst of signals never piles up work.

Every reload is logged with its diff (values of anything named like a key, token or secret
are redacted) and counted in moed_config_reloads_total{result}. A reload that fails for any
reason (a file that is not UTF-8 or not a regular file, a veto, or a bug while planning) is
INVALID: the running config stays, and the reload still ends (`on_done`, i.e. READY=1).
"""
from __future__ import annotations

import asyncio
import enum
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import structlog

from moed.config import Change, Config, ConfigError, apply_live, diff, load

log = structlog.get_logger(__name__)

_SECRET = re.compile(r"(key|token|secret|password|credential)", re.IGNORECASE)
REDACTED = "<redacted>"


class ReloadOutcome(enum.Enum):
    APPLIED = "applied"                    # live changes adopted (cold ones, if any, reported)
    UNCHANGED = "unchanged"                # the file and environment say what is running
    RESTART_REQUIRED = "restart_required"  # only fields that need a restart changed: none applied
    INVALID = "invalid"                    # refused (bad file, unreadable key, or an internal
                                           # error while reloading): nothing changed


@dataclass(frozen=True)
class ReloadResult:
    outcome: ReloadOutcome
    config: Config                           # what runs after this reload (the old one if invalid)
    applied: tuple[Change, ...] = ()
    needs_restart: tuple[Change, ...] = ()
    error: str = ""
    source: str = "reload"                   # reload (SIGHUP) | rollback (apply_now)


def plan_reload(running: Config, path: str | Path | None, environ: Mapping[str, str],
                overrides: Mapping[str, Mapping[str, Any]] | None = None) -> ReloadResult:
    """Load the config again exactly as at start (file < env < the original flags) and compare."""
    try:
        new = load(path, environ=environ, overrides=overrides)
    except ConfigError as e:
        return ReloadResult(ReloadOutcome.INVALID, running, error=str(e))
    return plan_change(running, new)


def plan_change(running: Config, new: Config, source: str = "reload") -> ReloadResult:
    """What adopting `new` on a node running `running` changes (pure)."""
    changes = diff(running, new)
    live = tuple(c for c in changes if c.live)
    cold = tuple(c for c in changes if not c.live)
    if live:
        outcome = ReloadOutcome.APPLIED
    elif cold:
        outcome = ReloadOutcome.RESTART_REQUIRED
    else:
        outcome = ReloadOutcome.UNCHANGED
    return ReloadResult(outcome, apply_live(running, new) if live else running, live, cold,
                        source=source)


def redact(key: str, value: Any) -> Any:
    """A value fit for a log line: anything whose name smells of a secret is hidden."""
    return REDACTED if _SECRET.search(key) and value not in ("", (), None) else value


def describe(changes: tuple[Change, ...]) -> list[dict[str, Any]]:
    return [{"key": c.key, "old": redact(c.key, c.old), "new": redact(c.key, c.new)}
            for c in changes]


# ---- the stateful part ---------------------------------------------------------------------

Commit = Callable[[], None]


class Subscriber(Protocol):
    def __call__(self, old: Config, new: Config) -> Commit | None:
        """Validate `new` for this component (raise ConfigError to veto); return the commit."""


@dataclass
class _Stats:
    version: int = 1
    counts: dict[str, int] = field(default_factory=dict)


class Reloader:
    """Holds the running config; `request()` (from the SIGHUP handler) reloads it once more."""

    def __init__(self, config: Config, path: str | Path | None,
                 overrides: Mapping[str, Mapping[str, Any]] | None = None, *,
                 environ: Callable[[], Mapping[str, str]] | None = None,
                 on_start: Callable[[], object] | None = None,
                 on_done: Callable[[ReloadResult], object] | None = None) -> None:
        import os

        self.config = config
        self._path = path
        self._overrides = overrides
        self._environ = environ or (lambda: os.environ)
        self._subscribers: list[tuple[str, Subscriber]] = []
        self._on_start = on_start   # e.g. notifier.reloading
        self._on_done = on_done     # e.g. metrics + notifier.ready
        self._stats = _Stats()
        self._task: asyncio.Task[None] | None = None
        self._pending = False

    @property
    def version(self) -> int:
        """1 at start, +1 for every reload that changed the running config."""
        return self._stats.version

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._stats.counts)

    def subscribe(self, name: str, hook: Subscriber) -> None:
        self._subscribers.append((name, hook))

    def request(self) -> None:
        """Signal-handler entry point: start a reload, or queue one if one is running."""
        if self._task is not None and not self._task.done():
            self._pending = True
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="config-reload")

    async def wait_idle(self) -> None:
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        while True:
            self._pending = False
            try:
                self.reload_now()
            except Exception:  # reload_now does not raise; this is the last line of defence
                log.exception("config_reload_crashed")
            await asyncio.sleep(0)  # let the step loop run between back-to-back reloads
            if not self._pending:
                return

    def apply_now(self, new: Config, source: str = "rollback") -> ReloadResult:
        """Adopt `new` (e.g. a config history entry) through the same path as a reload: live
        fields through every subscriber's prepare/commit, restart-only ones reported and left.
        Never raises; synchronous, so it never interleaves with a SIGHUP reload."""
        return self._once(lambda old: plan_change(old, new, source), source)

    def reload_now(self) -> ReloadResult:
        """One synchronous reload: plan, let every subscriber validate, then commit all.

        Never raises. Whatever goes wrong (a bad file, or a bug while planning) ends as an
        INVALID result that keeps the running config, is counted and logged, and reaches
        `on_done`: systemd got RELOADING=1 from `on_start` and must get its READY=1 back, or
        the unit stays "reloading"."""
        return self._once(lambda old: plan_reload(old, self._path, self._environ(),
                                                  self._overrides), "reload")

    def _once(self, plan: Callable[[Config], ReloadResult], source: str) -> ReloadResult:
        old = self.config
        result = ReloadResult(ReloadOutcome.INVALID, old, error="internal error: reload aborted",
                              source=source)
        try:
            if self._on_start:
                self._on_start()
            result = self._plan(old, plan)
        except Exception as e:  # a bug, not a bad file: nothing was committed, nothing changes
            log.exception("config_reload_crashed", detail="the running config is unchanged")
            result = ReloadResult(ReloadOutcome.INVALID, old,
                                  error=f"internal error {type(e).__name__}: {e}", source=source)
        finally:
            self._finish(result)
        return result

    def _plan(self, old: Config, plan: Callable[[Config], ReloadResult]) -> ReloadResult:
        result = plan(old)
        if result.outcome is not ReloadOutcome.INVALID:
            result = self._apply(old, result)
        return result

    def _finish(self, result: ReloadResult) -> None:
        if result.outcome is ReloadOutcome.APPLIED:
            self._stats.version += 1
        self.config = result.config
        try:
            self._record(result)
        except Exception:  # a log line that cannot be written must not skip on_done
            log.exception("config_reload_record_failed")
        if self._on_done:
            try:
                self._on_done(result)
            except Exception:
                log.exception("config_reload_on_done_failed", result=result.outcome.value)

    def _apply(self, old: Config, result: ReloadResult) -> ReloadResult:
        # Subscribers run even when nothing in the config changed: a secret file they read
        # (API keys) may have been rotated under the same path.
        commits: list[tuple[str, Commit]] = []
        for name, hook in self._subscribers:
            try:
                commit = hook(old, result.config)
            except ConfigError as e:
                return ReloadResult(ReloadOutcome.INVALID, old, error=f"{name}: {e}",
                                    source=result.source)
            except Exception as e:  # a bug, not a bad file; still nothing may change
                log.exception("config_reload_prepare_crashed", subscriber=name)
                return ReloadResult(ReloadOutcome.INVALID, old,
                                    error=f"{name}: internal error {type(e).__name__}: {e}",
                                    source=result.source)
            if commit is not None:
                commits.append((name, commit))
        for name, commit in commits:
            try:
                commit()
            except Exception:  # commits only store values; keep the others consistent
                log.exception("config_reload_commit_crashed", subscriber=name)
        return result

    def _record(self, r: ReloadResult) -> None:
        outcome = r.outcome.value
        self._stats.counts[outcome] = self._stats.counts.get(outcome, 0) + 1
        fields = dict(result=outcome, version=self.version, config_hash=self.config.digest(),
                      path=str(self._path or ""), source=r.source)
        if r.outcome is ReloadOutcome.INVALID:
            log.error("config_reload_rejected", error=r.error,
                      detail="the running config is unchanged", **fields)
            return
        if r.needs_restart:
            log.warning("config_reload_needs_restart", applied=describe(r.applied),
                        needs_restart=describe(r.needs_restart),
                        detail="these fields keep their running values until a restart",
                        **fields)
        else:
            log.info("config_reloaded", applied=describe(r.applied), **fields)
