"""Speculative decoding on a GPU (CUDA only): the verify step's multi-row chunk and the MTP
forward through the CUDA kernels equal plain decoding. fp32 with the torch backend is held to
token-for-token equality (as the CPU tests); FlashInfer runs bf16 only, where a verified position
is computed as a chunk row and plain decoding as a decode row, so a near-tie may flip (the CPU's
bf16 note in docs/speculative.md): where they part, the fp32 logits must show a near tie."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from moed.config import EngineConfig, SpeculativeConfig
from moed.engine.engine import Engine
from moed.model.batch import ForwardBatch
from moed.model.runner import ModelRunner
from moed.model.tokenizer import Tokenizer
from moed.obs import metrics
from moed.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEMO = Path(__file__).resolve().parents[2] / "models" / "stdlib-ds3-tiny"
SNIPPETS = [
    "def {a}(x, y):\n    return x + y\n\n\ndef {b}(x, y):\n    return x - y\n\n\ndef {c}(x, y):\n",
    "import {a}\nimport {b}\nimport {c}\nimport {a}\nimport",
    "for {a} in range(10):\n    print({a})\nfor {b} in range(10):\n    print(",
    "class {a}:\n    def __init__(self, x):\n        self.x = x\n\n\nclass {b}:\n    def __init__(",
    "{a} = [1, 2, 3]\n{b} = [1, 2, 3]\n{c} = [1, 2,",
]
NAMES = ["os", "sys", "re", "json", "path", "item", "value", "key"]
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                          prompt_lookup_max=3, adaptive=False)
MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=1, adaptive=False)
MTP3 = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)   # chained
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(d, dtype: str, backend: str, spec=None) -> Engine:
    r = ModelRunner(d, dtype=dtype, device="cuda", attention_backend=backend, num_blocks=256,
                    block_size=16, mtp=spec is not None and spec.method == "mtp")
    cfg = EngineConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    return Engine(r, Tokenizer.from_dir(d), cfg, speculative=spec)


def _run(e: Engine, prompts) -> tuple[list[list[int]], float, float]:
    d0, a0 = metrics.SPEC_DRAFT_TOKENS._value.get(), metrics.SPEC_ACCEPTED._value.get()
    out = [t for i in range(0, len(prompts), 8) for t in e.generate(prompts[i:i + 8], PARAMS)]
    assert e.kv.num_used_blocks == 0
    return out, metrics.SPEC_DRAFT_TOKENS._value.get() - d0, metrics.SPEC_ACCEPTED._value.get() - a0


def _demo_prompts() -> list[list[int]]:
    tok = Tokenizer.from_dir(DEMO)
    ps = [tok.encode(t.format(a=NAMES[i % 8], b=NAMES[(i + 3) % 8], c=NAMES[(i + 5) % 8]))
          for i, t in enumerate(SNIPPETS * 8)]
    return ps + ps[:8]                      # 48 prompts, the last 8 hit the prefix cache


@pytest.mark.parametrize("spec", [NGRAM, MTP, MTP3], ids=["ngram", "mtp", "mtp-k3"])
def test_demo_model_cuda_fp32_speculation_equals_plain(spec):
    """The trained demo model (DeepSeek-V3 with MLA and an MTP layer; torch attention, since
    FlashInfer's MLA serves only V3's own sizes) on CUDA in fp32: token for token."""
    prompts = _demo_prompts()
    want, _, _ = _run(_engine(DEMO, "float32", "torch"), prompts)
    got, drafted, accepted = _run(_engine(DEMO, "float32", "torch", spec), prompts)
    assert got == want
    assert drafted > 0 and accepted > 0


def test_ngram_on_flashinfer_bf16(make_checkpoint):
    assert importlib.util.find_spec("flashinfer") is not None, "flashinfer-python is not installed"
    # every token takes both experts (top_k = num_experts): no routing decision that a bf16
    # rounding could flip, which would part the outputs far from any tie in the logits
    d = make_checkpoint("qwen3_moe", "tiny", 4, num_heads=4, num_kv_heads=2, num_layers=2,
                        num_experts=2, top_k=2)
    plain, spec = _engine(d, "bfloat16", "flashinfer"), _engine(d, "bfloat16", "flashinfer", NGRAM)
    assert spec.runner.backend.name == "flashinfer"
    g = torch.Generator().manual_seed(0)
    vocab = plain.runner.spec.vocab_size
    prompts = []
    for n in range(32):      # edit-style: a passage, then again with a change (drafts accepted)
        base = torch.randint(3, vocab, (6 + n % 14,), generator=g).tolist()
        prompts.append(base + base[:-1] + [base[-1] ^ 1] + base[: 1 + n % 4])
    want, _, _ = _run(plain, prompts)
    got, drafted, accepted = _run(spec, prompts)
    assert drafted > 0 and accepted > 0
    # Where the two part, the model must be near a tie there: the fp32 logits (torch backend)
    # of the two tokens at the first differing position lie within the bf16 model's own error
    # at that position (|bf16 - fp32| logits, torch backend), with a margin of 3. A wrong
    # verify (a shifted position, a stale KV row) parts far from any tie.
    kw = dict(device="cuda", attention_backend="torch", num_blocks=16, block_size=16)
    r32, r16 = ModelRunner(d, dtype="float32", **kw), ModelRunner(d, dtype="bfloat16", **kw)
    parted = 0
    for p, a, b in zip(prompts, got, want):
        if a == b:
            continue
        parted += 1
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        seq = p + b[:i]
        fb = ForwardBatch([seq], [0], [list(range(-(-len(seq) // 16)))])
        l32, l16 = r32.forward(fb)[0].float(), r16.forward(fb)[0].float()
        gap, err = (l32[a[i]] - l32[b[i]]).abs().item(), (l16 - l32).abs().max().item()
        assert gap <= 3 * err + 1e-3, (
            f"prompt {p[:6]}...: speculation parted from plain decoding at token {i} "
            f"({a[i]} vs {b[i]}), fp32 logit gap {gap:.4f} against the bf16 error {err:.4f}")
    assert parted < len(prompts), "every prompt parted: nothing was compared"
