"""ModelRunner: loads a checkpoint, owns the paged KV cache, runs one ForwardBatch per step.

Built once per model, in this order: the spec (config.json) picks the architecture module
(moed/model/archs), which gives the KVLayout; the ComputeContext says where the model computes
and whether the CPU kernels serve; the attention backend, the decoder stack and the KV tensor
all read those same two objects. A decode-only step goes through the whole model in one native
call where the model allows (decode_step.py), else layer by layer. With mtp=True it also serves
DeepSeek-V3's MTP layer (moed/model/mtp.py): forward(hidden=True) hands out the hidden states
forward_mtp takes, and the KV tensor has the MTP layer's one more layer. Called from the
engine's single executor thread; not thread-safe by design (one writer).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path
from typing import Literal, overload

import structlog
import torch

from moed.model import archs
from moed.model.attention.registry import get_backend
from moed.model.batch import ForwardBatch
from moed.model.cold import ColdSettings, ExpertStore, cold_store
from moed.model.context import ComputeContext, ExpertPlacement
from moed.model.decode_step import NativeDecodeStep
from moed.model.kernels.choice import by_class
from moed.model.decoder import MoEDecoder
from moed.model.hf_config import load_spec
from moed.model.kv_layout import KVLayout, kv_cache_dtype
from moed.model.layers import quant_paths
from moed.model.loader import Weights, load_weights, mtp_layers
from moed.model.mtp import MTPLayer
from moed.model.quant import bytes_by_format
from moed.model.quant import formats as quant_formats
from moed.model.spec import ModelSpec, parse_dtype
from moed.transfer.base import KVRegion, RegionLayout

log = structlog.get_logger(__name__)


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str | torch.dtype, spec: ModelSpec, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return parse_dtype(dtype)
    dt = spec.dtype
    if device.type == "cpu" and dt == torch.float16:
        return torch.bfloat16          # fp16 matmuls are slow on CPU; bf16 has the same size
    return dt


def auto_num_blocks(spec: ModelSpec, block_size: int, dtype: str | torch.dtype, memory_mb: int,
                    kv_dtype: str = "auto", mtp: bool = False) -> int:
    """How many KV blocks fit in memory_mb (kv_dtype: engine.kv_cache_dtype; fp8 holds twice
    bf16's blocks; mtp: a runner built with mtp=True, one more layer per block)."""
    per_block = archs.kv_layout(spec, block_size, kv_cache_dtype(kv_dtype, parse_dtype(dtype)),
                                mtp_layers(spec, mtp)).bytes_per_block
    n = (memory_mb << 20) // per_block
    if n < 1:
        raise ValueError(f"{memory_mb} MB of KV memory holds no block of {per_block} bytes")
    return int(n)


def rss_mb() -> float | None:
    """This process's resident set (Linux /proc), MiB; None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


class ModelRunner:
    def __init__(self, model_dir: str | Path, *, dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "auto", attention_backend: str = "auto",
                 num_blocks: int, block_size: int, spec: ModelSpec | None = None,
                 weights: Weights | None = None, placement: ExpertPlacement | None = None,
                 quantization: str = "", quantization_group_size: int = 128,
                 quantization_lm_head: str = "none", quantization_activations: str = "none",
                 kv_dtype: str = "auto", mtp: bool = False, batch_invariant: bool = False,
                 cold: ColdSettings | None = None) -> None:
        """placement: expert parallelism (moed.parallel.dispatch.RankPlacement): only this rank's
        expert slots are loaded, and every MoE layer dispatches over the group.
        quantization: model.quantization ("" = the checkpoint's own format, or none; fp8, int8,
        int4 quantize a plain checkpoint at load, moed/model/quant); quantization_lm_head:
        model.quantization_lm_head (none, int8, model); quantization_activations:
        model.quantization_activations (none, int8: the quantized matmuls of up to 64 rows on
        int8 activations, ctx.quant_act); a QuantConfigError for a combination that is refused.
        kv_dtype: engine.kv_cache_dtype ("auto": the model's dtype; "fp8": float8 e4m3).
        mtp: also serve DeepSeek-V3's MTP layer (moed/model/mtp.py, forward_mtp): its weights and
        one more KV layer, which the layout id names; ValueError for a checkpoint without one.
        With expert parallelism its MoE layer is one more in the group's exchanges (its own
        slots of this rank, the initial layout: the expert balancer moves the main model's).
        Off: nothing of it is read or allocated.
        batch_invariant: model.batch_invariant (ComputeContext.build; ValueError where it
        cannot hold).
        cold: [experts] with a resident budget (moed/model/cold): only that share of the routed
        experts is loaded, the others are read from the checkpoint when routed to; None or a
        budget that holds every expert: all resident, no store."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        t0 = time.monotonic()
        self.spec = spec or load_spec(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.spec, self.device)
        self.block_size, self.num_blocks = block_size, num_blocks
        arch = archs.get(self.spec.arch)
        n_mtp = mtp_layers(self.spec, mtp)
        self.kv_layout: KVLayout = archs.kv_layout(self.spec, block_size, kv_cache_dtype(kv_dtype, self.dtype),
                                                   n_mtp)
        own = weights is None
        self.quant_plan = quant_formats.plan(model_dir, quantization, quantization_group_size,
                                             quantization_lm_head) if own \
            else quant_formats.Plan(None)
        if own:
            quant_formats.check_activations(self.quant_plan, quantization_activations)
        self.cold: ExpertStore | None = None if cold is None or not own else \
            cold_store(model_dir, self.spec, self.dtype, self.device, cold, placement, n_mtp, self.quant_plan)
        if self.cold is not None:
            placement = self.cold
        self.ctx = ComputeContext.build(self.device, self.dtype, placement, batch_invariant, quantization_activations)
        if own:
            weights = load_weights(model_dir, self.spec, self.dtype, self.device,
                                   None if placement is None else placement.local_slots, self.quant_plan, mtp)
        held = bytes_by_format(weights)
        self.backend = get_backend(attention_backend, self.spec, self.kv_layout, self.ctx)
        self.model = MoEDecoder(self.spec, weights, arch.build_layer, self.ctx, consume=own)
        self.mtp = MTPLayer.build(weights, arch.build_layer, self.ctx, self.model, own) if n_mtp else None
        if self.cold is not None:       # layer-ahead prefetch's routers and hook (cold/prefetch.py)
            self.cold.attach(self.model)
        del weights
        self.kv_cache = self.kv_layout.allocate(num_blocks, self.device)
        # the batch the backend's plan is for, its positions tensor and largest position
        self._planned: tuple[ForwardBatch, torch.Tensor, int] | None = None
        # Decode-only steps in one native call where the model allows (decode_step.py).
        self.native_decode, why_not = NativeDecodeStep.for_model(self.model, self.backend, self.kv_cache)
        self.native_decode_off = why_not or ""
        if getattr(self.backend, "kernels_off", ""):
            log.info("attention_kernels_off", reason=self.backend.kernels_off,
                     effect="attention runs on the torch path")
        log.info("model_runner_ready", **self.describe(), native_decode=why_not or "on",
                 cpu_isa=getattr(self.ctx.kernels, "isa", "none"), kernel_classes=self._kernel_classes(),
                 quant_matmuls=quant_paths(self.model) if self.quant_plan.fmt else "none",
                 num_blocks=num_blocks, block_size=block_size, kv_layout=self.kv_layout.layout_id,
                 mtp_layers=n_mtp,
                 kv_bytes_per_token=self.kv_layout.bytes_per_token,
                 kv_mb=round(num_blocks * self.kv_layout.bytes_per_block / 2**20, 1),
                 weights_mb={k: round(v / 2**20, 2) for k, v in held.items()},
                 rss_mb=rss_mb(), seconds=round(time.monotonic() - t0, 2))

    def _kernel_classes(self) -> str:
        """Per row class, what serves this model's matmuls (choice.by_class); 'none' without kernels."""
        k = self.ctx.kernels
        if k is None:
            return "none"
        if not self.ctx.pack:       # no oneDNN bf16 here: no race, the native kernel serves all
            return f"all:{k.isa} (no oneDNN bf16)"
        return by_class(k.choose.chosen(), k.isa)

    def describe(self) -> dict[str, str]:
        """What runs: for the model_runner_ready log line and the moed_model_info metric."""
        return {"arch": self.spec.arch, "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "backend": self.backend.name,
                "cpu_kernels": "on" if self.ctx.kernels is not None else "off",
                "quantization": self.quant_plan.fmt or "none",
                "kv_dtype": self.kv_layout.dtype_name}

    def kv_region(self) -> KVRegion:
        """The KV tensor and its byte layout, as the transfer layer registers it."""
        return KVRegion(self.kv_cache, RegionLayout.from_kv_layout(
            self.kv_layout, self.kv_cache.data_ptr(), self.num_blocks))

    def _check(self, batch: ForwardBatch) -> None:
        if batch.num_seqs == 0:
            raise ValueError("empty ForwardBatch")
        vocab = self.spec.vocab_size
        for i, (toks, start, table) in enumerate(zip(batch.token_ids, batch.start_pos, batch.block_tables)):
            if not toks:
                raise ValueError(f"sequence {i} has no new tokens")
            if start < 0:
                raise ValueError(f"sequence {i}: start_pos {start} < 0")
            if min(toks) < 0 or max(toks) >= vocab:
                raise ValueError(f"sequence {i}: token id out of range [0, {vocab})")
            if table and (min(table) < 0 or max(table) >= self.num_blocks):
                raise ValueError(f"sequence {i}: block id out of range [0, {self.num_blocks})")

    def _inputs(self, batch: ForwardBatch, reuse_plan: bool = False, logits: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
        """(token ids [T], positions [T], the largest position, logit rows or None without
        `logits`) on the device; the backend planned for them. reuse_plan: when the last batch
        the backend planned had the same positions and block tables (the MTP step after a main
        step whose drafts were all kept), keep its plan (~0.1 ms of the demo model's 2 ms step)
        and its positions tensor, whose rotary tables Rotary.tables then gives back ungathered."""
        dev = self.device
        ids = [t for toks in batch.token_ids for t in toks]
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        last_rows = None
        if logits and batch.all_logits:
            last_rows = torch.tensor(batch.logit_rows, dtype=torch.long, device=dev)
        elif logits:
            last_rows = torch.tensor([len(t) for t in batch.token_ids], device=dev).cumsum(0) - 1
        if reuse_plan and self._planned is not None and _same_rows(batch, self._planned[0]):
            return input_ids, self._planned[1], self._planned[2], last_rows
        pos = [p for toks, s in zip(batch.token_ids, batch.start_pos) for p in range(s, s + len(toks))]
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        self.backend.plan(batch, positions)
        self._planned = (batch, positions, max(pos))
        return input_ids, positions, max(pos), last_rows

    @overload
    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...
    @overload
    def forward(self, batch: ForwardBatch, *, hidden: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, *, hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits of `batch.logit_rows` (K/V of all new tokens cached): [B, vocab], one per
        sequence's last new token, unless `batch.all_logits` asks for every row of some.
        hidden: (those logits, every new token's hidden state after the final norm [T, H], the
        model dtype, rows in the batch's token order): what forward_mtp takes. The logits are the
        same either way; the native decode step (GQA models) does not give it and steps aside."""
        self._check(batch)
        if self.cold is not None:       # between steps: heat, read-ahead installs (cold/store.py)
            self.cold.between_steps()
        if not hidden and self.native_decode is not None and self.native_decode.serves(batch):
            return self.native_decode(batch)
        input_ids, positions, max_pos, rows = self._inputs(batch)
        if hidden:
            return self.model.with_hidden(input_ids, positions, max_pos, rows, self.backend, self.kv_cache)
        return self.model(input_ids, positions, max_pos, rows, self.backend, self.kv_cache)

    @torch.inference_mode()
    def forward_mtp(self, batch: ForwardBatch, hidden: torch.Tensor,
                    kv_only: bool = False) -> torch.Tensor | None:
        """DeepSeek-V3's MTP layer (moed/model/mtp.py; built with mtp=True): fp32 logits of
        `batch.logit_rows`, each predicting the token two past its position.

        batch: positions the main model has run, with its start_pos and block tables, and each
        token shifted by one: token_ids[i][j] is the token at position start_pos[i] + j + 1
        (mtp.mtp_inputs builds it from the main batch). hidden [batch.num_tokens, H]: the main
        model's hidden states at those positions (forward(..., hidden=True)), in that order.
        The MTP layer's KV entries of those positions are written (its KV layer, same blocks).
        kv_only: those entries only (the same numbers; no attention, MoE or head) -> None.
        (The engine's step runs draft_mtp, which also joins an EP group's exchanges.)"""
        if self.mtp is None:
            raise RuntimeError("forward_mtp: this runner was built without mtp=True")
        self._check(batch)
        if tuple(hidden.shape) != (batch.num_tokens, self.spec.hidden_size):
            raise ValueError(f"forward_mtp: hidden {tuple(hidden.shape)}, expected "
                             f"({batch.num_tokens}, {self.spec.hidden_size})")
        input_ids, positions, max_pos, rows = self._inputs(batch, reuse_plan=True, logits=not kv_only)
        hidden, kv = hidden.to(self.device, self.dtype), self.kv_cache[self.spec.num_layers]
        if kv_only:
            self.mtp.write_kv(hidden, input_ids, positions, max_pos, self.model.rotary, self.backend, kv)
            return None
        return self.mtp(hidden, input_ids, positions, max_pos, rows, self.model.rotary, self.backend, kv)

    @torch.inference_mode()
    def draft_mtp(self, batch: ForwardBatch, hidden: torch.Tensor, depth: Sequence[int],
                  passes: int = 0, kept: Sequence[int] | None = None) -> list[list[int]]:
        """The MTP step as the engine runs it: forward_mtp's KV entries of every position, and
        depth[i] greedy drafts from sequence i (0: its entries only) -> the drafts per sequence.

        Only the drafting rows (each drafting sequence's last) run the layer's attention, MoE
        and head; the others write their entries only (write_kv, the numbers forward_mtp
        writes: those of the query rows are written again after their pass). Drafts past the
        first chain the one layer as vLLM and SGLang do: entry j (1 <= j < depth[i]) at the
        position j past the last, from entry j - 1's output and draft; its KV goes to that
        position's slot, which batch.block_tables[i] must hold (scratch: the next step's MTP
        step writes it again before anything reads it). passes (expert parallelism): the layer's
        MoE exchanges to make in all, one per chained pass run, the rest with no rows
        (moed.parallel.agree.Verdict.mtp_passes; 0: as many as run). kept[i]: sequence i's
        real rows (default all), the rest padding (mtp_inputs(pad=True)): its draft is made at
        its row kept[i] - 1, and the padding's entries, past that position, are scratch as a
        chain's are."""
        ran = max(depth, default=0)     # the chained passes it runs, one MoE exchange each
        if passes and ran > passes:
            raise ValueError(f"draft_mtp: a chain of {ran} passes, the group agreed on {passes}")
        out = self._draft_mtp(batch, hidden, depth, kept)
        for _ in range(passes - ran):
            self.mtp.empty_step()
        return out

    @torch.inference_mode()
    def mtp_exchanges(self, passes: int) -> None:
        """Expert parallelism, a step whose MTP layer has no row to run on this rank (its rows'
        entries are deferred, moed.engine.drafts.mtp_kv) while a peer drafts: the layer's MoE
        exchange with no rows, `passes` times (Verdict.mtp_passes)."""
        if passes and self.mtp is None:
            raise RuntimeError("mtp_exchanges: this runner was built without mtp=True")
        for _ in range(passes):
            self.mtp.empty_step()

    def _draft_mtp(self, batch: ForwardBatch, hidden: torch.Tensor, depth: Sequence[int],
                   kept: Sequence[int] | None = None) -> list[list[int]]:
        if self.mtp is None:
            raise RuntimeError("draft_mtp: this runner was built without mtp=True")
        self._check(batch)
        n = batch.num_tokens
        if len(depth) != batch.num_seqs or tuple(hidden.shape) != (n, self.spec.hidden_size):
            raise ValueError(f"draft_mtp: {len(depth)} depths, hidden {tuple(hidden.shape)} for "
                             f"{batch.num_seqs} sequences of {n} tokens")
        lens = [len(t) for t in batch.token_ids]
        if kept is None:
            kept = lens
        elif len(kept) != len(lens) or not all(1 <= k <= n for k, n in zip(kept, lens)):
            raise ValueError(f"draft_mtp: kept {list(kept)} for sequences of {lens} rows")
        last = [s + k - 1 for s, k in zip(batch.start_pos, kept)]     # each drafting row's position
        for i, d in enumerate(depth):
            if d > 1 and last[i] + d - 1 >= len(batch.block_tables[i]) * self.block_size:
                raise ValueError(f"draft_mtp: sequence {i}'s chain of {d} needs slots to position "
                                 f"{last[i] + d - 1}, its block table holds fewer")
        input_ids, positions, max_pos, _ = self._inputs(batch, reuse_plan=True, logits=False)
        hidden, kv = hidden.to(self.device, self.dtype), self.kv_cache[self.spec.num_layers]
        q = [i for i, d in enumerate(depth) if d > 0]
        out: list[list[int]] = [[] for _ in depth]
        first = None
        if len(q) == n:      # one row each, all drafting: one pass, as forward_mtp, on this plan
            x, ent = self.mtp._input(hidden, input_ids), None
            first = self.mtp.draft(x, positions, max_pos, self.model.rotary, self.backend, kv)
        elif q and max(len(t) for t in batch.token_ids) <= MTP_ONE_PASS_ROWS:
            # short chunks only (a verify step's kept rows, a held decoding row's entry): one
            # pass on this plan, attention on every row (its entries), MoE and head on the
            # drafting sequences' last rows only; a second pass's plan, inputs and entry
            # writes cost ~20% of the demo's pass at batch 1
            x, ent = self.mtp._input(hidden, input_ids), None
            starts = [0, *accumulate(lens)]
            sel = torch.tensor([starts[i] + kept[i] - 1 for i in q], device=x.device)
            first = self.mtp.draft(x, positions, max_pos, self.model.rotary, self.backend, kv, sel)
        else:
            x, ent = self.mtp.write_kv(hidden, input_ids, positions, max_pos, self.model.rotary,
                                       self.backend, kv)
            if not q:
                return out
            starts = [0, *accumulate(lens)]
            sel = torch.tensor([starts[i] + kept[i] - 1 for i in q], device=x.device)
            x, ent = x.index_select(0, sel), ent.index_select(0, sel)
        chain = [batch.block_tables[i] for i in q]
        for j in range(max(depth)):
            if first is not None:
                (tok, h), first = first, None
            else:
                b = ForwardBatch([[0]] * len(q), [last[i] + j for i in q], chain)
                _, pos, mp, _ = self._inputs(b, reuse_plan=True, logits=False)
                tok, h = self.mtp.draft(x, pos, mp, self.model.rotary, self.backend, kv)
            if ent is not None:     # the query rows' entries as the all-row pass wrote them
                self.backend.write_latent(ent, kv)
                ent = None
            for i, t in zip(q, tok.tolist()):
                out[i].append(t)
            keep = [n for n, i in enumerate(q) if depth[i] > j + 1]
            if not keep:        # the usual k = 1: no chain goes on, nothing to select
                break
            if len(keep) != len(q):
                q, chain = [q[n] for n in keep], [chain[n] for n in keep]
                tok, h = tok[keep], h[keep]
            x = self.mtp._input(h, tok)
        return out

    def argmax_of(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits.argmax(-1) where the step that returned these logits computed it already (the
        native decode step does, while they are in cache); None otherwise."""
        return None if self.native_decode is None else self.native_decode.argmax_of(logits)

    @torch.inference_mode()
    def forward_empty(self, mtp: int = 0) -> None:
        """Expert parallelism: this rank has no tokens this step but takes part in every MoE
        layer's exchange (moed.parallel.agree); mtp: and in that many of the MTP layer's, after
        them (a peer runs that layer in full this step: Verdict.mtp_passes)."""
        if self.cold is not None:       # heat and installs as before a forward (cold/store.py)
            self.cold.between_steps()
        self.model.empty_step()
        if mtp:
            if self.mtp is None:
                raise RuntimeError("forward_empty(mtp): this runner was built without mtp=True")
            for _ in range(int(mtp)):
                self.mtp.empty_step()

    def resident_expert_bytes(self) -> int:
        """Bytes of expert weights this process holds, summed over the tensors themselves."""
        return self.model.resident_expert_bytes()

    def expert_load(self) -> torch.Tensor:
        """Tokens routed per logical expert [layers, experts] since the last call (then reset).

        Call it between steps (e.g. on the step thread): a read racing a forward may drop counts."""
        load = self.model.expert_load.cpu().clone()
        self.model.expert_load.zero_()
        return load


# the longest chunk per sequence an MTP step runs in one pass: a verify step's known token and
# its accepted drafts (num_speculative_tokens <= 4)
MTP_ONE_PASS_ROWS = 5


def _same_rows(a: ForwardBatch, b: ForwardBatch | None) -> bool:
    """Whether a backend's plan for b serves a: the same positions in the same blocks."""
    return b is not None and a.start_pos == b.start_pos and a.block_tables == b.block_tables \
        and all(len(x) == len(y) for x, y in zip(a.token_ids, b.token_ids)) \
        and len(a.token_ids) == len(b.token_ids)
