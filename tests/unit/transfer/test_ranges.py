"""Pure helpers of moed.transfer: run merging, byte ranges, layouts, metadata, state machine."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from moed.transfer.base import (BadMetadata, IncompatibleLayout, PeerMetadata, RegionLayout,
                                TRANSFER_TRANSITIONS, TransferState, check_transition)
from moed.transfer.ranges import byte_ranges, check_ids, merge_runs


def test_merge_runs_examples() -> None:
    assert merge_runs([], []) == []
    assert merge_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    # src contiguous but dst not: no merge
    assert merge_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]
    # descending ids never merge (order matters: row i pairs with row i)
    assert merge_runs([3, 2], [3, 2]) == [(3, 3, 1), (2, 2, 1)]
    with pytest.raises(ValueError, match="src has 2 block ids but dst has 1"):
        merge_runs([1, 2], [1])


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_merge_runs_expands_back(pairs: list[tuple[int, int]]) -> None:
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    runs = merge_runs(src, dst)
    expanded = [(s + i, d + i) for s, d, n in runs for i in range(n)]
    assert expanded == list(zip(src, dst))
    # maximal: two neighbouring runs could not have been one
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:]):
        assert not (s1 == s0 + n0 and d1 == d0 + n0)


def test_byte_ranges_layer_major() -> None:
    runs = [(2, 0, 3), (9, 5, 1)]
    rows = byte_ranges(runs, num_layers=2, base=1000, layer_stride=100_000, block_bytes=10,
                       side=0)
    assert rows.dtype == np.uint64
    assert rows.tolist() == [[1020, 30], [1090, 10], [101020, 30], [101090, 10]]
    dst = byte_ranges(runs, 2, 0, 500, 10, side=1)
    assert dst.tolist() == [[0, 30], [50, 10], [500, 30], [550, 10]]
    assert byte_ranges([], 3, 0, 1, 1, 0).shape == (0, 2)


def test_check_ids() -> None:
    check_ids([0, 3], 4, "source")
    with pytest.raises(ValueError, match=r"source block id out of range \[0, 4\): 4"):
        check_ids([0, 4], 4, "source")
    with pytest.raises(ValueError, match="out of range"):
        check_ids([-1], 4, "destination")
    with pytest.raises(ValueError, match="duplicates"):
        check_ids([1, 1], 4, "destination")


def test_layout_from_kv_tensor_matches_byte_math() -> None:
    kv = torch.zeros(3, 8, 2, 4, 2, 16, dtype=torch.bfloat16)   # [L, N, 2, bs, H, D]
    lay = RegionLayout.from_tensor(kv)
    assert lay.block_bytes == 2 * 4 * 2 * 16 * 2
    assert lay.layer_stride == 8 * lay.block_bytes
    assert lay.nbytes == kv.numel() * 2
    assert lay.block_format == "bfloat16:2x4x2x16"
    # block 5 of layer 2 is where byte math says it is
    assert kv[2, 5].data_ptr() == lay.base_addr + 2 * lay.layer_stride + 5 * lay.block_bytes
    with pytest.raises(ValueError, match="dense"):
        RegionLayout.from_tensor(kv.transpose(2, 3))


def test_layout_compatibility() -> None:
    a = RegionLayout(0, 2, 10, 64, 640, "f32:16")
    a.check_compatible(RegionLayout(4096, 2, 99, 64, 99 * 64, "f32:16"))  # block count may differ
    with pytest.raises(IncompatibleLayout, match="KV layout mismatch"):
        a.check_compatible(RegionLayout(0, 3, 10, 64, 640, "f32:16"))
    with pytest.raises(IncompatibleLayout):
        a.check_compatible(RegionLayout(0, 2, 10, 64, 640, "bf16:32"))
    with pytest.raises(ValueError, match="empty KV region"):
        RegionLayout(0, 0, 10, 64, 640)


def test_metadata_roundtrip_and_errors() -> None:
    md = PeerMetadata("nixl", "agent-1", RegionLayout(8, 2, 10, 64, 640, "x"), b"\x00blob\xff")
    assert PeerMetadata.decode(md.encode()) == md
    with pytest.raises(BadMetadata, match="not a moed KV transfer envelope"):
        PeerMetadata.decode(b"garbage")
    with pytest.raises(BadMetadata, match="corrupt"):
        PeerMetadata.decode(md.encode()[:14])


def test_transfer_state_machine() -> None:
    for s in (TransferState.DONE, TransferState.FAILED, TransferState.ABORTED):
        check_transition(TransferState.PENDING, s)
        assert TRANSFER_TRANSITIONS[s] == frozenset()
        with pytest.raises(RuntimeError, match="illegal transfer transition"):
            check_transition(s, TransferState.PENDING)
