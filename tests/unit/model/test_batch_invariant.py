"""A row's result independent of its batch (docs/migration.md, "Identical at any concurrency"):
model.batch_invariant puts every bf16 matmul on the native kernel at every row count, and a
prompt's one-token chunk takes the prefill attention path as the whole prompt does; combos
where it cannot hold are refused."""
from __future__ import annotations

import shutil

import pytest
import torch

from moed.config import ConfigError, load
from moed.model import context as ctx_mod
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kernels import cpu_flags_ok
from moed.model.runner import ModelRunner

needs_kernels = pytest.mark.skipif(not (cpu_flags_ok() and (shutil.which("cc") or
                                                            shutil.which("gcc"))),
                                   reason="CPU runs no native kernel variant, or no C compiler")


def _prompt(i: int, n: int) -> list[int]:
    return [3 + (i * 37 + k * 11) % 4000 for k in range(n)]


def test_a_one_token_prompt_chunk_is_not_a_decode_row() -> None:
    b = ForwardBatch([[5], [6], [7, 8]], [9, 3, 0], [[0], [1], [2]], prompt=(False, True, True))
    assert b.decode_seqs == [0] and not b.is_decode_only
    assert ForwardBatch([[5], [6]], [9, 3], [[0], [1]]).is_decode_only     # unflagged: decode
    with pytest.raises(ValueError):
        ForwardBatch([[5]], [0], [[0]], prompt=(True, False))


@pytest.mark.parametrize("over", [{"model": {"batch_invariant": True, "quantization": "int8"}},
                                  {"model": {"batch_invariant": True, "dtype": "float16"}},
                                  {"model": {"batch_invariant": True},
                                   "parallel": {"ep_size": 2}}])
def test_settings_where_it_cannot_hold_are_refused(over: dict) -> None:
    with pytest.raises(ConfigError, match="batch_invariant"):
        load(environ={}, overrides={"model": {"path": "/m", **over.pop("model")}, **over})


def test_the_env_var_sets_it() -> None:
    cfg = load(environ={"MOED_MODEL_BATCH_INVARIANT": "true", "MOED_MODEL_PATH": "/m"})
    assert cfg.model.batch_invariant is True


def test_speculative_decoding_is_allowed_with_it() -> None:
    """A verified chunk is attended as decode rows (test_a_verified_chunk_equals_decoding_it)."""
    cfg = load(environ={}, overrides={"model": {"path": "/m", "batch_invariant": True},
                                      "speculative": {"method": "ngram"}})
    assert cfg.model.batch_invariant and cfg.speculative.method == "ngram"


def test_bf16_without_the_native_kernels_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(ctx_mod, "cpu_kernels", lambda: None)
    monkeypatch.setattr(ctx_mod, "can_pack", lambda d, t: True)
    with pytest.raises(ValueError, match="needs the native CPU kernels"):
        ComputeContext.build("cpu", torch.bfloat16, batch_invariant=True)
    assert ComputeContext.build("cpu", torch.float32, batch_invariant=True).kernels is None


@pytest.fixture(scope="module")
def runner(tiny_qwen3) -> ModelRunner:
    return ModelRunner(tiny_qwen3, dtype="bfloat16", num_blocks=512, block_size=16,
                       batch_invariant=True)


@needs_kernels
def test_every_row_class_is_the_native_kernel(runner) -> None:
    assert runner.ctx.kernels is not None
    assert all(not c.any_onednn for c in runner.ctx.kernels.choose.chosen())
    for n in (1, 8, 64, 512, 1024):
        assert not runner.ctx.kernels.choose(4096, 256).use_onednn(n)


@needs_kernels
def test_a_prompt_prefilled_with_company_equals_it_alone(runner) -> None:
    """12 prompts of 12-23 tokens in one step (~200 rows) vs each alone (12-23 rows): other
    row classes, the same last-token logits bit for bit."""
    prompts = [_prompt(i, 12 + i) for i in range(12)]
    tables = [list(range(2 * i, 2 * i + 2)) for i in range(12)]
    together = runner.forward(ForwardBatch(prompts, [0] * 12, tables))
    for i, p in enumerate(prompts):
        alone = runner.forward(ForwardBatch([p], [0], [tables[i]]))
        assert torch.equal(alone[0], together[i]), i


