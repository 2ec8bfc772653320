"""Refilled cold slots' oneDNN copies come back from the store's side file (cold/onednn.py)
instead of being packed again: the bytes restored are the ones a pack gives, the logits stay
the all-resident ones, and a restore that cannot read (not cached, a short read) packs, as
before the file."""
from __future__ import annotations

import os

import pytest
import torch

from moed.model.cold import ColdSettings
from moed.model.cold.onednn import _bytes, unavailable
from moed.model.kernels.choice import ONEDNN_ROWS_HINT
from test_cold_experts import _budget, _runner, _steps

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@pytest.fixture(autouse=True)
def _no_kernels(monkeypatch):
    """oneDNN copies are kept beside an expert's plain weight only without the native kernels
    (with them, DeepSeek-V3's experts are held once, in the kernels' layout)."""
    from moed.model import context
    monkeypatch.setattr(context, "cpu_kernels", lambda: None)


def _cold(ck):
    full = _runner(ck, "bfloat16")
    want = _steps(full, 6)
    r = _runner(ck, "bfloat16", ColdSettings(_budget(full, 0.3), 1 << 30, 4.0, 0))
    assert r.cold.onednn is not None, r.cold.onednn_off     # the torch path keeps oneDNN copies
    return want, r


def _assert_fresh(r) -> int:
    """Every slot whose copies are not stale holds exactly what packing its plain weight gives."""
    checked = 0
    for layer in r.cold.layers:
        local = layer.local
        for slot, unit in enumerate(layer.expert_in):
            if unit < 0 or slot in local.stale:
                continue
            for lin in local.experts[slot]:
                fresh = torch.ops.mkldnn._reorder_linear_weight(lin.weight, ONEDNN_ROWS_HINT)
                assert bytes(_bytes(lin.packed)) == bytes(_bytes(fresh)), (layer.pos, slot, unit)
                checked += 1
    return checked


def test_refilled_slots_copy_their_onednn_bytes_back(make_checkpoint):
    want, r = _cold(make_checkpoint("deepseek_v3"))
    r.cold.onednn.cap = 1 << 40         # room for every expert (the cap has its own test)
    got = _steps(r, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "logits differ from all-resident"
    st = r.cold.stats
    assert st.onednn_restored > 0, st           # a slot refilled with an expert packed before
    assert st.onednn_packed == len(r.cold.onednn.where), st     # each expert packed once
    assert _assert_fresh(r) > 0


def test_a_restore_that_cannot_read_packs_instead(make_checkpoint, monkeypatch):
    want, r = _cold(make_checkpoint("deepseek_v3"))
    fd, real = r.cold.onednn.fd, os.preadv

    def preadv(f, bufs, offset, flags=0):
        """The side file's pages are never cached; a short read every other time."""
        if f == fd:
            if offset % 2:
                raise BlockingIOError(11, "Resource temporarily unavailable")
            return real(f, [bufs[0][:len(bufs[0]) // 2]], offset, flags)
        return real(f, bufs, offset, flags)
    monkeypatch.setattr(os, "preadv", preadv)
    got = _steps(r, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "logits differ from all-resident"
    st = r.cold.stats
    assert st.onednn_restored == 0 and st.onednn_packed > len(r.cold.onednn.where), st
    assert _assert_fresh(r) > 0


def test_the_side_file_holds_no_more_than_its_cap(make_checkpoint):
    want, r = _cold(make_checkpoint("deepseek_v3"))
    side = r.cold.onednn
    assert side.cap == r.cold.settings.resident_bytes       # the operator's budget bounds it
    side.cap = 3 * r.cold.expert_bytes // 2                 # room for one expert's copies
    got = _steps(r, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "logits differ from all-resident"
    assert 0 < side.end <= side.cap and len(side.where) == 1, (side.end, side.cap, side.where)
    assert r.cold.stats.onednn_packed > 1, r.cold.stats      # the rest packed as before


def test_a_failing_write_turns_the_side_file_off_and_packs(make_checkpoint, monkeypatch):
    """A full TMPDIR (ENOSPC on the side file): the file turns off, every re-pack packs, the
    output stays the all-resident one."""
    want, r = _cold(make_checkpoint("deepseek_v3"))
    side, real = r.cold.onednn, os.pwrite

    def pwrite(f, data, offset):
        if f == side.fd:
            raise OSError(28, "No space left on device")
        return real(f, data, offset)
    monkeypatch.setattr(os, "pwrite", pwrite)
    got = _steps(r, 6)
    assert all(torch.equal(a, b) for a, b in zip(want, got)), "logits differ from all-resident"
    st = r.cold.stats
    assert not side.on and side.where == {} and side.end == 0, (side.on, side.where)
    assert st.onednn_restored == 0 and st.onednn_packed > 1, st
    assert _assert_fresh(r) > 0
