"""OpsComponent policies without a server: the watchdog's engine-progress veto."""
from __future__ import annotations

from dataclasses import dataclass

from moed.ops.daemon import EngineProgress
from moed.types import EngineStats


@dataclass
class FakeEngine:
    stats_now: EngineStats

    def stats(self) -> EngineStats:
        return self.stats_now


def test_engine_progress_vetoes_only_a_stalled_engine_with_work() -> None:
    now = [0.0]
    eng = FakeEngine(EngineStats(running=0, waiting=0, steps=0))
    check = EngineProgress(eng, stall_s=60.0, clock=lambda: now[0])
    now[0] = 500.0
    assert check()                                   # idle for ages: healthy
    eng.stats_now = EngineStats(running=2, steps=0)
    now[0] = 530.0
    assert check()                                   # work, no step yet, within stall_s
    now[0] = 561.0
    assert not check()                               # work and no step for > 60 s
    eng.stats_now = EngineStats(running=2, steps=1)
    assert check()                                   # a step finished: healthy again
    now[0] = 600.0
    assert check()
    eng.stats_now = EngineStats(running=0, waiting=3, waiting_remote_kv=1, steps=1)
    now[0] = 700.0
    assert check()                                   # only waiting (e.g. for remote KV): not stuck


def test_engine_reload_reaches_a_decode_nodes_engine() -> None:
    """A decode node's engine is the engine (remote prefill is its prompt source, not a
    wrapper: moed.engine.prompts); apply_config gets through."""
    from types import SimpleNamespace

    from moed.config import load
    from moed.ops.daemon import OpsComponent

    applied = []
    inner = SimpleNamespace(apply_config=applied.append)
    role = {"server": {"role": "router"}}          # no model needed to build the config
    old = load(environ={}, overrides=role)
    new = load(environ={"MOED_ENGINE_MAX_NUM_SEQS": "3"}, overrides=role)
    ops = OpsComponent(old, environ={})
    ops._app = SimpleNamespace(state=SimpleNamespace(engine=inner))
    assert ops._prepare_engine(old, old) is None                   # nothing changed: no commit
    ops._prepare_engine(old, new)()
    assert applied == [new.engine]


# ---- SIGHUP with a file gone bad: counted, and systemd always gets READY=1 back --------------

def _datagrams(sock) -> list[dict[str, str]]:
    out = []
    while True:
        try:
            data = sock.recv(4096).decode()
        except BlockingIOError:
            return out
        out.append(dict(line.split("=", 1) for line in data.split("\n") if "=" in line))


async def test_failed_reloads_are_counted_and_end_with_ready(tmp_path, monkeypatch) -> None:
    import asyncio
    import os
    import socket
    from types import SimpleNamespace

    from moed.config import load
    from moed.obs import metrics
    from moed.ops import reload as reload_mod
    from moed.ops.daemon import OpsComponent

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    conf = tmp_path / "node.toml"
    conf.write_text("[admission]\nmax_waiting_requests = 8\n")
    role = {"server": {"role": "router"}}
    cfg = load(conf, environ={}, overrides=role)
    ops = OpsComponent(cfg, conf, role, environ={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    app = SimpleNamespace(config=cfg, components=[ops], state=SimpleNamespace(engine=None),
                          spawn=lambda coro, name: coro.close(), set_config=lambda c: None,
                          node="n")
    await ops.start(app)
    ops._serving = True                   # as once READY=1 was sent

    def invalid() -> float:
        return metrics.REGISTRY.get_sample_value("moed_config_reloads_total",
                                                 {"result": "invalid"}) or 0.0

    def bad_bytes() -> None:
        conf.write_bytes(b"[admission]\nmax_waiting_requests = 2 # \xff\n")

    def fifo() -> None:
        conf.unlink()
        os.mkfifo(conf)

    def planner_bug() -> None:
        conf.unlink()
        conf.write_text("[admission]\nmax_waiting_requests = 2\n")
        monkeypatch.setattr(reload_mod, "plan_reload", lambda *a, **kw: 1 / 0)

    def metrics_bug() -> None:    # a failure in on_done itself still sends READY=1
        monkeypatch.setattr(metrics, "CONFIG_RELOADS", None)

    for make_bad, reason in ((bad_bytes, "not UTF-8"), (fifo, "a FIFO"),
                             (planner_bug, "ZeroDivisionError"), (metrics_bug, "")):
        before = invalid()
        make_bad()
        _datagrams(sock)
        ops._on_sighup()
        await asyncio.wait_for(ops.reloader.wait_idle(), 5)
        msgs = _datagrams(sock)
        assert [m.get("RELOADING") or m.get("READY") for m in msgs] == ["1", "1"], msgs
        assert "RELOADING" in msgs[0] and msgs[1]["STATUS"] == "serving, config v1 (invalid)"
        assert ops.reloader.config is cfg and ops.reloader.version == 1
        assert reason in ops.config_view()["last_reload"]["error"]
        if make_bad is not metrics_bug:
            assert invalid() == before + 1
    sock.close()
    ops.notifier.close()
