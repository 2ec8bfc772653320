"""The router's record of a stream (moed.api.migrate): which streams may migrate, what the
client sees of each event, what is resubmitted, the phases' transitions, SSE event framing."""
from __future__ import annotations

import json

import pytest

from moed.api.migrate import (TRANSITIONS, EventSplitter, Ledger, StreamPhase, choice_seed,
                              eligible, error_event, non_streamed, server_side)
from moed.api.protocol import SEED_MAX, SEED_MIN, parse_request


def _ev(obj: dict) -> bytes:
    return json.dumps(obj).encode()


def _chunk(i: int, *, first: bool = False, chat: bool = False, cid: str = "cmpl-1",
           finish: str | None = None) -> bytes:
    c: dict = {"index": 0, "finish_reason": finish, "token_ids": [100 + i]}
    if chat:
        c["delta"] = {"content": f"t{i}"}
    else:
        c["text"] = f"t{i}"
        if first:
            c["prompt_token_ids"] = [1, 2]
    body = {"id": cid, "created": 5, "choices": [c]}
    if chat and first:
        body["prompt_token_ids"] = [1, 2]
    return _ev(body)


def test_eligible_streams_are_one_prompt_without_tools() -> None:
    ok = {"prompt": "hi", "stream": True}
    assert eligible("/v1/completions", _ev(ok)) == ok
    assert eligible("/v1/chat/completions", _ev({"messages": [], "stream": True}))
    assert eligible("/v1/completions", _ev({**ok, "n": 2, "best_of": 1}))
    for bad in ({"prompt": "hi"}, {**ok, "best_of": 3}, {**ok, "tools": [{}]},
                {**ok, "prompt": ["a", "b"]}, {**ok, "n": "2"},
                {**ok, "n": 2, "stream_options": {"continuous_usage_stats": True}}):
        assert eligible("/v1/completions", _ev(bad)) is None, bad
    assert eligible("/v1/embeddings", _ev(ok)) is None
    assert eligible("/v1/completions", b"{not json") is None
    assert eligible("/v1/completions", _ev({**ok, "prompt": [1, 2]}))   # token ids: one prompt


def test_non_streamed_generation_requests_may_be_handed_back() -> None:
    for ok in ({"prompt": "hi"}, {"prompt": "hi", "stream": False, "n": 3},
               {"messages": [], "tools": [{}]}):
        assert non_streamed("/v1/completions", _ev(ok)), ok
    assert not non_streamed("/v1/completions", _ev({"prompt": "hi", "stream": True}))
    assert not non_streamed("/v1/embeddings", _ev({"input": "hi"}))
    assert not non_streamed("/v1/completions", b"{not json")
    assert not non_streamed("/v1/completions", b"[1]")


def test_ids_are_recorded_and_stripped_unless_the_client_asked() -> None:
    led = Ledger.open("/v1/completions", {"prompt": "hi", "stream": True})
    out, failed = led.relay(_chunk(0, first=True))
    assert not failed
    c = json.loads(out)["choices"][0]
    assert "token_ids" not in c and "prompt_token_ids" not in c and c["text"] == "t0"
    led.relay(_chunk(1))
    assert led.prompt_ids == [1, 2] and led.output_ids == [100, 101]
    asked = Ledger.open("/v1/completions", {"prompt": "hi", "stream": True,
                                            "return_token_ids": True})
    c = json.loads(asked.relay(_chunk(0, first=True))[0])["choices"][0]
    assert c["token_ids"] == [100] and c["prompt_token_ids"] == [1, 2]
    assert asked.output_ids == [100]


def test_chat_prompt_ids_come_from_the_first_chunk_body() -> None:
    led = Ledger.open("/v1/chat/completions", {"messages": [], "stream": True})
    out, _ = led.relay(_chunk(0, first=True, chat=True))
    assert "prompt_token_ids" not in json.loads(out) and led.prompt_ids == [1, 2]


