"""Stop handling: stop strings across token boundaries (held back, cut out), EOS, stop ids."""
from __future__ import annotations

from moed.engine.request import Request, StopStrings
from moed.types import FinishReason, SamplingParams

PIECES = {1: "Hel", 2: "lo ", 3: "wor", 4: "ld", 5: "!", 6: "lo", 7: "x", 9: "<eos>"}


class PieceDetok:
    def add(self, t: int) -> str:
        return PIECES[t]

    def flush(self) -> str:
        return ""


def _feed(stop, toks, **kw):
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 10), stop=tuple(stop), **kw)
    r = Request("r", [0], params, eos_token_ids=(9,), detokenizer=PieceDetok())
    texts, reason = [], None
    for t in toks:
        text, reason = r.append_token(t)
        texts.append(text)
        if reason:
            break
    return texts, reason


def test_stop_string_across_tokens_is_cut():
    texts, reason = _feed(["o w"], [1, 2, 3, 4])
    assert "".join(texts) == "Hell" and reason is FinishReason.STOP
    assert texts == ["Hel", "l", ""]          # "o " held back until "w" decided it


def test_held_text_released_when_not_a_stop():
    texts, reason = _feed(["lo!"], [1, 6, 7, 5])
    assert texts[:3] == ["He", "l", "lox"] and reason is None   # "l", then "lo" held


def test_held_text_flushed_on_length():
    texts, reason = _feed(["lo!"], [1, 6], max_tokens=2)
    assert "".join(texts) == "Hello" and reason is FinishReason.LENGTH


def test_earliest_of_several_stops_wins():
    s = StopStrings(("ld", "wor"))
    assert s.feed("Hello world") == ("Hello ", True)


def test_eos_and_stop_token_ids():
    texts, reason = _feed([], [1, 9, 2])
    assert texts == ["Hel", ""] and reason is FinishReason.STOP    # EOS text not shown
    _, reason = _feed([], [1, 9, 2], ignore_eos=True, max_tokens=3)
    assert reason is FinishReason.LENGTH
    texts, reason = _feed([], [1, 4, 2], stop_token_ids=(4,))
    assert texts == ["Hel", ""] and reason is FinishReason.STOP


def test_min_tokens_defers_stops():
    _, reason = _feed(["lo"], [1, 6, 7], min_tokens=3, max_tokens=5)
    assert reason is None
    texts, reason = _feed([], [9, 9, 1], min_tokens=2, max_tokens=5)
    assert reason is None and "".join(texts).endswith("Hel")


def test_context_length():
    params = SamplingParams(max_tokens=10)
    r = Request("r", [0, 0, 0], params, max_model_len=5, detokenizer=PieceDetok())
    assert r.append_token(1)[1] is None
    assert r.append_token(2)[1] is FinishReason.LENGTH
