"""The training loop: data, model, AdamW with a cosine schedule, DeepSeek-V3's MTP loss and
auxiliary-loss-free balancing, evaluation on the held-out split, export in Hugging Face format.

Deterministic given the seed, the thread count and the torch version: the same run twice gives
bitwise-equal weights (tests/unit/dev/test_train.py). Different thread counts or torch builds
may reorder float reductions, so they give different (equally good) weights.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moed.dev.train import corpus
from moed.dev.train.mtp import MTPModule

ARCH = "deepseek_v3"
EOT = "<|endoftext|>"       # separates documents in the training stream


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: dict[str, Any]           # moed's checkpoint names (moed/dev/checkpoint.py), vocab_size aside
    vocab_size: int = 4096
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 1500
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3         # lambda of DeepSeek-V3's MTP loss (0.3 early in its training)
    bias_update: float = 1e-3       # gamma of the aux-loss-free balancing (DeepSeek-V3's 0.001)
    seed: int = 0
    threads: int = 2
    eval_every: int = 100
    eval_chunks: int = 24           # held-out windows of the periodic evaluation (all at the end)
    save_every: int = 100
    max_corpus_bytes: int = 12_000_000
    max_train_files: int | None = None

    def __post_init__(self) -> None:
        bad = {k for k in self.model} - set(_MODEL_KEYS)
        if bad:
            raise ValueError(f"unknown model keys {sorted(bad)}; known: {sorted(_MODEL_KEYS)}")
        if self.seq_len > int(self.model["max_position_embeddings"]):
            raise ValueError("seq_len exceeds max_position_embeddings")


_MODEL_KEYS = ("hidden_size", "num_layers", "num_heads", "num_experts", "top_k", "moe_intermediate_size",
               "dense_intermediate_size", "max_position_embeddings", "q_lora_rank", "kv_lora_rank",
               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
               "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor", "init_std",
               "rope_theta", "rms_norm_eps")

PRESETS: dict[str, TrainConfig] = {
    # The committed demo model (models/stdlib-ds3-tiny): sized for ~35 min of 2 quiet cores
    # (~1.5-2x that on a busy machine); fp32 on disk (~17 MB with the MTP layer's copies).
    "demo": TrainConfig(model=dict(
        hidden_size=128, num_layers=4, num_heads=4, num_experts=8, top_k=2, moe_intermediate_size=128,
        dense_intermediate_size=384, max_position_embeddings=256, q_lora_rank=64, kv_lora_rank=48,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, init_std=0.02,
        rope_theta=10000.0),
        vocab_size=4096, seq_len=256, batch_size=16, steps=750, lr=2.5e-3, warmup=50),
    # The reproducibility test's: seconds, a few KB of text.
    "tiny": TrainConfig(model=dict(
        hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2, moe_intermediate_size=16,
        dense_intermediate_size=32, max_position_embeddings=64, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, init_std=0.02,
        rope_theta=10000.0),
        vocab_size=320, seq_len=32, batch_size=2, steps=5, warmup=2, eval_every=5, eval_chunks=2,
        save_every=5, max_corpus_bytes=8_000, max_train_files=3),
}


# ---------------------------------------------------------------------------------------- data

@dataclasses.dataclass(frozen=True)
class Data:
    tokenizer: Any                          # tokenizers.Tokenizer
    train_ids: torch.Tensor                 # [N] int64, documents joined by EOT
    train_files: tuple[str, ...]            # the files in train_ids, in order
    heldout_files: tuple[str, ...]
    all_train_files: tuple[str, ...]
    train_bytes: int


def load_data(cfg: TrainConfig, root: Path | None = None) -> Data:
    from moed.dev import bpe_train

    files = corpus.list_files(root)
    train, heldout = corpus.split(files)
    texts, used, total = [], [], 0
    for rel in train[:cfg.max_train_files]:
        text = corpus.read(rel, root)
        if text is None:
            continue
        texts.append(text)
        used.append(rel)
        total += len(text.encode())
        if total >= cfg.max_corpus_bytes:
            break
    tok = bpe_train.train_bpe("chatml", cfg.vocab_size, texts)
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(eot)
        ids.extend(enc.ids)
    return Data(tok, torch.tensor(ids, dtype=torch.int64), tuple(used), tuple(heldout), tuple(train), total)


def heldout_chunks(tok: Any, files: list[str] | tuple[str, ...], size: int, root: Path | None = None,
                   limit: int | None = None) -> tuple[list[list[int]], list[str]]:
    """Token windows of the held-out files (corpus.chunks), and the files this interpreter lacks;
    limit: stop after that many windows."""
    out, missing = [], []
    for rel in files:
        if limit is not None and len(out) >= limit:
            return out[:limit], missing
        text = corpus.read(rel, root)
        if text is None:
            missing.append(rel)
            continue
        out.extend(corpus.chunks(tok.encode(text, add_special_tokens=False).ids, size))
    return out, missing


# --------------------------------------------------------------------------------------- model

def build_config(cfg: TrainConfig, tok: Any):
    from moed.dev import bpe_train, checkpoint as init

    ids = {t: tok.token_to_id(t) for t in bpe_train.SPECIAL_TOKENS["chatml"]}
    params = {**cfg.model, "vocab_size": tok.get_vocab_size(), "dtype": "float32"}
    config = init._build_config(ARCH, params, ids)
    config.num_nextn_predict_layers = 1
    config._attn_implementation = "sdpa"      # causal without a mask; MTP's block relies on it
    return config


class Model(torch.nn.Module):
    """transformers' DeepseekV3ForCausalLM plus the MTP module (sharing embedding and head)."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import DeepseekV3ForCausalLM

        self.lm = DeepseekV3ForCausalLM(config)
        self.mtp = MTPModule(config)
        self.mtp.apply(self.lm._init_weights)
        self.routed: list[torch.Tensor] = []
        self.record = False
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
        self.routers = [m for m in self.modules() if isinstance(m, DeepseekV3TopkRouter)]
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if self.record:
            self.routed.append(output[2].detach())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T+2] -> main logits [B, T, V] (targets x[:, 1:T+1]) and MTP logits [B, T, V]
        (targets x[:, 2:T+2])."""
        t = x.shape[1] - 2
        h = self.lm.model(input_ids=x[:, :t]).last_hidden_state
        pos = torch.arange(t, device=x.device).unsqueeze(0)
        pe = self.lm.model.rotary_emb(h, pos)
        m = self.mtp(h, self.lm.model.embed_tokens(x[:, 1:t + 1]), pe)
        return self.lm.lm_head(h), self.lm.lm_head(m)

    @torch.no_grad()
    def update_bias(self, gamma: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: each router's e_score_correction_bias
        moves by gamma towards the mean load (up for underloaded experts, down for overloaded)."""
        assert len(self.routed) == len(self.routers), (len(self.routed), len(self.routers))
        for r, idx in zip(self.routers, self.routed):
            load = torch.bincount(idx.flatten(), minlength=r.num_experts).float()
            r.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
        self.routed.clear()


