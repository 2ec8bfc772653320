"""Speculative decoding in an expert-parallel group (issue 32, acceptance 1 and item 4): three
EP=2 groups of real `moed serve` processes (gloo on 127.0.0.1) on the demo model (a trained
DeepSeek-V3 with an MTP layer, fp32) — plain, `ngram` and `mtp` — each serve the same 50
prompts, half on each rank, concurrently, under chunked prefill (16 tokens a step), then 10 of
them again on the same rank (prefix hits). Greedy token ids with either method equal the plain
group's, token for token; drafts are made and accepted on both ranks; no rank fails.

What this exercises: ranks whose forward passes have different row counts (drafts), ranks with
no rows (empty forwards) and, with `mtp`, ranks whose MTP pass runs the layer's MoE while a
peer's writes its KV entries only or has no rows (the per-step switch decides per rank): an
exchange left unmatched fails the group within the 10 s collective timeout, not silently."""
from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ep_group import launch_group, wait_ready

pytestmark = pytest.mark.timeout(300)

MODEL = Path(__file__).resolve().parents[2] / "models" / "stdlib-ds3-tiny"
ARGS = ["--served-model-name", "m", "--dtype", "float32"]
ENV = {"MOED_ENGINE_KV_CACHE_MEMORY_MB": "16", "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "16",
       "MOED_ENGINE_BLOCK_SIZE": "16", "MOED_PARALLEL_COLLECTIVE_TIMEOUT_S": "10"}
SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3},
         "mtp": {"method": "mtp", "num_speculative_tokens": 1}}
TEMPLATES = [
    "def {a}(x, y):\n    return x + y\n\n\ndef {b}(x, y):\n    return x - y\n\n\ndef {c}(x, y):\n",
    "import {a}\nimport {b}\nimport {c}\nimport {a}\nimport",
    "for {a} in range(10):\n    print({a})\nfor {b} in range(10):\n    print(",
    "class {a}:\n    def __init__(self, x):\n        self.x = x\n\n\nclass {b}:\n    def __init__(",
    "{a} = [1, 2, 3]\n{b} = [1, 2, 3]\n{c} = [1, 2,",
]
NAMES = ["os", "sys", "re", "json", "path", "item", "value", "key", "data", "name"]
PROMPTS = [t.format(a=NAMES[i % 10], b=NAMES[(i + 3) % 10], c=NAMES[(i + 7) % 10])
           for i, t in enumerate(TEMPLATES * 10)]          # 50
REPEATS = list(range(0, 50, 5))                            # again, on the same rank: prefix hits
TOKENS = 16


def _ids(srv, prompt: str) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choice = json.loads(r.read())["choices"][0]
    assert len(choice["token_ids"]) == TOKENS, choice
    return choice["token_ids"]


def _serve(ranks) -> list[list[int]]:
    """Every prompt on rank i % 2, 12 at once; then the repeats, each on its first rank."""
    with ThreadPoolExecutor(12) as pool:
        first = list(pool.map(lambda i: _ids(ranks[i % 2], PROMPTS[i]), range(len(PROMPTS))))
        again = list(pool.map(lambda i: _ids(ranks[i % 2], PROMPTS[i]), REPEATS))
    return first + again


def test_ep_greedy_speculation_equals_plain(moed_server) -> None:
    groups = {"plain": launch_group(moed_server, MODEL, 2, args=ARGS, env=ENV)}
    for name, spec in SPECS.items():
        groups[name] = launch_group(moed_server, MODEL, 2, env=ENV,
                                    args=[*ARGS, "--speculative-config", json.dumps(spec)])
    wait_ready([srv for g in groups.values() for srv in g], ready_timeout=180)
    t0 = time.monotonic()
    want = _serve(groups["plain"])
    for name in SPECS:
        t = time.monotonic()
        got = _serve(groups[name])
        diff = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not diff, f"{name}: {len(diff)} of {len(want)} differ, first {diff[0]}: " \
                         f"{got[diff[0]]} != {want[diff[0]]}"
        drafted = accepted = 0
        for r, srv in enumerate(groups[name]):
            m = srv.metrics()
            d = m.get("moed_spec_decode_num_draft_tokens_total", 0)
            a = m.get("moed_spec_decode_num_accepted_tokens_total", 0)
            assert d > 0, (name, r)               # each rank drafted
            assert m.get("moed_prefix_cache_hit_tokens_total", 0) > 0, (name, r)
            drafted, accepted = drafted + d, accepted + a
        assert 0 < accepted <= drafted, (name, accepted, drafted)
        print(f"{name}: {len(got)} completions equal plain, {accepted:g}/{drafted:g} drafts "
              f"accepted, {time.monotonic() - t:.1f} s")
    print(f"serving took {time.monotonic() - t0:.1f} s")
    for g in groups.values():
        for srv in g:
            assert srv.alive, srv.tail()
            assert not [x for x in srv.log_records() if x.get("event") == "ep_group_failed"]
