"""Quantized weights under expert parallelism (real `moed serve` processes, gloo on 127.0.0.1):
an EP=2 group serving a quantized checkpoint (Qwen3-MoE GPTQ, DeepSeek-V3 fp8 blocks) or
`--quantization` gives one process's greedy
completions, each rank holding about half of the quantized expert bytes (it loads only its
experts' packed tensors and scales); and the expert balancer moves packed experts with their
scales (and zero points) between ranks mid-serve without changing an output."""
from __future__ import annotations

import threading
import time

import pytest
from ep_group import complete, launch_group, wait_ready

import quant_ckpt       # tests/quant_ckpt.py

ARGS = ["--kv-cache-memory", "8", "--served-model-name", "m"]
PROMPTS = ["the quick brown fox", "hello world, this is a longer prompt about", "1 2 3"]
EPLB = {"MOED_PARALLEL_EPLB_INTERVAL_S": "0.2", "MOED_PARALLEL_EPLB_MIN_GAIN": "0",
        "MOED_PARALLEL_EPLB_LAYERS_PER_STEP": "1", "MOED_PARALLEL_EPLB_STEP_MB": "0.001",
        "MOED_PARALLEL_REDUNDANT_EXPERTS": "1"}
SKEWED = ["a a a a a a a a a a a a", "a a a a b b b b a a a a", "zz zz zz zz zz zz zz"]
APPLIED = 'moed_eplb_rebalances_total{outcome="applied"}'


def _text(srv, prompt: str, tokens: int) -> str:
    status, body = complete(srv, prompt, tokens)
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.fixture(scope="module")
def gptq_asym(make_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    quant_ckpt.make(make_checkpoint("qwen3_moe"), d / "q", d / "o", "gptq", group=32, symmetric=False)
    return d / "q"


@pytest.fixture(scope="module")
def deepseek_fp8(make_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("quant-ds")
    quant_ckpt.make(make_checkpoint("deepseek_v3"), d / "q", d / "o", "fp8", block=(128, 128))
    return d / "q"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["gptq-int4-asym", "online-int8", "deepseek-fp8"])
def test_ep2_quantized_equals_one_process(moed_server, make_checkpoint, request, how):
    model = request.getfixturevalue("gptq_asym") if how.startswith("gptq") else \
        request.getfixturevalue("deepseek_fp8") if how.startswith("deepseek") else make_checkpoint("qwen3_moe")
    args = [*ARGS, "--dtype", "float32", *(["--quantization", "int8"] if how == "online-int8" else [])]
    one, two = launch_group(moed_server, model, 1, args=args), launch_group(moed_server, model, 2, args=args)
    wait_ready([*one, *two], ready_timeout=180)
    want = [_text(one[0], p, 8) for p in PROMPTS]
    assert [_text(two[i % 2], p, 8) for i, p in enumerate(PROMPTS)] == want
    total = one[0].metrics()["moed_ep_resident_expert_bytes"]
    for srv in two:
        held = srv.metrics()["moed_ep_resident_expert_bytes"]
        assert abs(held - total / 2) <= 0.02 * total / 2, (held, total)
    for srv in [*one, *two]:
        srv.send_signal()
    for srv in [*one, *two]:
        assert srv.proc.wait(30) == 0, srv.tail()


@pytest.mark.timeout(600)
def test_eplb_moves_quantized_experts_with_their_scales(moed_server, gptq_asym):
    # fp32: requests batched differently on the two ranks than on the one process must not move
    # a near tie (bf16 sums differ by batch shape and by each process's measured kernel choice)
    args = [*ARGS, "--dtype", "float32"]
    one = launch_group(moed_server, gptq_asym, 1, args=args)
    two = launch_group(moed_server, gptq_asym, 2, args=args, env=EPLB)
    wait_ready([*one, *two], ready_timeout=180)
    want = {p: _text(one[0], p, 24) for p in SKEWED}
    deadline = time.monotonic() + 60
    while not all(srv.metrics().get(APPLIED, 0) >= 1 for srv in two):
        assert time.monotonic() < deadline, [srv.tail() for srv in two]
        outs: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, _text(two[i % 2], SKEWED[i], 24)))
                   for i in range(len(SKEWED))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [outs.get(i) for i in range(len(SKEWED))] == [want[p] for p in SKEWED]
    for i, p in enumerate(SKEWED):        # the new maps, on either rank
        assert _text(two[(i + 1) % 2], p, 24) == want[p]
    ms = [srv.metrics() for srv in two]
    assert max(m.get('moed_eplb_expert_bytes_moved_total{source="peer"}', 0) for m in ms) > 0
    for srv in [*one, *two]:
        srv.send_signal()
    for srv in [*one, *two]:
        assert srv.proc.wait(30) == 0, srv.tail()
