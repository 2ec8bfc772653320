"""The HTTP layer end to end in-process, over real sockets, against the fake engine."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from api_harness import running_app
from api_fake_engine import FakeEngine


def sse_events(raw: str) -> list:
    out = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_completion_non_stream_exact_usage(server, http):
    app, url, engine = server
    async with http.post(f"{url}/v1/completions",
                         json={"model": "fake", "prompt": "hi", "max_tokens": 5,
                               "return_token_ids": True}) as r:
        assert r.status == 200
        body = await r.json()
    ch = body["choices"][0]
    expected = [engine.token_at(list(b"hi"), i) for i in range(5)]
    assert ch["token_ids"] == expected
    assert ch["prompt_token_ids"] == list(b"hi")
    assert ch["text"] == "".join(chr(t) for t in expected)
    assert ch["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert r.headers["X-Request-Id"]


async def test_stream_chat_with_usage_and_n(server, http):
    app, url, engine = server
    payload = {"model": "fake", "messages": [{"role": "user", "content": "yo"}], "n": 2,
               "max_completion_tokens": 3, "stream": True, "seed": 1,
               "stream_options": {"include_usage": True}, "ignore_eos": True, "unknown_x": 1}
    async with http.post(f"{url}/v1/chat/completions", json=payload) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await r.text())
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert all(c["usage"] is None for c in chunks)
    by_index: dict[int, str] = {0: "", 1: ""}
    for c in chunks:
        ch = c["choices"][0]
        by_index[ch["index"]] += ch["delta"].get("content", "")
    assert len(by_index[0]) == 3 and len(by_index[1]) == 3
    firsts = {}
    for c in chunks:
        firsts.setdefault(c["choices"][0]["index"], c["choices"][0]["delta"])
    assert all(d.get("role") == "assistant" for d in firsts.values())
    prompt_len = len(engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "yo"}])))
    assert usage_chunk["usage"]["prompt_tokens"] == prompt_len


async def test_token_id_prompts_batch_and_stop(server, http):
    _, url, engine = server
    prompts = [[104, 105], [120, 121, 122]]
    async with http.post(f"{url}/v1/completions",
                         json={"prompt": prompts, "max_tokens": 4}) as r:
        body = await r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 5
    first = chr(engine.token_at(prompts[0], 0)) + chr(engine.token_at(prompts[0], 1))
    async with http.post(f"{url}/v1/completions",
                         json={"prompt": prompts[0], "max_tokens": 10, "stop": first[1]}) as r:
        body = await r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == first[0]


async def test_logprobs_shapes(server, http):
    _, url, _ = server
    async with http.post(f"{url}/v1/completions",
                         json={"prompt": "a", "max_tokens": 2, "logprobs": 1}) as r:
        lp = (await r.json())["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.5, -0.5] and len(lp["tokens"]) == 2
    assert lp["text_offset"] == [0, 1]
    async with http.post(f"{url}/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
                               "logprobs": True}) as r:
        lp = (await r.json())["choices"][0]["logprobs"]
    assert [e["logprob"] for e in lp["content"]] == [-0.5, -0.5]


@pytest.mark.parametrize("payload,status,param", [
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x" * 200}, 400, "prompt"),
    ({"prompt": [1, 2, 999]}, 400, "prompt"),
    ({"prompt": "x", "model": "other"}, 404, "model"),
    ({"nope": 1}, 400, "prompt"),
    ({"prompt": ["a"] * 200, "n": 2}, 400, "n"),
])
async def test_bad_input_is_4xx_openai_shaped(server, http, payload, status, param):
    _, url, engine = server
    async with http.post(f"{url}/v1/completions", json=payload) as r:
        assert r.status == status
        err = (await r.json())["error"]
    assert err["param"] == param and err["message"] and err["type"]
    assert engine.stats().kv_blocks_used == 0 and not engine.reqs


async def test_malformed_json_oversized_body_and_unknown_route(http):
    async with running_app(server={"max_body_bytes": 1000}) as (_, url, engine):
        async with http.post(f"{url}/v1/completions", data=b"{not json",
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert "Malformed JSON" in (await r.json())["error"]["message"]
        async with http.post(f"{url}/v1/completions", data=b"x" * 5000) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "body_too_large"
        async with http.post(f"{url}/v1/completions", data=b"[" * 450 + b"]" * 450) as r:
            assert r.status == 400
        async with http.get(f"{url}/v1/nothing") as r:
            assert r.status == 404 and "error" in await r.json()
        async with http.get(f"{url}/health") as r:
            assert r.status == 200


async def test_api_keys(http, monkeypatch):
    monkeypatch.setenv("TEST_MOED_KEYS", "k1,k2")
    async with running_app(server={"api_keys_env": "TEST_MOED_KEYS",
                                   "metrics_require_auth": True}) as (_, url, _e):
        body = {"prompt": "x", "max_tokens": 1}
        async with http.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        async with http.post(f"{url}/v1/completions", json=body,
                             headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with http.post(f"{url}/v1/completions", json=body,
                             headers={"Authorization": "Bearer k2"}) as r:
            assert r.status == 200
        for path in ("/health", "/ready"):
            async with http.get(url + path) as r:
                assert r.status == 200
        async with http.get(f"{url}/metrics") as r:
            assert r.status == 401
        async with http.get(f"{url}/metrics", headers={"Authorization": "Bearer k1"}) as r:
            assert r.status == 200 and "moed_requests_running" in await r.text()


async def test_burst_over_admission_gives_429_and_successes(http):
    engine = FakeEngine(max_running=2, step_s=0.01)
    async with running_app(engine, admission={"max_waiting_requests": 3,
                                              "retry_after_s": 2}) as (_, url, engine):
        async def one() -> tuple[int, str | None]:
            async with http.post(f"{url}/v1/completions",
                                 json={"prompt": "burst", "max_tokens": 4}) as r:
                await r.read()
                return r.status, r.headers.get("Retry-After")
        results = await asyncio.gather(*[one() for _ in range(20)])
        statuses = [s for s, _ in results]
        assert 200 in statuses and 429 in statuses
        assert set(statuses) <= {200, 429}
        assert all(ra == "2" for s, ra in results if s == 429)
        assert engine.stats().kv_blocks_used == 0
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        assert 'moed_admission_rejected_total{reason="too_many_waiting"}' in text


async def test_client_disconnect_aborts_engine_request(http):
    engine = FakeEngine(step_s=0.02)
    async with running_app(engine) as (app, url, engine):
        async with http.post(f"{url}/v1/completions",
                             json={"prompt": "abc", "max_tokens": 100, "stream": True}) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")     # first token arrived
        for _ in range(100):
            if not engine.reqs and app.state.inflight == 0:
                break
            await asyncio.sleep(0.02)
        assert not engine.reqs and engine.aborted
        assert engine.stats().kv_blocks_used == 0
        assert app.state.admission.live == 0 and app.state.admission.pending == 0


async def test_request_timeout_aborts(http):
    engine = FakeEngine(step_s=0.05)
    async with running_app(engine, server={"request_timeout_s": 0.2}) as (_, url, engine):
        async with http.post(f"{url}/v1/completions",
                             json={"prompt": "t", "max_tokens": 100}) as r:
            assert r.status == 408
            assert (await r.json())["error"]["code"] == "timeout"
        assert not engine.reqs and engine.aborted
        async with http.post(f"{url}/v1/completions",
                             json={"prompt": "t", "max_tokens": 100, "stream": True}) as r:
            events = sse_events(await r.text())
        assert events[-1]["error"]["code"] == "timeout" and 1 <= len(events) - 1 < 100
        assert not engine.reqs and len(engine.aborted) == 2


async def test_request_id_echo_models_and_metrics(server, http):
    _, url, _ = server
    async with http.post(f"{url}/v1/completions", json={"prompt": "m", "max_tokens": 2},
                         headers={"X-Request-Id": "abc-123"}) as r:
        assert r.headers["X-Request-Id"] == "abc-123"
    async with http.get(f"{url}/v1/models") as r:
        data = (await r.json())["data"]
    assert data[0]["id"] == "fake"
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    for name in ("moed_time_to_first_token_seconds_bucket", "moed_inter_token_latency_seconds",
                 "moed_e2e_request_latency_seconds", "moed_prompt_tokens_total",
                 "moed_generation_tokens_total", 'moed_requests_finished_total{finish_reason="length",model_name="fake"}',
                 "moed_http_requests_total", "moed_kv_blocks_free", "moed_prefix_cache_hit_rate",
                 "moed_step_seconds", "moed_batch_size"):
        assert name in text, name


async def test_drain_finishes_inflight_then_refuses(http):
    engine = FakeEngine(step_s=0.01)
    async with running_app(engine, server={"shutdown_grace_s": 5.0}) as (app, url, engine):
        req = asyncio.ensure_future(http.post(f"{url}/v1/completions",
                                              json={"prompt": "d", "max_tokens": 20}))
        while app.state.inflight == 0:
            await asyncio.sleep(0.005)
        drain = asyncio.ensure_future(app.drain())
        await asyncio.sleep(0.02)
        async with http.get(f"{url}/ready") as r:
            assert r.status == 503
        async with http.post(f"{url}/v1/completions", json={"prompt": "d"}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "draining"
        resp = await req
        assert resp.status == 200
        assert (await resp.json())["usage"]["completion_tokens"] == 20
        await drain


class _BrokenEngine(FakeEngine):
    def add_request(self, rid, prompt, params):
        if params.max_tokens == 3:
            raise KeyError("secret internal detail")       # a bug: the catch-all answers
        if params.max_tokens == 5:
            raise RuntimeError("engine is shutting down")
        return super().add_request(rid, prompt, params)

    def _step(self, r):
        if r.params.max_tokens == 4:      # the engine reports a failed request
            from moed.types import FinishReason, TokenEvent
            r.queue.put_nowait(TokenEvent(r.rid, (), "", (), FinishReason.ERROR, len(r.prompt),
                                          error="engine step failed: boom"))
            r.done, r.blocks = True, 0
            self.reqs.pop(r.rid, None)
            return
        super()._step(r)


async def test_internal_errors_are_500_with_request_id_only(http):
    async with running_app(_BrokenEngine()) as (app, url, engine):
        for max_tokens in (3, 4):
            async with http.post(f"{url}/v1/completions",
                                 json={"prompt": "x", "max_tokens": max_tokens},
                                 headers={"X-Request-Id": f"rid-{max_tokens}"}) as r:
                assert r.status == 500
                err = (await r.json())["error"]
            assert f"rid-{max_tokens}" in err["message"]
            assert "secret" not in err["message"] and "boom" not in err["message"]
        async with http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 5}) as r:
            assert r.status == 503
        async with http.post(f"{url}/v1/completions",
                             json={"prompt": "x", "max_tokens": 4, "stream": True}) as r:
            events = sse_events(await r.text())
        assert "error" in events[-1] and "[DONE]" not in events
        async with http.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200                 # still serving
        assert app.state.admission.live == 0 and not engine.reqs


async def test_chat_stream_token_ids_and_live_config(http):
    import dataclasses

    async with running_app() as (app, url, engine):
        body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3, "stream": True,
                "return_token_ids": True}
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            chunks = sse_events(await r.text())[:-1]
        assert chunks[0]["prompt_token_ids"] == engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template(body["messages"]))
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 3
        # a reload that tightens admission applies to the next request
        cfg = app.config
        app.set_config(dataclasses.replace(cfg, admission=dataclasses.replace(
            cfg.admission, max_waiting_requests=1, retry_after_s=9)))
        async with http.post(f"{url}/v1/completions", json={"prompt": "p", "n": 2}) as r:
            assert r.status == 400 and "at most 1" in (await r.json())["error"]["message"]
        assert app.state.admission.max_waiting == 1
        async with http.post(f"{url}/v1/completions", json={"prompt": "p"}) as r:
            assert r.status == 200
