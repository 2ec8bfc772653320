"""The native decode step: a decode-only batch through the whole model in one kernel call.

A decode step is a few kernel calls per layer (norm, qkv, q/k norm + rotary, attention, o,
norm, MoE). Between them the layer-by-layer path (decoder.py, layers.py, the torch backend)
spends ~0.25 ms a layer on the 2-core bench in Python and small torch ops: views, output
allocations, the KV cache's index_copy_, the attention plan's index tensors, ctypes calls. At
batch 1 that is a quarter of the step (bench/decode_profile.py). `moed_decode_step_bf16`
(kernels/cpu_bf16.c) runs the same kernels in the same order on the same inputs in C, so the
logits, the K/V written and the expert-load counts are bitwise those of the layer-by-layer path
(tests/unit/model/test_decode_step.py), and the step crosses from Python once.

It serves a batch when the model is a GQA MoE decoder on the native kernels with all experts in
this process (no expert parallelism), every layer MoE, the torch attention backend on the
kernels, and, for the batch's row count, every projection the native kernel's (kernels/choice.py
may give a row class to oneDNN) and every MoE layer the fused kernel's. Otherwise the runner
takes the layer-by-layer path, which computes the same thing; `unsupported()` says why (logged
once in model_runner_ready). The lm_head is the exception: where its row class is oneDNN's, the
step stops after the final norm and lm_head runs on oneDNN, as the layered path does it (so
still bitwise). The lm_head's race is a near tie on a CPU with AMX (the bench preset's at one row:
oneDNN 1.6-1.9 ms, native 2.0-2.2 ms on 2 threads), and losing the whole step to it cost ~10%
of batch-1 decode.
"""
from __future__ import annotations

import ctypes
import weakref
from array import array

import torch

from moed.model.attention.torch_backend import TorchBackend
from moed.model.batch import ForwardBatch
from moed.model.decoder import MoEDecoder
from moed.model.layers import Linear
from moed.model.moe import MoELayer

_p, _l = ctypes.c_void_p, ctypes.c_long


class _Layer(ctypes.Structure):      # DecodeLayer in cpu_bf16.c
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", _p), ("qkv_bias", _p),
                ("qk_norm", _p), ("o", _p), ("o_bias", _p), ("kv", _p), ("router", _p),
                ("l2p", _p), ("nrep", _p), ("max_rep", _l), ("load", _p),
                ("gate_up", _p), ("down", _p), ("P", _l)]


class _Model(ctypes.Structure):      # DecodeModel in cpu_bf16.c
    _fields_ = [("L", _l), ("H", _l), ("Hq", _l), ("Hkv", _l), ("D", _l), ("E", _l), ("k", _l),
                ("I", _l), ("vocab", _l), ("num_blocks", _l), ("bs", _l), ("norm_topk", ctypes.c_int),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("embed", _p), ("norm", _p), ("lm_head", _p), ("layers", ctypes.POINTER(_Layer))]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _native(lin: Linear) -> bool:
    return lin.kpacked is not None


def unsupported(model: MoEDecoder, backend: object, kv_cache: torch.Tensor) -> str | None:
    """Why the native step cannot serve this model (None: it can, row counts permitting)."""
    if model.quantized:
        return f"quantized weights ({', '.join(model.quantized)}): the native step reads bf16 only"
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
        if mlp.kernels is None or layer.kernels is None or layer.attn.kernels is None:
            return f"layer {i} off the kernels"
        if not (_native(layer.attn.qkv) and _native(layer.attn.o)):
            return f"layer {i}: a projection the kernels cannot pack"
    if not _native(model.lm_head):
        return "lm_head the kernels cannot pack"
    plain = [model.embed, model.norm] + [t for layer in model.layers for t in (
        layer.input_norm, layer.post_norm, layer.attn.qk_norm, layer.attn.qkv.bias, layer.attn.o.bias)]
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
            ly.qkv, ly.qkv_bias = _ptr(attn.qkv.kpacked), _ptr(attn.qkv.bias)
            ly.o, ly.o_bias = _ptr(attn.o.kpacked), _ptr(attn.o.bias)
            ly.qk_norm = _ptr(attn.qk_norm)
            ly.kv = kv_cache[i].data_ptr()
            ly.router, ly.load = _ptr(mlp.router_p), _ptr(mlp.router.load)
            ly.gate_up, ly.down, ly.P = _ptr(mlp.experts.gate_up_p), _ptr(mlp.experts.down_p), mlp.router.num_physical
        self._refresh_maps()
        r0 = self._routers[0]
        self._model = _Model(
            L=len(model.layers), H=spec.hidden_size, Hq=spec.num_heads, Hkv=spec.num_kv_heads,
            D=spec.head_dim, E=spec.num_experts, k=spec.top_k, I=model.layers[0].mlp.experts.intermediate,
            vocab=spec.vocab_size, num_blocks=kv_cache.shape[1], bs=backend.block_size,
            norm_topk=int(r0.norm_topk), eps=spec.rms_norm_eps, scale=backend.scale,
            embed=_ptr(model.embed), norm=_ptr(model.norm), lm_head=_ptr(model.lm_head.kpacked),
            layers=self._layers)
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
        """Whether every matmul at this many rows is the native kernel's, and every MoE layer
        the fused kernel's (otherwise the layer-by-layer path would run oneDNN somewhere)."""
        got = self._serves_rows.get(rows)
        if got is None:
            lins = [x for layer in self.model.layers for x in (layer.attn.qkv, layer.attn.o)]
            got = (all(lin.choice is None or not lin.choice.use_onednn(rows) for lin in lins)
                   and all(layer.mlp.fused(rows) for layer in self.model.layers))
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
        native_head = head.choice is None or not head.choice.use_onednn(b)
        logits = torch.empty((b, self.vocab), dtype=torch.float32) if native_head else None
        greedy = torch.empty(b, dtype=torch.long)     # each row's argmax, for the sampler
        aligned = -scratch % 64
        rc = lib.moed_decode_step_bf16(
            model, b, ids.buffer_info()[0], pos.buffer_info()[0], flat.buffer_info()[0], width,
            ctypes.addressof(self._offsets), cos.data_ptr(), sin.data_ptr(), scratch + aligned,
            None if logits is None else logits.data_ptr(), None if logits is None else greedy.data_ptr(),
            torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("moed_decode_step_bf16: " + ("out of memory" if rc == -1 else
                                                            "bad token id, block id or expert map"))
        if logits is None:      # the final norm's output, in the scratch: lm_head on oneDNN
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
