"""Expert load: the engine reads the runner's counts only between steps and hands every routed
token to on_expert_load (periodically, and when it goes idle); metrics fold them."""
from __future__ import annotations

import asyncio
import threading
import time

import torch

from moed.config import EngineConfig
from moed.engine.engine import Engine
from moed.obs import metrics
from moed.types import SamplingParams

from engine_fakes import FakeRunner

LAYERS, EXPERTS, TOP_K = 2, 4, 2


class RoutingRunner(FakeRunner):
    """Routes each forwarded token to experts (t % E, (t+1) % E) in every layer."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.load = torch.zeros(LAYERS, EXPERTS, dtype=torch.long)
        self.in_forward = threading.Event()
        self.reads_during_forward = 0
        self.forwarded = 0

    def forward(self, batch):
        self.in_forward.set()
        try:
            time.sleep(0.002)
            for toks in batch.token_ids:
                for t in toks:
                    for k in range(TOP_K):
                        self.load[:, (t + k) % EXPERTS] += 1
                self.forwarded += len(toks)
            return super().forward(batch)
        finally:
            self.in_forward.clear()

    def expert_load(self):
        self.reads_during_forward += self.in_forward.is_set()
        out, self.load = self.load, torch.zeros_like(self.load)
        return out


async def test_every_routed_token_reaches_on_expert_load_between_steps():
    runner = RoutingRunner(64, 4)
    windows = []
    eng = Engine(runner, None, EngineConfig(max_num_batched_tokens=8, block_size=4),
                 on_expert_load=windows.append)
    await eng.start()
    try:
        streams = [eng.add_request(f"r{i}", list(range(1 + i, 12 + i)),
                                   SamplingParams(max_tokens=5, temperature=0.0)) for i in range(3)]
        for s in streams:
            async for _ in s:
                pass
        end = time.monotonic() + 5
        while sum(int(w.sum()) for w in windows) < runner.forwarded * TOP_K:
            assert time.monotonic() < end, "the idle flush never came"
            await asyncio.sleep(0.01)
    finally:
        await eng.shutdown()
    assert runner.forwarded == 3 * (11 + 4)          # prompts + every output but the last
    total = sum(windows)
    assert total.sum(dim=1).tolist() == [runner.forwarded * TOP_K] * LAYERS
    assert runner.reads_during_forward == 0
    assert len(windows) < eng.steps                  # batched into windows, not read per step


async def test_two_expert_load_listeners_each_get_every_window_and_can_leave():
    """Metrics and the expert balancer both listen: one read per window, same tensor to both;
    a failing listener does not starve the other; unsubscribing stops delivery."""
    runner = RoutingRunner(64, 4)
    eng = Engine(runner, None, EngineConfig(max_num_batched_tokens=8, block_size=4))
    first, second = [], []

    def broken(load):
        raise RuntimeError("listener bug")

    eng.subscribe_expert_load(broken)
    eng.subscribe_expert_load(first.append)
    leave = eng.subscribe_expert_load(second.append)
    await eng.start()
    try:
        async def run(rid: str) -> None:
            async for _ in eng.add_request(rid, list(range(1, 12)),
                                           SamplingParams(max_tokens=5, temperature=0.0)):
                pass
        await run("a")
        end = time.monotonic() + 5
        while sum(int(w.sum()) for w in first) < runner.forwarded * TOP_K:
            assert time.monotonic() < end, "the idle flush never came"
            await asyncio.sleep(0.01)
        assert len(first) == len(second) and all(a is b for a, b in zip(first, second))
        leave()
        n_second, seen = len(second), runner.forwarded
        await run("b")
        while sum(int(w.sum()) for w in first) < runner.forwarded * TOP_K:
            assert time.monotonic() < end, "the idle flush never came"
            await asyncio.sleep(0.01)
        assert runner.forwarded > seen and len(second) == n_second
    finally:
        await eng.shutdown()


def _sample(name, **labels):
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_observe_expert_load_counts_and_imbalance():
    before = [_sample("moed_expert_tokens_total", layer="91", expert=str(e)) for e in range(3)]
    metrics.observe_expert_load(torch.tensor([[1, 2, 3], [0, 0, 0]]).repeat(46, 1))
    after = [_sample("moed_expert_tokens_total", layer="91", expert=str(e)) for e in range(3)]
    assert [a - b for a, b in zip(after, before)] == [0.0, 0.0, 0.0]   # layer 91 = dense row
    metrics.observe_expert_load(torch.tensor([[0, 0, 0]] * 90 + [[4, 4, 4], [6, 0, 0]]))
    assert _sample("moed_expert_imbalance", layer="90") == 1.0
    assert _sample("moed_expert_imbalance", layer="91") == 3.0
    assert _sample("moed_expert_tokens_total", layer="91", expert="0") - before[0] == 6.0
    assert metrics.REGISTRY.get_sample_value(
        "moed_expert_tokens_total", {"layer": "91", "expert": "1"}) is None   # no empty series
