"""DeepSeek-V3 (config.json model_type "deepseek_v3"; R1 and Kimi K2 share the architecture).

Particular to it:
  attention   MLA with a latent KV cache (moed/model/attention/mla.py): q directly (`q_proj`,
              q_lora_rank null) or through a low-rank bottleneck (`q_a_proj`, `q_a_layernorm`,
              `q_b_proj`); the latent `kv_a_proj_with_mqa` -> [c_kv | k_rope], `kv_a_layernorm`
              on c_kv, `kv_b_proj` -> per-head k_nope and v; rotary on the rope dims only,
              interleaved pairs when rope_interleave (transformers' default), YaRN when the
              config's rope scaling says so
  dense       the first `first_k_dense_replace` layers have a dense MLP (`intermediate_size`)
  routing     sigmoid scores; `e_score_correction_bias` added for choosing only; a group's score
              is the sum of its top-2 biased scores; the best `topk_group` groups are kept (the
              others masked with -inf, never 0); top-k experts among them; the weights are
              the unbiased scores of the chosen, normalised (norm_topk_prob), times
              `routed_scaling_factor` (grouped_topk below)
  shared      `n_shared_experts` x moe_intermediate_size as one SwiGLU MLP added to every
              token of a MoE layer (on every rank under expert parallelism: it is not an expert
              slot)
The fused CPU MoE kernel routes softmax top-k only, so these MoE layers take the torch path
(logged once, `moe_torch_path`): the grouped router in torch, then each expert's rows through
its Linears, which (like the dense MLPs, attention projections and norms) use the kernels.
Not served: scoring_func other than sigmoid, topk_method other than noaux_tc, moe_layer_freq != 1.
The MTP layer (`num_nextn_predict_layers`: layer num_hidden_layers in the checkpoint, a whole
decoder layer plus enorm, hnorm, eh_proj and a copy of the embedding and head) is read only when
the runner asks for it (ModelRunner(mtp=True), moed/model/mtp.py); otherwise, and past the first
one, those layers are skipped unread (Arch.skip_layers_past_end).
"""
from __future__ import annotations

from typing import Any

import structlog
import torch
import torch.nn.functional as F

from moed.model.archs import Arch, InitRecipe, register
from moed.model.archs._hf import INIT_NAMES
from moed.model.attention.mla import MLAAttention
from moed.model.context import ComputeContext, ExpertPlacement
from moed.model.decoder import DecoderLayer, Weights, dense_block
from moed.model.kv_layout import KVLayout
from moed.model.layers import DenseMLP, Linear
from moed.model.moe import MoELayer, Router
from moed.model.quant.weight import cat_rows
from moed.model.spec import ModelSpec, SpecError, required

log = structlog.get_logger(__name__)

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate")


def grouped_topk(scores: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                 normalise: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing. scores [T, E] fp32 (sigmoid of the router logits), bias [E]
    -> weights [T, k] fp32, expert ids [T, k] int64 (best first).

    Ties go to the lower index (stable sorts), for groups and for experts alike."""
    t, e = scores.shape
    choice = scores + bias                                           # for choosing only
    if n_group > 1:
        per = e // n_group
        group_score = choice.view(t, n_group, per).topk(2, dim=-1).values.sum(dim=-1)   # [T, G]
        keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        mask = torch.zeros((t, n_group), dtype=torch.bool, device=scores.device).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
    idx = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = scores.gather(1, idx)
    if normalise:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, idx


class GroupedRouter(Router):
    """Router whose choice is grouped_topk over sigmoid scores (fp32, as transformers keeps
    the gate); the expert map, load count and replica split are Router's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, spec: ModelSpec, num_physical: int,
                 load: torch.Tensor, linear: Linear) -> None:
        super().__init__(weight, spec, num_physical, load, linear)
        self.weight_f32, self.bias = weight.float(), bias.float()
        self.n_group, self.topk_group, self.scale = spec.n_group, spec.topk_group, spec.routed_scaling_factor

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight_f32).sigmoid()
        w, idx = grouped_topk(scores, self.bias, self.n_group, self.topk_group, self.top_k,
                              self.norm_topk, self.scale)
        return w.to(x.dtype), idx

    def choice_scores(self, x: torch.Tensor) -> torch.Tensor:
        """Router.choice_scores: the biased sigmoid scores (the group limit not applied)."""
        return F.linear(x.float(), self.weight_f32).sigmoid() + self.bias


