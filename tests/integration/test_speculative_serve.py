"""Speculative decoding through a real `moed serve --speculative-config` and the official
openai client: greedy completions (n = 1 and n = 2, logprobs, a stop string, guided JSON and
regex) equal a server without it, token for token; the spec_decode counters move; the start log names the method."""
from __future__ import annotations

import json

import openai
import pytest

from moed_server import serve_process

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
ENV = {"MOED_ENGINE_KV_CACHE_MEMORY_MB": "16", "MOED_MODEL_MAX_MODEL_LEN": "256",
       "MOED_MODEL_SERVED_NAME": "tiny", "MOED_MODEL_DTYPE": "float32",
       "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "16"}
PROMPTS = ["a b c d e f g a b c d e f g a b c", "def f(x): return x + 1\ndef g(x): return",
           "one two three four one two three four one two", "The cat sat on the mat. The cat"]


def _complete(client, prompt: str, **kw):
    return client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0.0, **kw,
        extra_body={"return_token_ids": True, "ignore_eos": True})


SHOWN = '{"name": "ada", "tags": ["x", "y"]}'
GUIDED = [{"guided_json": {"type": "object", "required": ["name", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3}}}},
    {"guided_regex": "(ab ){2,9}"}]


def _outputs(client) -> list:
    out = []
    for p in PROMPTS:
        r = _complete(client, p, logprobs=2, n=2)
        out.append([(list(c.token_ids), c.text, c.finish_reason,
                     [round(x, 3) for x in c.logprobs.token_logprobs]) for c in r.choices])
    for g, p in zip(GUIDED, ["Example: " + SHOWN + " Again: " + SHOWN[:12], "ab ab ab ab"]):
        c = client.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0.0,
                                      extra_body={"return_token_ids": True, **g}).choices[0]
        out.append((list(c.token_ids), c.text, c.finish_reason))    # structured: speculated too
    return out


def test_greedy_equal_with_and_without_speculation(tiny_qwen3, tmp_path_factory):
    with serve_process(model=tiny_qwen3, env=ENV, log_dir=tmp_path_factory.mktemp("plain")) as s:
        plain = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        want = _outputs(plain)
        stop_text = want[0][0][1][6:9]
        want_stop = _complete(plain, PROMPTS[0], stop=[stop_text]).choices[0]
    with serve_process(model=tiny_qwen3, env=ENV, args=["--speculative-config", json.dumps(SPEC)],
                       log_dir=tmp_path_factory.mktemp("spec")) as s:
        spec = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        got = _outputs(spec)
        got_stop = _complete(spec, PROMPTS[0], stop=[stop_text]).choices[0]
        m = s.metrics()
        starts = [r for r in s.log_records() if r.get("event") == "speculative_decoding"]
    assert got == want
    assert (got_stop.text, got_stop.finish_reason) == (want_stop.text, want_stop.finish_reason)
    assert want_stop.finish_reason == "stop" and stop_text not in got_stop.text
    drafts = m.get("moed_spec_decode_num_draft_tokens_total", 0)
    assert drafts > 0 and m.get("moed_spec_decode_num_drafts_total", 0) > 0
    assert 0 < m.get("moed_spec_decode_num_accepted_tokens_total", 0) < drafts
    assert len(starts) == 1 and starts[0]["method"] == "ngram" \
        and starts[0]["num_speculative_tokens"] == 3 \
        and starts[0]["adaptive"] == "measured per decoding row count" \
        and starts[0]["grammar_rows"].startswith("speculated")


@pytest.mark.parametrize("bad,says", [
    ('{"method": "ngram", "draft_tensor_parallel_size": 1}',
     "draft_tensor_parallel_size is not supported"),
])
def test_refused_speculative_config_is_a_config_error(tiny_qwen3, bad, says):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "moed", "check-config", "--model", str(tiny_qwen3),
                        "--speculative-config", bad], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr


def test_mtp_on_the_demo_model_equals_plain(tmp_path_factory):
    """The trained demo model served with its MTP layer drafting (k = 1): greedy completions
    equal a server without speculation; most drafts are accepted."""
    from pathlib import Path
    demo = Path(__file__).resolve().parents[2] / "models" / "stdlib-ds3-tiny"
    env = {**ENV, "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "32"}
    code = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", "import os\nimport sys\n",
            "for i in range(10):\n    print(i)\n"]

    def run(args):
        with serve_process(model=demo, env=env, args=args,
                           log_dir=tmp_path_factory.mktemp("demo")) as s:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
            outs = [list(_complete(c, p, n=2).choices[1].token_ids) for p in code]
            return outs, s.metrics()
    want, _ = run([])
    got, m = run(["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'])
    assert got == want
    drafts = m.get("moed_spec_decode_num_draft_tokens_total", 0)
    assert drafts > 0 and m.get("moed_spec_decode_num_accepted_tokens_total", 0) > drafts / 2
