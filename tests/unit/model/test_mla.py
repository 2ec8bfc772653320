"""MLA (DeepSeek-V3) pieces: absorbed vs expanded attention on the same latent cache, the
latent KVLayout, YaRN against transformers' own functions, and what the spec refuses."""
from __future__ import annotations

import pytest
import torch

from moed.model import archs
from moed.model.attention import mla
from moed.model.attention.registry import get_backend
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kv_layout import KVLayout
from moed.model.spec import SpecError
from moed.model.hf_config import spec_from_config

CFG = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, n_routed_experts=6, n_group=2, topk_group=1, num_experts_per_tok=2,
           moe_intermediate_size=32, intermediate_size=96, kv_lora_rank=32, q_lora_rank=None,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
           vocab_size=100, max_position_embeddings=512, rope_theta=10000.0, n_shared_experts=1)
PLAIN = ComputeContext(torch.device("cpu"), torch.float32)


def test_spec_and_latent_layout():
    spec = spec_from_config(CFG)
    assert spec.attention_kind == "mla" and spec.head_dim == 8 and spec.q_lora_rank == 0
    assert spec.dense_layers == (0,) and spec.shared_expert_intermediate_size == 32
    kv = archs.kv_layout(spec, 16, torch.bfloat16)
    assert kv.kind == "mla" and kv.entry_shape == (40,) and kv.rope_dim == 8 and kv.latent_rank == 32
    assert kv.block_bytes == 16 * (32 + 8) * 2          # (kv_lora_rank + rope) x dtype per token
    other = KVLayout.mla(2, 40, 16, torch.bfloat16, rope_dim=16)      # same bytes, other split
    assert other.layout_id != kv.layout_id


@pytest.mark.parametrize("change,match", [
    (dict(scoring_func="softmax"), "scoring_func"), (dict(topk_method="greedy"), "topk_method"),
    (dict(num_key_value_heads=2), "num_key_value_heads"), (dict(n_group=4), "do not fit"),
    (dict(rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 128,
                        "frobnicate": 1}), "frobnicate"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2}), "dynamic")])
def test_spec_refuses(change, match):
    with pytest.raises(SpecError, match=match):
        spec_from_config({**CFG, **change})


def test_yarn_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=yarn)
    inv_ref, att_ref = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    spec = spec_from_config({**CFG, "qk_rope_head_dim": 64, "max_position_embeddings": 163840, "rope_theta": None,
                             "rope_parameters": yarn})
    inv, att = mla.yarn_parameters(64, spec.rope_theta, dict(spec.rope_yarn), spec.max_position_embeddings)
    assert torch.allclose(inv, inv_ref) and att == pytest.approx(att_ref)
    assert mla.softmax_scale(spec) == pytest.approx(yarn_apply_mscale(yarn, (16 + 64) ** -0.5))
    assert mla.softmax_scale(spec) != pytest.approx((16 + 64) ** -0.5)    # the mscale^2 applies


def _weights(gen, h=4, nope=16, vd=12, r=32):
    return (torch.randn((h, nope, r), generator=gen) * 0.3, torch.randn((h, vd, r), generator=gen) * 0.3)


def test_absorbed_equals_expanded_on_one_history():
    gen = torch.Generator().manual_seed(0)
    w_uk, w_uv = _weights(gen)
    s = 37
    latent = torch.randn((s, 32 + 8), generator=gen)
    qn, qr = torch.randn((1, 4, 16), generator=gen), torch.randn((1, 4, 8), generator=gen)
    exp = mla.expanded(qn, qr, latent, w_uk, w_uv, 0.2, torch.ones((1, s), dtype=torch.bool))
    absd = mla.absorbed(qn, qr, latent.unsqueeze(0), torch.zeros((1, 1, s)), w_uk, w_uv, 0.2)
    assert (exp - absd).abs().max().item() <= 1e-4


