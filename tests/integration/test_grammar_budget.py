"""Grammars that pass validation but are too big for the grammar engine (issue 27, items 1-2),
against a real colocated `moed serve`: each answer is a 400 `grammar_too_complex` naming the
field or a correct output (never a 500), another tenant's stream keeps its pace while they
arrive, and a flood of heavy schemas does not hold up an unrelated small request.

The cases: `guided_regex` a{1000}{1000} (llguidance: LexerTooComplex at token two, after a
~1 s first mask), a choice list of 1,024 strings of 4,000 characters, JSON schemas of 500 and
3,000 optional properties (ParserTooComplex after "{"), sixteen distinct ~90 KB schemas.
Timing bounds are deadlines for "it stalled", far above what the fixed server shows and far
below the 1.7-13 s stalls it had (see each test)."""
from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.timeout(300)

ENV = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "16",
       "MOED_MODEL_SERVED_NAME": "tiny", "MOED_BALANCE_CALIBRATION_STEPS": "0"}
REGEX = "a{1000}{1000}"
CHOICES = ["%04d" % i + "x" * 3996 for i in range(1024)]


def optional_props(n: int, tag: str = "p") -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(n)}}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def post(srv, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(srv.url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream(srv, body: dict, timeout: float = 120.0) -> tuple[int, list[dict], dict | None]:
    """A streamed completion: (status, the SSE data objects, the error object if any)."""
    req = urllib.request.Request(srv.url + "/v1/completions",
                                 json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                      if line.startswith("data: {")]
            err = next((e["error"] for e in events if "error" in e), None)
            return r.status, events, err
    except urllib.error.HTTPError as e:
        return e.code, [], json.loads(e.read() or b"{}").get("error")


def too_complex(status: int, body: dict, param: str) -> bool:
    err = body.get("error") or {}
    return status == 400 and err.get("code") == "grammar_too_complex" and \
        err.get("param") == param and "<state>" not in err.get("message", "")


@pytest.fixture(scope="module")
def srv(tiny_qwen3, tmp_path_factory):
    from moed_server import serve_process

    with serve_process(model=tiny_qwen3, role="colocated", env=ENV,
                       log_dir=tmp_path_factory.mktemp("grammar")) as s:
        yield s


BASE = {"model": "tiny", "prompt": "x", "max_tokens": 24, "temperature": 1.0}


def test_a_regex_past_the_lexer_limit_is_a_400(srv) -> None:
    for n in (1, 4):
        status, body = post(srv, "/v1/completions", {**BASE, "n": n, "guided_regex": REGEX})
        assert too_complex(status, body, "guided_regex"), (status, body)
    status, events, err = stream(srv, {**BASE, "guided_regex": REGEX})
    assert status == 400 and err["code"] == "grammar_too_complex" and not events
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
            "structured_outputs": {"regex": REGEX}}
    status, body = post(srv, "/v1/chat/completions", chat)
    assert too_complex(status, body, "structured_outputs"), (status, body)
    m = srv.metrics()
    assert m.get('moed_grammar_refused_total{reason="too_complex"}', 0) >= 4


@pytest.mark.parametrize("n_props", [500, 3000])
def test_a_schema_of_many_optional_properties_is_a_400_whatever_the_seed(srv, n_props) -> None:
    """The row of 500+ optional properties overflows llguidance's Earley row after "{", which
    the sampled first token decides: every seed must get the 400 (today: a 500 for some)."""
    rf = schema_format(optional_props(n_props))
    for seed in range(4):
        status, body = post(srv, "/v1/completions",
                            {**BASE, "seed": seed, "n": 2, "response_format": rf})
        assert too_complex(status, body, "response_format"), (seed, status, body)
    status, body = post(srv, "/v1/completions", {**BASE, "guided_json": optional_props(n_props)})
    assert too_complex(status, body, "guided_json"), (status, body)


def test_a_long_choice_list_is_served_or_refused_never_a_500(srv) -> None:
    for seed in range(2):
        status, body = post(srv, "/v1/completions", {**BASE, "max_tokens": 200, "seed": seed,
                                                     "n": 4, "guided_choice": CHOICES})
        if status == 400:
            assert body["error"]["code"] == "grammar_too_complex", body
            continue
        assert status == 200, body
        for c in body["choices"]:
            if c["finish_reason"] == "stop":
                assert c["text"] in CHOICES
            else:
                assert c["finish_reason"] == "length" and \
                    any(s.startswith(c["text"]) for s in CHOICES), c["text"][:40]


def test_a_small_grammar_still_works(srv) -> None:
    status, body = post(srv, "/v1/completions", {**BASE, "guided_regex": "[A-Z]{2}-[0-9]{3}",
                                                 "n": 2, "seed": 1})
    assert status == 200 and all(len(c["text"]) == 6 and c["finish_reason"] == "stop"
                                 for c in body["choices"]), body


# ---- other tenants ----------------------------------------------------------------------------

class Victim:
    """Long greedy streams, one after the other, on a thread; `times` are their chunks'
    arrival times (a new stream's first chunk comes after a TTFT, ~ms here)."""

    def __init__(self, srv, max_tokens: int = 2000) -> None:
        self.times: list[float] = []
        self.error: str | None = None
        self.done = threading.Event()
        self._stop = False
        body = {"model": "tiny", "prompt": "A story:", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        self._req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(body).encode(),
                                           {"Content-Type": "application/json"})
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            while not self._stop:       # a new stream when one ends: the flood outlasts one
                with urllib.request.urlopen(self._req, timeout=240) as r:
                    for line in r:
                        if self._stop:
                            return
                        if line.startswith(b"data: {"):
                            if b'"error"' in line:
                                self.error = line.decode()[:300]
                                return
                            self.times.append(time.monotonic())
        except Exception as e:   # noqa: BLE001 - reported by the test
            self.error = repr(e)
        finally:
            self.done.set()

    def wait_tokens(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < n and time.monotonic() < deadline and not self.done.is_set():
            time.sleep(0.01)
        assert len(self.times) >= n, (len(self.times), self.error)

    def stop(self) -> None:
        self._stop = True
        self._t.join(30)

    def gaps(self, start: float, end: float) -> list[float]:
        t = [x for x in self.times if start <= x <= end]
        return [b - a for a, b in zip(t, t[1:])]


def _flood(srv, bodies: list[tuple[str, dict]]) -> list[tuple[int, dict]]:
    out: list[tuple[int, dict]] = [(0, {})] * len(bodies)

    def one(i: int, path: str, body: dict) -> None:
        out[i] = post(srv, path, body)

    threads = [threading.Thread(target=one, args=(i, p, b)) for i, (p, b) in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


def test_other_tenants_grammars_leave_no_gap_in_a_stream(srv) -> None:
    """While eight a{1000}{1000} regexes, a 1,024 x 4,000 choice list and 3,000-property
    schemas arrive (distinct, so nothing is cached), another stream keeps its pace. Before the
    fix its largest gap was 1.7-2.9 s for one such request and 12.7-13.7 s for eight (on
    9e325de with this test: 4.8 s); the bound here, 0.6 s (or 25 of its own median gaps on a
    loaded host), fails on those and holds with room on this 2-core box (fixed: 49-160 ms)."""
    victim = Victim(srv)
    try:
        victim.wait_tokens(20)
        base = victim.times[-1]
        own = statistics.median(victim.gaps(0, base))
        bodies = [("/v1/completions", {**BASE, "guided_regex": REGEX.replace("a", c)})
                  for c in "abcdefgh"]
        bodies.append(("/v1/completions", {**BASE, "n": 4, "guided_choice": CHOICES}))
        bodies += [("/v1/completions", {**BASE, "response_format": schema_format(
            optional_props(3000, tag))}) for tag in ("q", "r")]
        t0 = time.monotonic()
        results = _flood(srv, bodies)
        t1 = time.monotonic()
        victim.wait_tokens(len(victim.times) + 5)
        gaps = victim.gaps(t0, time.monotonic())
    finally:
        victim.stop()
    assert victim.error is None, victim.error
    assert gaps and t1 > t0
    worst = max(gaps)
    print(f"victim: own median gap {own * 1000:.1f} ms, worst during the flood "
          f"{worst * 1000:.0f} ms over {len(gaps)} gaps, flood {t1 - t0:.2f} s")
    assert worst < max(0.6, 25 * own), (worst, own)
    for (path, body), (status, answer) in zip(bodies, results):
        assert status in (200, 400, 429), (status, answer)      # never a 500
        if status == 400:
            assert answer["error"]["code"] == "grammar_too_complex", answer
    assert all(s in (400, 429) for s, _ in results[:8]), [s for s, _ in results]


def test_a_flood_of_big_schemas_does_not_hold_up_a_small_request(srv) -> None:
    """Sixteen distinct ~90 KB schemas (3,000 optional properties; refused after a ~0.7 s
    compile each) at once, then an unrelated 2-token request: before, it waited 11.5-13 s
    behind them in the pool shared with tokenization; now the schemas compile on the grammar
    pool (queued, or 429 grammar_busy) and it is served at once (on 9e325de with this test it
    waited 24 s; fixed: 0.03-0.8 s). Bound: 3 s."""
    bodies = [("/v1/completions", {**BASE, "response_format": schema_format(
        optional_props(3000, f"f{k}_"))}) for k in range(16)]
    assert len(json.dumps(bodies[0][1])) > 60_000
    results: list[tuple[int, dict]] = []
    flood = threading.Thread(target=lambda: results.extend(_flood(srv, bodies)))
    flood.start()
    time.sleep(0.5)         # the flood is in the pools
    t = time.monotonic()
    status, body = post(srv, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                 "temperature": 0})
    took = time.monotonic() - t
    flood.join(180)
    print(f"small request during the flood: {took:.2f} s")
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    assert took < 3.0, took
    assert len(results) == 16
    for status_, answer in results:
        assert status_ in (400, 429), (status_, answer)
        assert answer["error"]["code"] in ("grammar_too_complex", "grammar_busy"), answer