def test_a_continuation_keeps_the_first_id_and_resubmits_what_the_client_has() -> None:
    led = Ledger.open("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 9})
    kind, body = led.resubmission()
    assert kind == "fresh" and json.loads(body)["return_token_ids"] is True   # nothing yet
    led.relay(_chunk(0, first=True))
    led.relay(_chunk(1))
    kind, body = led.resubmission("prefill")
    cont = json.loads(body)
    assert kind == "continue" and cont["output_token_ids"] == [100, 101]
    assert cont["prompt_token_ids"] == [1, 2] and cont["replay"] == "prefill"
    assert cont["request"]["max_tokens"] == 9 and cont["request"]["return_token_ids"] is True
    out, _ = led.relay(_chunk(2, cid="cmpl-other"))
    assert json.loads(out)["id"] == "cmpl-1" and led.output_ids == [100, 101, 102]


def test_server_side_errors_migrate_request_errors_pass() -> None:
    led = Ledger.open("/v1/completions", {"prompt": "hi", "stream": True})
    assert led.relay(_ev({"error": {"type": "server_error", "code": "engine_error"}})) \
        == (None, True)
    mine = _ev({"error": {"type": "invalid_request_error", "code": "grammar_too_complex"}})
    assert led.relay(mine) == (mine, False)
    assert server_side({"type": "server_error"}) and not server_side({"type": "timeout_error"})
    err = json.loads(error_event("gone", "backend_failed"))["error"]
    assert err["type"] == "server_error" and err["code"] == "backend_failed"


def test_done_closes_and_a_finished_stream_is_closed_with_exact_usage() -> None:
    led = Ledger.open("/v1/completions", {"prompt": "hi", "stream": True,
                                          "stream_options": {"include_usage": True}})
    led.relay(_chunk(0, first=True))
    led.relay(_chunk(1, finish="length"))
    assert led.finished
    usage, done = led.closing()
    assert json.loads(usage)["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                          "total_tokens": 4}
    assert done == b"[DONE]" and json.loads(usage)["id"] == "cmpl-1"
    assert led.relay(b"[DONE]") == (b"[DONE]", False) and led.phase is StreamPhase.DONE


def test_phases_change_only_along_their_transitions() -> None:
    led = Ledger.open("/v1/completions", {"stream": True})
    led.to(StreamPhase.MIGRATING)
    led.to(StreamPhase.RELAYING)
    led.to(StreamPhase.FAILED)
    with pytest.raises(ValueError):
        led.to(StreamPhase.RELAYING)
    assert not TRANSITIONS[StreamPhase.DONE] and not TRANSITIONS[StreamPhase.FAILED]
    with pytest.raises(ValueError):
        Ledger.open("/v1/completions", {}).to(StreamPhase.RELAYING)   # not from itself


def test_events_are_framed_whole_and_a_cut_one_is_held() -> None:
    sp = EventSplitter()
    assert sp.feed(b"data: {\"a\":1}\n\ndata: {\"b\"") == [b'{"a":1}']
    assert sp.feed(b":2}\n\n: comment\n\ndata: [DONE]\n\n") == [b'{"b":2}', b"[DONE]"]
    assert sp.feed(b"data: cut") == []


def _c(i: int, index: int, *, first: bool = False, finish: str | None = None) -> bytes:
    c: dict = {"index": index, "text": f"c{index}t{i}", "finish_reason": finish,
               "token_ids": [100 * (index + 1) + i]}
    if first:
        c["prompt_token_ids"] = [1, 2]
    return _ev({"id": "cmpl-1", "created": 5, "choices": [c]})


def test_choice_seeds_are_the_nodes_per_choice_seeds() -> None:
    base = {"prompt": "hi", "n": 3}
    for seed in (None, 0, 41, SEED_MAX, SEED_MIN):
        parsed = parse_request({**base, "seed": seed} if seed is not None else base,
                               chat=False)              # the node's own derivation
        for i in range(3):
            assert choice_seed(seed, i) == parsed.sampling_params(8, i).seed
            # the continuation's n = 1 request seeded so gets that seed again as its choice 0
            assert choice_seed(choice_seed(seed, i), 0) == choice_seed(seed, i)


def test_n2_choices_are_kept_apart_and_each_unfinished_one_continues_alone() -> None:
    req = {"prompt": "hi", "stream": True, "n": 2, "seed": 9,
           "stream_options": {"include_usage": True}}
    led = Ledger.open("/v1/completions", req)
    for data in (_c(0, 0, first=True), _c(0, 1, first=True), _c(1, 0, finish="stop"),
                 _c(1, 1)):
        out, failed = led.relay(data)
        assert not failed and json.loads(out)["choices"][0]["index"] in (0, 1)
    assert led.outputs == {0: [100, 101], 1: [200, 201]} and led.done == {0}
    assert not led.finished and led.pending() == 1
    kind, body = led.resubmission()
    cont = json.loads(body)
    assert kind == "continue" and led.current == 1       # the finished choice 0 is not resent
    assert cont["request"]["n"] == 1 and cont["request"]["seed"] == choice_seed(9, 1)
    assert cont["output_token_ids"] == [200, 201] and cont["prompt_token_ids"] == [1, 2]
    # the continuation's events: re-indexed to choice 1, its usage and [DONE] dropped
    out, _ = led.relay(_ev({"id": "cmpl-9", "created": 7, "choices": [
        {"index": 0, "text": "c1t2", "finish_reason": "length", "token_ids": [202]}]}))
    got = json.loads(out)
    assert got["choices"][0]["index"] == 1 and got["id"] == "cmpl-1" and got["created"] == 5
    assert led.relay(_ev({"id": "x", "choices": [], "usage": {"prompt_tokens": 2}})) == (
        None, False)
    assert led.relay(b"[DONE]") == (None, False) and led.ended
    assert led.phase is StreamPhase.RELAYING and led.finished
    usage, done = led.closing()
    assert json.loads(usage)["usage"] == {"prompt_tokens": 2, "completion_tokens": 5,
                                          "total_tokens": 7}
    assert done == b"[DONE]"


def test_n2_without_a_seed_or_ids_yet_resubmits_fresh_or_unseeded() -> None:
    led = Ledger.open("/v1/completions", {"prompt": "hi", "stream": True, "n": 2})
    assert led.resubmission()[0] == "fresh" and led.current is None   # nothing sent yet
    led.relay(_c(0, 1, first=True))
    kind, body = led.resubmission()
    cont = json.loads(body)
    assert kind == "continue" and led.current == 0 and cont["output_token_ids"] == []
    assert "seed" not in cont["request"] and cont["request"]["n"] == 1