def test_backend_absorbed_decode_vs_expanded_on_the_same_cache():
    """A mixed step (two decodes of different lengths, one chunked prefill) through the torch
    MLA backend; then each decode row recomputed in expanded form from the cache it wrote."""
    spec = spec_from_config(CFG)
    kv = archs.kv_layout(spec, 4, torch.float32)
    backend = get_backend("torch", spec, kv, PLAIN)
    cache = kv.allocate(32, "cpu")[0]
    gen = torch.Generator().manual_seed(1)
    cache.normal_(generator=gen)                                   # history: whatever is there
    w_uk, w_uv = _weights(gen, nope=16, vd=12)
    batch = ForwardBatch([[1], [2, 3, 4, 5, 6], [7]], [9, 6, 2], [[3, 4, 5], [6, 7, 8], [10]])
    pos = torch.tensor([9, 6, 7, 8, 9, 10, 2])
    backend.plan(batch, pos)
    t = 7
    qn, qr = torch.randn((t, 4, 16), generator=gen), torch.randn((t, 4, 8), generator=gen)
    c, kr = torch.randn((t, 32), generator=gen), torch.randn((t, 8), generator=gen)
    out = backend.forward_mla(0, qn, qr, c, kr, cache, w_uk, w_uv)
    flat = cache.reshape(-1, 40)
    assert torch.equal(flat[5 * 4 + 1], torch.cat((c[0], kr[0])))         # pos 9 of table [3, 4, 5]
    for row, table, n in ((0, [3, 4, 5], 10), (6, [10], 3)):
        rows = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(n)])
        ref = mla.expanded(qn[row:row + 1], qr[row:row + 1], flat[rows], w_uk, w_uv, backend.scale,
                           torch.ones((1, n), dtype=torch.bool))
        assert (out[row:row + 1] - ref).abs().max().item() <= 1e-4
    rows = torch.tensor([[6, 7, 8][p // 4] * 4 + p % 4 for p in range(11)])     # the chunk: causal
    mask = torch.arange(11)[None, :] <= torch.arange(6, 11)[:, None]
    ref = mla.expanded(qn[1:6], qr[1:6], flat[rows], w_uk, w_uv, backend.scale, mask)
    assert (out[1:6] - ref).abs().max().item() <= 1e-5


def test_gqa_backends_refuse_mla_and_mla_refuses_mismatch():
    spec = spec_from_config(CFG)
    with pytest.raises(ValueError, match="does not match"):
        get_backend("torch", spec, KVLayout.mla(2, 40, 4, torch.float32, rope_dim=16), PLAIN)
    with pytest.raises(TypeError, match="forward_mla"):
        get_backend("torch", spec, archs.kv_layout(spec, 4, torch.float32), PLAIN).forward(
            0, torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1))


def test_flashinfer_serves_only_the_mla_sizes_and_cache_its_kernels_take(monkeypatch):
    """FlashInfer 0.6.1's MLA kernels (seen on an H200): latent 512 + rope 64 over a 16-bit cache.
    Anything else: `auto` picks torch, naming flashinfer is refused with the reason."""
    from moed.model.attention import registry

    cuda = torch.device("cuda")
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: object())
    small = spec_from_config(CFG)                                  # latent 32, rope 8
    ds = spec_from_config({**CFG, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                           "v_head_dim": 128, "hidden_size": 256})
    bf16, fp8 = archs.kv_layout(ds, 16, torch.bfloat16), archs.kv_layout(ds, 16, torch.float8_e4m3fn)
    assert registry.flashinfer_refusal(ds, bf16) is None
    assert registry.resolve("auto", cuda, ds, bf16) == "flashinfer"
    assert "16-bit" in registry.flashinfer_refusal(ds, fp8)
    assert registry.resolve("auto", cuda, ds, fp8) == "torch"
    small_kv = archs.kv_layout(small, 16, torch.bfloat16)
    assert "kv_lora_rank 512" in registry.flashinfer_refusal(small, small_kv)
    assert registry.resolve("auto", cuda, small, small_kv) == "torch"
    assert registry.resolve("auto", torch.device("cpu"), ds, bf16) == "torch"
    with pytest.raises(ValueError, match="kv_lora_rank 512"):
        registry.get_backend("flashinfer", small, small_kv, ComputeContext(cuda, torch.bfloat16))


def test_init_lists_deepseek():
    from moed.dev.checkpoint import init_archs

    assert "deepseek_v3" in init_archs()


def test_checkpoint_with_an_mtp_layer_loads(tmp_path):
    """Real DeepSeek-V3 checkpoints carry the MTP head as a layer past num_hidden_layers: not read."""
    from safetensors.torch import load_file, save_file

    from moed.dev.checkpoint import init_checkpoint
    from moed.model.loader import load_weights
    from moed.model.hf_config import load_spec

    d = init_checkpoint("deepseek_v3", tmp_path / "m", preset="tiny", hidden_size=64, num_layers=2,
                        num_heads=4, num_experts=8, moe_intermediate_size=32, vocab_size=512)
    f = d / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)      # the MTP layer's
    t["model.layers.2.enorm.weight"] = torch.zeros(3)
    save_file(t, str(f), metadata={"format": "pt"})
    w = load_weights(d, load_spec(d), "float32")
    assert "layers.1.attn.kv_b" in w and not any(k.startswith("layers.2.") for k in w)


