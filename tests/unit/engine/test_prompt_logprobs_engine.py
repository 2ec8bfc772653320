"""Prompt logprobs in the engine (tiny Qwen3-MoE, fp32, the real runner): the values equal a
direct log_softmax over the runner's logits for the whole prompt in one pass, whether the
prompt is chunked, shares a cached prefix, or is preempted halfway and recomputed; requests
that do not ask never make the runner return more than the last row."""
from __future__ import annotations

import pytest
import torch

from moed.config import EngineConfig
from moed.engine.engine import Engine
from moed.model.batch import ForwardBatch
from moed.model.runner import ModelRunner
from moed.types import SamplingParams

torch.set_num_threads(1)
BLOCK = 4


class SpyRunner(ModelRunner):
    """Records each forward's all_logits flags."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.flags: list[tuple[bool, ...]] = []

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.flags.append(batch.all_logits)
        return super().forward(batch)


def _engine(model, num_blocks: int, budget: int) -> tuple[Engine, list]:
    runner = SpyRunner(model, dtype="float32", device="cpu", num_blocks=num_blocks,
                       block_size=BLOCK)
    eng = Engine(runner, None, EngineConfig(block_size=BLOCK, max_num_batched_tokens=budget,
                                            enable_prefix_caching=True))
    events: list = []
    publish = eng._publish
    eng._publish = lambda evs: (events.extend(evs), publish(evs))
    return eng, events


def _oracle(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every prompt position, one forward over the whole prompt."""
    r = ModelRunner(model, dtype="float32", device="cpu", num_blocks=64, block_size=BLOCK)
    blocks = list(range(-(-len(prompt) // BLOCK)))
    logits = r.forward(ForwardBatch([prompt], [0], [blocks], all_logits=(True,)))
    assert logits.shape[0] == len(prompt)
    return torch.log_softmax(logits, dim=-1)


def _check(plps, prompt: list[int], want: torch.Tensor, top: int) -> None:
    assert [p.token_id for p in plps] == prompt[1:]
    for j, p in enumerate(plps):           # token j + 1 given tokens 0..j
        assert abs(p.logprob - want[j, prompt[j + 1]].item()) < 1e-4, j
        assert len(p.top) == top
        if top:
            assert abs(p.top[0][1] - want[j].max().item()) < 1e-4
        v = want[j, prompt[j + 1]]
        assert int((want[j] > v + 1e-4).sum()) + 1 <= p.rank <= int((want[j] > v - 1e-4).sum()) + 1


def _prompt_events(events, n: int):
    got = [e for e in events if e.prompt_logprobs]
    assert len(got) == n
    return got


def test_chunked_with_a_cached_prefix_and_a_plain_batch_mate(tiny_qwen3):
    prompt = [(7 * i + 3) % 500 + 3 for i in range(37)]
    eng, events = _engine(tiny_qwen3, num_blocks=64, budget=7)
    eng.generate([prompt[:20]], SamplingParams(max_tokens=2, temperature=0))   # cache 4 blocks
    assert all(f == () for f in eng.runner.flags)          # nobody asked: one row per sequence
    n_before = len(eng.runner.flags)
    out = eng.generate([prompt, [5, 6, 7]],
                       [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2),
                        SamplingParams(max_tokens=3, temperature=0)])
    flags = eng.runner.flags[n_before:]
    assert sum(1 for f in flags if f) >= 5                 # 37 tokens in chunks of <= 7
    assert all(not f or f.count(True) == 1 for f in flags)  # only the asking sequence
    (ev,) = _prompt_events(events, 1)
    _check(ev.prompt_logprobs, prompt, _oracle(tiny_qwen3, prompt), 2)
    assert ev.token_ids == (out[0][0],)                    # on the first token's event


def test_preempted_mid_prompt_then_recomputed(tiny_qwen3):
    """B (plain) holds most of a small pool; A asks for prompt logprobs and is preempted
    (last admitted) while its prompt is still being computed, then recomputes it."""
    a = [(11 * i + 5) % 700 + 3 for i in range(40)]
    b = [(13 * i + 1) % 600 + 3 for i in range(60)]
    eng, events = _engine(tiny_qwen3, num_blocks=24, budget=8)
    eng.generate([b, a], [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                          SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)])
    assert eng.scheduler.num_preemptions >= 1
    (ev,) = _prompt_events(events, 1)
    _check(ev.prompt_logprobs, a, _oracle(tiny_qwen3, a), 0)    # no duplicates, no gaps
    assert eng.kv.stats().used == 0


def test_a_one_token_prompt_has_no_prompt_logprobs(tiny_qwen3):
    eng, events = _engine(tiny_qwen3, num_blocks=16, budget=16)
    eng.generate([[9]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert not any(e.prompt_logprobs for e in events)
    assert all(f in ((), (False,)) for f in eng.runner.flags)


@pytest.mark.parametrize("bad", [-1, 21])
def test_prompt_logprobs_range(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
