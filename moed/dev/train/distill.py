"""The MTP layer distilled on its own main model: a second training stage for a checkpoint that
drafts with its MTP layer (speculative.method mtp).

    python -m moed.dev.train.distill --model models/stdlib-ds3-tiny [--steps 400] [--threads 2]

DeepSeek-V3 trains its MTP module on the true token i+2. A draft is accepted when it agrees
with the main model's own choice at i+1 instead (greedy), so this stage fits the MTP layer to
that: the main model frozen, the loss is the cross-entropy of the MTP layer's distribution at i
against the main model's distribution at i+1 (soft targets; the KL divergence plus a constant),
on windows of the training split (split.json), as EAGLE's and Medusa-2's self-distillation
fit a draft to its target. Only the MTP layer's own weights move (its norms, eh_proj and
decoder block, and its router's aux-loss-free bias as training moves it); the main model, the
shared embedding and head stay bitwise as they were. The checkpoint is rewritten in place
(model.safetensors, training.json's "mtp_distill"); the acceptance it buys is measured by
bench/spec.py, the held-out agreement (the MTP argmax at i equal to the main argmax at i+1,
teacher-forced) here, before and after.

Deterministic given the seed, the thread count and the torch build, as train.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moed.dev.train import corpus
from moed.dev.train.train import Model, _lr, _optimizer, from_checkpoint, heldout_chunks


CHECK_WINDOWS = 24
HISTORY_EVERY = 10      # steps between the records training.json keeps (and the last)


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    steps: int = 400
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update: float = 1e-3       # the MTP router's aux-loss-free balancing (train.py's gamma)
    seed: int = 0
    threads: int = 2
    eval_windows: int = 0           # held-out windows scored before and after (0: all)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or self.eval_windows < 0 or self.warmup < 0:
            raise ValueError(f"lr must be > 0 and warmup, eval_windows >= 0 "
                             f"(got {self.lr}, {self.warmup}, {self.eval_windows})")


def _main_states(model: Model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen main model on x [B, T+1]: (hidden after the final norm at 0..T-1 [B, T, H],
    its log-probabilities at 1..T [B, T, V], the targets of the MTP layer at 0..T-1)."""
    t = x.shape[1] - 1
    with torch.no_grad():
        h = model.lm.model(input_ids=x).last_hidden_state
        logp = torch.log_softmax(model.lm.lm_head(h[:, 1:t + 1]).float(), dim=-1)
    return h[:, :t], logp