@needs_kernels
def test_a_prompt_cut_into_chunks_equals_it_whole(runner) -> None:
    """37 tokens in chunks of 4 end with a one-token chunk: flagged as prompt it takes the
    prefill path, and the logits and every layer's KV are the whole prompt's."""
    p, table = _prompt(1, 37), list(range(40, 43))
    whole = runner.forward(ForwardBatch([p], [0], [table]))
    kv_whole = runner.kv_cache[:, table].clone()      # [layers, blocks, ...]
    runner.kv_cache[:, table] = 0
    for s in range(0, len(p), 4):
        out = runner.forward(ForwardBatch([p[s:s + 4]], [s], [table], prompt=(True,)))
    assert torch.equal(out, whole)
    assert torch.equal(runner.kv_cache[:, table], kv_whole)


@needs_kernels
def test_deepseek_rows_equal_alone_and_in_company() -> None:
    """deepseek_v3 (the demo model: grouped sigmoid routing, so the torch MoE path, MLA): with
    batch invariance its router and experts run the native kernels too, so an expert's rows
    are their own alone bit for bit (ATen's 1-2 row gemv against oneDNN past that differed by
    an ulp in ~10% of 3-5 row calls), and a prompt's logits in a 12-prompt step are its own."""
    from pathlib import Path
    demo = Path(__file__).resolve().parents[3] / "models" / "stdlib-ds3-tiny"
    r = ModelRunner(demo, dtype="bfloat16", num_blocks=256, block_size=16, batch_invariant=True)
    moe = [layer.mlp for layer in r.model.layers if hasattr(layer.mlp, "experts")]
    assert moe
    g = torch.Generator().manual_seed(0)
    for trial in range(120):
        experts = moe[trial % len(moe)].experts
        rows = 3 + trial % 3
        for lin in experts._expert(trial % experts.num_physical, rows):
            k = lin.kpacked.shape[-1] * 2 if lin.kpacked is not None else lin.weight.shape[1]
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            alone = torch.cat([lin(x[i:i + 1]) for i in range(rows)])
            assert torch.equal(lin(x), alone), (trial, rows)
    prompts = [_prompt(i, 12 + i) for i in range(12)]
    tables = [list(range(2 * i, 2 * i + 2)) for i in range(12)]
    together = r.forward(ForwardBatch(prompts, [0] * 12, tables))
    for i, p in enumerate(prompts):
        assert torch.equal(r.forward(ForwardBatch([p], [0], [tables[i]]))[0], together[i]), i


def _verify_equals_decoding(r: ModelRunner, company: bool) -> None:
    """A speculative step's verified chunk (a known token and 4 drafts after a history, all
    logits) against decoding those 5 positions one step at a time: the same logits and KV
    bit for bit, alone or beside another sequence's decode row."""
    p, table, other = _prompt(2, 29), list(range(60, 63)), list(range(70, 73))
    r.forward(ForwardBatch([p], [0], [table]))
    r.forward(ForwardBatch([_prompt(5, 17)], [0], [other]))
    chunk = _prompt(7, 5)
    stepped = [r.forward(ForwardBatch([[t]], [len(p) + k], [table]))[0] for k, t in enumerate(chunk)]
    kv_stepped = r.kv_cache[:, table].clone()
    ids, starts, tables = [chunk], [len(p)], [table]
    if company:
        ids, starts, tables = [[9], chunk], [17, len(p)], [other, table]
    out = r.forward(ForwardBatch(ids, starts, tables, all_logits=(False, True)[-len(ids):]))
    assert torch.equal(out[-5:], torch.stack(stepped))
    assert torch.equal(r.kv_cache[:, table], kv_stepped)


@needs_kernels
@pytest.mark.parametrize("company", [False, True])
def test_a_verified_chunk_equals_decoding_it(runner, company: bool) -> None:
    _verify_equals_decoding(runner, company)


@needs_kernels
def test_attention_off_the_native_kernel_is_refused(make_checkpoint) -> None:
    """head_dim 16 (not a size the attention kernel is built for) would decode on the torch
    path, whose rows are padded to the step's longest history: refused, not silently variant."""
    d = make_checkpoint("qwen3_moe", "tiny", 0, hidden_size=64, num_heads=4, num_layers=1)
    with pytest.raises(ValueError, match="native attention kernel.*head_dim 16"):
        ModelRunner(d, dtype="bfloat16", num_blocks=16, block_size=16, batch_invariant=True)


@needs_kernels
def test_mla_attention_off_the_native_kernel_is_refused() -> None:
    """An fp8 KV cache keeps MLA's torch path (the native absorbed kernel reads bf16 rows)."""
    from pathlib import Path
    demo = Path(__file__).resolve().parents[3] / "models" / "stdlib-ds3-tiny"
    with pytest.raises(ValueError, match="native MLA attention kernel"):
        ModelRunner(demo, dtype="bfloat16", num_blocks=16, block_size=16, kv_dtype="fp8",
                    batch_invariant=True)
