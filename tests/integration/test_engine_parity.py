"""Engine end-to-end parity with transformers (the oracle), fp32, on the real ModelRunner.

Prompts of different lengths are submitted together with a small token budget, so prefill is
chunked and mixed with decodes; a second batch shares a long prefix with the first and is
served from the prefix cache. Every generated token must be the oracle's argmax on the same
prefix, whole greedy sequences must equal transformers' `generate`, and the logits the engine
sampled from must match the oracle's within 1e-3. Afterwards every KV block is back in the pool.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from moed.config import EngineConfig
from moed.engine.engine import Engine
from moed.model.runner import ModelRunner
from moed.model.tokenizer import Tokenizer
from moed.types import FinishReason, SamplingParams
from moed.engine.runner import RunnerDefaults

torch.set_num_threads(1)

SHAPES = [
    ("qwen3_moe", dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=7,
                       moe_intermediate_size=64)),
    ("qwen3_moe", dict(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3, num_experts=8, top_k=3,
                       moe_intermediate_size=48)),
    ("mixtral", dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=1, num_experts=5,
                     moe_intermediate_size=64)),
    ("mixtral", dict(hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=2, num_experts=8,
                     moe_intermediate_size=96)),
]
BLOCK = 4
NEW = 32
TOL = 1e-3


class RecordingRunner(RunnerDefaults):
    """Wraps the real runner; remembers, per full token sequence, the logits returned for its
    last token. The sequence is rebuilt by reading a token shadow of the paged cache through the
    block table, so a wrong table or a bad prefix hit shows up as a missing/odd key."""

    def __init__(self, runner: ModelRunner) -> None:
        self.inner = runner
        self.spec, self.num_blocks, self.block_size = runner.spec, runner.num_blocks, runner.block_size
        self.slots: dict[tuple[int, int], int] = {}
        self.logits: dict[tuple[int, ...], torch.Tensor] = {}

    def forward(self, batch):
        out = self.inner.forward(batch)
        bs = self.block_size
        for i, (toks, start, table) in enumerate(zip(batch.token_ids, batch.start_pos, batch.block_tables)):
            for j, t in enumerate(toks):
                self.slots[(table[(start + j) // bs], (start + j) % bs)] = t
            seq = tuple(self.slots[(table[p // bs], p % bs)] for p in range(start + len(toks)))
            self.logits[seq] = out[i].clone()
        return out


def _oracle(model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                             experts_implementation="eager", attn_implementation="eager")
    return m.eval()


def _check(ref, rec: RecordingRunner, prompt: list[int], out: list[int]) -> None:
    with torch.no_grad():
        full = ref(torch.tensor([prompt + out])).logits[0].float()
    for j, tok in enumerate(out):
        row = full[len(prompt) - 1 + j]
        assert tok == int(row.argmax()), f"token {j}: ours {tok}, oracle argmax {int(row.argmax())}"
        ours = rec.logits[tuple(prompt + out[:j])]
        diff = (ours - row).abs().max().item()
        assert diff <= TOL, f"token {j}: max |logit diff| {diff:.2e}"
    with torch.no_grad():
        gen = ref.generate(torch.tensor([prompt]), max_new_tokens=len(out), min_new_tokens=len(out),
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    assert gen[0, len(prompt):].tolist() == out


async def _serve(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    streams = [engine.add_request(f"r{len(engine.scheduler.requests)}-{i}-{id(p)}", p, params)
               for i, p in enumerate(prompts)]

    async def collect(s):
        evs = [e async for e in s]
        assert evs[-1].finish_reason is FinishReason.LENGTH
        return [t for e in evs for t in e.token_ids]

    return await asyncio.gather(*(collect(s) for s in streams))


@pytest.mark.parametrize("arch,kw", SHAPES,
                         ids=[f"{a}-e{k['num_experts']}-kv{k['num_kv_heads']}" for a, k in SHAPES])
async def test_engine_parity(make_checkpoint, arch, kw):
    d = make_checkpoint(arch, "tiny", 2, **kw)
    runner = ModelRunner(d, dtype="float32", device="cpu", attention_backend="torch",
                         num_blocks=96, block_size=BLOCK)
    rec = RecordingRunner(runner)
    cfg = EngineConfig(block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=8)
    engine = Engine(rec, Tokenizer.from_dir(d), cfg)
    await chunked_and_prefix_hit_parity(engine, rec, _oracle(d), runner.spec.vocab_size, seed=7)


async def chunked_and_prefix_hit_parity(engine: Engine, rec: RecordingRunner, ref, vocab: int,
                                        seed: int) -> None:
    """The parity scenario every architecture runs (engine budget 16 tokens): prompts of
    different lengths batched together, the long ones chunked; then prompts sharing prefixes
    with them, served from the prefix cache. Every token equals the oracle; no block leaks."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    await engine.start()
    try:
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 21, 9, 30)]
        outs = await _serve(engine, prompts, params)
        assert engine.stats().kv_blocks_used == 0
        hits0 = engine.stats().prefix_cache_hits
        prompts2 = [prompts[3][:24] + [5, 6, 7], prompts[1] + outs[1][:6] + [11]]
        outs2 = await _serve(engine, prompts2, params)
        st = engine.stats()
        assert st.prefix_cache_hits - hits0 >= 24 + 20
        assert st.kv_blocks_used == 0 and st.running == 0
        for p, o in zip(prompts + prompts2, outs + outs2):
            assert len(o) == NEW
            _check(ref, rec, p, o)
    finally:
        await engine.shutdown()
    assert engine.stats().kv_blocks_used == 0


async def test_abort_and_preemption_return_every_block(make_checkpoint):
    """A pool too small for all requests at once (preemption) and aborts mid-stream."""
    d = make_checkpoint(*SHAPES[0][:1], "tiny", 2, **SHAPES[0][1])
    runner = ModelRunner(d, dtype="float32", device="cpu", attention_backend="torch",
                         num_blocks=14, block_size=BLOCK)
    rec = RecordingRunner(runner)
    engine = Engine(rec, Tokenizer.from_dir(d), EngineConfig(block_size=BLOCK, max_num_batched_tokens=32))
    ref = _oracle(d)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4000, (10,), generator=gen).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    await engine.start()
    try:
        outs = await _serve(engine, prompts, params)       # 4 x 22 tokens > 56 slots: preempts
        assert engine.scheduler.num_preemptions > 0
        for p, o in zip(prompts, outs):
            _check(ref, rec, p, o)
        s = engine.add_request("abort-me", prompts[0] + [1], SamplingParams(max_tokens=30))
        n = 0
        async for ev in s:
            n += 1
            if n == 3:
                engine.abort("abort-me")
        assert ev.finish_reason is FinishReason.ABORT
        assert engine.stats().kv_blocks_used == 0
    finally:
        await engine.shutdown()