def test_a_verify_chunk_attends_as_decode_rows_a_prompt_chunk_as_a_prefill():
    """A speculative step's chunk (decoded tokens after a history: the known token and its
    drafts) runs each row in the absorbed form beside the decode rows, as plain decoding runs
    those positions; a prompt chunk, a fresh prompt and a chunk longer than ABSORBED_CHUNK
    take the expanded form (prefill)."""
    from moed.model.attention.mla_torch import ABSORBED_CHUNK

    spec = spec_from_config(CFG)
    backend = get_backend("torch", spec, archs.kv_layout(spec, 4, torch.float32), PLAIN)
    n_long = ABSORBED_CHUNK + 1
    batch = ForwardBatch([[1], [2, 3, 4], [5, 6], [7] * 3, [8] * n_long],
                         [9, 6, 4, 0, 3], [[0, 1, 2], [3, 4, 13], [5, 6], [7], [8, 9, 10, 11, 12]],
                         prompt=(False, False, True, True, False))
    pos = torch.tensor([9, 6, 7, 8, 4, 5, 0, 1, 2, *range(3, 3 + n_long)])
    backend.plan(batch, pos)
    assert backend.dec_rows.tolist() == [0, 1, 2, 3]
    assert [(p.row, p.n) for p in backend.prefills] == [(4, 2), (6, 3), (9, n_long)]
    # three queries a sequence (the chunk's), each over its own history; the decode row's
    # one query is repeated (the repeats' outputs are dropped)
    lens = (backend.dec_bias[:, :, 0] == 0).sum(-1).tolist()
    assert lens == [[10, 10, 10], [7, 8, 9]] and backend.dec_keep.tolist() == [0, 3, 4, 5]


def test_a_lone_chunk_keeps_the_expanded_form():
    spec = spec_from_config(CFG)
    backend = get_backend("torch", spec, archs.kv_layout(spec, 4, torch.float32), PLAIN)
    backend.plan(ForwardBatch([[2, 3, 4]], [6], [[3, 4, 13]]), torch.tensor([6, 7, 8]))
    assert backend.dec_rows is None and [(p.row, p.n) for p in backend.prefills] == [(0, 3)]


def test_demo_model_bf16_verified_rows_are_plain_decodings_logits():
    """bf16, the demo model: two sequences' chunks of four decoded tokens after their prompts
    give, row by row, bitwise the logits four plain decode steps of the two give (the expanded
    form differed by ~0.06)."""
    from pathlib import Path

    from moed.model.runner import ModelRunner

    demo = Path(__file__).resolve().parents[3] / "models" / "stdlib-ds3-tiny"
    prompts, conts = [list(range(40, 70)), list(range(300, 321))], [[71, 72, 73, 74], [9, 8, 7, 6]]
    tables = [list(range(12)), list(range(12, 24))]

    def runner() -> ModelRunner:
        r = ModelRunner(demo, dtype="bfloat16", device="cpu", num_blocks=24, block_size=4)
        r.forward(ForwardBatch(prompts, [0, 0], tables, prompt=(True, True)))
        return r
    plain = runner()
    steps = [plain.forward(ForwardBatch([[c[j]] for c in conts], [len(p) + j for p in prompts],
                                        tables)) for j in range(4)]
    want = torch.cat([torch.stack([s[i] for s in steps]) for i in range(2)])
    got = runner().forward(ForwardBatch(conts, [len(p) for p in prompts], tables,
                                        all_logits=(True, True)))
    assert torch.equal(got, want)
