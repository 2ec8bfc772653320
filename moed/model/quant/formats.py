"""A checkpoint's `quantization_config` (config.json) and `model.quantization`, as one Plan.

Served on load (moed/model/quant/checkpoint.py reads the tensors):
  fp8                 quant_method "fp8" (DeepSeek-V3/R1, Kimi-K2, Qwen3 -FP8): float8_e4m3fn
                      weights, `weight_scale_inv` per weight_block_size block; activation_scheme
                      dynamic (activations stay in the compute dtype: W8A16 numerics)
  compressed-tensors  one config group of int weights, input_activations null: num_bits 8
                      (int-quantized / naive-quantized, or pack-quantized) or 4
                      (pack-quantized), strategy channel or group, symmetric or not
  gptq                bits 4, desc_act false, checkpoint_format gptq (v1: zeros stored minus
                      one) or gptq_v2
  awq                 bits 4, version gemm, zero_point true (AutoAWQ's GEMM packing)
Everything else is refused by name (ConfigError-ready ValueError naming the key): bitsandbytes,
GPTQ with desc_act (its g_idx permutes the groups), activation quantization, other bit widths.

The heads (`lm_head`, DeepSeek-V3's MTP `shared_head.head`) stay plain unless
model.quantization_lm_head asks (Plan.head): int8 per output channel, or the model's own format.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ONLINE = ("fp8", "int8", "int4")
LM_HEAD = ("none", "int8", "model")     # model.quantization_lm_head
_CT_FORMATS = {"pack-quantized": (4, 8), "int-quantized": (8,), "naive-quantized": (8,)}


class QuantConfigError(ValueError):
    """quantization_config (or model.quantization against it) that moed does not serve."""


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint stores its quantized weights."""
    method: str                         # "fp8" | "compressed-tensors" | "gptq"
    fmt: str                            # in-memory format: "fp8" | "int8" | "int4"
    block: tuple[int, int] = (0, 0)     # fp8: weight_block_size (rows, columns)
    group: int = 0                      # int: input columns per scale; 0 = per channel
    symmetric: bool = True
    packed: bool = False                # compressed-tensors pack-quantized (int32 words)
    zeros_minus_one: bool = False       # GPTQ v1


@dataclass(frozen=True)
class Plan:
    """What the loader does: decode a quantized checkpoint, quantize a plain one, or neither."""
    checkpoint: CheckpointQuant | None
    online: str = ""                    # "" | fp8 | int8 | int4
    group_size: int = 128               # online int4
    head: str = ""                      # the heads' format ("" = plain); model.quantization_lm_head
    head_group: int = 0                 # their input columns per scale; 0 = one group per row

    @property
    def fmt(self) -> str:
        return self.checkpoint.fmt if self.checkpoint is not None else self.online

    def head_format(self, in_features: int) -> tuple[str, int]:
        """(format, group) a plain head is quantized to at load; ("", 0) when it stays plain."""
        if not self.head:
            return "", 0
        return self.head, 128 if self.head == "fp8" else self.head_group or in_features

    def describe(self) -> str:
        if self.checkpoint is not None:
            return f"{self.checkpoint.method} ({self.checkpoint.fmt}, from the checkpoint)" \
                + (f", lm_head {self.head}" if self.head else "")
        own = f"{self.online} (online)" if self.online else "none"
        return own + (f", lm_head {self.head}" if self.head else "")


def _err(key: str, msg: str) -> QuantConfigError:
    return QuantConfigError(f"quantization_config.{key}: {msg}")