def from_checkpoint(model_dir: str | Path) -> Model:
    """A checkpoint this module exported (or any with the same MTP layout), MTP layer included,
    in fp32 for evaluation: the speculation work's draft model."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    d = Path(model_dir)
    config = AutoConfig.from_pretrained(d)
    if int(getattr(config, "num_nextn_predict_layers", 0) or 0) != 1:
        raise ValueError(f"{d}: num_nextn_predict_layers is not 1")
    config._attn_implementation = "sdpa"
    model = Model(config)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()          # the MTP tensors are "unexpected" to transformers
    hf_logging.disable_progress_bar()
    try:
        lm = DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.lm.load_state_dict(lm.state_dict())
    model.mtp.load_checkpoint_tensors({k: v.float() for k, v in load_file(str(d / "model.safetensors")).items()},
                                      model.lm.model.embed_tokens.weight, model.lm.lm_head.weight)
    return model.eval()


def losses(model: Model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits, mlogits = model(x)
    t = logits.shape[1]
    v = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, v), x[:, 1:t + 1].reshape(-1))
    mtp = F.cross_entropy(mlogits.reshape(-1, v), x[:, 2:t + 2].reshape(-1))
    return main, mtp


@torch.no_grad()
def evaluate(model: Model, chunks: list[list[int]]) -> dict[str, float]:
    """Per window: main NLL over its tokens after the first (the perplexity of bench/quality.py),
    and the MTP module's top-1 accuracy on token i+2 wherever it exists (and the main model's
    on token i+1, for comparison)."""
    model.eval()
    nll, n, mtp_hit, mtp_n, hit = 0.0, 0, 0, 0, 0
    for c in chunks:
        x = torch.tensor([c + [0]])                 # padded by one: forward wants T+2 ids
        logits, mlogits = model(x)                  # positions 0..len-2 of c
        tgt = x[0, 1:len(c)]
        lp = torch.log_softmax(logits[0].double(), dim=-1)
        nll -= lp.gather(1, tgt.unsqueeze(1)).sum().item()
        n += len(tgt)
        hit += int((logits[0].argmax(-1) == tgt).sum())
        k = len(c) - 2                              # MTP at i predicts c[i+2], i < len-2
        if k > 0:
            mtp_hit += int((mlogits[0, :k].argmax(-1) == x[0, 2:len(c)]).sum())
            mtp_n += k
    model.train()
    return {"nll": nll / max(n, 1), "ppl": math.exp(nll / max(n, 1)), "tokens": n,
            "next_token_acc": hit / max(n, 1), "mtp_next_next_acc": mtp_hit / max(mtp_n, 1)}


# -------------------------------------------------------------------------------------- export

def export(model: Model, data: Data, cfg: TrainConfig, out: Path, meta: dict[str, Any]) -> None:
    """Hugging Face format: config.json (num_nextn_predict_layers 1), model.safetensors (fp32,
    the weights as trained), the MTP layer as
    model.layers.{N}.*, tokenizer files, generation_config.json, split.json, training.json."""
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    from moed.dev import checkpoint as init

    hf_logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    config = model.lm.config
    ids = init._write_tokenizer(ARCH, out, config.vocab_size, config.max_position_embeddings, tok=data.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        model.lm.save_pretrained(tmp)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
        (out / "config.json").write_text((Path(tmp) / "config.json").read_text())
    tensors.update(model.mtp.checkpoint_tensors(model.lm.model.embed_tokens.weight, model.lm.lm_head.weight))
    tensors = {k: v.float().contiguous() for k, v in sorted(tensors.items())}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=[ids["<|im_end|>"], ids[EOT]],
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    (out / "split.json").write_text(json.dumps({
        "python": platform.python_version(), "stdlib": "sysconfig.get_paths()['stdlib']",
        "rule": f"sha256(relative path)[:4] mod 100 < {corpus.HELDOUT_PERCENT} is held out; "
                f"excluded: top-level {list(corpus.EXCLUDED_TOP)}, any 'tests' folder, files over "
                f"{corpus.MAX_FILE_BYTES} bytes",
        "heldout": list(data.heldout_files), "train": list(data.train_files)}, indent=1))
    (out / "training.json").write_text(json.dumps(meta, indent=1))


# ---------------------------------------------------------------------------------------- loop

def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def _optimizer(params: list[torch.nn.Parameter], cfg: Any) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (cfg: TrainConfig or distill's DistillConfig)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]      # norms
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _log(path: Path | None, rec: dict[str, Any]) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if path is not None:
        with path.open("a") as f:
            f.write(line + "\n")


def train(cfg: TrainConfig, out: Path, work: Path | None = None, root: Path | None = None,
          final_eval: bool = True, resume: bool = False) -> dict[str, Any]:
    """Train and export to out; work (default out/../.train-<name>) holds the log and the
    periodic training state (resume from it with resume=True). Runs with cfg.threads threads
    and deterministic algorithms, and restores both settings after."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _train(cfg, out, work, root, final_eval, resume)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(cfg: TrainConfig, out: Path, work: Path | None, root: Path | None, final_eval: bool,
           resume: bool) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    t_start = time.monotonic()
    data = load_data(cfg, root)
    config = build_config(cfg, data.tokenizer)
    torch.manual_seed(cfg.seed)
    model = Model(config)
    model.train()
    opt = _optimizer(list(model.parameters()), cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    chunks, missing = heldout_chunks(data.tokenizer, data.heldout_files, cfg.seq_len, root, cfg.eval_chunks)
    work = work or out.parent / f".train-{out.name}"
    work.mkdir(parents=True, exist_ok=True)
    log_path, state_path = work / "log.jsonl", work / "state.pt"
    history: list[dict[str, Any]] = []
    step, seconds_before = 0, 0.0
    if resume and state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, history, seconds_before = st["step"], st["history"], st["seconds"]
    elif log_path.exists():
        log_path.unlink()
    params = sum(p.numel() for p in model.lm.parameters())
    mtp_params = sum(p.numel() for p in model.mtp.parameters())
    evals: dict[str, Any] = {}
    if step == 0:
        evals["random_init"] = evaluate(model, chunks)
        _log(log_path, {"step": 0, "eval": evals["random_init"], "params": params, "mtp_params": mtp_params,
                        "train_tokens": len(data.train_ids)})
    n = len(data.train_ids) - (cfg.seq_len + 2)
    t0 = time.monotonic() - seconds_before
    while step < cfg.steps:
        starts = torch.randint(0, n, (cfg.batch_size,), generator=gen)
        x = torch.stack([data.train_ids[s:s + cfg.seq_len + 2] for s in starts.tolist()])
        lr = _lr(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        model.record = True
        main, mtp = losses(model, x)
        model.record = False
        loss = main + cfg.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        model.update_bias(cfg.bias_update)
        step += 1
        rec = {"step": step, "loss": round(main.item(), 4), "mtp_loss": round(mtp.item(), 4),
               "lr": lr, "grad_norm": round(float(gnorm), 3), "seconds": round(time.monotonic() - t0, 1),
               "tokens": step * cfg.batch_size * cfg.seq_len}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rec["eval"] = evaluate(model, chunks)
        history.append(rec)
        _log(log_path, rec)
        if step % cfg.save_every == 0 or step == cfg.steps:
            seconds = time.monotonic() - t0
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "step": step, "history": history, "seconds": seconds}, state_path)
            export(model, data, cfg, out, _meta(cfg, data, step, seconds, history, evals, params, mtp_params,
                                                 missing, partial=step < cfg.steps))
    train_seconds = time.monotonic() - t0
    if final_eval:
        chunks, missing = heldout_chunks(data.tokenizer, data.heldout_files, cfg.seq_len, root)
        evals["heldout"] = evaluate(model, chunks)
        torch.manual_seed(cfg.seed)
        evals["random_init_full"] = evaluate(Model(config), chunks)
    meta = _meta(cfg, data, step, train_seconds, history, evals, params, mtp_params, missing, partial=False)
    meta["wall_seconds_total"] = round(time.monotonic() - t_start, 1)
    export(model, data, cfg, out, meta)
    _log(log_path, {"done": True, "evals": evals, "train_seconds": round(train_seconds, 1)})
    return meta


