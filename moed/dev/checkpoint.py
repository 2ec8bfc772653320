"""Random-weight checkpoints in exactly the Hugging Face format, built offline.

The model is built with transformers' own config/model classes and saved with
`save_pretrained` (safetensors, per-expert names on disk), plus generation_config.json and a
byte-level BPE tokenizer trained on local text (see bpe_train). Weights use a wider init std
than transformers' 0.02 so logits are not flat (greedy ties make parity tests flaky), and norm
weights are perturbed around 1 so a missing norm weight shows up in parity.

What differs per architecture (transformers classes, config keys, chat style, special tokens)
is the architecture module's InitRecipe (moed/model/archs/): any registered architecture with one
can be written. CLI: `moed model init --arch {qwen3_moe,mixtral,deepseek_v3} --out DIR [--preset tiny|bench]
[--seed N]` calls add_arguments()/main() below.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from moed.dev import bpe_train
from moed.model import archs

log = structlog.get_logger(__name__)

# Presets in moed's own names (mapped to each architecture's config.json keys by its InitRecipe).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, num_experts=8,
                 top_k=2, moe_intermediate_size=128, vocab_size=4096, max_position_embeddings=2048),
    "bench": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, num_experts=16,
                  top_k=2, moe_intermediate_size=512, vocab_size=32000, max_position_embeddings=4096),
}


class MissingInitExtra(RuntimeError):
    """transformers (the `init` extra) is not installed: serving never needs it, init does."""


def _transformers():
    try:
        import transformers
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "transformers":
            raise
        raise MissingInitExtra(
            "model init needs transformers (moed's init extra; serving does not): "
            "pip install '.[init]' in moed's checkout, or pip install 'transformers>=4.51'") from None
    return transformers


def init_archs() -> tuple[str, ...]:
    """The registered architectures that `moed model init` can write."""
    return tuple(a for a in archs.supported() if archs.get(a).init is not None)


def _recipe(arch: str) -> archs.InitRecipe:
    recipe = archs.get(arch).init if arch in archs.supported() else None
    if recipe is None:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(init_archs())}")
    return recipe


def _hf_kwargs(arch: str, params: dict[str, Any]) -> dict[str, Any]:
    names = _recipe(arch).names
    known = {n for a in init_archs() for n in _recipe(a).names}
    out: dict[str, Any] = {}
    for k, v in params.items():
        if k not in known:
            raise ValueError(f"unknown checkpoint override {k!r}; known: {', '.join(sorted(known))}")
        if k not in names:
            raise ValueError(f"override {k!r} does not apply to {arch}")
        out[names[k]] = v
    theta = out.pop("rope_theta", 1_000_000.0)
    scaling = out.pop("rope_scaling", None) or {}       # e.g. DeepSeek-V3's yarn parameters
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta), **scaling}
    return out


def _build_config(arch: str, params: dict[str, Any], tok_ids: dict[str, int]):
    transformers = _transformers()
    recipe = _recipe(arch)
    kw = recipe.config_kwargs(tok_ids, _hf_kwargs(arch, params))
    return getattr(transformers, recipe.config_class)(**kw)


# The templates speak each family's published tool-calling format, so tool calling is tested on
# the real path: Qwen3's (<tools> in the system turn, <tool_call> JSON blocks, <tool_response>
# in a user turn, enable_thinking) and Mistral's v3 markers ([AVAILABLE_TOOLS] before the last
# user turn, [TOOL_CALLS] JSON array, [TOOL_RESULTS]). Without tools they render as before.
_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
_MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(system='', last_user=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] + '\\n\\n' %}"
    "{%- elif message['role'] == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}"
    "{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{%- set ns.system = '' %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- message['content'] + '[TOOL_CALLS] [' }}"
    "{%- for call in message.tool_calls %}{%- if not loop.first %}{{- ', ' }}{%- endif %}"
    "{{- '{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": ' + "
    "(call.function.arguments | tojson) + ', \"id\": ' + (call.id | tojson) + '}' }}"
    "{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + (message['content'] | tojson) + ', \"call_id\": ' + "
    "(message.tool_call_id | tojson) + '}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('unknown role: ' + message['role']) }}{%- endif %}"
    "{%- endfor %}")


def _write_tokenizer(arch: str, out: Path, vocab_size: int, max_len: int,
                     tok: Any = None) -> dict[str, int]:
    """tok: a tokenizers.Tokenizer of the arch's chat style (default: the cached stdlib one)."""
    style = _recipe(arch).chat_style
    tok = tok or bpe_train.trained_tokenizer(style, vocab_size)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in bpe_train.SPECIAL_TOKENS[style]}
    if style == "chatml":
        cfg = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
                   chat_template=_CHATML_TEMPLATE)
    else:
        cfg = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token=None,
                   chat_template=_MISTRAL_TEMPLATE)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=max_len,
               clean_up_tokenization_spaces=False,
               added_tokens_decoder={str(i): {"content": t, "special": True} for t, i in ids.items()})
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return ids


