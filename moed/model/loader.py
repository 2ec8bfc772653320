"""Load a HF checkpoint's safetensors into moed's canonical weight names.

The generic machinery: single-file and sharded (`model.safetensors.index.json`) checkpoints,
each tensor cast and placed into its slice of a preallocated canonical tensor, and checks that
nothing is missing, partial, unexpected or mis-shaped. Which checkpoint name is which canonical
tensor is the architecture's (`Arch.weight_names` in moed/model/archs/): (regex, kind) pairs,
per-layer regexes matched after `[model.]layers.{i}.`, where kind is one of

  embed, norm, lm_head                      whole tensors (no layer prefix)
  input_norm, post_norm, q_norm, k_norm,    whole per-layer tensors
  router
  qkv        groups (q|k|v, weight|bias)    one third of the fused q/k/v projection
  o_proj     group (weight|bias)
  expert.gate, expert.up, expert.down       group (expert index): one expert's matrix
  fused.gate_up, fused.down                 all experts at once ([E, 2I, H] gate half first,
                                            [E, H, I]: transformers 5.x in-memory layout)
  dense.gate, dense.up, dense.down          the MLP of a dense (non-MoE) layer
  whole.<name>                              an architecture's own per-layer tensor, kept as is
                                            under `layers.{i}.<name>` (shape: Arch.layer_shapes)

Experts always end up fused and contiguous ([E, 2I, H] and [E, H, I]): one slice per expert
in the MoE hot path. Attention q/k/v are fused into one [(Hq + 2 Hkv) * D, H] matrix.

Reading (moed/model/safetensors_file.py): each tensor is copied (cast) from the file's mapping
into its slice of the canonical tensor, then its pages are dropped, so loading holds about one
copy of the weights, not two (safetensors' own reader kept the whole file resident until close).

Canonical names: embed, norm, lm_head, and per layer `layers.{i}.` + input_norm, post_norm,
qkv[.bias], o_proj[.bias], q_norm, k_norm, router, experts.gate_up, experts.down,
mlp.gate_up, mlp.down (dense layers).

DeepSeek-V3's MTP layer (layer num_layers of the checkpoint) is read only with mtp=True: its
decoder layer under the same names as any layer, its own tensors as `layers.{N}.mtp.*`
(moed/model/mtp.py builds it). Without mtp, layers past the model's end are skipped unread.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

import structlog
import torch

from moed.model import archs
from moed.model.quant import bytes_by_format, is_head, quantizable
from moed.model.quant.checkpoint import Grouper, QuantSource
from moed.model.quant.formats import Plan
from moed.model.quant.quantize import quantize
from moed.model.quant.weight import QuantWeight, empty
from moed.model.safetensors_file import Mapped, Stored, WeightError, read_index
from moed.model.spec import ModelSpec, parse_dtype

log = structlog.get_logger(__name__)

Weights = dict[str, torch.Tensor | QuantWeight]


_L = r"^(?:model\.)?layers\.(\d+)\."
_GLOBAL = frozenset({"embed", "norm", "lm_head"})
_WHOLE = frozenset({"input_norm", "post_norm", "q_norm", "k_norm", "router"})
_ROLE = {"gate": 0, "up": 1, "down": 2}
_KINDS = _GLOBAL | _WHOLE | {"qkv", "o_proj"} | {f"{a}.{r}" for a in ("expert", "dense") for r in _ROLE} \
    | {"fused.gate_up", "fused.down"}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_LAYER = re.compile(_L)


@functools.cache
def compile_rules(names: tuple[tuple[str, str], ...]) -> tuple[tuple[re.Pattern[str], str], ...]:
    """An architecture's (regex, kind) pairs, anchored (per-layer ones after the layer prefix)."""
    bad = [k for _, k in names if k not in _KINDS and not k.startswith("whole.")]
    if bad:
        raise ValueError(f"unknown weight kinds {bad}; expected {sorted(_KINDS)}")
    return tuple((re.compile(("^" if k in _GLOBAL else _L) + p + "$"), k) for p, k in names)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise WeightError(f"{model_dir}: shards listed in the index are missing: {missing}")
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{model_dir}: no *.safetensors files")
    return files


