"""Held-out perplexity of the demo model through moed's API and through transformers, side by side.

    .venv/bin/python bench/quality.py [--model models/stdlib-ds3-tiny] [--url http://127.0.0.1:8000]
                                      [--files N] [--api-key KEY] [--no-transformers] [--json PATH]

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
    ap.add_argument("--json", type=Path, help="write the figures here too")
    a = ap.parse_args()
    windows, missing = heldout_windows(a.model, a.files)
    for rel in missing:
        print(f"skipped (not in this Python's stdlib): {rel}", file=sys.stderr)
    proc = None
    url = a.url
    if url is None:
        log = Path(tempfile.mkdtemp(prefix="moed-quality-")) / "moed.log"
        proc, url = start_server(a.model, log)
    try:
        t0 = time.monotonic()
        moed = [api_nll(url, a.served_name or a.model.name, ids, a.api_key) for _, ids in windows]
        moed_s = time.monotonic() - t0
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    hf = None
    if not a.no_transformers:
        scorer = HFScorer(a.model)
        hf = [scorer.nll(ids) for _, ids in windows]
    n = sum(len(ids) - 1 for _, ids in windows)
    res = {"model": str(a.model), "files": len({f for f, _ in windows}), "missing": missing,
           "windows": len(windows), "tokens": n, "moed_ppl": math.exp(sum(moed) / n), "moed_seconds": round(moed_s, 1)}
    if hf is not None:
        res["transformers_ppl"] = math.exp(sum(hf) / n)
        res["rel_diff"] = abs(res["moed_ppl"] - res["transformers_ppl"]) / res["transformers_ppl"]
    print(f"held-out: {res['files']} files, {res['windows']} windows, {n} scored tokens"
          + (f" ({len(missing)} files missing here)" if missing else ""))
    print(f"  moed (API, fp32)     perplexity {res['moed_ppl']:.3f}")
    if hf is not None:
        print(f"  transformers (fp32)  perplexity {res['transformers_ppl']:.3f}   relative difference {res['rel_diff']:.2e}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
