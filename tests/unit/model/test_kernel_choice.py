"""Kernel choice by measurement (moed/model/kernels/choice.py): the policy, its cache, and the
layers that follow it (Linear per row class, the MoE layer's fused-or-grouped decision)."""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from moed.model import kernels as K
from moed.model.context import ComputeContext
from moed.model.kernels import choice as C
from moed.model.layers import Linear
from moed.model.moe import MoELayer, fused_serves
from moed.model.hf_config import load_spec
from conftest import needs_onednn_bf16     # tests/unit/model/conftest.py

CPU = torch.device("cpu")

# The kernel tests run wherever the kernels can (CI can): there a load failure is a failure.
needs_kernels = pytest.mark.skipif(
    not K.cpu_flags_ok() or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
    reason="no AVX512-BF16 or no C compiler: moed runs the torch path, no choice to make")

ONEDNN_PAST_8 = C.LinearChoice((False, False, True, True, True))


def test_row_classes_have_the_documented_bounds():
    assert [C.row_class(r) for r in (1, 2, 8, 9, 64, 65, 512, 513, 10 ** 6)] == [0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_decide_needs_the_margin_and_fills_untimed_classes_from_below():
    native = [1.0, 1.0, 1.2, 2.0, None]
    onednn = [2.0, 1.0, 1.1, 1.0, None]
    # 1.2 / 1.1 = 1.09 < 1.15: a tie stays native (no second weight copy); 2.0 / 1.0 wins
    assert C.decide(native, onednn).onednn == (False, False, False, True, True)
    assert C.decide([None] * 5, [None] * 5).onednn == (False,) * 5
    assert C.decide(native, onednn, margin=1.05).onednn == (False, False, True, True, True)


def test_probe_rows_are_cut_to_the_flop_budget():
    assert C.probe_rows(64, 64) == list(C.PROBE_ROWS)
    rows = C.probe_rows(32000, 1024)            # lm_head: past 64 rows the probe would not fit
    assert rows[:3] == [1, 8, 30] and rows[3:] == [None, None]
    assert all(r is None or 2 * r * 32000 * 1024 <= C.PROBE_MAX_FLOP for r in rows)


def test_race_takes_each_sides_fastest_settled_call():
    delays = iter([0.0, 0.0] + [0.02, 0.001, 0.001, 0.001, 0.001, 0.001] + [0.001] * 30)
    slow_first = lambda: time.sleep(next(delays))  # noqa: E731
    fast = lambda: None  # noqa: E731
    ta, tb = C.race(slow_first, fast)
    assert ta < 0.01 and tb < ta                 # a 20 ms stall is not the kernel's time
    calls = []
    C.race(lambda: calls.append(1) or time.sleep(0.01), fast, max_calls=50, budget_s=0.05)
    assert len(calls) < 12                       # the budget stops a long race


def test_fused_serves_follows_the_expert_choice():
    assert fused_serves(1, 2, 16, None) and fused_serves(8192, 2, 16, None)    # no cap on tokens
    # 64 tokens x top-2 over 16 experts = 8 rows per expert (native); 80 -> 10 (oneDNN)
    assert fused_serves(64, 2, 16, ONEDNN_PAST_8)
    assert not fused_serves(80, 2, 16, ONEDNN_PAST_8)
    assert fused_serves(1, 2, 16, C.NATIVE_ONLY) and fused_serves(8192, 2, 16, C.NATIVE_ONLY)


@pytest.fixture
def quiet(monkeypatch):
    """No other process takes the cores during a measurement (run delay never grows)."""
    monkeypatch.setattr(C, "run_delay_s", lambda: 0.0)


def test_chooser_measures_once_then_reads_the_cache(tmp_path, monkeypatch, quiet):
    so = tmp_path / "moed_cpu_bf16-0123.so"
    calls = []

    def fake_measure(kernels, n, k):
        calls.append((n, k))
        return [1.0, 1.0, 1.0, 3.0, 3.0], [2.0, 2.0, 1.0, 1.0, 1.0]
    monkeypatch.setattr(C, "measure", fake_measure)
    first = C.KernelChooser(None, so)
    got = first(96, 128)
    assert got.onednn == (False, False, False, True, True) and calls == [(96, 128)]
    assert first(96, 128) is got and calls == [(96, 128)]          # memory
    again = C.KernelChooser(None, so)                               # a restart: the file
    assert again(96, 128) == got and calls == [(96, 128)]
    body = json.loads(C.cache_file_for(so).read_text())
    assert body["kernels"] == so.name and body["threads"] == torch.get_num_threads()
    assert body["shapes"]["96x128"]["native_us"][3] == 3e6
    # another thread count is another machine as far as timings go: its own file, measured
    with _threads(torch.get_num_threads() + 1):
        C.KernelChooser(None, so)(96, 128)
    assert calls == [(96, 128)] * 2
    # a torn file is measured again and rewritten
    C.cache_file_for(so).write_text("{not json")
    assert C.KernelChooser(None, so)(96, 128) == got and len(calls) == 3
    assert "96x128" in json.loads(C.cache_file_for(so).read_text())["shapes"]


def test_a_measurement_on_busy_cores_is_used_but_not_cached(tmp_path, monkeypatch):
    from structlog.testing import capture_logs

    so = tmp_path / "moed_cpu_bf16-0123.so"
    calls = []
    monkeypatch.setattr(C, "measure", lambda kernels, n, k: calls.append(1) or ([3.0] * 5, [1.0] * 5))
    delays = iter([0.0, 0.5])           # the race's threads waited 0.5 s for a CPU
    monkeypatch.setattr(C, "run_delay_s", lambda: next(delays, 0.5))
    with capture_logs() as logs:
        got = C.KernelChooser(None, so)(96, 128)
    assert got.onednn == (True,) * 5                       # this process goes by what it saw
    assert not C.cache_file_for(so).exists()                # ... but no later start does
    assert any(e["event"] == "kernel_choice_not_cached" and e["reason"] == "cores busy" for e in logs)
    assert any(e["event"] == "kernel_choice" and e["source"] == "measured_busy" for e in logs)
    monkeypatch.setattr(C, "run_delay_s", lambda: 0.0)     # a quiet restart measures and caches
    C.KernelChooser(None, so)(96, 128)
    assert len(calls) == 2 and C.cache_file_for(so).exists()


def test_busy_needs_a_real_wait_and_proc_says_something():
    assert not C.busy_during(1.0, 1.0005, 0.0)     # under a millisecond: noise, not load
    assert C.busy_during(1.0, 1.05, 0.2) and not C.busy_during(1.0, 1.01, 0.2)
    assert not C.busy_during(None, 2.0, 0.1)
    d = C.run_delay_s()
    assert d is None or d >= 0.0


def test_chooser_on_an_unwritable_cache_keeps_answers_in_memory(tmp_path, monkeypatch, quiet):
    monkeypatch.setattr(C, "measure", lambda kernels, n, k: ([1.0] * 5, [1.0] * 5))
    (tmp_path / "file").write_text("")          # the cache's folder is a file: no write can work
    ch = C.KernelChooser(None, tmp_path / "file" / "k.so")
    assert ch(8, 8) == C.NATIVE_ONLY and ch.so_path is None
    assert ch(8, 16) == C.NATIVE_ONLY


def test_chooser_with_no_cache_file_still_decides(monkeypatch):
    monkeypatch.setattr(C, "measure", lambda kernels, n, k: ([4.0] * 5, [1.0] * 5))
    assert C.KernelChooser(None, None)(8, 8).onednn == (True,) * 5


@pytest.mark.parametrize("shape", [(96, 128), (40, 80), (7, 80)])
def test_unpack_inverts_pack(shape):
    w = torch.randn(3, *shape).bfloat16()
    assert torch.equal(K.CpuKernels.unpack(K.CpuKernels.pack(w), shape[0]), w)


@needs_kernels
@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 8, 9, 80, 300])
def test_linear_serves_each_row_class_from_its_choice(kern, rows):
    kern.choose = C.FixedChooser(ONEDNN_PAST_8)
    g = torch.Generator().manual_seed(rows)
    w, b = (torch.randn(96, 128, generator=g) * 0.1).bfloat16(), torch.randn(96, generator=g).bfloat16()
    lin = Linear(w, b, pack=True, kernels=kern)
    assert lin.weight is None and lin.packed is not None and lin.kpacked is not None
    x = torch.randn(rows, 128, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float()).bfloat16()
    assert (lin(x).float() - ref.float()).abs().max() <= 3 * ref.float().abs().max() * 2 ** -8
    native = kern.linear_bf16(x, lin.kpacked, 96, b)
    onednn = torch.ops.mkldnn._linear_pointwise(x, lin.packed, b, "none", [], "")
    assert torch.equal(lin(x), onednn if rows > 8 else native)

    kern.choose = C.FixedChooser(C.NATIVE_ONLY)   # native everywhere: one packed copy only
    lin = Linear(w, b, pack=True, kernels=kern)
    assert lin.packed is None and torch.equal(lin(x), kern.linear_bf16(x, lin.kpacked, 96, b))