_logged_torch_path = False


class SharedExpertMoE(MoELayer):
    """Routed experts (grouped router, torch path) plus the shared experts on every token."""

    def __init__(self, spec: ModelSpec, router: torch.Tensor, bias: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, shared: DenseMLP | None, load: torch.Tensor, ctx: ComputeContext,
                 placement: ExpertPlacement | None = None) -> None:
        global _logged_torch_path
        if ctx.kernels is not None and not _logged_torch_path:
            log.info("moe_torch_path", arch=spec.arch,
                     reason="the fused CPU MoE kernel routes softmax top-k; grouped sigmoid routing runs in torch")
            _logged_torch_path = True
        # The router's and experts' matmuls on the native kernels, each shape's row classes as
        # measured (kernels/choice.py; every class pinned native under model.batch_invariant):
        # an expert is then held once, in the kernels' layout, where ATen's gemv (1-2 rows) and
        # oneDNN (more) needed the plain weight and a oneDNN copy beside it (twice the bytes a
        # cold-expert slot counts); the native kernel is 2.5-4x oneDNN at 3-512 rows here
        # (docs/cold-experts.md, 2026-12-05 coldbig)
        super().__init__(spec, router, gate_up, down, load, ctx, placement, fused=False)
        r = self.router
        grouped = GroupedRouter(router, bias, spec, r.num_physical, load, r.linear)
        grouped.set_expert_map(r.logical_to_physical, r.num_replicas)
        self.router, self.shared = grouped, shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = super().__call__(x)
        return y if self.shared is None else y + self.shared(x)


