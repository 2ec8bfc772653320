"""Fixtures shared by the model tests."""
from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch

from moed.model import kernels as K
from moed.model.context import can_pack

# oneDNN's packed bf16 matmul needs AVX512BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU no row
# class can be oneDNN's (the kernels serve all, test_fastpaths.py), so tests of that split skip.
needs_onednn_bf16 = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16),
    reason="oneDNN has no bf16 matmul on this CPU (AVX2 without AVX512BW/VL/DQ or AVX-NE-CONVERT)")


def isa_params() -> list:
    """One pytest param per kernel variant: those this CPU cannot run skip with why (so an
    AVX512 machine runs the AVX2 variant too, and an AVX2-only one says what it skipped)."""
    return [pytest.param(isa, id=isa, marks=pytest.mark.skipif(
        bool(K.isa_missing(isa)), reason=f"{isa} variant: {K.isa_missing(isa) or 'runs'}")) for isa in K.ISAS]


def isa_pair_params() -> list:
    """One pytest param per pair of kernel variants (every pair of K.ISAS, in its order): a pair
    with a variant this CPU cannot run skips with why."""
    why = {isa: K.isa_missing(isa) for isa in K.ISAS}
    return [pytest.param(a, b, id=f"{a}-{b}", marks=pytest.mark.skipif(
        bool(why[a] or why[b]), reason="; ".join(f"{i} variant: {why[i]}" for i in (a, b) if why[i]) or "runs"))
        for a, b in itertools.combinations(K.ISAS, 2)]


@contextlib.contextmanager
def forced_isa(isa: str):
    """MOED_CPU_ISA=isa for the block: cpu_kernels() (and so every runner and context built
    inside) gives that variant; the previous setting and answer come back after."""
    saved = os.environ.get(K.ISA_ENV)
    os.environ[K.ISA_ENV] = isa
    K.cpu_kernels.cache_clear()
    try:
        k = K.cpu_kernels()
        assert k is not None and k.isa == isa, f"the {isa} kernels must build and load (see the log)"
        yield k
    finally:
        if saved is None:
            os.environ.pop(K.ISA_ENV, None)
        else:
            os.environ[K.ISA_ENV] = saved
        K.cpu_kernels.cache_clear()


@pytest.fixture
def kern():
    """The loaded CPU kernels (the test module skips where they cannot load); the chooser a test
    swaps in is put back after it."""
    k = K.cpu_kernels()
    assert k is not None, "this CPU runs a kernel variant: the kernels must build and load"
    saved = k.choose
    yield k
    k.choose = saved


@pytest.fixture(params=isa_params())
def isa_kern(request):
    """`kern` for each variant in turn (MOED_CPU_ISA forced while the test runs)."""
    with forced_isa(request.param) as k:
        saved = k.choose
        yield k
        k.choose = saved
