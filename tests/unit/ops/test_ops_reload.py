"""Reload planning and the Reloader: live vs restart-only fields, invalid files, vetoes, redaction."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from moed.config import ConfigError, load
from moed.ops.reload import REDACTED, ReloadOutcome, Reloader, describe, plan_reload, redact

BASE = '[model]\npath = "m"\n[admission]\nmax_waiting_requests = 8\n'


def write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def test_live_change_applies_and_cold_change_is_reported(tmp_path: Path) -> None:
    p = write(tmp_path / "c.toml", BASE)
    running = load(p, environ={})
    write(p, BASE.replace("= 8", "= 3") + '[server]\nport = 9999\nlog_level = "debug"\n')
    r = plan_reload(running, p, {})
    assert r.outcome is ReloadOutcome.APPLIED
    assert {c.key for c in r.applied} == {"admission.max_waiting_requests", "server.log_level"}
    assert [c.key for c in r.needs_restart] == ["server.port"]
    assert r.config.admission.max_waiting_requests == 3
    assert r.config.server.port == running.server.port == 8000


def test_only_cold_changes_apply_nothing(tmp_path: Path) -> None:
    p = write(tmp_path / "c.toml", BASE)
    running = load(p, environ={})
    write(p, BASE.replace('"m"', '"other-model"') + '[server]\nrole = "decode"\n')
    r = plan_reload(running, p, {})
    assert r.outcome is ReloadOutcome.RESTART_REQUIRED and r.config is running
    assert {c.key for c in r.needs_restart} == {"model.path", "server.role"}


@pytest.mark.parametrize("text", ["[admission\n", BASE + "[admission]\nbogus = 1\n",
                                  BASE.replace("= 8", "= -1")])
def test_invalid_file_changes_nothing(tmp_path: Path, text: str) -> None:
    p = write(tmp_path / "c.toml", BASE)
    running = load(p, environ={})
    write(p, text)
    r = plan_reload(running, p, {})
    assert r.outcome is ReloadOutcome.INVALID and r.config is running and r.error


def test_environment_and_flags_keep_their_precedence(tmp_path: Path) -> None:
    p = write(tmp_path / "c.toml", BASE)
    flags = {"server": {"port": 8123}}
    running = load(p, environ={}, overrides=flags)
    write(p, BASE + "[server]\nport = 9000\n")
    env = {"MOED_ADMISSION_MAX_WAITING_REQUESTS": "5"}
    r = plan_reload(running, p, env, flags)
    assert r.config.server.port == 8123 and not r.needs_restart   # the flag still wins
    assert r.config.admission.max_waiting_requests == 5           # env beats the file


def test_redaction() -> None:
    assert redact("server.api_keys_file", "/run/keys") == REDACTED
    assert redact("server.admin_token_env", "TOK") == REDACTED
    assert redact("cluster.secondary_key_file", "") == ""
    assert redact("admission.max_waiting_requests", 3) == 3


def test_reloader_versions_counts_and_two_phase_subscribers(tmp_path: Path, caplog) -> None:
    p = write(tmp_path / "c.toml", BASE + '[server]\napi_keys_file = "/secret/path"\n')
    running = load(p, environ={})
    committed: list[int] = []
    veto = {"on": False}

    def sub(old, new):
        if veto["on"]:
            raise ConfigError("api-key file unreadable")
        return lambda: committed.append(new.admission.max_waiting_requests)

    events: list[str] = []
    rl = Reloader(running, p, environ=lambda: {}, on_start=lambda: events.append("start"),
                  on_done=lambda r: events.append(r.outcome.value))
    rl.subscribe("auth", sub)
    assert rl.reload_now().outcome is ReloadOutcome.UNCHANGED
    assert committed == [8] and rl.version == 1      # subscribers run anyway (key rotation)

    write(p, BASE.replace("= 8", "= 4") + '[server]\napi_keys_file = "/new/secret"\n')
    with caplog.at_level(logging.INFO):
        r = rl.reload_now()
    assert r.outcome is ReloadOutcome.APPLIED and rl.config.admission.max_waiting_requests == 4
    assert committed[-1] == 4 and rl.version == 2
    text = caplog.text + json.dumps(describe(r.applied))
    assert "/new/secret" not in text and "/secret/path" not in text

    veto["on"] = True
    write(p, BASE.replace("= 8", "= 2"))
    r = rl.reload_now()
    assert r.outcome is ReloadOutcome.INVALID and "auth: api-key file unreadable" in r.error
    assert rl.config.admission.max_waiting_requests == 4 and committed[-1] == 4
    assert rl.version == 2
    assert rl.counts == {"unchanged": 1, "applied": 1, "invalid": 1}
    assert events == ["start", "unchanged", "start", "applied", "start", "invalid"]


async def test_signal_bursts_coalesce(tmp_path: Path) -> None:
    p = write(tmp_path / "c.toml", BASE)
    rl = Reloader(load(p, environ={}), p, environ=lambda: {})
    seen = []

    def sub(old, new):  # SIGHUPs arriving while a reload runs
        seen.append(1)
        if len(seen) == 1:
            for _ in range(20):
                rl.request()
        return None

    rl.subscribe("probe", sub)
    for _ in range(20):       # before the reload task starts: one reload covers them all
        rl.request()
    await rl.wait_idle()
    assert sum(rl.counts.values()) == 2 == len(seen)   # + one for everything during the first


async def test_a_crashing_subscriber_does_not_kill_the_loop(tmp_path: Path) -> None:
    p = write(tmp_path / "c.toml", BASE)
    rl = Reloader(load(p, environ={}), p, environ=lambda: {})
    rl.subscribe("buggy", lambda old, new: 1 / 0)
    write(p, BASE.replace("= 8", "= 2"))
    rl.request()
    await rl.wait_idle()
    rl.request()
    await rl.wait_idle()
    assert rl.counts == {"invalid": 2} and rl.config.admission.max_waiting_requests == 8


# ---- a reload that fails in any way is counted, ends (on_done), and changes nothing ----------

def _reloader(p: Path, events: list) -> Reloader:
    return Reloader(load(p, environ={}), p, environ=lambda: {},
                    on_start=lambda: events.append("start"), on_done=events.append)


def _make_bad(p: Path, kind: str) -> None:
    import os

    if kind == "not-utf8":
        p.write_bytes(BASE.replace("= 8", "= 2").encode() + b'# caf\xe9\n')
        return
    p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
    elif kind == "huge":
        with open(p, "wb") as f:
            f.truncate(1 << 30)


@pytest.mark.parametrize("kind,reason", [("not-utf8", "not UTF-8 text at byte"),
                                         ("fifo", "not a regular file (a FIFO)"),
                                         ("directory", "not a regular file (a directory)"),
                                         ("huge", "too large")])
async def test_a_file_gone_bad_is_refused_counted_and_ended(tmp_path: Path, kind: str,
                                                            reason: str) -> None:
    import asyncio

    p = write(tmp_path / "c.toml", BASE)
    events: list = []
    rl = _reloader(p, events)
    running = rl.config
    _make_bad(p, kind)
    with capture_logs() as logs:
        rl.request()                      # what SIGHUP does; a FIFO must not block the loop
        await asyncio.wait_for(rl.wait_idle(), 5)
    assert events[0] == "start" and len(events) == 2
    result = events[1]                    # on_done got the result: READY=1 follows
    assert result.outcome is ReloadOutcome.INVALID and reason in result.error
    assert rl.config is running and rl.version == 1 and rl.counts == {"invalid": 1}
    assert [r["event"] for r in logs] == ["config_reload_rejected"]      # no traceback
    assert reason in logs[0]["error"] and logs[0]["result"] == "invalid"

    if kind in ("fifo", "directory"):     # back to a good file: the next reload applies
        p.rmdir() if kind == "directory" else p.unlink()
    write(p, BASE.replace("= 8", "= 3"))
    assert rl.reload_now().outcome is ReloadOutcome.APPLIED and rl.version == 2


async def test_a_crash_while_planning_is_counted_and_ended(tmp_path: Path, monkeypatch) -> None:
    import asyncio

    from moed.ops import reload as reload_mod

    p = write(tmp_path / "c.toml", BASE)
    events: list = []
    rl = _reloader(p, events)
    running = rl.config

    def boom(*a, **kw):
        raise RuntimeError("planner bug")

    monkeypatch.setattr(reload_mod, "plan_reload", boom)
    with capture_logs() as logs:
        rl.request()
        await asyncio.wait_for(rl.wait_idle(), 5)
    assert [e if isinstance(e, str) else e.outcome for e in events] == [
        "start", ReloadOutcome.INVALID]
    assert events[1].error == "internal error RuntimeError: planner bug"
    assert rl.config is running and rl.counts == {"invalid": 1}
    # the bug with its traceback, then the one line every rejected reload gets
    assert [r["event"] for r in logs] == ["config_reload_crashed", "config_reload_rejected"]
    assert logs[0].get("exc_info") is True

    # even a failing on_start or on_done neither raises nor skips the count
    monkeypatch.undo()
    bad_hooks = Reloader(running, p, environ=lambda: {}, on_start=lambda: 1 / 0,
                         on_done=lambda r: 1 / 0)
    r = bad_hooks.reload_now()
    assert r.outcome is ReloadOutcome.INVALID and "ZeroDivisionError" in r.error
    assert bad_hooks.counts == {"invalid": 1} and bad_hooks.config is running
