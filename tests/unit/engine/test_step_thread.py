"""The step thread (moed.engine.step_thread): an engine from the config builds, calibrates,
generates and steps on one thread, so libgomp keeps one pool (with two, its barriers stop
spinning: the served engine ran 1.5-1.75x slower than the same engine alone)."""
from __future__ import annotations

import threading

import pytest

from moed.config import Config, EngineConfig, ModelConfig
from moed.engine.engine import Engine
from moed.engine.step_thread import StepThread, build_on_step_thread, on_step_thread
from moed.types import SamplingParams

from engine_fakes import FakeRunner

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_runs_there_reentrantly_and_refuses_once_stopped():
    t = StepThread()
    assert not t.here
    assert t.run(threading.get_ident) == t.ident != threading.get_ident()
    assert t.run(lambda: t.run(threading.get_ident)) == t.ident    # from itself: no deadlock
    with pytest.raises(ZeroDivisionError):
        t.run(lambda: 1 / 0)
    assert on_step_thread(None, threading.get_ident) == threading.get_ident()
    t.shutdown()
    with pytest.raises(RuntimeError, match="stopped"):
        t.run(threading.get_ident)


def test_a_failed_build_stops_its_thread():
    made = []

    def build(step_thread: StepThread) -> None:
        made.append(step_thread)
        raise ValueError("no checkpoint")

    with pytest.raises(ValueError, match="no checkpoint"):
        build_on_step_thread(build)
    with pytest.raises(RuntimeError, match="stopped"):
        made[0].run(int)


class ThreadRecordingRunner(FakeRunner):
    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.threads: set[int] = set()
        self.torch_threads: set[int] = set()

    def forward(self, batch):
        import torch

        self.threads.add(threading.get_ident())
        self.torch_threads.add(torch.get_num_threads())
        return super().forward(batch)


async def test_generate_and_the_loop_step_on_the_engines_thread():
    t = StepThread()
    runner = ThreadRecordingRunner(64, 4)
    eng = Engine(runner, None, EngineConfig(block_size=4, max_num_seqs=4), max_model_len=256,
                 step_thread=t)
    eng.generate([[1, 2, 3]], GREEDY)           # called here, computed there
    await eng.start()
    try:
        evs = [e async for e in eng.add_request("a", [4, 5, 6], GREEDY)]
    finally:
        await eng.shutdown()
    assert evs[-1].finished and runner.threads == {t.ident}
    with pytest.raises(RuntimeError, match="stopped"):
        t.run(int)                              # shutdown stopped it
    runner.threads.clear()
    eng.generate([[7, 8]], GREEDY)              # after shutdown: the caller's thread, as before
    assert runner.threads == {threading.get_ident()}


def test_generate_runs_at_the_callers_torch_thread_count():
    import torch

    t = StepThread()
    runner = ThreadRecordingRunner(64, 4)
    eng = Engine(runner, None, EngineConfig(block_size=4), max_model_len=256, step_thread=t)
    before = torch.get_num_threads()
    try:
        t.run(torch.set_num_threads, 1)     # the step thread's own team size
        torch.set_num_threads(2)            # what this caller asks for
        eng.generate([[1, 2, 3]], GREEDY)
    finally:
        torch.set_num_threads(before)
        t.shutdown()
    assert runner.threads == {t.ident} and runner.torch_threads == {2}


def test_an_engine_built_by_hand_generates_on_the_callers_thread():
    runner = ThreadRecordingRunner(64, 4)
    eng = Engine(runner, None, EngineConfig(block_size=4), max_model_len=256)
    eng.generate([[1, 2, 3]], GREEDY)
    assert runner.threads == {threading.get_ident()}


async def test_from_config_loads_calibrates_and_serves_on_one_thread(tiny_qwen3, monkeypatch):
    import torch

    from moed.model.runner import ModelRunner

    seen: list[tuple[str, int]] = []
    init, fwd = ModelRunner.__init__, ModelRunner.forward

    def record_init(self, *a, **kw):
        seen.append(("load", threading.get_ident()))
        init(self, *a, **kw)

    def record_forward(self, *a, **kw):
        seen.append(("forward", threading.get_ident()))
        return fwd(self, *a, **kw)

    monkeypatch.setattr(ModelRunner, "__init__", record_init)
    monkeypatch.setattr(ModelRunner, "forward", record_forward)
    before = torch.get_num_threads()
    cfg = Config(model=ModelConfig(path=str(tiny_qwen3), max_model_len=64),
                 engine=EngineConfig(kv_cache_memory_mb=2, num_threads=1))
    try:
        eng = Engine.from_config(cfg)
        assert eng.calibrate(3) >= 3
        eng.generate([[5, 6, 7]], GREEDY)
        await eng.start()
        try:
            evs = [e async for e in eng.add_request("a", [8, 9, 10], GREEDY)]
        finally:
            await eng.shutdown()
    finally:
        torch.set_num_threads(before)
    assert sum(len(e.token_ids) for e in evs) == 3
    assert [w for w, _ in seen[:2]] == ["load", "forward"]
    threads = {t for _, t in seen}
    assert len(threads) == 1 and threading.get_ident() not in threads