def _yarn(cfg: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    params, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    src = params if params.get("rope_type", "default") != "default" else scaling
    kind = src.get("rope_type") or src.get("type") or "default"
    if kind == "default":
        return ()
    if kind != "yarn":
        raise SpecError(f"rope type {kind!r} is not supported for deepseek_v3 (default or yarn)")
    extra = set(src) - set(_YARN_KEYS) - {"rope_type", "type", "rope_theta"}
    if extra:
        raise SpecError(f"yarn rope scaling keys not understood: {sorted(extra)}")
    if src.get("original_max_position_embeddings") is None:
        raise SpecError("yarn rope scaling lacks original_max_position_embeddings")
    return tuple(sorted((k, float(src[k])) for k in _YARN_KEYS if src.get(k) is not None))


def spec_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise SpecError(f"scoring_func {cfg['scoring_func']!r} is not supported (only sigmoid)")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise SpecError(f"topk_method {cfg['topk_method']!r} is not supported (only noaux_tc)")
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        raise SpecError("moe_layer_freq != 1 is not supported")
    heads = int(required(cfg, "num_attention_heads"))
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        raise SpecError("MLA needs num_key_value_heads == num_attention_heads")
    experts = int(required(cfg, "n_routed_experts", "num_local_experts"))
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    top_k = int(required(cfg, "num_experts_per_tok"))
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise SpecError(f"{experts} experts in n_group {n_group} with topk_group {topk_group} do not fit")
    if n_group > 1 and experts // n_group < 2:
        raise SpecError("grouped routing needs >= 2 experts per group (a group scores its top 2)")
    if top_k > topk_group * (experts // n_group):
        raise SpecError(f"num_experts_per_tok {top_k} exceeds the experts of {topk_group} groups")
    rope, r = int(required(cfg, "qk_rope_head_dim")), int(required(cfg, "kv_lora_rank"))
    if rope % 2:
        raise SpecError("qk_rope_head_dim must be even")
    moe_i = int(required(cfg, "moe_intermediate_size"))
    k_dense = int(cfg.get("first_k_dense_replace") or 0)
    return dict(
        num_experts=experts, moe_intermediate_size=moe_i,
        dense_intermediate_size=int(cfg.get("intermediate_size") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), qk_norm=False,
        dense_layers=tuple(range(min(k_dense, num_layers))),
        attention_kind="mla", head_dim=rope, num_kv_heads=heads,
        shared_expert_intermediate_size=moe_i * int(cfg.get("n_shared_experts") or 0),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=r,
        qk_nope_head_dim=int(required(cfg, "qk_nope_head_dim")), qk_rope_head_dim=rope,
        v_head_dim=int(required(cfg, "v_head_dim")), rope_interleave=bool(cfg.get("rope_interleave", True)),
        rope_yarn=_yarn(cfg), router_scoring="sigmoid", n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def layer_shapes(spec: ModelSpec, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's MLA, router-bias and shared-expert tensors (loader kinds whole.*, o_proj); the
    MTP layer's own tensors too for i >= num_layers."""
    h, heads, r = spec.hidden_size, spec.num_heads, spec.kv_lora_rank
    qd = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    out: dict[str, tuple[int, ...]] = {
        "attn.kv_a": (r + spec.qk_rope_head_dim, h), "attn.kv_a_norm": (r,),
        "attn.kv_b": (heads * (spec.qk_nope_head_dim + spec.v_head_dim), r),
        "o_proj": (h, heads * spec.v_head_dim)}
    if spec.q_lora_rank:
        out.update({"attn.q_a": (spec.q_lora_rank, h), "attn.q_a_norm": (spec.q_lora_rank,),
                    "attn.q_b": (heads * qd, spec.q_lora_rank)})
    else:
        out["attn.q"] = (heads * qd, h)
    if spec.attention_bias:
        out.update({"attn.kv_a.bias": (r + spec.qk_rope_head_dim,), "o_proj.bias": (h,)})
        if spec.q_lora_rank:
            out["attn.q_a.bias"] = (spec.q_lora_rank,)
    if i >= spec.num_layers:        # the MTP layer's own tensors (moed/model/mtp.py)
        out.update({"mtp.enorm": (h,), "mtp.hnorm": (h,), "mtp.eh_proj": (h, 2 * h), "mtp.head_norm": (h,),
                    "mtp.embed": (spec.vocab_size, h), "mtp.head": (spec.vocab_size, h)})
    if i not in spec.dense_layers:
        out["router_bias"] = (spec.num_experts,)
        si = spec.shared_expert_intermediate_size
        if si:
            out.update({"shared.gate": (si, h), "shared.up": (si, h), "shared.down": (h, si)})
    return out


_A = r"self_attn\."
_MOE = r"mlp\."
WEIGHTS: tuple[tuple[str, str], ...] = (
    (r"(?:model\.)?embed_tokens\.weight", "embed"),
    (r"(?:model\.)?norm\.weight", "norm"),
    (r"lm_head\.weight", "lm_head"),
    (r"input_layernorm\.weight", "input_norm"),
    (r"post_attention_layernorm\.weight", "post_norm"),
    (_A + r"q_proj\.weight", "whole.attn.q"),
    (_A + r"q_a_proj\.weight", "whole.attn.q_a"),
    (_A + r"q_a_proj\.bias", "whole.attn.q_a.bias"),
    (_A + r"q_a_layernorm\.weight", "whole.attn.q_a_norm"),
    (_A + r"q_b_proj\.weight", "whole.attn.q_b"),
    (_A + r"kv_a_proj_with_mqa\.weight", "whole.attn.kv_a"),
    (_A + r"kv_a_proj_with_mqa\.bias", "whole.attn.kv_a.bias"),
    (_A + r"kv_a_layernorm\.weight", "whole.attn.kv_a_norm"),
    (_A + r"kv_b_proj\.weight", "whole.attn.kv_b"),
    (_A + r"o_proj\.(weight|bias)", "o_proj"),
    (_MOE + r"gate\.weight", "router"),
    (_MOE + r"gate\.e_score_correction_bias", "whole.router_bias"),
    (_MOE + r"experts\.(\d+)\.gate_proj\.weight", "expert.gate"),
    (_MOE + r"experts\.(\d+)\.up_proj\.weight", "expert.up"),
    (_MOE + r"experts\.(\d+)\.down_proj\.weight", "expert.down"),
    (_MOE + r"experts\.gate_up_proj(?:\.weight)?", "fused.gate_up"),     # transformers 5.x in memory
    (_MOE + r"experts\.down_proj(?:\.weight)?", "fused.down"),
    (_MOE + r"shared_experts\.gate_proj\.weight", "whole.shared.gate"),
    (_MOE + r"shared_experts\.up_proj\.weight", "whole.shared.up"),
    (_MOE + r"shared_experts\.down_proj\.weight", "whole.shared.down"),
    (_MOE + r"gate_proj\.weight", "dense.gate"),
    (_MOE + r"up_proj\.weight", "dense.up"),
    (_MOE + r"down_proj\.weight", "dense.down"),
    # the MTP layer's own (layer num_hidden_layers; loaded with mtp=True only)
    (r"enorm\.weight", "whole.mtp.enorm"),
    (r"hnorm\.weight", "whole.mtp.hnorm"),
    (r"eh_proj\.weight", "whole.mtp.eh_proj"),
    (r"embed_tokens\.weight", "whole.mtp.embed"),
    (r"shared_head\.norm\.weight", "whole.mtp.head_norm"),
    (r"shared_head\.head\.weight", "whole.mtp.head"),
)


def build_layer(spec: ModelSpec, i: int, w: Weights, load_row: torch.Tensor, ctx: ComputeContext) -> DecoderLayer:
    p = f"layers.{i}."
    if i in spec.dense_layers:
        mlp: MoELayer | DenseMLP = dense_block(i, w, ctx)
    else:
        shared = None
        if spec.shared_expert_intermediate_size:
            shared = DenseMLP(cat_rows([w[p + "shared.gate"], w[p + "shared.up"]]), w[p + "shared.down"], ctx)
        mlp = SharedExpertMoE(spec, w[p + "router"], w[p + "router_bias"], w[p + "experts.gate_up"],
                              w[p + "experts.down"], shared, load_row, ctx, ctx.placement)
    return DecoderLayer(w[p + "input_norm"], w[p + "post_norm"], spec.rms_norm_eps,
                        MLAAttention(spec, i, w, ctx), mlp, ctx.kernels)     # type: ignore[arg-type]


def kv_layout(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> KVLayout:
    """Per token and layer only [c_kv | k_rope]: (kv_lora_rank + qk_rope_head_dim) values."""
    return KVLayout.mla(spec.num_layers, spec.kv_lora_rank + spec.qk_rope_head_dim, block_size, dtype,
                        spec.qk_rope_head_dim)


# Per-preset MLA/routing sizes, scaled from DeepSeek-V3's ratios (r = hidden/14 there; here a
# bit wider so tiny models are not degenerate); overrides win over these.
def _config_kwargs(ids: dict[str, int], kw: dict[str, Any]) -> dict[str, Any]:
    h, heads = kw["hidden_size"], kw["num_attention_heads"]
    hd = h // heads
    experts = kw.get("n_routed_experts", 8)
    defaults = dict(
        kv_lora_rank=max(32, h // 4), q_lora_rank=max(48, 3 * h // 8), qk_nope_head_dim=hd,
        qk_rope_head_dim=max(8, hd // 2), v_head_dim=hd, n_shared_experts=1,
        n_group=4 if experts % 4 == 0 and experts >= 8 else 1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, intermediate_size=4 * kw["moe_intermediate_size"])
    defaults["topk_group"] = max(1, defaults["n_group"] // 2)
    out = {**defaults, **kw}
    out["num_key_value_heads"] = heads         # MLA: one latent, every head reads it
    out.pop("head_dim", None)                  # the config derives it (= qk_rope_head_dim)
    return {**out, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"]}


INIT = InitRecipe(
    config_class="DeepseekV3Config", model_class="DeepseekV3ForCausalLM", chat_style="chatml",
    names={**{k: v for k, v in INIT_NAMES.items() if k != "head_dim"},
           "num_experts": "n_routed_experts", "moe_intermediate_size": "moe_intermediate_size",
           "dense_intermediate_size": "intermediate_size", "norm_topk_prob": "norm_topk_prob",
           "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
           "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
           "v_head_dim": "v_head_dim", "n_group": "n_group", "topk_group": "topk_group",
           "n_shared_experts": "n_shared_experts", "first_k_dense_replace": "first_k_dense_replace",
           "routed_scaling_factor": "routed_scaling_factor", "rope_interleave": "rope_interleave",
           "rope_scaling": "rope_scaling"},
    config_kwargs=_config_kwargs,
    eos_ids=lambda ids: [ids["<|im_end|>"], ids["<|endoftext|>"]])

register(Arch("deepseek_v3", spec_fields, WEIGHTS, build_layer, kv_layout, INIT, layer_shapes,
              skip_layers_past_end=True))
