"""config.json -> ModelSpec: the common fields here, the architecture's own through archs.

This file parses what every architecture spells alike (sizes, heads, rope, norms, token ids,
dtype); config.json's `model_type` picks the architecture module (moed/model/archs/), which
maps the rest (experts, dense layers, q/k norm) and refuses what it does not serve. Both config
dialects are read: transformers 5.x writes `rope_parameters: {rope_theta, ...}` where
older/real checkpoints have a top-level `rope_theta`; `num_local_experts` and `num_experts`
are both accepted. It sits above archs/ (which import spec.py, never this module).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moed.model import archs
from moed.model.spec import ModelSpec, SpecError, parse_dtype, required


def _ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in v) if isinstance(v, (list, tuple)) else (int(v),)


def _rope_theta(cfg: dict[str, Any], yarn: bool = False) -> float:
    """yarn: the architecture parsed YaRN scaling itself (spec field rope_yarn)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default" and not (yarn and kind == "yarn"):
        raise SpecError(f"rope type {kind!r} is not supported for {cfg.get('model_type')} "
                        f"(only default RoPE{', yarn' if yarn else ''})")
    theta = cfg["rope_theta"] if cfg.get("rope_theta") is not None else params.get("rope_theta")
    if theta is None:
        raise SpecError("config.json lacks rope_theta (top level or in rope_parameters)")
    return float(theta)


def spec_from_config(cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelSpec:
    arch = archs.get(cfg.get("model_type"))
    if cfg.get("hidden_act", "silu") != "silu":
        raise SpecError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    hidden = int(required(cfg, "hidden_size"))
    heads = int(required(cfg, "num_attention_heads"))
    layers = int(required(cfg, "num_hidden_layers"))
    own = arch.spec_fields(cfg, layers)
    experts, dense = own["num_experts"], own["dense_layers"]
    if dense and own["dense_intermediate_size"] <= 0:
        raise SpecError("config has dense layers but no intermediate_size")
    top_k = int(required(cfg, "num_experts_per_tok"))
    if experts and not 1 <= top_k <= experts:
        raise SpecError(f"num_experts_per_tok {top_k} must be in 1..{experts}")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise SpecError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    gen = generation or {}
    eos = _ids(gen.get("eos_token_id")) or _ids(cfg.get("eos_token_id"))
    for extra in _ids(cfg.get("eos_token_id")):   # keep config's eos even if generation lists others
        if extra not in eos:
            eos = (*eos, extra)
    bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    parse_dtype(dtype)
    common = dict(
        arch=arch.model_type, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=int(required(cfg, "vocab_size")),
        top_k=top_k, rope_theta=_rope_theta(cfg, bool(own.get("rope_yarn"))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(required(cfg, "max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        eos_token_ids=eos, bos_token_id=None if bos is None else int(bos), torch_dtype=dtype)
    # The architecture's fields win (MLA: head_dim is the rotary width, kv heads = heads).
    return ModelSpec(**{**common, **own})


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Parse `model_dir/config.json` (plus generation_config.json for eos ids when present)."""
    d = Path(model_dir)
    path = d / "config.json"
    if not path.is_file():
        raise SpecError(f"{path} not found: not a Hugging Face checkpoint directory")
    try:
        cfg = json.loads(path.read_text())
        gpath = d / "generation_config.json"
        gen = json.loads(gpath.read_text()) if gpath.is_file() else None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path.parent}: malformed JSON: {e}") from None
    return spec_from_config(cfg, gen)
