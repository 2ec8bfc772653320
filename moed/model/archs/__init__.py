"""Architectures, registered by config.json's `model_type`.

Each module in this package (names starting with "_" are shared helpers, not architectures)
owns what is particular to one architecture and, when imported, calls `register(Arch(...))`
once. The registry imports every module here the first time it is asked, so adding an
architecture is one new file here plus its test; nothing else is edited. A new module must give:

  model_type    config.json's "model_type" it serves, e.g. "deepseek_v3"
  spec_fields   (config: dict, num_layers: int) -> dict: the ModelSpec fields that differ per
                architecture (num_experts, moe_intermediate_size, dense_intermediate_size,
                norm_topk_prob, dense_layers, qk_norm; later shared experts, MLA dims), raising
                SpecError for what it does not serve (spec.py parses the common fields)
  weight_names  ((regex, kind), ...): checkpoint tensor names -> canonical names; the kinds and
                the common Hugging Face names (embed, norms, q/k/v/o) are in loader.py
  build_layer   (spec, i, weights, expert_load_row, ctx) -> decoder.DecoderLayer: which blocks
                layer i is made of (helpers: decoder.decoder_layer, moe_block, dense_block)
  kv_layout     (spec, block_size, dtype) -> KVLayout: its paged KV cache entry (gqa; MLA later)
  init          optional InitRecipe: how `moed model init` writes a random checkpoint of it
  layer_shapes  optional (spec, i) -> {name: shape}: layer i's tensors that only this
                architecture has (loader kind "whole.<name>", canonical `layers.{i}.<name>`);
                with spec.attention_kind != "gqa" they replace the q/k/v ones
  skip_layers_past_end  optional: checkpoint layers past num_hidden_layers are not read (an
                MTP head a real checkpoint carries; the first is when a runner serves MTP,
                moed/model/mtp.py), instead of refused as unexpected

Lookups: get(model_type) (SpecError listing the supported types when unknown), supported(),
kv_layout(spec, block_size, dtype, mtp_layers=0).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from moed.model.kv_layout import KVLayout
from moed.model.spec import ModelSpec, SpecError

if TYPE_CHECKING:
    from moed.model.decoder import BuildLayer


@dataclass(frozen=True)
class InitRecipe:
    """How `moed model init` builds a random checkpoint with transformers' own classes."""
    config_class: str                      # transformers class names, e.g. "MixtralConfig"
    model_class: str                       # e.g. "MixtralForCausalLM"
    chat_style: str                        # tokenizer + chat template style (bpe_train)
    names: Mapping[str, str]               # moed override name -> this arch's config.json key
    # special token ids -> extra config kwargs (bos/eos/pad and arch defaults), given the kwargs so far
    config_kwargs: Callable[[dict[str, int], dict[str, Any]], dict[str, Any]]
    eos_ids: Callable[[dict[str, int]], int | list[int]]   # generation_config.json's eos_token_id


@dataclass(frozen=True)
class Arch:
    model_type: str
    spec_fields: Callable[[dict[str, Any], int], dict[str, Any]]
    weight_names: tuple[tuple[str, str], ...]
    build_layer: BuildLayer
    kv_layout: Callable[[ModelSpec, int, torch.dtype], KVLayout]
    init: InitRecipe | None = None
    layer_shapes: Callable[[ModelSpec, int], dict[str, tuple[int, ...]]] | None = None
    skip_layers_past_end: bool = False     # checkpoint layers >= num_layers are not read (MTP heads)


_REGISTRY: dict[str, Arch] = {}
_discovered = False


def register(arch: Arch) -> Arch:
    if arch.model_type in _REGISTRY and _REGISTRY[arch.model_type] is not arch:
        raise ValueError(f"architecture {arch.model_type!r} is registered twice")
    _REGISTRY[arch.model_type] = arch
    return arch


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")
    _discovered = True


def supported() -> tuple[str, ...]:
    _discover()
    return tuple(sorted(_REGISTRY))


def get(model_type: Any) -> Arch:
    _discover()
    arch = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise SpecError(f"model_type {model_type!r} is not supported; supported: {', '.join(supported())}")
    return arch


def kv_layout(spec: ModelSpec, block_size: int, dtype: torch.dtype, mtp_layers: int = 0) -> KVLayout:
    """The paged KV layout of spec's architecture for this block size and cache dtype; mtp_layers:
    plus that many MTP layers (a runner built with mtp=True)."""
    return get(spec.arch).kv_layout(spec, block_size, dtype).with_mtp(mtp_layers)
