"""/tokenize, /detokenize, /version and /v1/models/{id} on a real aiohttp server with the fake
engine (its tokenizer maps text to UTF-8 bytes, so expected ids are computed by hand)."""
from __future__ import annotations

from api_harness import running_app

from moed import __version__


async def test_tokenize_detokenize_and_model_by_id(http) -> None:
    async with running_app() as (_, url, engine):
        r = await http.post(url + "/tokenize", json={"model": "fake", "prompt": "héllo"})
        assert r.status == 200
        body = await r.json()
        assert body == {"count": 6, "max_model_len": engine.max_model_len,
                        "tokens": list("héllo".encode())}
        msgs = [{"role": "user", "content": "hi"}]
        r = await http.post(url + "/tokenize", json={"messages": msgs})
        assert (await r.json())["tokens"] == list(b"<user>hi\n<assistant>")
        r = await http.post(url + "/tokenize", json={"messages": msgs,
                                                     "add_generation_prompt": False})
        assert (await r.json())["tokens"] == list(b"<user>hi\n")
        r = await http.post(url + "/detokenize", json={"tokens": list(b"abc")})
        assert r.status == 200 and (await r.json()) == {"prompt": "abc"}
        r = await http.get(url + "/v1/models/fake")
        assert r.status == 200 and (await r.json())["max_model_len"] == engine.max_model_len
        assert (await http.get(url + "/v1/models/other")).status == 404
        r = await http.get(url + "/version")
        assert r.status == 200 and (await r.json()) == {"version": __version__}


async def test_tokenize_refuses_what_it_does_not_apply(http) -> None:
    async with running_app() as (_, url, _engine):
        for body, param in [({"prompt": "x", "return_token_strs": True}, "return_token_strs"),
                            ({"prompt": "x", "messages": []}, "prompt"),
                            ({}, "prompt"),
                            ({"prompt": 5}, "prompt"),
                            ({"prompt": "\ud800"}, "prompt"),
                            ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
                            ({"messages": [{"role": "user", "content": "x"}],
                              "add_special_tokens": False}, "add_special_tokens")]:
            r = await http.post(url + "/tokenize", json=body)
            err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == param, (body, err)
        r = await http.post(url + "/tokenize", json={"model": "other", "prompt": "x"})
        assert r.status == 404
        for tokens in ([-1], [10**6], ["a"], None):
            r = await http.post(url + "/detokenize", json={"tokens": tokens})
            assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"
        r = await http.post(url + "/tokenize", data=b"{not json")
        assert r.status == 400


async def test_tokenize_needs_the_api_key_version_does_not(http, monkeypatch) -> None:
    monkeypatch.setenv("TEST_MOED_KEYS", "k1")
    async with running_app(server={"api_keys_env": "TEST_MOED_KEYS"}) as (_, url, _engine):
        assert (await http.post(url + "/tokenize", json={"prompt": "x"})).status == 401
        assert (await http.post(url + "/detokenize", json={"tokens": [1]})).status == 401
        ok = {"Authorization": "Bearer k1"}
        assert (await http.post(url + "/tokenize", json={"prompt": "x"}, headers=ok)).status == 200
        assert (await http.get(url + "/v1/models/fake")).status == 401
        assert (await http.get(url + "/version")).status == 200
