"""The native decode step: a decode-only batch through the whole model in one kernel call.

A decode step is a few kernel calls per layer (norm, qkv, q/k norm + rotary, attention, o,
norm, MoE). Between them the layer-by-layer path (decoder.py, layers.py, the torch backend)
spends ~0.25 ms a layer on the 2-core bench in Python and small torch ops: views, output
allocations, the KV cache's index_copy_, the attention plan's index tensors, ctypes calls. At
batch 1 that is a quarter of the step (bench/decode_profile.py). `moed_decode_step`
(kernels/cpu_step.c) runs the same kernels in the same order on the same inputs in C, so the
logits, the K/V written and the expert-load counts are bitwise those of the layer-by-layer path
(tests/unit/model/test_decode_step.py, test_decode_step_quant.py), and the step crosses from
Python once.

Each projection (qkv, o, lm_head) is handed to C as a descriptor (_Proj: DecodeProj) naming the
kernel layers.Linear calls for its weight, with that call's arguments: bf16 weights
moed_linear_bf16 on the packed copy; quantized ones (int8, int4, fp8 as stored) moed_qlinear,
or moed_qdot_linear where model.quantization_activations = int8 takes the weight
(kernels/quant.py linear_act), bf16 in and out, the bias in fp32. Each MoE layer likewise
(_MoE: DecodeMoE): moed_moe_bf16, or moed_moe_q_routed in its few-row mode with int8
activations as kernels/quant.py experts_act says.

It serves a batch when the model is a GQA MoE decoder on the native kernels with all experts in
this process (no expert parallelism, no cold-expert store), every layer MoE, the torch attention
backend on the kernels, every projection's few-row calls a native kernel's (a quantized weight
the kernels cannot read is refused) and every MoE layer on its fused kernel (quantized experts
under batch invariance stay per-expert: refused); and, for the batch's row count, every
projection and MoE layer on that kernel: not a row class kernels/choice.py gave to oneDNN, not
past a quantized weight's qrows (64 rows: the blocked prefill kernels serve there). Otherwise
the runner takes the layer-by-layer path, which computes the same thing; `unsupported()` says
why (logged once in model_runner_ready). The lm_head is the exception: where its row class is
oneDNN's (or it is a quantized head off its few-row kernel), the step stops after the final norm
and lm_head runs on its own path, as the layered path does it (so still bitwise). The lm_head's
race is a near tie on a CPU with AMX (the bench preset's at one row: oneDNN 1.6-1.9 ms, native
2.0-2.2 ms on 2 threads), and losing the whole step to it cost ~10% of batch-1 decode.
"""
from __future__ import annotations

import ctypes
import weakref
from array import array

import torch

from moed.model.attention.torch_backend import TorchBackend
from moed.model.batch import ForwardBatch
from moed.model.decoder import MoEDecoder
from moed.model.kernels import quant as kq
from moed.model.layers import Linear
from moed.model.moe import MoELayer

_p, _l, _i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


class _Proj(ctypes.Structure):       # DecodeProj in cpu_step.c
    _fields_ = [("kind", _i), ("fmt", _i), ("w", _p), ("s", _p), ("z", _p),
                ("ldw", _l), ("lds", _l), ("ldz", _l), ("group", _l), ("bias", _p)]


class _MoE(ctypes.Structure):        # DecodeMoE in cpu_step.c
    _fields_ = [("kind", _i), ("fmt", _i), ("qact", _i), ("gptr", _p * 3), ("dptr", _p * 3),
                ("gdim", _l * 7), ("ddim", _l * 7)]


class _Layer(ctypes.Structure):      # DecodeLayer in cpu_step.c
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", _Proj), ("qk_norm", _p), ("o", _Proj),
                ("kv", _p), ("router", _p), ("l2p", _p), ("nrep", _p), ("max_rep", _l), ("load", _p),
                ("moe", _MoE), ("P", _l)]


class _Model(ctypes.Structure):      # DecodeModel in cpu_step.c
    _fields_ = [("L", _l), ("H", _l), ("Hq", _l), ("Hkv", _l), ("D", _l), ("E", _l), ("k", _l),
                ("I", _l), ("vocab", _l), ("num_blocks", _l), ("bs", _l), ("norm_topk", _i),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("embed", _p), ("norm", _p), ("lm_head", _Proj), ("layers", ctypes.POINTER(_Layer))]