def parse(qc: Any) -> CheckpointQuant | None:
    """config.json's quantization_config -> CheckpointQuant (None when absent)."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantConfigError(f"quantization_config: expected a table, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    raise _err("quant_method", f"{method!r} is not supported (fp8, compressed-tensors, gptq, awq)")


def _fp8(qc: dict[str, Any]) -> CheckpointQuant:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _err("activation_scheme", f"{qc['activation_scheme']!r} is not supported (dynamic: "
                                         f"activations stay in the compute dtype)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _err("fmt", f"{qc['fmt']!r} is not supported (e4m3)")
    b = qc.get("weight_block_size")
    if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                          and x > 0 for x in b)):
        raise _err("weight_block_size", f"{b!r}: expected two positive integers (per-tensor fp8 "
                                        f"is not supported)")
    return CheckpointQuant("fp8", "fp8", block=(b[0], b[1]))


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    fmt = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _err("config_groups", "expected exactly one config group")
    (name, g), = groups.items()
    if not isinstance(g, dict):
        raise _err(f"config_groups.{name}", "expected a table")
    fmt = g.get("format") or fmt
    if fmt not in _CT_FORMATS:
        raise _err("format", f"{fmt!r} is not supported ({', '.join(_CT_FORMATS)})")
    for k in ("input_activations", "output_activations"):
        if g.get(k) is not None:
            raise _err(f"config_groups.{name}.{k}", "activation quantization is not supported")
    if qc.get("kv_cache_scheme") is not None:
        raise _err("kv_cache_scheme", "a quantized KV cache is not supported")
    if qc.get("sparsity_config"):
        raise _err("sparsity_config", "sparse checkpoints are not supported")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _err("quantization_status", f"{qc['quantization_status']!r}: expected compressed")
    w = g.get("weights")
    k = f"config_groups.{name}.weights"
    if not isinstance(w, dict):
        raise _err(k, "missing")
    if w.get("type", "int") != "int":
        raise _err(k + ".type", f"{w['type']!r} is not supported (int)")
    bits = w.get("num_bits")
    if bits not in _CT_FORMATS[fmt]:
        raise _err(k + ".num_bits", f"{bits!r} is not supported with format {fmt}")
    if w.get("dynamic"):
        raise _err(k + ".dynamic", "dynamic weight quantization is not supported")
    if w.get("actorder") not in (None, False, "weight", "static"):
        raise _err(k + ".actorder", f"{w['actorder']!r} is not supported (its g_idx permutes the groups)")
    strategy = w.get("strategy")
    if strategy == "channel":
        group = 0
    elif strategy == "group":
        group = w.get("group_size")
        if not isinstance(group, int) or group <= 0:
            raise _err(k + ".group_size", f"{group!r}: expected a positive integer")
    else:
        raise _err(k + ".strategy", f"{strategy!r} is not supported (channel, group)")
    return CheckpointQuant("compressed-tensors", "int4" if bits == 4 else "int8", group=group,
                           symmetric=bool(w.get("symmetric", True)), packed=fmt == "pack-quantized")


def _gptq(qc: dict[str, Any]) -> CheckpointQuant:
    if qc.get("bits") != 4:
        raise _err("bits", f"{qc.get('bits')!r} is not supported (4)")
    if qc.get("desc_act"):
        raise _err("desc_act", "true is not supported (act-order: g_idx permutes the groups); "
                               "use a checkpoint quantized with desc_act false")
    dynamic = qc.get("dynamic") or {}
    overrides = [k for k, v in dynamic.items() if not str(k).startswith("-:") and v] \
        if isinstance(dynamic, dict) else ["?"]
    if overrides:       # gptqmodel's per-module bits/group: moed reads one layout for all
        raise _err("dynamic", f"per-module overrides {overrides[:3]} are not supported "
                              f"(only '-:' exclusions, whose modules stay plain on disk)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _err("checkpoint_format", f"{fmt!r} is not supported (gptq, gptq_v2)")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or not (group > 0 or group == -1):
        raise _err("group_size", f"{group!r}: expected a positive integer or -1")
    return CheckpointQuant("gptq", "int4", group=max(group, 0), symmetric=bool(qc.get("sym", True)),
                           zeros_minus_one=fmt == "gptq")


def _awq(qc: dict[str, Any]) -> CheckpointQuant:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _err("bits", f"{bits!r} is not supported (4)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _err("version", f"{qc['version']!r} is not supported (gemm: the packing AutoAWQ "
                              f"writes for GEMM kernels)")
    if not qc.get("zero_point", True):
        raise _err("zero_point", "false is not supported (AWQ checkpoints carry zero points)")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or not (group > 0 or group == -1):
        raise _err("group_size", f"{group!r}: expected a positive integer or -1")
    return CheckpointQuant("awq", "int4", group=max(group, 0), symmetric=False)


def read_config(model_dir: str | Path) -> CheckpointQuant | None:
    path = Path(model_dir) / "config.json"
    return parse(json.loads(path.read_text()).get("quantization_config"))


def plan(model_dir: str | Path, quantization: str = "", group_size: int = 128,
         lm_head: str = "none") -> Plan:
    """The checkpoint's format, model.quantization and model.quantization_lm_head, reconciled
    (QuantConfigError if not)."""
    if quantization not in ("",) + ONLINE:
        raise QuantConfigError(f"model.quantization: {quantization!r}; expected one of "
                               f"{', '.join(ONLINE)} or empty")
    ck = read_config(model_dir)
    if ck is not None and quantization and quantization != ck.fmt:
        raise QuantConfigError(
            f"model.quantization: {quantization} asked, but the checkpoint is already quantized "
            f"(quantization_config.quant_method {ck.method}, {ck.fmt}); requantizing is not "
            f"supported: leave model.quantization empty")
    base = Plan(ck) if ck is not None else Plan(None, quantization, group_size)
    return with_head(base, lm_head)


def with_head(base: Plan, lm_head: str) -> Plan:
    """base with model.quantization_lm_head applied: none (plain heads), int8 (per output
    channel) or model (the model's format and group: int4's group size, a quantized
    checkpoint's own group). Refused on a model that quantizes nothing: a quantized head
    alone would take the bf16 model off its native decode step for a gain it does not need."""
    if lm_head not in LM_HEAD:
        raise QuantConfigError(f"model.quantization_lm_head: {lm_head!r}; expected one of "
                               f"{', '.join(LM_HEAD)}")
    if lm_head == "none":
        return base
    if not base.fmt:
        raise QuantConfigError(f"model.quantization_lm_head: {lm_head} asks for a quantized "
                               f"lm_head, but the model's weights are plain; set "
                               f"model.quantization (or serve a quantized checkpoint), or leave "
                               f"it none")
    if lm_head == "int8":
        return replace(base, head="int8", head_group=0)
    ck = base.checkpoint
    group = base.group_size if ck is None else (ck.group if ck.fmt != "fp8" else ck.block[1])
    return replace(base, head=base.fmt, head_group=group if base.fmt == "int4" else 0)


def check_activations(p: Plan, act: str) -> None:
    """model.quantization_activations against the plan: int8 needs every quantized matmul in
    int8 or int4 (the integer path, cpu_qdot.c); refused on plain weights and on fp8 (weights or
    head), where it would do nothing or only part of what it says."""
    if act not in ("none", "int8"):
        raise QuantConfigError(f"model.quantization_activations: {act!r}; expected none or int8")
    if act == "none":
        return
    if not p.fmt:
        raise QuantConfigError("model.quantization_activations: int8 quantizes the activations of "
                               "quantized matmuls, but the model's weights are plain; set "
                               "model.quantization int8 or int4 (or serve such a checkpoint)")
    if "fp8" in (p.fmt, p.head):
        raise QuantConfigError("model.quantization_activations: int8 serves int8 and int4 weights; "
                               "this model's are fp8 (no fp8 x int8 kernel): leave it none")