def mtp_layers(spec: ModelSpec, mtp: bool) -> int:
    """MTP layers served when asked for (mtp): the checkpoint's first (DeepSeek-V3 stores one;
    chained drafts from more are not built); ValueError naming the config key when it has none."""
    if not mtp:
        return 0
    if spec.num_mtp_layers < 1:
        raise ValueError(f"MTP asked for, but this {spec.arch} checkpoint has no MTP layer "
                         f"(config.json num_nextn_predict_layers is {spec.num_mtp_layers} or absent)")
    return 1


def expected_shapes(spec: ModelSpec, num_slots: int | None = None, mtp: int = 0) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape; num_slots: expert slots held (expert parallelism), default all;
    mtp: MTP layers after the model's (layers num_layers ..)."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.moe_intermediate_size
    e = spec.num_experts if num_slots is None else num_slots
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * d
    shapes: dict[str, tuple[int, ...]] = {"embed": (spec.vocab_size, h), "norm": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head"] = (spec.vocab_size, h)
    own = archs.get(spec.arch).layer_shapes
    for n in range(spec.num_layers + mtp):
        p = f"layers.{n}."
        shapes.update({p + "input_norm": (h,), p + "post_norm": (h,)})
        if own is not None:
            shapes.update({p + k: v for k, v in own(spec, n).items()})
        if spec.attention_kind == "gqa":
            shapes.update({p + "qkv": (qkv, h), p + "o_proj": (h, spec.num_heads * d)})
        if spec.attention_bias and spec.attention_kind == "gqa":
            shapes.update({p + "qkv.bias": (qkv,), p + "o_proj.bias": (h,)})
        if spec.qk_norm:
            shapes.update({p + "q_norm": (d,), p + "k_norm": (d,)})
        if n in spec.dense_layers:
            di = spec.dense_intermediate_size
            shapes.update({p + "mlp.gate_up": (2 * di, h), p + "mlp.down": (h, di)})
        else:
            shapes.update({p + "router": (spec.num_experts, h), p + "experts.gate_up": (e, 2 * i, h),
                           p + "experts.down": (e, h, i)})
    return shapes


def is_expert(name: str) -> bool:
    return ".experts." in name


# what _Assembler places: a tensor, one still on disk, or a quantized matrix's parts
Source = torch.Tensor | Stored | QuantSource


class _Assembler:
    """Places each checkpoint tensor into its slice of a preallocated canonical tensor."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 slots: tuple[int, ...] | None = None, plan: Plan | None = None, mtp: int = 0) -> None:
        """slots: the logical expert of each expert slot to fill (expert parallelism: this
        rank's, replicas included); None: every expert, slot e = expert e. plan: quantized
        weights (a quantized checkpoint's, or model.quantization of a plain one). mtp: MTP
        layers to read (mtp_layers())."""
        self.spec, self.dtype, self.device = spec, dtype, device
        self.plan = plan or Plan(None)
        self.rules = compile_rules(archs.get(spec.arch).weight_names)
        # DeepSeek-V3's MTP head: layers past num_hidden_layers in real checkpoints, read only
        # when served (mtp)
        self.skip_past_end = archs.get(spec.arch).skip_layers_past_end
        self.end = spec.num_layers + mtp
        self.past_end: dict[int, int] = {}     # layer -> tensors skipped (logged once, at the end)
        self.slots = tuple(range(spec.num_experts)) if slots is None else tuple(slots)
        self.slots_of: dict[int, list[int]] = {}
        for j, x in enumerate(self.slots):
            self.slots_of.setdefault(x, []).append(j)
        self.shapes = expected_shapes(spec, len(self.slots), mtp)
        self.out: Weights = {}
        self.filled: dict[str, set] = {}       # canonical name -> parts written
        self.parts: dict[str, int] = {}        # canonical name -> parts needed

    def _dst(self, name: str, nparts: int, first: Source) -> torch.Tensor | QuantWeight:
        """The canonical tensor, allocated on its first part: quantized where the name takes a
        format and the part is quantized (its format) or a plain one is to be (model.quantization)."""
        if name not in self.shapes:
            raise WeightError(f"unexpected tensor for {name} (not in this config)")
        if name not in self.out:
            shape, online = self.shapes[name], self.plan.online
            head, head_group = self.plan.head_format(shape[-1]) if is_head(name) else ("", 0)
            if isinstance(first, QuantSource) and head:      # a quantized head kept as stored
                if first.fmt != head:
                    raise WeightError(f"{name}: the checkpoint's is {first.fmt}; "
                                      f"model.quantization_lm_head {head} would requantize it "
                                      f"(use model, which keeps it as stored, or none)")
                self.out[name] = empty(first.fmt, shape, first.group, first.asymmetric, self.device)
            elif head:
                self.out[name] = empty(head, shape, head_group, False, self.device)
            elif isinstance(first, QuantSource) and quantizable(name):
                self.out[name] = empty(first.fmt, shape, first.group, first.asymmetric, self.device)
            elif online and quantizable(name):
                self.out[name] = empty(online, shape, 128 if online == "fp8" else
                                       shape[-1] if online == "int8" else self.plan.group_size,
                                       False, self.device)
            else:
                self.out[name] = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.filled[name], self.parts[name] = set(), nparts
        return self.out[name]

    def put(self, name: str, part: object, nparts: int, dst_slice: tuple, t: Source, src: str) -> None:
        dst = self._dst(name, nparts, t)[dst_slice]
        if tuple(dst.shape) != tuple(t.shape):
            raise WeightError(f"{src}: shape {tuple(t.shape)}, expected {tuple(dst.shape)} for config")
        if part in self.filled[name]:
            raise WeightError(f"{src}: duplicate tensor")
        if isinstance(dst, QuantWeight):
            if isinstance(t, QuantSource):
                q = t.read()
            elif self.plan.online or is_head(name):     # per checkpoint matrix, as a quantizer would
                q = quantize(t.read() if isinstance(t, Stored) else t, dst.fmt, dst.group)
            else:
                raise WeightError(f"{src}: a plain tensor where the other parts of {name} are quantized")
            try:
                dst.copy_(q, src)
            except ValueError as e:
                raise WeightError(str(e)) from None
        elif isinstance(t, QuantSource):    # a quantized matrix kept plain (a head, MLA's kv_b)
            dst.copy_(t.read().dequantize(torch.float32))
        elif isinstance(t, Stored):
            t.into(dst)
        else:
            dst.copy_(t)
        self.filled[name].add(part)

    def skip(self, key: str) -> bool:
        """A per-expert tensor of an expert this process does not hold, or a layer past the
        model's end of an architecture that says so (an MTP head): not even read."""
        if self.skip_past_end:
            m = _LAYER.match(key)
            if m is not None and int(m.group(1)) >= self.end:
                self.past_end[int(m.group(1))] = self.past_end.get(int(m.group(1)), 0) + 1
                return True
        for pat, kind in self.rules:
            m = pat.match(key)
            if m is not None:
                return kind.startswith("expert.") and 0 <= int(m.groups()[1]) < self.spec.num_experts \
                    and int(m.groups()[1]) not in self.slots_of
        return False

    def add(self, key: str, t: Source) -> bool:
        for pat, kind in self.rules:
            m = pat.match(key)
            if m is None:
                continue
            if kind in _GLOBAL:
                self.put(kind, 0, 1, (), t, key)
            else:
                self._place(f"layers.{m.group(1)}.", kind, m.groups()[1:], t, key)
            return True
        return False

    def _place(self, p: str, kind: str, g: tuple[str, ...], t: Source, key: str) -> None:
        s = self.spec
        if kind in _WHOLE:
            self.put(p + kind, 0, 1, (), t, key)
        elif kind.startswith("whole."):
            self.put(p + kind.removeprefix("whole."), 0, 1, (), t, key)
        elif kind == "qkv":
            which, bias = g[0], ".bias" if g[1] == "bias" else ""
            hq, hkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            lo = {"q": 0, "k": hq, "v": hq + hkv}[which]
            hi = lo + (hq if which == "q" else hkv)
            self.put(p + "qkv" + bias, which, 3, (slice(lo, hi),), t, key)
        elif kind == "o_proj":
            self.put(p + "o_proj" + (".bias" if g[0] == "bias" else ""), 0, 1, (), t, key)
        elif kind.startswith("expert."):
            e, role = int(g[0]), _ROLE[kind.split(".")[1]]
            if e >= s.num_experts:
                raise WeightError(f"{key}: expert {e} but config has {s.num_experts} experts")
            i = s.moe_intermediate_size
            for j in self.slots_of.get(e, ()):
                if role == 2:
                    self.put(p + "experts.down", j, len(self.slots), (j,), t, key)
                else:
                    self.put(p + "experts.gate_up", (j, role), 2 * len(self.slots),
                             (j, slice(role * i, (role + 1) * i)), t, key)
        elif kind.startswith("fused."):
            if t.shape[0] != s.num_experts:
                raise WeightError(f"{key}: shape {tuple(t.shape)}, expected {s.num_experts} experts")
            if isinstance(t, QuantSource):
                raise WeightError(f"{key}: quantized experts in the fused naming are not supported")
            if self.slots != tuple(range(s.num_experts)):     # expert parallelism: our slots
                whole = t.read() if isinstance(t, Stored) else t
                t = whole.index_select(0, torch.tensor(self.slots, dtype=torch.long))
            self.put(p + ("experts.gate_up" if kind == "fused.gate_up" else "experts.down"), "all", 1, (), t, key)
        else:   # dense.*
            role, di = _ROLE[kind.split(".")[1]], s.dense_intermediate_size
            if role == 2:
                self.put(p + "mlp.down", 0, 1, (), t, key)
            else:
                self.put(p + "mlp.gate_up", role, 2, (slice(role * di, (role + 1) * di),), t, key)

    def finish(self) -> Weights:
        missing = [n for n in self.shapes if n not in self.out]
        partial = [n for n in self.out if len(self.filled[n]) != self.parts[n] and "all" not in self.filled[n]]
        mixed = [n for n in self.out if "all" in self.filled[n] and len(self.filled[n]) > 1]
        mtp = [n for n in missing if n.startswith(f"layers.{self.spec.num_layers}.")]
        if mtp:     # transformers writes num_nextn_predict_layers 1 by default, layer or not
            raise WeightError(f"MTP asked for: config.json num_nextn_predict_layers is {self.spec.num_mtp_layers}, "
                              f"but the checkpoint lacks its layer's tensors: {mtp[:4]} ...")
        if missing or partial or mixed:
            raise WeightError(
                "checkpoint does not match its config: "
                + "; ".join(f"{what}: {names[:6]}{' ...' if len(names) > 6 else ''}"
                            for what, names in (("missing", missing), ("incomplete", partial),
                                                ("both fused and per-expert", mixed)) if names))
        if self.spec.tie_word_embeddings:   # the gather keeps reading the plain rows
            fmt, group = self.plan.head_format(self.spec.hidden_size)
            embed = self.out["embed"]
            self.out["lm_head"] = quantize(embed, fmt, group) if fmt else embed
        return self.out


def load_weights(model_dir: str | Path, spec: ModelSpec, dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "cpu", slots: tuple[int, ...] | None = None,
                 plan: Plan | None = None, mtp: bool = False) -> Weights:
    """All tensors of the checkpoint in canonical names, cast to dtype ("auto" = config's).
    slots: expert parallelism: fill only these experts' slots (logical expert per slot, this
    rank's share); the other experts' tensors are skipped unread (and their scales).
    plan (moed/model/quant/formats.py): a quantized checkpoint's tensors become QuantWeights
    (the projections; anything else dequantized into its plain tensor), or the projections of
    a plain one are quantized as they are placed (model.quantization).
    mtp: DeepSeek-V3's MTP layer too (mtp_layers(): ValueError for a checkpoint without one).
    Logs a `shard_loaded` line per file (a big checkpoint loads for minutes); a progress bar
    too when the logs are console lines on a terminal."""
    d = Path(model_dir)
    tdtype = spec.dtype if dtype == "auto" else parse_dtype(dtype)
    plan = plan or Plan(None)
    asm = _Assembler(spec, tdtype, torch.device(device), slots, plan, mtp_layers(spec, mtp))
    grouper = None if plan.checkpoint is None else Grouper(plan.checkpoint)
    files = checkpoint_files(d)
    sizes = [p.stat().st_size for p in files]
    t0, nbytes, ntensors, unexpected = time.monotonic(), 0, 0, []
    with _progress(sum(sizes)) as bar:
        for n, (path, size) in enumerate(zip(files, sizes)):
            t_shard, read = time.monotonic(), 0
            with Mapped(path) as f:
                items: Any = read_index(f).items()
                if grouper is not None:     # a quantized matrix's tensors become one source
                    items = grouper.feed(items)
                for key, t in items:
                    if _IGNORED.search(key) or asm.skip(key):
                        continue
                    size_t = t.nbytes
                    read += size_t
                    bar.update(size_t)
                    if not asm.add(key, t):
                        unexpected.append(key)
                        continue
                    ntensors += 1
                    nbytes += size_t
                if grouper is not None:
                    grouper.end_of_file()
            bar.update(size - read)          # the file's header and skipped tensors
            _log_shard(path.name, n + 1, len(files), size, time.monotonic() - t_shard)
    if grouper is not None:
        grouper.finish()
    if unexpected:
        raise WeightError(f"{d}: unexpected tensors: {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
    weights = asm.finish()
    if asm.past_end:
        log.info("mtp_layers_skipped", layers=sorted(asm.past_end), tensors=sum(asm.past_end.values()),
                 reason="layers past num_hidden_layers are the multi-token-prediction module; "
                        "read only when the runner serves it (mtp), and then only the first")
    held = bytes_by_format(weights)
    # before/after: what these weights hold plain in the compute dtype, and what they hold
    plain = sum(math.prod(shape) for shape in asm.shapes.values()) * tdtype.itemsize
    log.info("weights_loaded", model_dir=str(d), shards=len(files), tensors=ntensors, bytes=nbytes,
             dtype=str(tdtype).removeprefix("torch."), quantization=plan.describe(),
             unquantized_bytes=plain, resident_bytes=sum(held.values()), bytes_by_format=held,
             seconds=round(time.monotonic() - t0, 3))
    return weights


def _log_shard(name: str, index: int, of: int, size: int, seconds: float) -> None:
    log.info("shard_loaded", shard=name, index=index, of=of, bytes=size,
             seconds=round(seconds, 3), mb_per_s=round(size / 1e6 / max(seconds, 1e-6), 1))


class _NoBar:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def _progress(total: int) -> Iterator[Any]:
    """A tqdm bar of `total` bytes on the terminal the console logs go to, log lines printed
    above it; a no-op bar for JSON logs or when that stream is no terminal."""
    stream = _console_terminal()
    if stream is None:
        yield _NoBar()
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(total=total, desc="loading weights", unit="B",
                                       unit_scale=True, file=stream, leave=False) as bar:
        yield bar


def _console_terminal() -> TextIO | None:
    """The stream of the root logger's console renderer (moed.obs.log) if it is a terminal."""
    for h in logging.getLogger().handlers:
        processors = getattr(h.formatter, "processors", ())
        stream = getattr(h, "stream", None)
        if any(isinstance(p, structlog.dev.ConsoleRenderer) for p in processors) and \
                _isatty(stream):
            return stream
    return None


def _isatty(stream: Any) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (ValueError, OSError):       # closed (a finished test's capture), or no fd
        return False
