"""Logprobs in OpenAI's and vLLM's response shapes (pure): the legacy completions object with
its text offsets, chat's content entries, echo's prompt part and vLLM's prompt_logprobs."""
from __future__ import annotations

from typing import Any

from moed.types import PromptLogprob


def _token_str(tok: Any, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


TopLogprobs = tuple[tuple[int, float], ...]      # one token's (token id, logprob), best first


def _tops(ids: list[int], lps: list[float], tops: list[TopLogprobs]) -> list[TopLogprobs]:
    """The engine's top-N per token; a token without them (an engine that does not compute
    them) lists the sampled token alone."""
    return [tops[i] if i < len(tops) and tops[i] else ((t, lp),)
            for i, (t, lp) in enumerate(zip(ids, lps))]


class TextOffsets:
    """Legacy `text_offset`s of a run of tokens: where each token's text starts in the returned
    text, i.e. `start` + the length of what the tokens before it decode to. Incremental, so an
    incomplete UTF-8 character adds nothing until its last byte and the offsets stay on the
    returned text's characters (summing each token's own string would not: each half of a
    character decodes to U+FFFD)."""

    def __init__(self, tok: Any, start: int, context: list[int] | tuple[int, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        from moed.model.tokenizer import IncrementalDetokenizer   # torch-free

        # decoded as the engine decodes the text (skip_special_tokens: the request's)
        self._detok = IncrementalDetokenizer(tok, context, skip_special_tokens)
        self.pos = start

    def take(self, ids: list[int]) -> list[int]:
        out = []
        for t in ids:
            out.append(self.pos)
            self.pos += len(self._detok.add(t))
        return out


def _top_dict(tok: Any, row: TopLogprobs) -> dict[str, float]:
    """{token text: logprob}; two ids that decode to the same text keep the likelier one."""
    d: dict[str, float] = {}
    for t, v in row:
        d.setdefault(_token_str(tok, t), v)
    return d


def completion_logprobs(tok: Any, ids: list[int], lps: list[float], top: int,
                        offsets: list[int], tops: list[TopLogprobs] = ()) -> dict[str, Any]:
    """Legacy completions logprobs: top_logprobs is one {token text: logprob} per token."""
    top_lps = [_top_dict(tok, row) for row in _tops(ids, lps, list(tops))] if top > 0 else None
    return {"tokens": [_token_str(tok, t) for t in ids], "token_logprobs": list(lps),
            "top_logprobs": top_lps, "text_offset": offsets}


def echo_logprobs(tok: Any, prompt_ids: list[int], plps: tuple[PromptLogprob, ...], top: int,
                  offsets: list[int]) -> dict[str, Any]:
    """The prompt's part of echo + logprobs (OpenAI's legacy API, vLLM): the first token has
    no logprob (null, and null top_logprobs); the others have the engine's prompt logprobs."""
    rest: list[PromptLogprob | None] = list(plps[:len(prompt_ids) - 1])
    rest += [None] * (len(prompt_ids) - 1 - len(rest))   # an engine that computed none
    entries = [None] + rest
    return {"tokens": [_token_str(tok, t) for t in prompt_ids],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": None if top <= 0 else
            [None if e is None else _top_dict(tok, e.top[:top]) for e in entries],
            "text_offset": offsets}


def vllm_prompt_logprobs(tok: Any, plps: tuple[PromptLogprob, ...], top: int
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token {token id:
    {logprob, rank, decoded_token}} for the prompt token and the top `top` tokens."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for e in plps:
        d = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank,
                               "decoded_token": _token_str(tok, e.token_id)}}
        for k, (t, v) in enumerate(e.top[:top]):
            d.setdefault(str(t), {"logprob": v, "rank": k + 1,
                                  "decoded_token": _token_str(tok, t)})
        out.append(d)
    return out


def join_logprobs(a: dict[str, Any], b: dict[str, Any] | None) -> dict[str, Any]:
    """Two legacy logprobs objects, one after the other."""
    if b is None:
        return a
    return {k: None if a[k] is None else a[k] + b[k] for k in a}   # top_logprobs: both or none


def _chat_entry(tok: Any, tid: int, lp: float) -> dict[str, Any]:
    s = _token_str(tok, tid)
    return {"token": s, "logprob": lp, "bytes": list(s.encode())}


def chat_logprobs(tok: Any, ids: list[int], lps: list[float], top: int,
                  tops: list[TopLogprobs] = ()) -> dict[str, Any]:
    content = []
    for t, lp, row in zip(ids, lps, _tops(ids, lps, list(tops))):
        tops_out = [_chat_entry(tok, i, v) for i, v in row] if top > 0 else []
        content.append({**_chat_entry(tok, t, lp), "top_logprobs": tops_out})
    return {"content": content}