def _meta(cfg: TrainConfig, data: Data, step: int, seconds: float, history: list, evals: dict,
          params: int, mtp_params: int, missing: list[str], partial: bool) -> dict[str, Any]:
    return {"config": dataclasses.asdict(cfg), "steps_done": step, "partial": partial,
            "tokens_seen": step * cfg.batch_size * cfg.seq_len, "train_seconds": round(seconds, 1),
            "train_corpus_tokens": len(data.train_ids), "train_corpus_bytes": data.train_bytes,
            "params_main": params, "params_mtp": mtp_params, "evals": evals, "heldout_missing": missing,
            "python": platform.python_version(), "torch": torch.__version__,
            "threads": cfg.threads, "cpu": platform.processor() or platform.machine(),
            "history": [{k: v for k, v in h.items()} for h in history]}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m moed.dev.train", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, type=Path, help="checkpoint directory (written)")
    ap.add_argument("--work", type=Path, help="log and training state (default: OUT/../.train-NAME)")
    ap.add_argument("--steps", type=int, help="override the preset's steps")
    ap.add_argument("--seed", type=int, help="override the preset's seed")
    ap.add_argument("--threads", type=int, help="override the preset's thread count")
    ap.add_argument("--resume", action="store_true", help="continue from WORK/state.pt")
    ap.add_argument("--no-final-eval", action="store_true", help="skip the full held-out evaluation")
    a = ap.parse_args(argv)
    cfg = PRESETS[a.preset]
    over = {k: v for k, v in (("steps", a.steps), ("seed", a.seed), ("threads", a.threads)) if v is not None}
    cfg = dataclasses.replace(cfg, **over)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    train(cfg, a.out, a.work, final_eval=not a.no_final_eval, resume=a.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
