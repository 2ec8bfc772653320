"""Speculative decoding with DeepSeek-V3's MTP layer (method "mtp", k = 1, and chained for
k = 2, 3): greedy output equals plain decoding token for token (fp32) on the trained demo
model, whose MTP layer is trained (most drafts accepted, chained ones too), and on a tiny
random DeepSeek-V3 with a random MTP layer (most rejected), with chunked prefill, prefix hits
and preemption; seeded sampling reproduces; no block leaks, and a chain's scratch entries
never land in a block the prefix cache holds."""
from __future__ import annotations

import random
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from moed.config import EngineConfig, SpeculativeConfig
from moed.engine.drivers import SyncDriver, run_sync
from moed.engine.engine import Engine
from moed.model.kernels import cpu_flags_ok
from moed.model.runner import ModelRunner
from moed.model.tokenizer import Tokenizer
from moed.obs import metrics
from moed.types import SamplingParams

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "models" / "stdlib-ds3-tiny"
# the per-step switch off (as in test_speculative.py): every step may draft
MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=1, adaptive=False)
MTP3 = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)
SNIPPETS = [
    "def {a}(x, y):\n    return x + y\n\n\ndef {b}(x, y):\n    return x - y\n\n\ndef {c}(x, y):\n",
    "import {a}\nimport {b}\nimport {c}\nimport {a}\nimport",
    "for {a} in range(10):\n    print({a})\nfor {b} in range(10):\n    print(",
    "class {a}:\n    def __init__(self, x):\n        self.x = x\n\n\nclass {b}:\n    def __init__(",
    "{a} = [1, 2, 3]\n{b} = [1, 2, 3]\n{c} = [1, 2,",
]
NAMES = ["os", "sys", "re", "json", "path", "item", "value", "key"]


def _engine(d, spec=None, batched=24, blocks=512, dtype="float32") -> Engine:
    r = ModelRunner(d, dtype=dtype, device="cpu", num_blocks=blocks, block_size=4,
                    mtp=spec is not None, batch_invariant=dtype == "bfloat16")
    return Engine(r, Tokenizer.from_dir(d), EngineConfig(block_size=4, max_num_seqs=6,
                                                         max_num_batched_tokens=batched),
                  speculative=spec)


def _counts() -> tuple[float, float]:
    return metrics.SPEC_DRAFT_TOKENS._value.get(), metrics.SPEC_ACCEPTED._value.get()


def _per_position() -> dict[str, float]:
    return {s.labels["position"]: s.value for s in metrics.SPEC_ACCEPTED_POS.collect()[0].samples
            if s.name.endswith("_total")}


def _compare(d, prompts, params, sc=MTP, **kw) -> tuple[float, float, Engine]:
    plain, spec = _engine(d, **kw), _engine(d, sc, **kw)
    want = [plain.generate(prompts[i:i + 6], params) for i in range(0, len(prompts), 6)]
    d0, a0 = _counts()
    got = [spec.generate(prompts[i:i + 6], params) for i in range(0, len(prompts), 6)]
    assert got == want
    assert spec.kv.num_used_blocks == 0
    return _counts()[0] - d0, _counts()[1] - a0, spec


@pytest.mark.parametrize("k,dtype", [(1, "float32"), (3, "float32"), pytest.param(
    1, "bfloat16", marks=pytest.mark.skipif(
        not (cpu_flags_ok() and (shutil.which("cc") or shutil.which("gcc"))),
        reason="bf16 batch invariance needs a native kernel variant this CPU runs and a C compiler"))])
