"""DeepSeek-V3's multi-token-prediction (MTP) layer, served as a draft model.

Built by ModelRunner(mtp=True) and run by `ModelRunner.forward_mtp` (or, in a step that makes
no draft, `forward_mtp(kv_only=True)`: its KV entries only); the engine drafts with it
(speculative.method mtp, moed/engine/speculate.py). The definition is moed/dev/train/mtp.py's MTPModule (what the
demo model was trained with; vLLM's deepseek_mtp computes the same): the MTP entry at sequence
position i combines the main model's hidden state h_i, taken AFTER the final norm, with the
embedding of token i+1, and predicts token i+2:

    x = eh_proj(concat(enorm(embed(t[i+1])), hnorm(h_i)))
    x = decoder layer N (MLA over the MTP layer's own KV, DeepSeek MoE), rotary at position i
    logits = head(head_norm(x))

Positions: the entry of position i is written with rotary position i into KV layer N (the KV
tensor's last, `KVLayout.mtp_layers`) at the block slot of the main model's position i (block
tables are shared). So once the main model has run positions s .. s+n-1 and t[s+n] is known (the
prompt's next token, or the token sampled there), the MTP layer runs the same positions with the
tokens shifted by one (`mtp_inputs`); its last row is the draft for position s+n+1. vLLM zeroes
the token embedding at position 0 ("not needed by MTP"); the training module does not, nor this.

Embedding and head: DeepSeek's checkpoints store copies under the layer's own names; the main
model's are used when the copy is bitwise equal (DeepSeek-V3's and the demo's are), else the copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from moed.model.attention.base import AttentionBackend
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.decoder import BuildLayer, DecoderLayer, MoEDecoder, Weights
from moed.model.layers import Linear, Rotary, add_rms_norm
from moed.model.moe import MoELayer
from moed.model.quant.weight import QuantWeight

log = structlog.get_logger(__name__)


def mtp_inputs(batch: ForwardBatch, next_ids: list[int], keep: list[int] | None = None,
               pad: bool = False) -> tuple[ForwardBatch, list[int]]:
    """The MTP step that follows a main step: (its batch, the rows of the main step's hidden
    states it takes, for hidden.index_select(0, rows)).

    next_ids[i]: the token after the last position sequence i keeps (the next prompt token, or
    the token sampled or accepted there); keep[i]: how many of sequence i's new positions to run
    (default all; after verifying drafts, the accepted ones + 1). Positions and block tables are
    the main step's; each token moves one to the left. pad: a sequence keeps its rejected
    drafts' rows too, as padding (token next_ids[i]; ModelRunner.draft_mtp's `kept` says where
    each sequence's real rows end): the batch is then the main step's, whose attention plan the
    MTP pass reuses (a rejection's new plan was ~20% of the demo model's pass at batch 1)."""
    if len(next_ids) != batch.num_seqs or (keep is not None and len(keep) != batch.num_seqs):
        raise ValueError("mtp_inputs: one next id (and keep) per sequence")
    tokens, rows, row = [], [], 0
    for i, toks in enumerate(batch.token_ids):
        k = len(toks) if keep is None else keep[i]
        if not 1 <= k <= len(toks):
            raise ValueError(f"sequence {i}: keep {k} of {len(toks)} positions")
        n = len(toks) if pad else k
        tokens.append([*toks[1:k], *[next_ids[i]] * (n - k + 1)])
        rows.extend(range(row, row + n))
        row += len(toks)
    return ForwardBatch(tokens, list(batch.start_pos), batch.block_tables), rows


def _equal(a: torch.Tensor | QuantWeight, b: torch.Tensor | QuantWeight) -> bool:
    """Equal plain tensors, or equal quantized ones (the same quantizer on equal weights)."""
    if isinstance(a, QuantWeight) or isinstance(b, QuantWeight):
        if not (isinstance(a, QuantWeight) and isinstance(b, QuantWeight)) or a.describe() != b.describe():
            return False
        return all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    return torch.equal(a, b)


@dataclass(frozen=True)
class Shared:
    """Whether the MTP layer uses the main model's embedding and head (its copies were equal)."""
    embed: bool
    head: bool


