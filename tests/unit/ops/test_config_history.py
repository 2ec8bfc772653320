"""Config history (moed/ops/history.py) and rollback through the reload path: entries are
kept newest last and bounded, survive a restart in the state directory, an unreadable file is
set aside; Reloader.apply_now takes the same prepare/commit path as SIGHUP; the ops component
records start, reload and rollback, and rolls back by hash (or refuses, saying why)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from moed.config import ConfigError, from_dict, load
from moed.obs import metrics
from moed.ops.history import FILE, ConfigHistory, parse, state_dir
from moed.ops.reload import ReloadOutcome, Reloader

ROLE = {"server": {"role": "router"}}


def _cfg(waiting: int, **extra) -> object:
    return load(environ={}, overrides={**ROLE, "admission": {"max_waiting_requests": waiting},
                                       **extra})


async def test_history_is_bounded_persisted_and_found_by_hash(tmp_path: Path) -> None:
    h = ConfigHistory.open(tmp_path / "state", size=3)
    configs = [_cfg(w) for w in (1, 2, 3, 4)]
    for i, c in enumerate(configs):
        h.record(c, "start" if i == 0 else "reload", now=100.0 + i)
    assert [e.hash for e in h.entries()] == [c.digest() for c in configs[1:]]   # oldest dropped
    await h.flush()
    again = ConfigHistory.open(tmp_path / "state", size=3)
    assert again.entries() == h.entries()
    assert from_dict(again.entries()[-1].config, "entry") == configs[-1]        # exact config
    assert again.find(configs[2].digest()) == again.entries()[1]
    assert again.find(configs[2].digest()[:6]).hash == configs[2].digest()      # a prefix
    assert again.find("ffffffffffff") is None and again.find(configs[0].digest()) is None
    again.resize(1)
    await again.flush()
    on_disk = parse((tmp_path / "state" / FILE).read_bytes())
    assert [e.hash for e in on_disk] == [configs[-1].digest()]
    assert (tmp_path / "state" / FILE).stat().st_mode & 0o777 == 0o600
    h.close()
    again.close()


def test_unreadable_history_is_set_aside(tmp_path: Path) -> None:
    (tmp_path / FILE).write_text('{"format": 1, "entries": [{"hash": 3}]}')
    h = ConfigHistory.open(tmp_path, size=5)
    assert h.entries() == () and (tmp_path / (FILE + ".bad")).exists()
    (tmp_path / FILE).write_text("not json")
    assert ConfigHistory.open(tmp_path, size=5).entries() == ()


def test_state_directory_from_config_or_systemd(tmp_path: Path) -> None:
    plain = _cfg(1)
    assert state_dir(plain, {}) is None
    assert state_dir(plain, {"STATE_DIRECTORY": "/var/lib/moed/a:/var/lib/x"}) == \
        Path("/var/lib/moed/a")
    set_ = _cfg(1, server={"role": "router", "state_dir": str(tmp_path)})
    assert state_dir(set_, {"STATE_DIRECTORY": "/elsewhere"}) == tmp_path
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot create"):
        ConfigHistory.open(blocker / "sub", 5)


def test_an_entry_from_another_release_is_refused_not_guessed() -> None:
    entry = json.loads(json.dumps(_cfg(2).to_dict(), default=list))
    entry["admission"]["max_waiting_requests"] = 0                  # out of its bounds
    with pytest.raises(ConfigError, match="max_waiting_requests"):
        from_dict(entry, "history entry x")
    entry = json.loads(json.dumps(_cfg(2).to_dict(), default=list))
    entry["admission"]["from_the_future"] = 1
    with pytest.raises(ConfigError, match="unknown key admission.from_the_future"):
        from_dict(entry, "history entry x")


def test_apply_now_takes_the_reload_path() -> None:
    a, b = _cfg(8), _cfg(2, router={"max_connections": 7})
    seen: list[tuple[str, int]] = []
    done = []

    def hook(old, new):
        if new.admission.max_waiting_requests == 666:
            raise ConfigError("vetoed")
        return lambda: seen.append(("commit", new.admission.max_waiting_requests))

    rl = Reloader(a, None, environ=lambda: {}, on_done=done.append)
    rl.subscribe("h", hook)
    r = rl.apply_now(b)
    assert r.outcome is ReloadOutcome.APPLIED and r.source == "rollback"
    assert [c.key for c in r.applied] == ["admission.max_waiting_requests"]
    assert [c.key for c in r.needs_restart] == ["router.max_connections"]   # left as it was
    assert rl.config.router.max_connections == a.router.max_connections
    assert seen == [("commit", 2)] and rl.version == 2 and done == [r]
    assert rl.apply_now(rl.config).outcome is ReloadOutcome.UNCHANGED and rl.version == 2
    commits = len(seen)
    vetoed = rl.apply_now(_cfg(666))
    assert vetoed.outcome is ReloadOutcome.INVALID and "vetoed" in vetoed.error
    assert rl.config.admission.max_waiting_requests == 2 and len(seen) == commits


async def test_ops_records_start_reload_rollback_and_rolls_back_by_hash(tmp_path: Path) -> None:
    from moed.ops.daemon import OpsComponent

    conf = tmp_path / "node.toml"
    a_text = "[admission]\nmax_waiting_requests = 8\n"
    conf.write_text(a_text)
    overrides = {"server": {"role": "router", "state_dir": str(tmp_path / "state")}}
    cfg = load(conf, environ={}, overrides=overrides)
    ops = OpsComponent(cfg, conf, overrides, environ={})
    applied = []
    app = SimpleNamespace(config=cfg, components=[ops], state=SimpleNamespace(engine=None),
                          spawn=lambda coro, name: coro.close(), set_config=applied.append,
                          node="n")
    await ops.start(app)
    ops._serving = True
    hash_a = cfg.digest()
    conf.write_text("[admission]\nmax_waiting_requests = 3\n")
    ops._on_sighup()
    await asyncio.wait_for(ops.reloader.wait_idle(), 5)
    hash_b = ops.reloader.config.digest()
    assert hash_b != hash_a and applied[-1].admission.max_waiting_requests == 3

    before = metrics.REGISTRY.get_sample_value("moed_config_rollbacks_total",
                                               {"result": "applied"}) or 0.0
    status, body = ops.rollback(hash_a[:8])
    assert status == 200 and body["result"] == "applied" and body["hash"] == hash_a
    assert body["applied"] == [{"key": "admission.max_waiting_requests", "old": 3, "new": 8}]
    assert body["file_differs"] is True          # the file still says B
    assert ops.reloader.config.digest() == hash_a
    assert applied[-1].admission.max_waiting_requests == 8
    assert metrics.REGISTRY.get_sample_value("moed_config_rollbacks_total",
                                             {"result": "applied"}) == before + 1
    view = ops.history_view()
    assert [(e["hash"], e["source"]) for e in view["entries"]] == [
        (hash_a, "start"), (hash_b, "reload"), (hash_a, "rollback")]
    assert view["running"] == hash_a

    assert ops.rollback(hash_a)[1]["result"] == "unchanged"
    assert ops.rollback("0123abcd")[0] == 404
    conf.write_text(a_text)                      # the file restored: nothing differs
    assert ops.rollback(hash_b)[1]["file_differs"] is True
    assert ops.rollback(hash_a)[1]["file_differs"] is False
    await ops.stop()
    on_disk = parse((tmp_path / "state" / FILE).read_bytes())
    assert [e.source for e in on_disk] == ["start", "reload", "rollback", "rollback", "rollback"]
