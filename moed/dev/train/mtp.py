"""DeepSeek-V3's multi-token-prediction (MTP) module, depth 1, laid out as its checkpoints are.

At position i it combines the main model's final hidden state h_i (after the final norm, as
vLLM's deepseek_mtp passes it) with the embedding of token i+1 and predicts token i+2:

    x = eh_proj(concat(enorm(embed(t[i+1])), hnorm(h[i])))
    x = one more decoder block (MLA + the config's MoE, causal over the sequence)
    logits = shared_head.head(shared_head.norm(x))

Embedding and output head are the main model's (shared in training, as in DeepSeek-V3); the
checkpoint stores copies under the MTP layer's own names: model.layers.{N}.{enorm, hnorm,
eh_proj, embed_tokens, shared_head.norm, shared_head.head, self_attn.*, mlp.*, *_layernorm}
with N = num_hidden_layers and config num_nextn_predict_layers = 1.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm


class MTPModule(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = config.num_hidden_layers
        self.enorm = DeepseekV3RMSNorm(h, eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(config, self.layer_idx)
        self.head_norm = DeepseekV3RMSNorm(h, eps)        # shared_head.norm

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """hidden [B, T, H] (main model, post-norm), next_embeds [B, T, H] = embed(t[i+1])
        -> [B, T, H] normed, for the shared head. Causal attention (sdpa, no mask)."""
        x = self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(hidden)), dim=-1))
        x = self.block(x, attention_mask=None, position_embeddings=position_embeddings)
        return self.head_norm(x)

    def checkpoint_tensors(self, embed: torch.Tensor, head: torch.Tensor) -> dict[str, torch.Tensor]:
        """This module's tensors under DeepSeek-V3's checkpoint names (experts one by one)."""
        p = f"model.layers.{self.layer_idx}."
        out = {p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
               p + "eh_proj.weight": self.eh_proj.weight, p + "embed_tokens.weight": embed,
               p + "shared_head.norm.weight": self.head_norm.weight, p + "shared_head.head.weight": head}
        for name, t in self.block.state_dict().items():
            if name == "mlp.experts.gate_up_proj":
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[p + f"mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                    out[p + f"mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
            elif name == "mlp.experts.down_proj":
                for e in range(t.shape[0]):
                    out[p + f"mlp.experts.{e}.down_proj.weight"] = t[e]
            else:
                out[p + name] = t
        return {k: v.detach().contiguous().clone() for k, v in out.items()}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], embed: torch.Tensor,
                                head: torch.Tensor) -> None:
        """The inverse of checkpoint_tensors: this module's weights from a checkpoint's tensors.
        The stored embedding and head must equal the main model's (they are shared here)."""
        p = f"model.layers.{self.layer_idx}."
        mine = {k.removeprefix(p): v for k, v in tensors.items() if k.startswith(p)}
        for name, shared in (("embed_tokens.weight", embed), ("shared_head.head.weight", head)):
            if not torch.equal(mine.pop(name).to(shared.dtype), shared.detach()):
                raise ValueError(f"{p}{name} differs from the main model's: not a shared-head MTP layer")
        own = {"enorm.weight": self.enorm.weight, "hnorm.weight": self.hnorm.weight,
               "eh_proj.weight": self.eh_proj.weight, "shared_head.norm.weight": self.head_norm.weight}
        block = dict(self.block.state_dict())
        n = block["mlp.experts.gate_up_proj"].shape[0]
        experts = {k: mine.pop(k) for k in list(mine) if k.startswith("mlp.experts.")}
        fused = {"mlp.experts.gate_up_proj": torch.stack([torch.cat((experts[f"mlp.experts.{e}.gate_proj.weight"],
                                                                     experts[f"mlp.experts.{e}.up_proj.weight"]))
                                                          for e in range(n)]),
                 "mlp.experts.down_proj": torch.stack([experts[f"mlp.experts.{e}.down_proj.weight"] for e in range(n)])}
        with torch.no_grad():
            for name, param in own.items():
                param.copy_(mine.pop(name))
        rest = {**{k: v for k, v in mine.items()}, **fused}
        if set(rest) != set(block):
            raise ValueError(f"MTP layer tensors do not match the decoder block: "
                             f"{sorted(set(rest) ^ set(block))[:6]}")
        self.block.load_state_dict(rest)
