"""Structured outputs against real servers through the openai client: a colocated server C, and
a prefill node P + decode node D (token one is sampled on P under the grammar, the rest on D).
The tiny model has random weights, so only the grammar makes its output valid: every sample is
checked with `jsonschema`, and every schema here is bounded so that it closes well within
max_tokens (finish "stop")."""
from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

from moed_server import _wait_ready, start_server

pytestmark = pytest.mark.timeout(240)

COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "16",
          "MOED_MODEL_SERVED_NAME": "tiny",
          "MOED_SERVER_CACHE_METRICS_BATCH": "1"}     # prefix-hit counters at every request
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def servers(tiny_qwen3, tmp_path_factory):
    from moed_server import free_port

    pport = free_port()
    specs = {"C": ("colocated", None, {}),
             "P": ("prefill", pport, {}),
             "D": ("decode", None, {"MOED_TRANSFER_PREFILL_PEERS": f"http://127.0.0.1:{pport}",
                                    "MOED_TRANSFER_PREFILL_TIMEOUT_S": "60"})}
    log_dir = tmp_path_factory.mktemp("structured")
    out: dict = {}
    try:
        for name, (role, port, env) in specs.items():      # start all, then wait: in parallel
            out[name] = start_server(model=tiny_qwen3, role=role, port=port,
                                     env={**COMMON, **env}, log_dir=log_dir, wait=None)
        for s in out.values():
            _wait_ready(s, "/ready", time.monotonic() + 150)
        yield out
    finally:
        for s in out.values():
            s.stop(timeout=10)


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _samples(client: openai.OpenAI, stream: bool) -> list[tuple[str, str]]:
    """20 seeded samples at temperature 1: 2 requests of n=10 (seeds 11.. and 31..)."""
    out: list[tuple[str, str]] = []
    for seed in (11, 31):
        kw = dict(model="tiny", messages=MESSAGES, response_format=RESPONSE_FORMAT, n=10,
                  temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
        if not stream:
            r = client.chat.completions.create(**kw)
            out += [(c.message.content, c.finish_reason) for c in r.choices]
            continue
        texts, finish = [""] * 10, [None] * 10
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finish[c.index] = c.finish_reason or finish[c.index]
        out += list(zip(texts, finish))
    return out


def _check_valid(samples: list[tuple[str, str]]) -> list[dict]:
    objs = []
    for text, finish in samples:
        assert finish == "stop", (finish, text[-200:])
        obj = json.loads(text)
        jsonschema.validate(obj, SCHEMA)
        objs.append(obj)
    assert len(objs) == 20
    assert len({json.dumps(o, sort_keys=True) for o in objs}) > 10   # sampled, not one answer
    return objs


def _prefill_jobs(srv) -> float:
    return srv.metrics().get('moed_transfer_jobs_total{result="done",role="prefill"}', 0.0)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_always_validates_colocated(servers, stream) -> None:
    objs = _check_valid(_samples(_client(servers["C"]), stream))
    if stream:      # the same seeds streamed and not give the same objects
        assert objs == _check_valid(_samples(_client(servers["C"]), False))


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_always_validates_through_prefill_and_decode(servers, stream) -> None:
    before = _prefill_jobs(servers["P"])
    _check_valid(_samples(_client(servers["D"]), stream))
    assert _prefill_jobs(servers["P"]) >= before + 20       # token one came from P each time


def test_first_token_from_the_prefill_node_obeys_the_grammar(servers) -> None:
    """A choice whose options differ at token one: D's matcher consumes P's token, so the
    output is one of the options, and matches a colocated run of the same seed."""
    kw = dict(model="tiny", prompt="Pick one:", max_tokens=20, temperature=1.0, n=8, seed=5,
              extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    got = _client(servers["D"]).completions.create(**kw)
    want = _client(servers["C"]).completions.create(**kw)
    assert all(c.text in ("alpha", "beta", "gamma") and c.finish_reason == "stop"
               for c in got.choices)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]


def test_json_object_regex_choice_and_grammar(servers) -> None:
    c = _client(servers["C"])
    # any JSON object: unbounded, so the random model may run out of tokens inside one; the
    # ones that close must parse as objects
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, n=8, seed=3, temperature=1.0,
                                  max_tokens=MAX_TOKENS, response_format={"type": "json_object"},
                                  extra_body={"structured_outputs": None})
    closed = [ch.message.content for ch in r.choices if ch.finish_reason == "stop"]
    assert len(closed) >= 2 and all(isinstance(json.loads(t), dict) for t in closed)
    assert all(ch.message.content.startswith("{") for ch in r.choices)
    r = c.completions.create(model="tiny", prompt="A code:", max_tokens=30, temperature=1.0,
                             n=4, seed=1, extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
    import re
    assert all(re.fullmatch(r"[A-Z]{2}-[0-9]{3}", ch.text) and ch.finish_reason == "stop"
               for ch in r.choices)
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = c.completions.create(model="tiny", prompt="x", max_tokens=30, temperature=1.0, seed=2,
                             extra_body={"guided_grammar": 'start: "(" NUM ("," NUM)~0..2 ")"\n'
                                                           'NUM: /[0-9]{1,3}/'})
    assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,2}\)", r.choices[0].text)


def test_a_cut_grammar_ends_with_length_and_prefix_cache_repeats(servers) -> None:
    c = _client(servers["C"])
    kw = dict(model="tiny", messages=MESSAGES, response_format=RESPONSE_FORMAT, max_tokens=3,
              temperature=1.0, seed=9)
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")
    # the same request again is served from the prefix cache: the same tokens
    kw["max_tokens"] = MAX_TOKENS
    a = c.chat.completions.create(**kw)
    hits = servers["C"].metrics().get("moed_prefix_cache_hit_tokens_total", 0.0)
    b = c.chat.completions.create(**kw)
    assert servers["C"].metrics().get("moed_prefix_cache_hit_tokens_total", 0.0) > hits
    assert a.choices[0].message.content == b.choices[0].message.content
    jsonschema.validate(json.loads(b.choices[0].message.content), SCHEMA)


def test_a_schema_the_engine_cannot_compile_is_a_400_with_its_reason(servers) -> None:
    for srv in (servers["C"], servers["D"]):
        c = _client(srv)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                      response_format={"type": "json_schema", "json_schema": {
                                          "name": "bad", "schema": {"type": "florp"}}})
        err = e.value.body
        assert err["param"] == "response_format" and "florp" in err["message"]
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="x", max_tokens=5,
                                 extra_body={"guided_regex": "a", "guided_choice": ["a"]})
        assert e.value.body["param"] == "guided_choice"