def _moe(spec, g):
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    return ((torch.randn(e, h, generator=g) * 0.5).bfloat16(), (torch.randn(e, 2 * i, h, generator=g) * 0.1).bfloat16(),
            (torch.randn(e, h, i, generator=g) * 0.1).bfloat16())


@needs_kernels
@needs_onednn_bf16
def test_moe_layer_takes_the_grouped_onednn_path_where_chosen(kern, make_checkpoint, monkeypatch):
    """With oneDNN chosen past 8 rows, a batch with > 8 rows per expert skips the fused kernel
    (spied) and still matches the torch path; fewer rows per expert stay fused. load_slot
    rebuilds the oneDNN copy from the kernels' packed weights."""
    spec = load_spec(make_checkpoint("qwen3_moe", num_experts=4, top_k=2, hidden_size=80, moe_intermediate_size=40))
    g = torch.Generator().manual_seed(5)
    router, gate_up, down = _moe(spec, g)
    ref = MoELayer(spec, router, gate_up, down, torch.zeros(4, dtype=torch.long), ComputeContext(CPU, torch.bfloat16))
    kern.choose = C.FixedChooser(ONEDNN_PAST_8)
    ctx = ComputeContext(CPU, torch.bfloat16, pack=True, kernels=kern)
    layer = MoELayer(spec, router, gate_up, down, torch.zeros(4, dtype=torch.long), ctx)
    fused = []
    orig = type(kern).moe_bf16
    monkeypatch.setattr(type(kern), "moe_bf16", lambda self, *a, **kw: fused.append(1) or orig(self, *a, **kw))
    for t, want_fused in ((8, True), (60, False)):      # 4 vs 30 rows per expert
        fused.clear()
        x = torch.randn(t, spec.hidden_size, generator=g).bfloat16()
        got, want = layer(x).float(), ref(x).float()
        assert bool(fused) == want_fused
        assert (got - want).abs().max() <= 4 * want.abs().max() * 2 ** -8
    # slot 0 takes expert 3's weights: the oneDNN copies must follow
    layer.experts.load_slot(0, [w.clone() for w in layer.experts.slot_weights(3)])
    (gu0, down0), (gu3, down3) = layer.experts.experts[0], layer.experts.experts[3]
    x, a = (torch.randn(30, n, generator=g).bfloat16() for n in (spec.hidden_size, spec.moe_intermediate_size))
    assert gu0.packed is not None and torch.equal(gu0(x), gu3(x)) and torch.equal(down0(a), down3(a))


class _threads:
    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self):
        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)


def test_processes_on_one_host_take_turns_to_measure(tmp_path) -> None:
    """The cache file's lock is exclusive across processes: a holder makes another wait (here:
    until the wait runs out, then it goes on alone and says so)."""
    import fcntl
    import os
    import time

    from structlog.testing import capture_logs

    from moed.model.kernels import choice as C
    f = tmp_path / "moed_kernel_choice-x.json"
    fd = os.open(f.with_suffix(".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)          # flock locks are per open file: this one holds it
    old, C.LOCK_WAIT_S = C.LOCK_WAIT_S, 0.3
    try:
        t0 = time.monotonic()
        with capture_logs() as logs, C._host_lock(f):
            waited = time.monotonic() - t0
        assert waited >= 0.3 and any(e["event"] == "kernel_choice_lock_timeout" for e in logs)
        os.close(fd)                          # released: the next one takes it at once
        t0 = time.monotonic()
        with C._host_lock(f):
            assert time.monotonic() - t0 < 0.2
    finally:
        C.LOCK_WAIT_S = old