class MTPLayer:
    """One MTP layer over canonical weights `layers.{N}.*` (N = num_layers): the decoder layer as
    the architecture builds any layer, plus `mtp.{enorm, hnorm, eh_proj, embed, head_norm, head}`."""

    def __init__(self, eps: float, index: int, w: Weights, block: DecoderLayer, ctx: ComputeContext,
                 main: MoEDecoder) -> None:
        p = f"layers.{index}.mtp."
        self.index, self.eps, self.kernels, self.dtype = index, eps, ctx.kernels, ctx.dtype
        self.enorm, self.hnorm, self.head_norm = w[p + "enorm"], w[p + "hnorm"], w[p + "head_norm"]
        self.eh_proj = Linear(w[p + "eh_proj"], None, ctx.pack, ctx.kernels)
        self.block = block
        # copies equal to the main model's are dropped: one tensor in memory, the same numbers
        self.shared = Shared(torch.equal(w[p + "embed"], main.embed), _equal(w[p + "head"], w["lm_head"]))
        self.embed = main.embed if self.shared.embed else w[p + "embed"]
        head = w[p + "head"]     # quantized as lm_head is (model.quantization_lm_head)
        self.head = main.lm_head if self.shared.head else Linear(head, None, ctx.pack, ctx.for_weight(head))

    @classmethod
    def build(cls, w: Weights, build_layer: BuildLayer, ctx: ComputeContext, main: MoEDecoder,
              consume: bool = False) -> MTPLayer:
        """The first MTP layer from the loader's weights (load_weights(mtp=True)), beside `main`;
        consume: its entries leave `w` once built (as MoEDecoder's do)."""
        spec = main.spec
        i = spec.num_layers
        load_row = torch.zeros(max(spec.num_experts, 1), dtype=torch.long, device=ctx.device)  # not reported
        layer = cls(spec.rms_norm_eps, i, w, build_layer(spec, i, w, load_row, ctx), ctx, main)
        for name in [n for n in w if n.startswith(f"layers.{i}.")] if consume else ():
            del w[name]
        log.info("mtp_layer_ready", layer=i, shared_embed=layer.shared.embed, shared_head=layer.shared.head)
        return layer

    def _input(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        e, _ = add_rms_norm(self.embed.index_select(0, next_ids), None, self.enorm, self.eps, self.kernels)
        h, _ = add_rms_norm(hidden, None, self.hnorm, self.eps, self.kernels)
        return self.eh_proj(torch.cat((e, h), dim=-1))

    def write_kv(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                 max_pos: int, rotary: Rotary, backend: AttentionBackend, kv_layer: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """__call__'s KV entries only (the same numbers): its input, the layer's input norm and
        latent projection, no attention, MoE or head. What a step that makes no draft runs, so
        the MTP layer's KV still covers every position when drafting resumes (~1/10 of the
        full layer's time on the demo model). -> (the layer's input x [T, H], the entries
        written [T, r + rope]) for `draft` to run the rest on some rows."""
        b = self.block
        x = self._input(hidden, next_ids)
        n, _ = add_rms_norm(x, None, b.input_norm, b.eps, b.kernels)
        cos, sin = rotary.tables(positions, max_pos)
        return x, b.attn.write_kv(n, cos, sin, backend, kv_layer)

    def draft(self, x: torch.Tensor, positions: torch.Tensor, max_pos: int, rotary: Rotary,
              backend: AttentionBackend, kv_layer: torch.Tensor,
              rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the layer on input rows x [Q, H] (write_kv's, or `_input`'s for a chained
        entry) at `positions` [Q], the backend planned for them (their entries are written as
        __call__ writes them) -> (greedy drafts [Q], the layer's output [Q, H] before the head's
        norm: a chained entry's hidden, as vLLM's and SGLang's MTP proposers chain it).
        rows: attention on every row of x, MoE and head on these only (drafts and outputs [R])."""
        cos, sin = rotary.tables(positions, max_pos)
        h, delta = self.block(x, None, cos, sin, backend, kv_layer, rows)
        x, out = add_rms_norm(h, delta, self.head_norm, self.eps, self.kernels)
        logits = self.head(x)
        if self.kernels is None or logits.device.type != "cpu":
            return logits.argmax(-1), out
        # the same index (bf16 -> fp32 is exact; first on ties, as torch): ~11 us where
        # ATen's bf16 argmax took ~30 on the demo's 4096-token vocabulary (AVX2 EPYC)
        return self.kernels.argmax_f32(logits.float()), out

    def empty_step(self) -> None:
        """Expert parallelism, a rank whose step does not run this layer in full while a peer's
        does: the layer's MoE exchange with no rows (nothing where its MLP is dense)."""
        mlp = self.block.mlp
        if isinstance(mlp, MoELayer):
            mlp.empty_step(self.dtype)

    def __call__(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, max_pos: int,
                 rows: torch.Tensor, rotary: Rotary, backend: AttentionBackend,
                 kv_layer: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (the main model's, after its final norm), next_ids / positions [T]
        (token i+1 at position i) -> fp32 logits [len(rows), vocab] of the rows asked for; the
        T entries are cached in kv_layer (the backend planned this batch's positions)."""
        x = self._input(hidden, next_ids)
        cos, sin = rotary.tables(positions, max_pos)
        h, delta = self.block(x, None, cos, sin, backend, kv_layer)
        x, _ = add_rms_norm(h.index_select(0, rows), delta.index_select(0, rows), self.head_norm, self.eps,
                            self.kernels)
        return self.head(x).float()
