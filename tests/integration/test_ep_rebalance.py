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


def _post(srv, path: str, headers: dict[str, str]) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request
    req = urllib.request.Request(srv.url + path, data=b"", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_an_operator_triggers_a_rebalance_on_rank_0(moed_server, tiny_qwen3) -> None:
    """POST /admin/eplb/rebalance: with an interval of a day, rank 0 decides at the group's next
    working steps; rank 1 and a node without a group say why they cannot; the admin token is
    required."""
    from moed_server import ADMIN_HEADERS
    DECIDED = ('moed_eplb_rebalances_total{outcome="applied"}',
               'moed_eplb_rebalances_total{outcome="unchanged"}')
    env = {**EPLB, "MOED_PARALLEL_EPLB_INTERVAL_S": "86400"}
    two = launch_group(moed_server, tiny_qwen3, 2, args=ARGS, env=env)
    one = launch_group(moed_server, tiny_qwen3, 1, args=ARGS)
    wait_ready([*two, *one], ready_timeout=120)

    def decisions() -> float:
        m = two[0].metrics()
        return sum(m.get(k, 0.0) for k in DECIDED)

    _text(two[0], SKEWED[0], 8)                   # a window of expert load, no decision
    assert decisions() == 0
    assert _post(two[0], "/admin/eplb/rebalance", {})[0] == 401
    status, body = _post(two[1], "/admin/eplb/rebalance", ADMIN_HEADERS)
    assert (status, body["error"]["code"]) == (409, "not_rank_0"), body
    status, body = _post(one[0], "/admin/eplb/rebalance", ADMIN_HEADERS)
    assert (status, body["error"]["code"]) == (409, "not_expert_parallel"), body
    status, body = _post(two[0], "/admin/eplb/rebalance", ADMIN_HEADERS)
    assert (status, body["status"]) == (202, "requested"), body
    deadline = time.monotonic() + 30
    while decisions() < 1:                        # steps run the collect/decide/publish/apply
        assert time.monotonic() < deadline, two[0].tail()
        _text(two[1], SKEWED[1], 8)
    # both ranks applied it (in the same step; their metrics are read one after the other)
    while _applied(two)[1] != _applied(two)[0]:
        assert time.monotonic() < deadline, [srv.tail() for srv in two]
        time.sleep(0.1)
