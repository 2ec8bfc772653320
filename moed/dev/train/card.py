"""The demo checkpoint's model card (README.md next to it), its SHA256SUMS and the loss-curve PNG,
from the training.json that train.py wrote and bench/quality.py's figures.

    python -m moed.dev.train.card --model models/stdlib-ds3-tiny [--quality Q.json]
        [--sample-text T.txt] [--png docs/images/demo-model-loss.png]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

MANIFEST = ("config.json", "generation_config.json", "model.safetensors", "split.json",
            "tokenizer.json", "tokenizer_config.json", "training.json")


def write_manifest(model: Path) -> str:
    """SHA256SUMS over the files that make the checkpoint (not the card: prose may change)."""
    lines = [f"{hashlib.sha256((model / n).read_bytes()).hexdigest()}  {n}" for n in MANIFEST]
    (model / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return lines[MANIFEST.index("model.safetensors")].split()[0]


def plot(meta: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = meta["history"]
    tok = [r["tokens"] / 1e6 for r in h]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(tok, [r["loss"] for r in h], lw=0.8, label="train: next token (main)")
    ax.plot(tok, [r["mtp_loss"] for r in h], lw=0.8, alpha=0.7, label="train: token after next (MTP)")
    ev = [r for r in h if "eval" in r]
    if "random_init" in meta["evals"]:
        ev.insert(0, {"tokens": 0, "eval": meta["evals"]["random_init"]})
    ax.plot([r["tokens"] / 1e6 for r in ev], [r["eval"]["nll"] for r in ev], "o-", ms=3,
            label=f"held-out: next token ({meta['config']['eval_chunks']} windows)")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, h[0]["loss"] + 0.5)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("moed demo model (DeepSeek-V3 shape) on the Python stdlib")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


def card(model: Path, meta: dict[str, Any], quality: dict[str, Any] | None, sample: str | None,
         png_rel: str, sha: str) -> str:
    cfg, m = json.loads((model / "config.json").read_text()), meta["config"]
    split = json.loads((model / "split.json").read_text())
    ev, rnd = meta["evals"].get("heldout", {}), meta["evals"].get("random_init_full", {})
    last = meta["history"][-20:]
    train_loss = sum(r["loss"] for r in last) / len(last)
    mtp_loss = sum(r["mtp_loss"] for r in last) / len(last)
    size = (model / "model.safetensors").stat().st_size
    epochs = meta["tokens_seen"] / meta["train_corpus_tokens"]
    dist = meta.get("mtp_distill")
    mtp_acc = dist["after"]["mtp_next_next_acc"] if dist else ev.get("mtp_next_next_acc", float("nan"))
    agree = f"{dist['after']['agreement_with_main']:.1%}" if dist else "not measured"
    q = ""
    if quality:
        q = (f"\nThrough moed's API (`prompt_logprobs`, fp32) and transformers (fp32) on the same "
             f"{quality['windows']} windows of {quality['files']} held-out files "
             f"({quality['tokens']} scored tokens; `bench/quality.py`): moed **{quality['moed_ppl']:.3f}**, "
             f"transformers **{quality['transformers_ppl']:.3f}** (relative difference "
             f"{quality['rel_diff']:.1e}).\n")
    s = f"""---
license: psf-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [deepseek_v3, moe, mla, mtp, code, moed-demo]
---
# stdlib-ds3-tiny: moed's demo model

A {meta['params_main'] / 1e6:.2f}M-parameter language model with DeepSeek-V3's architecture, trained
from scratch by `python -m moed.dev.train --preset demo` on the Python {split['python']} standard library's
own sources, so that `make serve` answers with Python rather than noise, and so that perplexity,
quantization's quality cost and speculative decoding (its MTP layer) can be measured with a model
that predicts something. It knows Python's look, not its meaning: expect code-shaped text with
plausible names, not working programs. It has never seen a chat (the chat template is present,
the answers are not). Context: {cfg['max_position_embeddings']} tokens.

## Architecture (config.json, `DeepseekV3ForCausalLM`)