PROJ_BF16, PROJ_QLINEAR, PROJ_QDOT = 0, 1, 2      # DecodeProj.kind: the kernel a projection takes
MOE_BF16, MOE_Q = 0, 1                            # DecodeMoE.kind


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _native(lin: Linear) -> bool:
    """Whether a Linear's few-row calls are a native kernel's (bf16 packed, or quantized)."""
    return lin.kpacked is not None or (lin.quant is not None and lin.kernels is not None)


def _proj(lin: Linear) -> _Proj:
    """The kernel and arguments Linear.__call__ gives a few-row bf16 call of `lin` (_native):
    moed_linear_bf16 on the packed copy, or kernels/quant.py qlinear's call (the kernel
    linear_act picks, the fp32 bias)."""
    w = lin.quant
    if w is None:
        return _Proj(kind=PROJ_BF16, w=_ptr(lin.kpacked), bias=_ptr(lin.bias))
    z = w.zero
    return _Proj(kind=PROJ_QDOT if kq.linear_act(lin.kernels, w) else PROJ_QLINEAR, fmt=kq.FORMAT_CODES[w.fmt],
                 w=w.data.data_ptr(), s=w.scale.data_ptr(), z=_ptr(z), ldw=w.data.stride(0),
                 lds=w.scale.stride(0), ldz=0 if z is None else z.stride(0), group=w.group, bias=_ptr(lin.qbias))


def _moe(mlp: MoELayer) -> _MoE:
    """The kernel MoELayer.__call__ gives a decode batch: moed_moe_bf16 (fused), or
    moed_moe_q_routed in few-row mode with kernels/quant.py moe_q_routed's arguments."""
    e = mlp.experts
    if mlp.kernels is not None:
        m = _MoE(kind=MOE_BF16)
        m.gptr[0], m.dptr[0] = e.gate_up_p.data_ptr(), e.down_p.data_ptr()
        return m
    gate_up, down = e.quant
    (gp, gd), (dp, dd) = kq.expert_mats(gate_up), kq.expert_mats(down)
    return _MoE(kind=MOE_Q, fmt=kq.FORMAT_CODES[gate_up.fmt], qact=kq.experts_act(e.qkernels, gate_up, down),
                gptr=gp, dptr=dp, gdim=gd, ddim=dd)


def _rows_native(lin: Linear, rows: int) -> bool:
    """Whether Linear.__call__ takes the kernel _proj describes for a bf16 call of `rows` rows
    (not oneDNN's row class, not the blocked quantized matmul past qrows)."""
    if lin.quant is not None:
        return rows <= lin.qrows
    return lin.choice is None or not lin.choice.use_onednn(rows)


def _moe_serves(mlp: MoELayer, rows: int) -> bool:
    """Whether MoELayer.__call__ takes the kernel _moe describes for a batch of `rows` tokens:
    the bf16 fused kernel's row classes, or moed_moe_q_routed's few-row mode (qfused_serves)."""
    return mlp.fused(rows) if mlp.kernels is not None else 0 < rows <= mlp.experts.qrows


