"""Speculative decoding with DeepSeek-V3's MTP layer (method "mtp", k = 1): greedy output
equals plain decoding token for token (fp32) on the trained demo model, whose MTP layer is
trained (most drafts accepted), and on a tiny random DeepSeek-V3 with a random MTP layer
(most rejected), with chunked prefill, prefix hits and preemption; seeded sampling reproduces;
no block leaks."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from moed.config import EngineConfig, SpeculativeConfig
from moed.engine.engine import Engine
from moed.model.runner import ModelRunner
from moed.model.tokenizer import Tokenizer
from moed.obs import metrics
from moed.types import SamplingParams

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "models" / "stdlib-ds3-tiny"
# the per-step switch off (as in test_speculative.py): every step may draft
MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=1, adaptive=False)
SNIPPETS = [
    "def {a}(x, y):\n    return x + y\n\n\ndef {b}(x, y):\n    return x - y\n\n\ndef {c}(x, y):\n",
    "import {a}\nimport {b}\nimport {c}\nimport {a}\nimport",
    "for {a} in range(10):\n    print({a})\nfor {b} in range(10):\n    print(",
    "class {a}:\n    def __init__(self, x):\n        self.x = x\n\n\nclass {b}:\n    def __init__(",
    "{a} = [1, 2, 3]\n{b} = [1, 2, 3]\n{c} = [1, 2,",
]
NAMES = ["os", "sys", "re", "json", "path", "item", "value", "key"]


def _engine(d, spec=None, batched=24, blocks=512) -> Engine:
    r = ModelRunner(d, dtype="float32", device="cpu", num_blocks=blocks, block_size=4,
                    mtp=spec is not None)
    return Engine(r, Tokenizer.from_dir(d), EngineConfig(block_size=4, max_num_seqs=6,
                                                         max_num_batched_tokens=batched),
                  speculative=spec)


def _counts() -> tuple[float, float]:
    return metrics.SPEC_DRAFT_TOKENS._value.get(), metrics.SPEC_ACCEPTED._value.get()


def _compare(d, prompts, params, **kw) -> tuple[float, float, Engine]:
    plain, spec = _engine(d, **kw), _engine(d, MTP, **kw)
    want = [plain.generate(prompts[i:i + 6], params) for i in range(0, len(prompts), 6)]
    d0, a0 = _counts()
    got = [spec.generate(prompts[i:i + 6], params) for i in range(0, len(prompts), 6)]
    assert got == want
    assert spec.kv.num_used_blocks == 0
    return _counts()[0] - d0, _counts()[1] - a0, spec


def test_demo_model_mtp_greedy_equals_plain_and_mostly_accepted():
    tok = Tokenizer.from_dir(DEMO)
    prompts = [tok.encode(t.format(a=NAMES[i % 8], b=NAMES[(i + 3) % 8], c=NAMES[(i + 5) % 8]))
               for i, t in enumerate(SNIPPETS * 8)]      # 40 prompts
    prompts += prompts[:10]                             # prefix hits
    drafted, accepted, spec = _compare(DEMO, prompts, SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True))
    assert drafted > 0 and 0.5 * drafted < accepted < drafted     # measured ~85%
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


def test_tiny_random_mtp_greedy_equals_plain_with_preemption(make_checkpoint,
                                                             tmp_path_factory):
    """A random MTP layer drafts badly: rejections everywhere, the output unchanged, also when
    a small pool preempts (recompute rewrites the MTP layer's KV too)."""
    d = _tiny_with_mtp(make_checkpoint, tmp_path_factory)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 40, (24,), generator=gen)]
    prompts += prompts[:4]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    drafted, accepted, _ = _compare(d, prompts, params, batched=16)
    assert drafted > accepted
    small_plain, small_spec = _engine(d, blocks=40), _engine(d, MTP, blocks=40)
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