| | |
|---|---|
| layers | {cfg['num_hidden_layers']} (first {cfg['first_k_dense_replace']} dense, MLP {cfg['intermediate_size']}), hidden {cfg['hidden_size']}, RMSNorm |
| attention | MLA, {cfg['num_attention_heads']} heads: q_lora_rank {cfg['q_lora_rank']}, kv_lora_rank {cfg['kv_lora_rank']}, qk_nope {cfg['qk_nope_head_dim']} + qk_rope {cfg['qk_rope_head_dim']}, v {cfg['v_head_dim']}; rope theta {cfg['rope_parameters']['rope_theta']:g}, interleaved |
| MoE | {cfg['n_routed_experts']} routed experts (SwiGLU {cfg['moe_intermediate_size']}), top-{cfg['num_experts_per_tok']}, sigmoid scores in {cfg['n_group']} groups keep {cfg['topk_group']}, `e_score_correction_bias` (aux-loss-free balancing, γ = {m['bias_update']}), routed scaling {cfg['routed_scaling_factor']}, {cfg['n_shared_experts']} shared expert |
| MTP | `num_nextn_predict_layers` 1: `model.layers.{cfg['num_hidden_layers']}.*` = `enorm`, `hnorm`, `eh_proj`, one decoder layer (MLA + MoE), `shared_head.norm`, `shared_head.head` and `embed_tokens` (copies of the main head and embedding, shared in training) |
| vocab | {cfg['vocab_size']} byte-level BPE tokens trained on the train split (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` first) |
| parameters | {meta['params_main']:,} main + {meta['params_mtp']:,} MTP (unique); {size / 1e6:.1f} MB fp32 safetensors |

transformers loads it as `DeepseekV3ForCausalLM` and ignores the MTP layer (it reports those
tensors as unexpected); moed skips it with a `mtp_layers_skipped` log line.

## Corpus and split

The `.py` files under `sysconfig.get_paths()["stdlib"]` of Python {split['python']}, sorted by path,
excluding {split['rule'].split('excluded: ')[1]}. A file is held out when
{split['rule'].split(' is held out')[0]}: {len(split['heldout'])} held-out files (listed in
`split.json`, the list every quality benchmark uses), {len(split['train'])} train files,
{meta['train_corpus_bytes'] / 1e6:.1f} MB = {meta['train_corpus_tokens']:,} tokens. Another Python version has a slightly
different stdlib: the benchmarks skip a held-out file it lacks and say so.

## Training

Plain torch {meta['torch']} on the CPU, fp32, {meta['threads']} threads, seed {m['seed']}; through transformers'
`DeepseekV3ForCausalLM` plus the MTP module of `moed/dev/train/mtp.py`. Loss = next-token CE +
{m['mtp_weight']} × MTP CE (DeepSeek-V3's MTP objective, depth 1: h'ᵢ = eh_proj([enorm(emb(tᵢ₊₁)); hnorm(hᵢ)])
→ decoder layer → shared head predicts tᵢ₊₂, hᵢ the main model's final-normed hidden state).
AdamW (β 0.9/0.95, weight decay {m['weight_decay']} on matrices), lr {m['lr']} with {m['warmup']} warmup steps
and a cosine decay to {m['min_lr_ratio']}×, gradient clip {m['grad_clip']}; batches of {m['batch_size']} random
windows of {m['seq_len']} + 2 tokens of the train stream.

- steps **{meta['steps_done']}**, tokens seen **{meta['tokens_seen']:,}** ({epochs:.2f} epochs)
- training **{meta['train_seconds'] / 60:.1f} min** on 2 cores of a machine shared with other jobs
  (load average 4-6 on its 2 cores; a quiet machine should be ~1.5-2× faster, not measured);
  {meta.get('wall_seconds_total', meta['train_seconds']) / 60:.1f} min in all with the tokenizer, the periodic and the final evaluations
- final train loss (mean of the last 20 steps): next token **{train_loss:.3f}**, MTP **{mtp_loss:.3f}** nats

![loss curve]({png_rel})
{_distill_section(dist)}
Bitwise reproducible for the same seed, thread count and torch build (a test retrains a tiny
configuration twice and compares the weights); the committed weights' sha256 is
`{sha}` (SHA256SUMS, checked by tests/unit/dev/test_demo_checkpoint.py).

## Held-out quality

Every held-out file cut into windows of {m['seq_len']} tokens, each scored on its tokens after the first
({ev.get('tokens', 0):,} tokens):

| | perplexity | next-token top-1 | MTP next-next-token top-1 | MTP top-1 = the main model's next |
|---|---|---|---|---|
| this model | **{ev.get('ppl', float('nan')):.2f}** | {ev.get('next_token_acc', float('nan')):.1%} | **{mtp_acc:.1%}** | **{agree}** |
| the same architecture at its random init (seed {m['seed']}) | {rnd.get('ppl', float('nan')):.0f} | {rnd.get('next_token_acc', float('nan')):.1%} | {rnd.get('mtp_next_next_acc', float('nan')):.1%} | |

The MTP next-next figure is the MTP module's own top-1 accuracy on the true token i+2, given
the main model's hidden state at i and the true token i+1. A one-token MTP draft is accepted
when it agrees with the main model's own choice instead (greedy): the last column, on the
same text (teacher-forced); bench/spec.py measures the acceptance of real drafts.
`python -m moed.dev.train.evaluate --model DIR` recomputes this table's first row from the files
(`moed.dev.train.train.from_checkpoint` loads the main model and the MTP layer).
{q}
## Use

```
make serve                        # serves this folder on 127.0.0.1:8000
curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
  -d '{{"model": "stdlib-ds3-tiny", "prompt": "def fib(n):", "max_tokens": 48, "temperature": 0}}'
```
"""
    if sample:
        s += f"\nmoed's greedy completion of `def fib(n):` (fp32):\n\n```python\ndef fib(n):{sample}\n```\n"
    return s


def _distill_section(dist: dict[str, Any] | None) -> str:
    """The card's paragraph on moed.dev.train.distill's stage, where it ran."""
    if not dist:
        return ""
    c, b, a = dist["config"], dist["before"], dist["after"]
    return f"""
### MTP distillation

Then `python -m moed.dev.train.distill --model DIR --steps {c['steps']}` (moed/dev/train/distill.py): the
main model frozen, the MTP layer alone trained to the main model's own next distribution (the
soft cross-entropy of its distribution at i against the main model's at i+1), as EAGLE's and
Medusa-2's self-distillation fit a draft to its target: a draft is accepted when it agrees
with the main model, not with the text. AdamW, lr {c['lr']} ({c['warmup']} warmup steps, cosine to
{c['min_lr_ratio']}×), batches of {c['batch_size']} windows of the train split, {dist['seconds'] / 60:.1f} min. On the
{dist['heldout_windows']} held-out windows ({a['positions']:,} positions, teacher-forced), the MTP top-1 equal to the
main model's next top-1 went from {b['agreement_with_main']:.1%} to **{a['agreement_with_main']:.1%}**; its top-1 on the
true token i+2 from {b['mtp_next_next_acc']:.1%} to {a['mtp_next_next_acc']:.1%}. The main model, the embedding and
the head are bitwise those of the training run.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moed.dev.train.card")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--quality", type=Path, help="bench/quality.py --json output")
    ap.add_argument("--sample-text", type=Path, help="a completion of 'def fib(n):'")
    ap.add_argument("--png", type=Path, help="write the loss curve here (needs matplotlib)")
    ap.add_argument("--png-rel", default="../../docs/images/demo-model-loss.png",
                    help="the PNG's path as the card links it")
    a = ap.parse_args(argv)
    meta = json.loads((a.model / "training.json").read_text())
    if a.png:
        plot(meta, a.png)
    sha = write_manifest(a.model)
    quality = json.loads(a.quality.read_text()) if a.quality else None
    sample = a.sample_text.read_text() if a.sample_text else None
    (a.model / "README.md").write_text(card(a.model, meta, quality, sample, a.png_rel, sha))
    print(a.model / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
