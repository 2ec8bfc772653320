"""Sampling extras across disaggregation: 1 prefill + 1 decode node (real processes, real NIXL)
against a colocated server on the same checkpoint and chunking. Token one is sampled on the
prefill node, the rest on the decode node; with penalties, logit_bias, min_p and seeded
sampling the outputs must equal the colocated ones token for token. Echo with logprobs (prompt
logprobs) is served by the decode node computing the prompt itself: same values as colocated."""
from __future__ import annotations

import random

import openai
import pytest

from moed_server import free_port, started_together

pytestmark = pytest.mark.timeout(240)

COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
          "MOED_ENGINE_BLOCK_SIZE": "4", "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "16",
          "MOED_MODEL_SERVED_NAME": "tiny"}
N = 16


@pytest.fixture(scope="module")
def pair(tiny_qwen3, tmp_path_factory):
    p_port = free_port()
    specs = {"C": ("colocated", None, {}), "P": ("prefill", p_port, {}),
             "D": ("decode", None, {"MOED_TRANSFER_PREFILL_PEERS": f"http://127.0.0.1:{p_port}",
                                    "MOED_TRANSFER_PREFILL_TIMEOUT_S": "30"})}
    with started_together(specs, tiny_qwen3, tmp_path_factory.mktemp("sdisagg"), COMMON) as servers:
        yield servers


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _prompt(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


def _jobs_done(srv) -> float:
    return srv.metrics().get('moed_transfer_jobs_total{result="done",role="prefill"}', 0.0)


def _ids(client: openai.OpenAI, prompt: list[int], **kw) -> list[int]:
    body = {k: kw.pop(k) for k in ("repetition_penalty", "min_p", "top_k") if k in kw}
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=N, **kw,
                                  extra_body={"return_token_ids": True, "ignore_eos": True,
                                              **body})
    return list(r.choices[0].token_ids)


CASES = [
    ("greedy", dict(temperature=0)),
    ("frequency_penalty", dict(temperature=0, frequency_penalty=2.0)),
    ("presence_penalty", dict(temperature=0, presence_penalty=2.0)),
    ("repetition_penalty", dict(temperature=0, repetition_penalty=2.0)),   # token one too
    ("logit_bias_ban", None),                                               # built below
    ("min_p", dict(temperature=1.0, seed=3, min_p=0.5)),
    ("seeded", dict(temperature=1.5, seed=7)),
    ("seeded_top_k_top_p", dict(temperature=1.0, seed=9, top_k=20, top_p=0.9)),
    ("seeded_penalised", dict(temperature=1.0, seed=5, frequency_penalty=1.0,
                              logit_bias={"7": 5.0})),
]


def test_greedy_and_seeded_outputs_equal_colocated_and_disaggregated(pair):
    c, d = _client(pair["C"]), _client(pair["D"])
    before = _jobs_done(pair["P"])
    seen = {}
    for i, (name, kw) in enumerate(CASES):
        p = _prompt(40, i)
        if kw is None:              # ban colocated's first two greedy tokens: token one moves
            first = _ids(c, p, temperature=0)
            kw = dict(temperature=0, logit_bias={str(first[0]): -100, str(first[1]): -100})
        want = _ids(c, p, **kw)
        got = _ids(d, p, **kw)
        assert got == want, f"{name}: decode node diverged from colocated"
        seen[name] = (p, want)
    assert _jobs_done(pair["P"]) - before >= len(CASES)     # every one went through P
    # each extra changed the output (against the same prompt's plain greedy run)
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty",
                 "logit_bias_ban", "seeded"):
        p, out = seen[name]
        assert out != _ids(c, p, temperature=0), name
    p, out = seen["logit_bias_ban"]
    first = _ids(c, p, temperature=0)
    assert first[0] not in out and first[1] not in out


def test_forced_token_one_comes_from_the_prefill_node(pair):
    """logit_bias +100 forces every token, the first (sampled on P) included."""
    c, d = _client(pair["C"]), _client(pair["D"])
    p = _prompt(40, 50)
    t = next(x for x in range(3, 1000) if x not in p)
    kw = dict(temperature=0, logit_bias={str(t): 100})
    assert _ids(d, p, **kw) == _ids(c, p, **kw) == [t] * N


def test_echo_logprobs_on_the_decode_node_equal_colocated(pair):
    c, d = _client(pair["C"]), _client(pair["D"])
    p = _prompt(40, 60)
    kw = dict(model="tiny", prompt=p, max_tokens=4, temperature=0, echo=True, logprobs=2)
    want = c.completions.create(**kw).choices[0]
    got = d.completions.create(**kw).choices[0]
    assert got.text == want.text
    w, g = want.logprobs, got.logprobs
    assert len(g.tokens) == len(p) + 4 and g.tokens == w.tokens
    assert g.token_logprobs[0] is None and g.text_offset == w.text_offset
    assert g.token_logprobs[1:] == pytest.approx(w.token_logprobs[1:], abs=1e-4)
    assert g.top_logprobs[0] is None      # the first prompt token: nothing precedes it
    assert [list(t) for t in g.top_logprobs[1:]] == [list(t) for t in w.top_logprobs[1:]]
