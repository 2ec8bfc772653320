"""The committed demo model (models/stdlib-ds3-tiny, a trained DeepSeek-V3 with an MTP layer)
through a real `moed serve` (fp32): it continues Python, moed skips its MTP layer with a log
line, and its held-out perplexity through the API equals transformers' within 0.5% (the check
bench/quality.py makes on the whole held-out split, here on a few windows)."""
from __future__ import annotations

import json
import math
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from moed_server import serve_process

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "stdlib-ds3-tiny"
sys.path.insert(0, str(ROOT / "bench"))
from quality import HFScorer, api_nll, heldout_windows  # noqa: E402

pytestmark = pytest.mark.timeout(240)
NAME = MODEL.name


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    env = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "32"}
    with serve_process(model=MODEL, env=env, log_dir=tmp_path_factory.mktemp("srv")) as s:
        yield s


def _complete(srv, prompt: str, max_tokens: int) -> str:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_it_continues_python_with_an_indented_body(srv):
    text = _complete(srv, "def fib(n):", 32)
    assert re.match(r"\n[ \t]+\S", text), repr(text)      # the function's body, indented


def test_the_mtp_layer_is_skipped_with_a_log_line(srv):
    recs = [r for r in srv.log_records() if r.get("event") == "mtp_layers_skipped"]
    n = json.loads((MODEL / "config.json").read_text())["num_hidden_layers"]
    assert len(recs) == 1 and recs[0]["layers"] == [n], recs


def test_heldout_perplexity_through_the_api_equals_transformers(srv):
    windows, missing = heldout_windows(MODEL, files=4)
    if not windows:
        pytest.skip(f"this Python's stdlib lacks the first held-out files: {missing}")
    windows = windows[:6]
    hf = HFScorer(MODEL)
    got = [api_nll(srv.url, NAME, ids) for _, ids in windows]
    want = [hf.nll(ids) for _, ids in windows]
    n = sum(len(ids) - 1 for _, ids in windows)
    ppl_moed, ppl_hf = math.exp(sum(got) / n), math.exp(sum(want) / n)
    assert abs(ppl_moed - ppl_hf) / ppl_hf < 0.005, (ppl_moed, ppl_hf)
    for a, b, (_, ids) in zip(got, want, windows):      # and window by window (mean NLL)
        assert abs(a - b) / (len(ids) - 1) < 0.005, (a, b)
    assert ppl_hf < 100, ppl_hf         # trained (56 on these windows); at random init ~4000
