"""Prompt-lookup drafts (vLLM's speculative method "ngram"): guess that the context repeats.

Glossary, in vLLM's terms: n_min, n_max = prompt_lookup_min, prompt_lookup_max; k =
num_speculative_tokens; the context t_0..t_{L-1} is the request's prompt + output so far.

propose(k): take the longest n in [n_min, n_max] whose suffix t_{L-n}..t_{L-1} also starts
at an earlier position s < L - n (it may overlap the suffix); the draft is the up-to-k tokens
that followed the most recent such s, t_{s+n}..t_{s+n+k-1}, cut at the end of the context
(a match near the end proposes fewer than k). No n matches: no draft.

vLLM's v1 proposer takes the earliest occurrence of the longest n-gram; this one takes the
most recent: the nearest repeat is the likelier to go on the same way (a list being copied,
code being edited), and it is what one dict write per n-gram keeps. The drafts are only
guesses: which occurrence is chosen changes the acceptance rate, never the output.

Cost: one dict from n-gram (a tuple of ids) to its last start position. A new token commits
the n_max - n_min + 1 n-grams that end just before it (the suffix itself is not "earlier"
until the next token arrives): O(n_max) dict writes a token, never a rescan of the context;
`propose` is at most n_max - n_min + 1 lookups. A prompt arrives in one `extend`, built with
C-level zips: 32k random tokens with n in [1, 5] index in ~28 ms and hold ~20 MB of tuples and
dict; then ~4-9 us a decode token, extend + propose (2-core dev machine).
"""
from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """One request's prompt-lookup index: `extend` with every token as it becomes known
    (the prompt, then each accepted output token), `propose(k)` for the next draft."""

    def __init__(self, n_min: int, n_max: int) -> None:
        if n_min < 1:
            raise ValueError(f"n_min must be >= 1, got {n_min}")
        if n_min > n_max:
            raise ValueError(f"n_min ({n_min}) must not exceed n_max ({n_max})")
        self.n_min = n_min
        self.n_max = n_max
        self._tokens: list[int] = []
        # n-gram -> start of its most recent occurrence that ends before the last token
        self._last: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the context and index the n-grams that are now earlier ones."""
        toks = self._tokens
        old = len(toks)
        toks.extend(tokens)
        new = len(toks)
        for n in range(self.n_min, self.n_max + 1):
            # newly committed: starts s with old <= s + n <= new - 1 (ends before the last token)
            lo, hi = max(0, old - n), new - 1 - n
            if hi == lo:                 # the decode path: one token, one n-gram per n
                self._last[tuple(toks[lo:lo + n])] = lo
            elif hi > lo:                # a prompt: zips of shifted slices, later starts win
                grams = zip(*(toks[lo + j:hi + 1 + j] for j in range(n)))
                self._last.update(zip(grams, range(lo, hi + 1)))

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens (fewer near the end of the context, [] without a match)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        toks = self._tokens
        L = len(toks)
        if k == 0:
            return []
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            s = self._last.get(tuple(toks[L - n:]))
            if s is not None:
                return toks[s + n:s + n + k]
        return []