def test_demo_model_mtp_greedy_equals_plain_and_mostly_accepted(k, dtype):
    """fp32, and bf16 with model.batch_invariant (each row's bits its own: a verified position
    is computed as plain decoding computes it)."""
    tok = Tokenizer.from_dir(DEMO)
    prompts = [tok.encode(t.format(a=NAMES[i % 8], b=NAMES[(i + 3) % 8], c=NAMES[(i + 5) % 8]))
               for i, t in enumerate(SNIPPETS * 8)]      # 40 prompts
    prompts += prompts[:10]                             # prefix hits
    n0, p0 = metrics.SPEC_DRAFTS._value.get(), _per_position()
    drafted, accepted, spec = _compare(DEMO, prompts, SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True),
        SpeculativeConfig(method="mtp", num_speculative_tokens=k, adaptive=False), dtype=dtype)
    n, p = metrics.SPEC_DRAFTS._value.get() - n0, _per_position()
    rate = [(p.get(str(i), 0) - p0.get(str(i), 0)) / n for i in range(k)]
    assert drafted > 0 and 0.5 * drafted < accepted < drafted     # measured ~85% (k = 1)
    assert rate[0] > 0.6 and all(rate[i + 1] > 0.3 * rate[i] for i in range(k - 1)), rate
    assert spec.kv.stats().prefix_hit_tokens > 0


def _tiny_with_mtp(make_checkpoint, tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location(
        "moed_test_mtp_helpers", ROOT / "tests" / "unit" / "model" / "test_mtp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = make_checkpoint("deepseek_v3", hidden_size=64, num_layers=2, num_heads=4,
                           num_experts=8, moe_intermediate_size=32, vocab_size=512,
                           max_position_embeddings=128, dtype="float32")
    return mod._with_mtp(base, tmp_path_factory.mktemp("mtp") / "m", own_copies=False)[0]


@pytest.mark.parametrize("sc", [MTP, MTP3], ids=["k1", "k3"])
def test_tiny_random_mtp_greedy_equals_plain_with_preemption(make_checkpoint,
                                                             tmp_path_factory, sc):
    """A random MTP layer drafts badly: rejections everywhere, the output unchanged, also when
    a small pool preempts (recompute rewrites the MTP layer's KV too)."""
    d = _tiny_with_mtp(make_checkpoint, tmp_path_factory)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 40, (24,), generator=gen)]
    prompts += prompts[:4]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    drafted, accepted, _ = _compare(d, prompts, params, sc, batched=16)
    assert drafted > accepted
    small_plain, small_spec = _engine(d, blocks=40), _engine(d, sc, blocks=40)
    assert small_spec.generate(prompts[:6], params) == small_plain.generate(prompts[:6], params)
    assert small_spec.scheduler.num_preemptions > 0 and small_spec.kv.num_used_blocks == 0


def test_mtp_seeded_sampling_reproduces():
    tok = Tokenizer.from_dir(DEMO)
    prompts = [tok.encode(t.format(a="a", b="b", c="c")) for t in SNIPPETS]
    ps = [SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, presence_penalty=0.2,
                         seed=i, ignore_eos=True) for i in range(len(prompts))]
    assert _engine(DEMO, MTP).generate(prompts, ps) == _engine(DEMO, MTP).generate(prompts, ps)


def test_demo_model_mtp_grammar_rows_equal_plain_with_drafts_accepted():
    """Structured output with the MTP layer's drafts (cut to the grammar-valid prefix, masked
    at each verified position): JSON schema, regex and choice rows beside free ones give plain
    decoding's tokens, and the grammar rows' drafts are accepted."""
    import json

    from moed.types import GrammarSpec
    tok = Tokenizer.from_dir(DEMO)
    schema = json.dumps({"type": "object", "required": ["name", "args"], "properties": {
        "name": {"type": "string", "maxLength": 16},
        "args": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}}})
    grammars = [GrammarSpec("json_schema", schema), GrammarSpec("regex", r"def [a-z_]{1,12}\(x\):"),
                GrammarSpec("choice", json.dumps(["import os\nimport sys", "import re"]))]
    prompts, params = [], []
    for i, t in enumerate(SNIPPETS * 2):
        prompts.append(tok.encode(t.format(a=NAMES[i % 8], b=NAMES[(i + 3) % 8], c="f")))
        g = None if i % 4 == 3 else grammars[i % 3]
        params.append(SamplingParams(max_tokens=32, temperature=0.0, grammar=g,
                                     ignore_eos=g is None))
    plain, spec = _engine(DEMO), _engine(DEMO, MTP)
    got = [0, 0]
    apply = spec.scheduler._apply_verified

    def spy(req, c, v):
        if req.grammar is not None:
            got[0] += len(c.draft)
            got[1] += v.accepted
        return apply(req, c, v)
    spec.scheduler._apply_verified = spy
    want = [plain.generate(prompts[i:i + 6], params[i:i + 6]) for i in range(0, 10, 6)]
    assert [spec.generate(prompts[i:i + 6], params[i:i + 6]) for i in range(0, 10, 6)] == want
    assert got[1] > 0 and spec.kv.num_used_blocks == 0, got


