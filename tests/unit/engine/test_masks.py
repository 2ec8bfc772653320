"""moed.engine.masks: a step's grammar masks beside the forward pass, each with a deadline; a
late or over-limit mask fails its row alone, the others are exact."""
from __future__ import annotations

import threading
import time

import torch

from moed.engine.masks import MaskPool


class FakeMatcher:
    """fill() writes `value` into every word, after waiting on `gate` (a slow grammar)."""

    def __init__(self, value: int, gate: threading.Event | None = None,
                 too_complex: bool = False) -> None:
        self.words, self.value, self.gate, self.too_complex = 3, value, gate, too_complex
        self.filled = 0

    def fill(self, bm: torch.Tensor, row: int) -> None:
        if self.gate is not None:
            assert self.gate.wait(30)
        bm[row] = self.value
        self.filled += 1


def test_masks_come_back_in_order() -> None:
    pool = MaskPool(workers=2, timeout_s=5.0)
    try:
        ms = [FakeMatcher(v) for v in (1, 2, 3)]
        masks, failed = pool.start(ms).collect()
        assert failed == {} and [int(m[0]) for m in masks] == [1, 2, 3]
    finally:
        pool.shutdown()


def test_a_late_mask_fails_its_row_alone_and_collect_keeps_its_deadline() -> None:
    gate = threading.Event()
    pool = MaskPool(workers=2, timeout_s=0.2)
    try:
        slow, fine = FakeMatcher(7, gate), FakeMatcher(5)
        t0 = time.monotonic()
        masks, failed = pool.start([slow, fine]).collect()
        assert time.monotonic() - t0 < 5          # the deadline holds (0.2 s; generous bound)
        assert failed == {0: "mask_timeout"}
        assert bool((masks[0] == -1).all())          # unmasked: its token is dropped anyway
        assert int(masks[1][0]) == 5
    finally:
        gate.set()
        pool.shutdown()


def test_a_row_queued_behind_a_slow_one_is_computed_not_failed() -> None:
    gate = threading.Event()
    pool = MaskPool(workers=1, timeout_s=0.2)
    try:
        slow, queued = FakeMatcher(7, gate), FakeMatcher(9)
        masks, failed = pool.start([slow, queued]).collect()
        assert failed == {0: "mask_timeout"} and int(masks[1][0]) == 9 and queued.filled == 1
    finally:
        gate.set()
        pool.shutdown()


def test_a_matcher_past_a_limit_fails_its_row() -> None:
    pool = MaskPool(workers=1, timeout_s=5.0)
    try:
        masks, failed = pool.start([FakeMatcher(1, too_complex=True), FakeMatcher(2)]).collect()
        assert failed == {0: "limit"} and int(masks[1][0]) == 2
    finally:
        pool.shutdown()


class SlowFill(FakeMatcher):
    def fill(self, bm: torch.Tensor, row: int) -> None:
        time.sleep(0.3)
        super().fill(bm, row)


def test_a_row_computed_on_the_step_thread_past_the_deadline_fails_once() -> None:
    """Workers tied up by a late mask: a queued row runs here; one that alone outlasts the
    deadline there ends its request, so later steps cannot keep paying for it."""
    gate = threading.Event()
    pool = MaskPool(workers=1, timeout_s=0.1)
    try:
        slow, queued, fine = FakeMatcher(7, gate), SlowFill(9), FakeMatcher(4)
        masks, failed = pool.start([slow, queued, fine]).collect()
        assert failed == {0: "mask_timeout", 1: "mask_timeout"} and queued.filled == 1
        assert int(masks[2][0]) == 4
    finally:
        gate.set()
        pool.shutdown()