def unsupported(model: MoEDecoder, backend: object, kv_cache: torch.Tensor) -> str | None:
    """Why the native step cannot serve this model (None: it can, row counts permitting)."""
    if model.kernels is None:
        return "cpu kernels off"
    if kv_cache.dtype == torch.float8_e4m3fn:
        return "fp8 KV cache (the native step reads bf16 blocks)"
    if model.spec.attention_kind != "gqa":
        return f"{model.spec.attention_kind} attention"
    if not isinstance(backend, TorchBackend) or backend.kernels is None:
        return f"attention backend {getattr(backend, 'name', '?')} without the kernels"
    if model.ctx.placement is not None:
        return model.ctx.placement.name
    if not kv_cache.is_contiguous() or kv_cache.dtype != torch.bfloat16:
        return "kv cache layout"
    for i, layer in enumerate(model.layers):
        mlp = layer.mlp
        if not isinstance(mlp, MoELayer):
            return f"layer {i} has a dense MLP"
        if layer.kernels is None or layer.attn.kernels is None or (mlp.experts.quant is None and mlp.kernels is None):
            return f"layer {i} off the kernels"
        if mlp.experts.quant is not None and (mlp.qroute is None or mlp.experts.qkernels is None):
            return f"layer {i}: quantized experts off moed_moe_q_routed (the per-expert path)"
        for lin in (layer.attn.qkv, layer.attn.o):
            if not _native(lin):
                return f"layer {i}: a quantized projection off the kernels ({lin.qpath})" if lin.quant is not None \
                    else f"layer {i}: a projection the kernels cannot pack"
    plain = [model.embed, model.norm] + [t for layer in model.layers for t in (
        layer.input_norm, layer.post_norm, layer.attn.qk_norm,
        *(lin.bias for lin in (layer.attn.qkv, layer.attn.o) if lin.quant is None))]
    if any(t is not None and not (t.is_contiguous() and t.dtype == torch.bfloat16) for t in plain):
        return "a weight the kernel would read is not contiguous bf16"
    return None


