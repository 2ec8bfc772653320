"""The scheduler's request timestamps (pure, no torch, a fake clock): the finish event carries
queue / prefill / decode times; a preempted request keeps its first scheduled and first token
times; a request aborted while queued has none."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from moed.engine import request as request_mod
from moed.engine import scheduler as scheduler_mod
from moed.engine.request import Request
from moed.engine.scheduler import Scheduler
from moed.kvcache.manager import KVCacheManager
from moed.types import FinishReason, RequestTimings, SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    for mod in (scheduler_mod, request_mod):
        monkeypatch.setattr(mod, "time", SimpleNamespace(monotonic=c))
    return c


def _req(rid: str, prompt: list[int], n: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0), arrival_time=100.0)


def test_finish_event_carries_phases_and_preemption_keeps_first_times(clock) -> None:
    s = Scheduler(KVCacheManager(4, 2, False), max_num_seqs=8, max_num_batched_tokens=32)
    a, b = _req("a", [1, 2, 3, 4], 3), _req("b", [4, 5, 6, 7], 3)
    s.add(a)
    s.add(b)
    clock.t = 100.5
    plan, _ = s.schedule()                       # both get 2 blocks: the pool is full
    clock.t = 101.0
    assert all(e.timings is None for e in s.update(plan, [7, 8]))   # first tokens, no finish
    finished: dict[str, tuple[float, RequestTimings]] = {}
    preempted = False
    for _ in range(20):
        if not s.has_unfinished():
            break
        clock.t += 0.25
        plan, _ = s.schedule()
        preempted |= "b" in plan.preempted
        for ev in s.update(plan, [9] * len(plan.sampled)):
            if ev.finished:
                assert ev.finish_reason is FinishReason.LENGTH
                finished[ev.request_id] = (clock.t, ev.timings)
    assert preempted and set(finished) == {"a", "b"}
    for rid, (t_end, t) in finished.items():
        assert t.queue_s == pytest.approx(0.5), rid         # first scheduled at 100.5, kept
        assert t.prefill_s == pytest.approx(0.5), rid       # first token at 101.0, kept
        assert t.decode_s == pytest.approx(t_end - 101.0), rid
    assert finished["b"][0] > finished["a"][0]              # b waited after its preemption


def test_aborted_while_queued_has_no_phases(clock) -> None:
    s = Scheduler(KVCacheManager(4, 2, False), max_num_seqs=8, max_num_batched_tokens=32)
    s.add(_req("c", [1, 2], 2))
    clock.t = 103.0
    ev = s.abort("c")
    assert ev.finish_reason is FinishReason.ABORT and ev.timings == RequestTimings()
