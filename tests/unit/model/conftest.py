"""Fixtures shared by the model tests."""
from __future__ import annotations

import pytest

from moed.model import kernels as K


@pytest.fixture
def kern():
    """The loaded CPU kernels (the test module skips where they cannot load); the chooser a test
    swaps in is put back after it."""
    k = K.cpu_kernels()
    assert k is not None, "this CPU has AVX512-BF16: the kernels must build and load"
    saved = k.choose
    yield k
    k.choose = saved