class NativeDecodeStep:
    """Build with `for_model` (None where it cannot serve); call with a decode-only batch."""

    def __init__(self, model: MoEDecoder, backend: TorchBackend, kv_cache: torch.Tensor) -> None:
        spec, self.model, self.kernels = model.spec, model, model.kernels
        self.vocab, self.hidden = spec.vocab_size, spec.hidden_size
        self._routers = [layer.mlp.router for layer in model.layers]
        self._maps: list[torch.Tensor | None] = [None] * len(self._routers)
        self._layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp, ly = layer.attn, layer.mlp, self._layers[i]
            ly.input_norm, ly.post_norm = _ptr(layer.input_norm), _ptr(layer.post_norm)
            ly.qkv, ly.o, ly.qk_norm = _proj(attn.qkv), _proj(attn.o), _ptr(attn.qk_norm)
            ly.kv = kv_cache[i].data_ptr()
            ly.router, ly.load = _ptr(mlp.router_p), _ptr(mlp.router.load)
            ly.moe, ly.P = _moe(mlp), mlp.router.num_physical
        self._refresh_maps()
        r0 = self._routers[0]
        self._model = _Model(
            L=len(model.layers), H=spec.hidden_size, Hq=spec.num_heads, Hkv=spec.num_kv_heads,
            D=spec.head_dim, E=spec.num_experts, k=spec.top_k, I=model.layers[0].mlp.experts.intermediate,
            vocab=spec.vocab_size, num_blocks=kv_cache.shape[1], bs=backend.block_size,
            norm_topk=int(r0.norm_topk), eps=spec.rms_norm_eps, scale=backend.scale,
            embed=_ptr(model.embed), norm=_ptr(model.norm), layers=self._layers)
        head = model.lm_head
        self._head_native = _native(head)       # else lm_head runs after the step, on its own path
        if self._head_native:
            self._model.lm_head = _proj(head)
        self._offsets = (ctypes.c_int64 * len(self._routers))()
        self._serves_rows: dict[int, bool] = {}
        self._scratch = torch.empty(0, dtype=torch.uint8)   # grown to the largest batch seen
        self._scratch_sizes: dict[int, int] = {}
        self._last: tuple[weakref.ref, torch.Tensor] | None = None    # (logits, their argmax)
        # The tensors the structs point into stay alive with the model, which outlives this.

    @classmethod
    def for_model(cls, model: MoEDecoder, backend: object,
                  kv_cache: torch.Tensor) -> tuple[NativeDecodeStep | None, str | None]:
        """(the step, None), or (None, why not)."""
        why = unsupported(model, backend, kv_cache)
        return (None, why) if why else (cls(model, backend, kv_cache), None)

    def _refresh_maps(self) -> None:
        """Point the layers at their routers' current expert maps (EPLB swaps the tensors)."""
        for i, r in enumerate(self._routers):
            if r.logical_to_physical is not self._maps[i]:
                ly = self._layers[i]
                ly.l2p, ly.nrep = r.logical_to_physical.data_ptr(), r.num_replicas.data_ptr()
                ly.max_rep = r.logical_to_physical.shape[1]
                self._maps[i] = r.logical_to_physical

    def _scratch_bytes(self, rows: int) -> int:
        """The kernel's scratch for a batch of `rows`, plus room to align it to 64 bytes."""
        got = self._scratch_sizes.get(rows)
        if got is None:
            got = self._scratch_sizes[rows] = self.kernels.lib.moed_decode_step_scratch(
                ctypes.byref(self._model), rows) + 64
        return got

    def serves_rows(self, rows: int) -> bool:
        """Whether, at this many rows, every projection takes the kernel its descriptor names
        and every MoE layer its fused kernel (otherwise the layer-by-layer path would run
        oneDNN, or the blocked quantized kernels past 64 rows, somewhere)."""
        got = self._serves_rows.get(rows)
        if got is None:
            lins = [x for layer in self.model.layers for x in (layer.attn.qkv, layer.attn.o)]
            got = (all(_rows_native(lin, rows) for lin in lins)
                   and all(_moe_serves(layer.mlp, rows) for layer in self.model.layers))
            self._serves_rows[rows] = got
        return got

    def serves(self, batch: ForwardBatch) -> bool:
        return batch.is_decode_only and self.serves_rows(batch.num_seqs)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits [B, vocab] of a decode-only batch (runner.forward's contract), with its
        K/V written into the cache. The runner has checked ids, positions and block ids."""
        b, bs = batch.num_seqs, self._model.bs
        ids = array("q", [t[0] for t in batch.token_ids])
        pos = array("q", batch.start_pos)
        need = [p // bs + 1 for p in batch.start_pos]
        width = max(need)
        flat = array("q")
        for i, (table, n) in enumerate(zip(batch.block_tables, need)):
            if len(table) < n:     # the message paging() gives on the layer-by-layer path
                raise ValueError(f"sequence {i}: {batch.start_pos[i] + 1} tokens need {n} KV blocks, "
                                 f"block table has {len(table)}")
            flat.extend(table[:n])
            flat.extend([0] * (width - n))     # padding: never read past a sequence's length
        cos, sin = self.model.rotary.full_tables(max(batch.start_pos))
        self._refresh_maps()
        for i, r in enumerate(self._routers):
            self._offsets[i] = r.next_offset()
        lib, model = self.kernels.lib, ctypes.byref(self._model)
        if self._scratch.numel() < self._scratch_bytes(b):
            self._scratch = torch.empty(self._scratch_bytes(b), dtype=torch.uint8)
        scratch = self._scratch.data_ptr()
        head = self.model.lm_head
        native_head = self._head_native and _rows_native(head, b)
        logits = torch.empty((b, self.vocab), dtype=torch.float32) if native_head else None
        greedy = torch.empty(b, dtype=torch.long)     # each row's argmax, for the sampler
        aligned = -scratch % 64
        rc = lib.moed_decode_step(
            model, b, ids.buffer_info()[0], pos.buffer_info()[0], flat.buffer_info()[0], width,
            ctypes.addressof(self._offsets), cos.data_ptr(), sin.data_ptr(), scratch + aligned,
            None if logits is None else logits.data_ptr(), None if logits is None else greedy.data_ptr(),
            torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("moed_decode_step: " + ("out of memory" if rc == -1 else
                                                       "bad token id, block id, expert map or weight"))
        if logits is None:      # the final norm's output, in the scratch: lm_head on its own path
            at = aligned + lib.moed_decode_step_hidden_offset(model, b)
            x = self._scratch[at:at + 2 * b * self.hidden].view(torch.bfloat16).view(b, self.hidden)
            logits = head(x).float()
            lib.moed_argmax_f32(logits.data_ptr(), b, self.vocab, greedy.data_ptr(), torch.get_num_threads())
        self._last = (weakref.ref(logits), greedy)
        return logits

    def argmax_of(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits.argmax(-1) if `logits` is the tensor the last call returned (computed in the
        step, while they were in cache), else None. By identity: a new tensor that reuses the
        memory is not it; the logits are an inference tensor, which nothing outside inference
        mode can change in place."""
        last = self._last
        return last[1] if last is not None and last[0]() is logits else None
