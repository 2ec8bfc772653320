"""Prompt-lookup drafts (moed.engine.drafts.ngram): the incremental index against a brute force
over the whole context, after every extend, on seeded random and periodic sequences; the edge
cases; no torch. Never timed (the cost bound is the docstring's, by construction)."""
from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from moed.engine.drafts.ngram import NgramIndex


def brute(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The definition, by rescanning: longest n, most recent earlier start, cut at the end."""
    L = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if L - n < 1:
            continue
        suffix = tokens[L - n:]
        for s in range(L - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def _check_stream(tokens: list[int], n_min: int, n_max: int, rng: random.Random) -> None:
    """Feed `tokens` in random-sized pieces (a prompt, then single tokens and small runs, as
    accepted drafts arrive); after every piece every k agrees with the brute force."""
    ix = NgramIndex(n_min, n_max)
    i = 0
    while i < len(tokens):
        step = rng.choice([1, 1, 1, 2, 3, rng.randrange(1, 40)])
        ix.extend(tokens[i:i + step])
        i = min(len(tokens), i + step)
        assert len(ix) == i
        for k in (0, 1, 3, 8):
            assert ix.propose(k) == brute(tokens[:i], n_min, n_max, k), (tokens[:i], k)


@pytest.mark.parametrize("seed", range(40))
def test_incremental_index_equals_the_brute_force_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])          # small vocabularies: many repeats, many n
    n_min = rng.randint(1, 3)
    n_max = n_min + rng.randint(0, 4)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 120))]
    _check_stream(tokens, n_min, n_max, rng)


def test_a_prompt_in_one_extend_equals_token_by_token() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(4) for _ in range(500)]
    bulk, single = NgramIndex(2, 4), NgramIndex(2, 4)
    bulk.extend(tokens)
    for t in tokens:
        single.extend([t])
    assert bulk._last == single._last
    for k in range(6):
        assert bulk.propose(k) == single.propose(k) == brute(tokens, 2, 4, k)


@pytest.mark.parametrize("period", [1, 2, 3, 7])
def test_periodic_sequences_propose_from_the_most_recent_period(period: int) -> None:
    base = list(range(100, 100 + period))
    tokens = (base * 10)[:period * 10 - 1]      # stops mid-period
    rng = random.Random(period)
    _check_stream(tokens, 1, 4, rng)
    ix = NgramIndex(1, 4)
    ix.extend(tokens)
    # the most recent earlier occurrence of the 4-token suffix starts one period back: what
    # followed it runs into the suffix and stops at the end of the context (period tokens)
    assert ix.propose(20) == tokens[len(tokens) - period:]


def test_the_longest_n_wins_over_a_more_recent_shorter_match() -> None:
    ix = NgramIndex(1, 3)
    ix.extend([1, 2, 3, 50, 9, 3, 60, 1, 2, 3])
    assert ix.propose(2) == [50, 9]            # [1, 2, 3] at 0, not [3] at 5 (-> 60)
    ix = NgramIndex(1, 1)
    ix.extend([1, 2, 3, 50, 9, 3, 60, 1, 2, 3])
    assert ix.propose(2) == [60, 1]            # n = 1 only: the most recent 3


def test_a_match_running_past_the_end_is_cut() -> None:
    ix = NgramIndex(2, 2)
    ix.extend([5, 6, 7, 5, 6])
    assert ix.propose(10) == [7, 5, 6]          # all that followed, not padded
    ix.extend([8, 5, 6])
    assert ix.propose(10) == [8, 5, 6]          # the most recent [5, 6] now is at 3


def test_edges_k_zero_too_short_no_match() -> None:
    ix = NgramIndex(2, 3)
    assert ix.propose(5) == []                  # empty
    ix.extend([1, 2])
    assert ix.propose(5) == []                  # the suffix has no earlier start
    ix.extend([1, 2])
    assert ix.propose(0) == []
    assert ix.propose(5) == [1, 2]
    ix.extend([])
    assert len(ix) == 4 and ix.propose(1) == [1]
    other = NgramIndex(3, 3)
    other.extend([4, 4, 4])                     # 3 tokens: a 3-gram has no earlier start
    assert other.propose(3) == []
    other.extend([4])
    assert other.propose(3) == [4]
    with pytest.raises(ValueError):
        ix.propose(-1)


@pytest.mark.parametrize("n_min,n_max", [(3, 2), (0, 2), (-1, 1)])
def test_bad_bounds_are_refused(n_min: int, n_max: int) -> None:
    with pytest.raises(ValueError):
        NgramIndex(n_min, n_max)


def test_the_module_imports_no_torch() -> None:
    src = Path(__file__).resolve().parents[3] / "moed" / "engine" / "drafts" / "ngram.py"
    names = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert "torch" not in names and "numpy" not in names
