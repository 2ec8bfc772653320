"""Fixtures over engine_fakes (the fake runner lives there so tests can import it by a
unique module name)."""
from __future__ import annotations

import pytest

from engine_fakes import FakeRunner, next_token


@pytest.fixture
def fake_runner():
    return FakeRunner


@pytest.fixture
def ref_greedy():
    def run(prompt: list[int], n: int) -> list[int]:
        seq, out = list(prompt), []
        for _ in range(n):
            t = next_token(seq)
            out.append(t)
            seq.append(t)
        return out
    return run