def test_mtp_chain_leaks_no_block_and_writes_no_cached_block(make_checkpoint, tmp_path_factory):
    """k = 3 on the demo model (chains accepted) and 120 requests, some aborted mid-way, in a
    pool that preempts, with prefix hits: every chained entry lands in a slot past the
    request's computed tokens, in a block no request holds in the prefix cache; the free
    count returns to its start."""
    e = _engine(DEMO, MTP3, batched=32, blocks=44)
    pool, draft_mtp = e.kv._pool, e.runner.draft_mtp
    chained = [0]

    def checked(batch, hidden, depth, passes=0, kept=None):
        for i, (toks, start, table, d) in enumerate(zip(batch.token_ids, batch.start_pos,
                                                        batch.block_tables, depth)):
            # the chain's entries, and a rejected draft's row kept as padding (mtp_inputs(pad))
            last = start + (len(toks) if kept is None else kept[i]) - 1
            for pos in range(last + 1, max(last + d, start + len(toks))):
                assert pool.block_hash(table[pos // 4]) is None, (pos, table)
                chained[0] += 1
        return draft_mtp(batch, hidden, depth, passes, kept)
    e.runner.draft_mtp = checked
    tok = Tokenizer.from_dir(DEMO)
    base = [tok.encode(t.format(a=NAMES[i % 8], b=NAMES[(i + 1) % 8], c=NAMES[(i + 2) % 8]))
            for i, t in enumerate(SNIPPETS * 4)]
    prompts = (base * 6)[:120]
    free0, rng, live, k = e.kv.num_free_blocks, random.Random(3), [], 0
    driver = SyncDriver()
    while k < len(prompts) or live:
        while k < len(prompts) and len(live) < 8:
            sp = SamplingParams(max_tokens=rng.randrange(4, 30), ignore_eos=True,
                                temperature=0.0 if k % 3 else 0.8, seed=k)
            r = e._new_request(f"r{k}", prompts[k], sp)
            e.scheduler.add(r)
            live.append(r)
            k += 1
        run_sync(e.step(driver))
        for r in list(live):
            if not r.finished and rng.random() < 0.03:
                e.scheduler.abort(r.request_id)
            if r.finished:
                live.remove(r)
    assert chained[0] > 100
    assert e.kv.num_free_blocks == free0 and e.kv.num_used_blocks == 0
    assert e.scheduler.num_preemptions > 0 and e.kv.stats().prefix_hit_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
def test_every_mtp_draft_is_verified(max_tokens):
    """A request drafts only what its next step may verify (max_tokens left after this step's
    tokens, less the one that step emits anyway): a request's last step drafts nothing, so
    every draft made is verified. Output equal to plain decoding all the same."""
    tok = Tokenizer.from_dir(DEMO)
    prompts = [tok.encode(t.format(a="os", b="re", c="sys")) for t in SNIPPETS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain, spec = _engine(DEMO, batched=2048), _engine(DEMO, MTP3, batched=2048)
    want = plain.generate(prompts, params)
    runner, depths = spec.runner, []
    draft_mtp = runner.draft_mtp
    runner.draft_mtp = lambda b, h, depth, *a: depths.append(list(depth)) or draft_mtp(b, h, depth, *a)
    d0, _ = _counts()
    assert spec.generate(prompts, params) == want
    made, verified = sum(map(sum, depths)), _counts()[0] - d0
    assert made == verified and (made > 0) == (max_tokens > 2), depths
    assert spec.kv.num_used_blocks == 0
