"""Held-out perplexity of the demo model through moed's API and through transformers, side by
side; and what each weight format costs: KL against bf16 on the same text.

    .venv/bin/python bench/quality.py [--model models/stdlib-ds3-tiny] [--url http://127.0.0.1:8000]
                                      [--files N] [--api-key KEY] [--no-transformers] [--json PATH]
                                      [--formats int8,int4,fp8 [--no-api] [--group-size 128]]

The text: the held-out files of the checkpoint's split.json (Python standard-library sources
of the interpreter running this; a file this Python lacks is skipped and named). Each file is
tokenized with the checkpoint's tokenizer and cut into windows of max_position_embeddings - 1
tokens (room for the one generated token the API needs); every window is scored on its tokens
after the first. Perplexity = exp(total NLL / scored tokens).

moed: /v1/completions with the window's token ids as the prompt, `prompt_logprobs: 0`
(vLLM's field: the log-probability of each prompt token), max_tokens 1, greedy. Without --url
a `moed serve` is started on a free 127.0.0.1 port with model.dtype float32 and stopped after.
transformers: DeepseekV3ForCausalLM in fp32 (eager experts and attention; the checkpoint's MTP
layer is not part of that class and is ignored). The two agree within 0.5% when the serving
path is right (tests/integration/test_demo_model.py checks it on a few windows).

--formats (issue 29): the same windows through one ModelRunner per format, every position's
logits: the reference is the checkpoint in --dtype (bfloat16) with plain weights, each format is
`model.quantization` (moed's online quantizer) on it; printed per format: KL(ref || format) in
nats per token, top-1 agreement, perplexity. The noise floor row is the plain weights in fp32
against --dtype: what rounding alone does. A checkpoint without split.json (not the demo model)
is scored on this repository's docs/*.md instead (--tokens of them).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
DEFAULT_MODEL = ROOT / "models" / "stdlib-ds3-tiny"


def heldout_windows(model_dir: Path, files: int | None = None) -> tuple[list[tuple[str, list[int]]], list[str]]:
    """[(file, window token ids)] over the held-out files (the first `files` of them), and the
    held-out files this interpreter lacks."""
    from tokenizers import Tokenizer

    from moed.dev.train import corpus

    split = json.loads((model_dir / "split.json").read_text())
    size = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]) - 1
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    out, missing = [], []
    for rel in split["heldout"][:files]:
        text = corpus.read(rel)
        if text is None:
            missing.append(rel)
            continue
        out.extend((rel, w) for w in corpus.chunks(tok.encode(text, add_special_tokens=False).ids, size))
    return out, missing


def docs_windows(model_dir: Path, tokens: int, window: int) -> list[tuple[str, list[int]]]:
    """For a checkpoint that is not the demo model: docs/*.md, the first `tokens` tokens."""
    from moed.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    text = "\n\n".join(p.read_text(errors="replace") for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tok.encode(text, add_special_tokens=False)[:tokens]
    return [("docs", ids[i:i + window]) for i in range(0, len(ids) - 1, window)
            if len(ids[i:i + window]) > 1]


def make_runner(model_dir: Path, window: int, dtype: str, fmt: str, group: int):
    from moed.model.runner import ModelRunner

    return ModelRunner(model_dir, dtype=dtype, device="cpu", attention_backend="torch",
                       num_blocks=-(-window // 16), block_size=16, quantization=fmt,
                       quantization_group_size=group)


def all_logits(runner, w: list[int]):
    """Every position's logits (fp64 log-softmax) of one window, one prefill."""
    import torch

    from moed.model.batch import ForwardBatch

    with torch.inference_mode():
        table = list(range(-(-len(w) // 16)))
        out = runner.forward(ForwardBatch([w], [0], [table], all_logits=(True,)))
    return torch.log_softmax(out.double(), -1)


class Divergence:
    """KL(ref || got) per position, top-1 agreement and both perplexities, summed over windows."""

    def __init__(self) -> None:
        self.kl = self.nll_ref = self.nll_got = 0.0
        self.agree = self.positions = self.scored = 0

    def add(self, lp, lq, w: list[int]) -> None:
        import torch

        self.kl += float((lp.exp() * (lp - lq)).sum())
        self.agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
        nxt = torch.tensor(w[1:])[:, None]
        self.nll_ref -= float(lp[:-1].gather(1, nxt).sum())
        self.nll_got -= float(lq[:-1].gather(1, nxt).sum())
        self.positions += lp.shape[0]
        self.scored += len(w) - 1

    def figures(self) -> dict[str, float]:
        return {"kl_mean": self.kl / self.positions, "top1_agreement": self.agree / self.positions,
                "ppl_ref": math.exp(self.nll_ref / self.scored),
                "ppl": math.exp(self.nll_got / self.scored), "positions": self.positions}


def format_rows(model_dir: Path, windows: list[list[int]], formats: list[str], dtype: str,
                group: int) -> dict[str, dict[str, float]]:
    """Every runner is loaded at once (the windows are read once, nothing big is kept)."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    n = max(len(w) for w in windows)
    ref = make_runner(model_dir, n, dtype, "", group)
    others = {f: make_runner(model_dir, n, dtype, f, group) for f in formats}
    if dtype != "float32":     # the noise floor: fp32 as the reference, this dtype as the other
        others["noise_floor"] = make_runner(model_dir, n, "float32", "", group)
    acc = {k: Divergence() for k in others}
    for w in windows:
        lr = all_logits(ref, w)
        for k, r in others.items():
            lo = all_logits(r, w)
            acc[k].add(*((lo, lr) if k == "noise_floor" else (lr, lo)), w)
    rows = {k: a.figures() for k, a in acc.items()}
    if "noise_floor" in rows:
        r = rows["noise_floor"]
        print(f"  noise floor  KL(fp32 || {dtype}, plain weights) {r['kl_mean']:.6f} nats/token"
              f"  top-1 agreement {100 * r['top1_agreement']:.2f}%", flush=True)
    for fmt in formats:
        r = rows[fmt]
        print(f"  {fmt:5s}        KL({dtype} || {fmt}) {r['kl_mean']:.6f} nats/token  top-1 agreement "
              f"{100 * r['top1_agreement']:.2f}%  perplexity {r['ppl']:.3f} ({dtype} {r['ppl_ref']:.3f})",
              flush=True)
    return rows


def api_nll(url: str, model: str, ids: list[int], api_key: str | None = None, timeout: float = 120.0) -> float:
    """Sum of -log p(token i | tokens < i) for i >= 1, from moed's prompt_logprobs."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        plp = json.loads(r.read())["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids), "prompt_logprobs does not cover the prompt"
    return -sum(plp[i][str(t)]["logprob"] for i, t in enumerate(ids) if i)


class HFScorer:
    """transformers' fp32 DeepseekV3ForCausalLM on the checkpoint."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()    # the MTP layer's tensors are "unexpected" to it
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          experts_implementation="eager",
                                                          attn_implementation="eager").eval()

    def nll(self, ids: list[int]) -> float:
        torch = self.torch
        with torch.inference_mode():
            lp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].double(), dim=-1)
        return -lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum().item()


def start_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    import socket

    from common import wait_ready

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    env.update(MOED_MODEL_DTYPE="float32", PYTHONPATH=str(ROOT))
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "moed", "serve", "--model", str(model_dir), "--host",
                                 "127.0.0.1", "--port", str(port)], env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    why = wait_ready(url, proc, 180)
    if why:
        proc.kill()
        raise SystemExit(f"moed serve {why}; see {log}")
    return proc, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--url", help="a running moed serving --model (default: start one, fp32)")
    ap.add_argument("--served-name", help="the model name the server answers to (default: the folder's name)")
    ap.add_argument("--files", type=int, help="only the first N held-out files")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-api", action="store_true", help="skip the API perplexity (formats only)")
    ap.add_argument("--formats", default="", help="weight formats to score against --dtype, e.g. int8,int4,fp8")
    ap.add_argument("--dtype", default="bfloat16", help="the formats' compute dtype and reference")
    ap.add_argument("--group-size", type=int, default=128, help="int4's group size")
    ap.add_argument("--tokens", type=int, default=4096, help="docs tokens for a checkpoint without split.json")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    a = ap.parse_args()
    formats = [f for f in a.formats.split(",") if f]
    if (a.model / "split.json").exists():
        windows, missing = heldout_windows(a.model, a.files)
    elif formats and a.no_api and a.no_transformers:
        windows, missing = docs_windows(a.model, a.tokens, 255), []
    else:
        raise SystemExit(f"{a.model} has no split.json: score formats on docs/*.md with "
                         "--formats ... --no-api --no-transformers")
    for rel in missing:
        print(f"skipped (not in this Python's stdlib): {rel}", file=sys.stderr)
    n = sum(len(ids) - 1 for _, ids in windows)
    res: dict = {"model": str(a.model), "files": len({f for f, _ in windows}), "missing": missing,
                 "windows": len(windows), "tokens": n}
    print(f"text: {res['files']} files, {res['windows']} windows, {n} scored tokens"
          + (f" ({len(missing)} files missing here)" if missing else ""))
    if not a.no_api:
        proc, url = None, a.url
        if url is None:
            log = Path(tempfile.mkdtemp(prefix="moed-quality-")) / "moed.log"
            proc, url = start_server(a.model, log)
        try:
            t0 = time.monotonic()
            moed = [api_nll(url, a.served_name or a.model.name, ids, a.api_key) for _, ids in windows]
            res.update(moed_ppl=math.exp(sum(moed) / n), moed_seconds=round(time.monotonic() - t0, 1))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        print(f"  moed (API, fp32)     perplexity {res['moed_ppl']:.3f}")
    if not a.no_transformers:
        scorer = HFScorer(a.model)
        res["transformers_ppl"] = math.exp(sum(scorer.nll(ids) for _, ids in windows) / n)
        line = f"  transformers (fp32)  perplexity {res['transformers_ppl']:.3f}"
        if "moed_ppl" in res:
            res["rel_diff"] = abs(res["moed_ppl"] - res["transformers_ppl"]) / res["transformers_ppl"]
            line += f"   relative difference {res['rel_diff']:.2e}"
        print(line)
    if formats:
        t0 = time.monotonic()
        print(f"weight formats against {a.dtype} (moed's ModelRunner, every position's logits):")
        res["formats"] = format_rows(a.model, [ids for _, ids in windows], formats, a.dtype, a.group_size)
        res.update(dtype=a.dtype, group_size=a.group_size, formats_seconds=round(time.monotonic() - t0, 1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
