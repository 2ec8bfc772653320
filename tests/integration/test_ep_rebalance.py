"""The expert balancer on a running EP=2 group (real `moed serve` processes, gloo on 127.0.0.1;
Qwen3-MoE bf16 on the CPU kernels, Mixtral fp32 on the torch path): greedy completions equal one
process's before any layer moved, while a rebalance switches layers between the steps of a
running request, and after; each rank reports (from its own /metrics) that maps changed and
expert bytes moved, some of them from the peer rank."""
from __future__ import annotations

import threading
import time

import pytest
from ep_group import complete, launch_group, wait_ready

ARGS = ["--kv-cache-memory", "8", "--served-model-name", "m"]
# every 0.2 s of work a decision; any gain moves; one expert per step (a budget under one
# expert's bytes: each layer's moves span several steps, staged until its last is in); one
# redundant slot per rank, so hot experts get replicas and the router splits their tokens
EPLB = {"MOED_PARALLEL_EPLB_INTERVAL_S": "0.2", "MOED_PARALLEL_EPLB_MIN_GAIN": "0",
        "MOED_PARALLEL_EPLB_LAYERS_PER_STEP": "1", "MOED_PARALLEL_EPLB_STEP_MB": "0.001",
        "MOED_PARALLEL_REDUNDANT_EXPERTS": "1"}
SKEWED = ["a a a a a a a a a a a a", "a a a a b b b b a a a a", "zz zz zz zz zz zz zz"]
APPLIED = 'moed_eplb_rebalances_total{outcome="applied"}'


def _text(srv, prompt: str, tokens: int) -> str:
    status, body = complete(srv, prompt, tokens)
    assert status == 200, body
    return body["choices"][0]["text"]


def _applied(ranks) -> list[float]:
    return [srv.metrics().get(APPLIED, 0.0) for srv in ranks]


# bf16: the CPU kernels' packed slot copies move; fp32: the torch path's plain weights
@pytest.mark.parametrize("arch,dtype", [("qwen3_moe", "bfloat16"), ("mixtral", "float32")])
def test_ep_outputs_equal_one_process_across_a_rebalance(moed_server, make_checkpoint, arch: str,
                                                         dtype: str) -> None:
    model = make_checkpoint(arch)
    args = [*ARGS, "--dtype", dtype]
    one = launch_group(moed_server, model, 1, args=args)
    two = launch_group(moed_server, model, 2, args=args, env=EPLB)
    wait_ready([*one, *two], ready_timeout=120)
    want = {p: _text(one[0], p, 24) for p in SKEWED}
    assert _applied(two) == [0.0, 0.0]

    # before: nothing applied yet at the first request's first steps (the first windows are
    # empty), so this is the initial layout (it may already switch near the end)
    assert _text(two[0], SKEWED[0], 24) == want[SKEWED[0]]

    # during: keep the group busy with skewed prompts on both ranks until a rebalance has been
    # applied while a request was running on it, then check every output
    deadline, seen_during = time.monotonic() + 40, False
    while not seen_during:
        assert time.monotonic() < deadline, [srv.tail() for srv in two]
        before = _applied(two)
        outs: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, _text(two[i % 2], SKEWED[i], 24)))
                   for i in range(len(SKEWED))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [outs.get(i) for i in range(len(SKEWED))] == [want[p] for p in SKEWED]
        seen_during = _applied(two) > before      # layers switched between these requests' steps

    # after: the new maps serve the same outputs, on either rank
    for i, p in enumerate(SKEWED):
        assert _text(two[(i + 1) % 2], p, 24) == want[p]
    ms = [srv.metrics() for srv in two]
    assert all(m.get(APPLIED, 0) >= 1 for m in ms)
    moved = [m.get('moed_eplb_expert_bytes_moved_total{source="peer"}', 0)
             + m.get('moed_eplb_expert_bytes_moved_total{source="local"}', 0) for m in ms]
    assert sum(moved) > 0, moved
    assert max(m.get('moed_eplb_expert_bytes_moved_total{source="peer"}', 0) for m in ms) > 0
    assert any(k.startswith("moed_eplb_balancedness{") for k in ms[0])
    for srv in two:
        srv.send_signal()
    for srv in two:
        assert srv.proc.wait(30) == 0, srv.tail()
