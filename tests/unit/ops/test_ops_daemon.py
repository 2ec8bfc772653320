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


def test_engine_reload_reaches_a_decode_nodes_wrapped_engine() -> None:
    """The decode role puts a DisaggEngine in front of the engine; apply_config gets through."""
    from types import SimpleNamespace

    from moed.config import load
    from moed.ops.daemon import OpsComponent
    from moed.roles.decode import DisaggEngine

    applied = []
    inner = SimpleNamespace(apply_config=applied.append)
    role = {"server": {"role": "router"}}          # no model needed to build the config
    old = load(environ={}, overrides=role)
    new = load(environ={"MOED_ENGINE_MAX_NUM_SEQS": "3"}, overrides=role)
    ops = OpsComponent(old, environ={})
    ops._app = SimpleNamespace(state=SimpleNamespace(engine=DisaggEngine(inner, None)))
    assert ops._prepare_engine(old, old) is None                   # nothing changed: no commit
    ops._prepare_engine(old, new)()
    assert applied == [new.engine]