def _perturb_norms(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        # DeepSeek-V3's routing bias starts at 0: make it matter, so parity covers "add it
        # for choosing, not for the weights"
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def init_checkpoint(arch: str, out: str | Path, preset: str = "tiny", seed: int = 0, *,
                    write_fused: bool = False, max_shard_size: str | None = None,
                    **overrides: Any) -> Path:
    """Write a random-weight HF checkpoint (config, safetensors, generation config, tokenizer).

    overrides use moed's names (num_experts=7, num_kv_heads=4, hidden_size=128, num_layers=2,
    init_std=0.02, ...). write_fused rewrites experts in the fused in-memory naming
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]);
    max_shard_size (e.g. "2MB") writes a sharded checkpoint with an index.
    """
    transformers = _transformers()
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # save_pretrained's shard bar would clutter logs

    recipe = _recipe(arch)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    t0 = time.monotonic()
    params = {**PRESETS[preset], "init_std": 0.08, "dtype": "bfloat16", **overrides}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(arch, out, int(params["vocab_size"]), int(params["max_position_embeddings"]))
    config = _build_config(arch, params, ids)
    torch.manual_seed(seed)
    model = getattr(transformers, recipe.model_class)(config)
    _perturb_norms(model, torch.Generator().manual_seed(seed + 1))
    model = model.to(getattr(torch, params["dtype"]))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=recipe.eos_ids(ids),
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    if write_fused:
        fuse_experts_on_disk(out)
    log.info("checkpoint_written", arch=arch, preset=preset, seed=seed, out=str(out),
             params=sum(p.numel() for p in model.parameters()),
             seconds=round(time.monotonic() - t0, 2))
    return out


def fuse_experts_on_disk(model_dir: str | Path) -> None:
    """Rewrite per-expert tensors of every shard into the fused naming (in place)."""
    import re

    from safetensors.torch import load_file, save_file

    d = Path(model_dir)
    pat = re.compile(r"^(.*\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
    role = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
    index_path = d / "model.safetensors.index.json"
    shards = sorted(d.glob("*.safetensors"))
    # Experts of one layer may straddle shards: collect all, then write each fused tensor
    # into the shard that held that layer's expert 0.
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    home: dict[str, Path] = {}
    tensors: dict[Path, dict[str, torch.Tensor]] = {}
    for shard in shards:
        kept = {}
        for name, t in load_file(str(shard)).items():
            m = pat.match(name)
            if m is None:
                kept[name] = t
                continue
            prefix = m.group(1) + "mlp.experts."
            parts.setdefault(prefix, {}).setdefault(int(m.group(2)), {})[role[m.group(3)]] = t
            if int(m.group(2)) == 0:
                home[prefix] = shard
        tensors[shard] = kept
    for prefix, experts in parts.items():
        n = len(experts)
        gate_up = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in range(n)])
        down = torch.stack([experts[e]["down"] for e in range(n)])
        tensors[home[prefix]][prefix + "gate_up_proj"] = gate_up.contiguous()
        tensors[home[prefix]][prefix + "down_proj"] = down.contiguous()
    for shard, kept in tensors.items():
        save_file(kept, str(shard), metadata={"format": "pt"})
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {n: s.name for s, kept in tensors.items() for n in kept}
        index_path.write_text(json.dumps(index, indent=2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", required=True, choices=init_archs())
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")


def main(args: argparse.Namespace) -> int:
    try:
        _transformers()     # before touching --out: a missing extra leaves nothing behind
    except MissingInitExtra as e:
        print(f"moed: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        if not getattr(args, "force", False):
            print(f"error: {out} is not empty (use --force to overwrite)", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    path = init_checkpoint(args.arch, out, preset=args.preset, seed=args.seed)
    print(path)
    return 0
