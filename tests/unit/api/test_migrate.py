"""The router's record of a stream (moed.api.migrate): which streams may migrate, what the
client sees of each event, what is resubmitted, the phases' transitions, SSE event framing."""
from __future__ import annotations

import json

import pytest

from moed.api.migrate import (TRANSITIONS, EventSplitter, Ledger, StreamPhase, eligible,
                              error_event, non_streamed, server_side)


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


def test_eligible_streams_are_single_choice_without_tools() -> None:
    ok = {"prompt": "hi", "stream": True}
    assert eligible("/v1/completions", _ev(ok)) == ok
    assert eligible("/v1/chat/completions", _ev({"messages": [], "stream": True}))
    for bad in ({"prompt": "hi"}, {**ok, "n": 2}, {**ok, "best_of": 3}, {**ok, "tools": [{}]},
                {**ok, "prompt": ["a", "b"]}):
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
