"""moed.engine.masks: a step's grammar masks beside the forward pass, each with a deadline; a
late or over-limit mask fails its row alone, the others are exact. A drafting row gets one mask
per verified position from a copy advanced by its drafts (the request's matcher untouched),
cut where a draft is refused or the deadline passes."""
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
        assert failed == {} and [int(m[0, 0]) for m in masks] == [1, 2, 3]
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
        assert int(masks[1][0, 0]) == 5
    finally:
        gate.set()
        pool.shutdown()


def test_a_row_queued_behind_a_slow_one_is_computed_not_failed() -> None:
    gate = threading.Event()
    pool = MaskPool(workers=1, timeout_s=0.2)
    try:
        slow, queued = FakeMatcher(7, gate), FakeMatcher(9)
        masks, failed = pool.start([slow, queued]).collect()
        assert failed == {0: "mask_timeout"} and int(masks[1][0, 0]) == 9 and queued.filled == 1
    finally:
        gate.set()
        pool.shutdown()


def test_a_matcher_past_a_limit_fails_its_row() -> None:
    pool = MaskPool(workers=1, timeout_s=5.0)
    try:
        masks, failed = pool.start([FakeMatcher(1, too_complex=True), FakeMatcher(2)]).collect()
        assert failed == {0: "limit"} and int(masks[1][0, 0]) == 2
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
        assert int(masks[2][0, 0]) == 4
    finally:
        gate.set()
        pool.shutdown()


class Advancing(FakeMatcher):
    """A grammar whose mask is its base value + the tokens consumed; refuses `refuse`."""

    def __init__(self, value: int, refuse: int = -1, slow_after: int = 99,
                 gate: threading.Event | None = None) -> None:
        super().__init__(value)
        self.refuse, self.slow_after, self.gate2, self.consumed = refuse, slow_after, gate, 0
        self.failed = self.stopped = False

    def fill(self, bm: torch.Tensor, row: int) -> None:
        if self.consumed >= self.slow_after:
            assert self.gate2.wait(30)
        bm[row] = self.value + self.consumed
        self.filled += 1

    def accept(self, t: int) -> bool:
        self.consumed += 1
        return t != self.refuse

    def copy(self) -> "Advancing":
        c = Advancing(self.value, self.refuse, self.slow_after, self.gate2)
        c.consumed = self.consumed
        return c


def test_a_drafting_row_gets_a_mask_per_position_and_its_matcher_is_untouched() -> None:
    pool = MaskPool(workers=2, timeout_s=5.0)
    try:
        m, refused, plain = Advancing(10), Advancing(20, refuse=6), FakeMatcher(3)
        masks, failed = pool.start([m, refused, plain], [(5, 6, 7), (5, 6, 7), ()]).collect()
        assert failed == {}
        assert masks[0][:, 0].tolist() == [10, 11, 12, 13] and m.consumed == 0
        assert masks[1][:, 0].tolist() == [20, 21]        # cut before the refused draft
        assert masks[2].shape == (1, 3) and int(masks[2][0, 0]) == 3
    finally:
        pool.shutdown()


def test_late_draft_masks_cut_the_draft_and_do_not_fail_the_request() -> None:
    """Mask 0 in time, the masks after 2 drafts stuck: the row keeps its first masks (its
    draft is verified shorter), is not failed, and collect keeps its deadline."""
    gate = threading.Event()
    pool = MaskPool(workers=1, timeout_s=0.2)
    try:
        m = Advancing(10, slow_after=2, gate=gate)
        t0 = time.monotonic()
        masks, failed = pool.start([m], [(5, 6, 7)]).collect()
        assert time.monotonic() - t0 < 5 and failed == {}
        assert masks[0][:, 0].tolist() == [10, 11]
    finally:
        gate.set()
        pool.shutdown()


def test_llguidance_draft_masks_equal_a_matcher_advanced_token_by_token(tiny_qwen3) -> None:
    """The real matcher: mask i equals a fresh matcher's after drafts 0..i-1, and the
    request's matcher is left as it was (its next masks and tokens unchanged)."""
    import json

    from moed.model.grammar import GrammarCompiler, fill_bitmask
    from moed.model.tokenizer import Tokenizer
    from moed.types import GrammarSpec

    tok = Tokenizer.from_dir(tiny_qwen3)
    comp = GrammarCompiler(tok.to_json(), tok.eos_token_ids)
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "required": ["ab"],
                                                  "properties": {"ab": {"type": "integer"}}}))
    text = tok.encode('{"ab": 123}')
    m = comp.matcher(spec)
    assert m.accept(text[0])
    draft = tuple(text[1:])
    assert m.valid_prefix(draft + (text[0],)) == len(draft)    # "{" after the object: refused
    before = fill_bitmask([m])[0].clone()
    pool = MaskPool(workers=2, timeout_s=5.0)
    try:
        masks, failed = pool.start([m], [draft]).collect()
    finally:
        pool.shutdown()
    ref, want = comp.matcher(spec), []
    for t in (text[0],) + draft:
        assert ref.accept(t)
        if len(want) < len(draft) + 1:
            want.append(fill_bitmask([ref])[0])
    assert failed == {} and torch.equal(masks[0], torch.stack(want[:len(draft) + 1]))
    assert torch.equal(fill_bitmask([m])[0], before)
    assert all(m.accept(t) for t in draft) and m.stopped