def _mtp_logits(model: Model, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The MTP layer at 0..T-1 from the main hidden states h [B, T, H] and tokens x [B, T+1]."""
    t = h.shape[1]
    pos = torch.arange(t, device=x.device).unsqueeze(0)
    pe = model.lm.model.rotary_emb(h, pos)
    return model.lm.lm_head(model.mtp(h, model.lm.model.embed_tokens(x[:, 1:t + 1]), pe))


def loss(model: Model, x: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy of the MTP layer at i against the main model at i + 1 (x [B, T+1])."""
    h, target = _main_states(model, x)
    logq = torch.log_softmax(_mtp_logits(model, h, x).float(), dim=-1)
    return -(target.exp() * logq).sum(-1).mean()


@torch.no_grad()
def agreement(model: Model, chunks: list[list[int]]) -> dict[str, float]:
    """Teacher-forced on held-out windows: how often the MTP argmax at i equals the main
    argmax at i + 1 (a one-token greedy draft's acceptance on the corpus's own text), and the
    MTP layer's top-1 on the true token i + 2."""
    was = model.training
    model.eval()
    agree = true = n = 0
    for c in chunks:
        if len(c) < 3:
            continue
        x = torch.tensor([c])
        h, logp = _main_states(model, x)
        drafts = _mtp_logits(model, h, x).argmax(-1)[0]      # [len-1]: drafts for 2..len
        k = len(c) - 2
        agree += int((drafts[:k] == logp[0, :k].argmax(-1)).sum())
        true += int((drafts[:k] == x[0, 2:]).sum())
        n += k
    model.train(was)
    return {"positions": n, "agreement_with_main": agree / max(n, 1), "mtp_next_next_acc": true / max(n, 1)}


def _train_ids(model_dir: Path, tok: Any) -> torch.Tensor:
    """The training split's files (split.json), documents joined by <|endoftext|>."""
    files = json.loads((model_dir / "split.json").read_text())["train"]
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for rel in files:
        text = corpus.read(rel)
        if text is not None:
            ids.append(eot)
            ids.extend(tok.encode(text, add_special_tokens=False).ids)
    return torch.tensor(ids, dtype=torch.int64)


def distill(model_dir: Path, cfg: DistillConfig, log=print) -> dict[str, Any]:
    """Distil the MTP layer of the checkpoint in model_dir and rewrite it there -> the record
    added to its training.json (as "mtp_distill")."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    for name in ("training.json", "split.json", "tokenizer.json", "model.safetensors"):
        if not (model_dir / name).is_file():
            raise ValueError(f"{model_dir} has no {name}: not a checkpoint python -m moed.dev.train wrote")
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    try:
        meta = json.loads((model_dir / "training.json").read_text())
        seq_len = int(meta["config"]["seq_len"])
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        chunks, _ = heldout_chunks(tok, json.loads((model_dir / "split.json").read_text())["heldout"], seq_len,
                                   limit=cfg.eval_windows or None)
        ids = _train_ids(model_dir, tok)
        torch.manual_seed(cfg.seed)
        model = from_checkpoint(model_dir)
        model.train()
        for p in model.lm.parameters():
            p.requires_grad_(False)
        own = list(model.mtp.parameters())
        opt = _optimizer(own, cfg)      # train.py's AdamW groups, on the MTP layer's weights
        router = model.routers[-1]          # the MTP block's (model.mtp is built after model.lm)
        before = agreement(model, chunks)
        log(json.dumps({"before": before}))
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        n = len(ids) - (seq_len + 1)
        t0, history = time.monotonic(), []
        for step in range(cfg.steps):
            starts = torch.randint(0, n, (cfg.batch_size,), generator=gen)
            x = torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])
            lr = _lr(cfg, step)      # train.py's warmup + cosine, on this config's fields
            for g in opt.param_groups:
                g["lr"] = lr
            model.routed.clear()
            model.record = True
            value = loss(model, x)
            model.record = False
            opt.zero_grad(set_to_none=True)
            value.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(own, cfg.grad_clip)
            opt.step()
            with torch.no_grad():       # the MTP router's balancing only: the main model's stays
                load = torch.bincount(model.routed[-1].flatten(), minlength=router.num_experts).float()
                router.e_score_correction_bias += cfg.bias_update * torch.sign(load.mean() - load)
            model.routed.clear()
            rec = {"step": step + 1, "loss": round(value.item(), 4), "lr": lr,
                   "grad_norm": round(float(gnorm), 3), "seconds": round(time.monotonic() - t0, 1)}
            if (step + 1) % HISTORY_EVERY == 0 or step + 1 == cfg.steps:
                history.append(rec)
            if (step + 1) % 50 == 0 or step + 1 == cfg.steps:
                log(json.dumps(rec))
        after = agreement(model, chunks)
        log(json.dumps({"after": after}))
        # a few windows' figure, for a test to check the stored layer against (the whole
        # split takes minutes)
        check = {"windows": min(CHECK_WINDOWS, len(chunks)), **agreement(model, chunks[:CHECK_WINDOWS])}
        tensors = load_file(str(model_dir / "model.safetensors"))
        mtp = model.mtp.checkpoint_tensors(model.lm.model.embed_tokens.weight, model.lm.lm_head.weight)
        for k in mtp:
            if k not in tensors:
                raise ValueError(f"{model_dir}: the MTP layer's {k} is not in the checkpoint")
        tensors.update({k: v.float().contiguous() for k, v in mtp.items()})
        save_file(dict(sorted(tensors.items())), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        record = {"config": dataclasses.asdict(cfg), "seconds": round(time.monotonic() - t0, 1),
                  "train_tokens": len(ids), "heldout_windows": len(chunks), "before": before,
                  "after": after, "check": check, "history": history}
        meta["mtp_distill"] = record
        (model_dir / "training.json").write_text(json.dumps(meta, indent=1))
        return record
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moed.dev.train.distill", description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="checkpoint directory (rewritten)")
    ap.add_argument("--steps", type=int, default=DistillConfig.steps)
    ap.add_argument("--lr", type=float, default=DistillConfig.lr)
    ap.add_argument("--seed", type=int, default=DistillConfig.seed)
    ap.add_argument("--threads", type=int, default=DistillConfig.threads)
    ap.add_argument("--eval-windows", type=int, default=DistillConfig.eval_windows)
    a = ap.parse_args(argv)
    try:
        distill(a.model, DistillConfig(steps=a.steps, lr=a.lr, seed=a.seed, threads=a.threads,
                                       eval_windows=a.eval_windows))
    except ValueError as e:     # a bad setting or directory: one line, the checkpoint untouched
        print(f"distill: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
