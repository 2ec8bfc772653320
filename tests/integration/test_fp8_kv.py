"""The fp8 KV cache (engine.kv_cache_dtype = fp8) through real `moed serve` processes on
127.0.0.1 (tiny Qwen3-MoE, fp32 compute, blocks of 4 tokens):

- P/D over real NIXL with fp8 on both sides answers token for token as a colocated fp8 node,
  for the GQA cache (Qwen3-MoE) and the MLA latent cache (DeepSeek-V3);
  the prefill node writes fp8 blocks (the transferred bytes are the fp8 layout's), and the
  log line and the gauge say the KV bytes per token (half of bf16's, a quarter of fp32's);
- a decode node on a bf16/fp32 cache never pairs with an fp8 prefill node: over gossip the
  prefill node is not a candidate (a long prompt fails with "no prefill node available", a
  short one is prefilled locally); with a static peer the transfer handshake refuses the
  mismatched layout and the client gets a clear error;
- structured output through an fp8 P/D pair answers as colocated;
- the disk tier: fp8 blocks written before a restart are restored and give the same output;
  a node on the model's own dtype does not restore them (another layout, another directory);
- an EP=2 group with fp8 caches answers as one fp8 process."""
from __future__ import annotations

import json
import random

import openai
import pytest
import torch

from moed_server import free_port, started_together

from moed.model import archs
from moed.model.kv_layout import FP8
from moed.model.hf_config import load_spec

pytestmark = pytest.mark.timeout(120)

FP8_ENV = {"MOED_ENGINE_KV_CACHE_DTYPE": "fp8"}
COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
          "MOED_ENGINE_BLOCK_SIZE": "4", "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "16",
          "MOED_MODEL_SERVED_NAME": "tiny"}


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _prompt(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


def _greedy(srv, prompt, max_tokens: int = 8) -> list[int]:
    r = _client(srv).completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                        temperature=0, extra_body={"return_token_ids": True})
    return r.choices[0].token_ids


def _event(srv, name: str) -> dict:
    return next(r for r in srv.log_records() if r.get("event") == name)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])     # GQA and MLA caches
def test_pd_with_fp8_equals_colocated_fp8(arch, make_checkpoint, tmp_path) -> None:
    model = make_checkpoint(arch)
    fp8 = archs.kv_layout(load_spec(model), 4, FP8)
    p_port = free_port()
    specs = {"C": ("colocated", None, FP8_ENV),
             "P": ("prefill", p_port, FP8_ENV),
             "D": ("decode", None, {**FP8_ENV,
                                    "MOED_TRANSFER_PREFILL_PEERS": f"http://127.0.0.1:{p_port}",
                                    "MOED_TRANSFER_PREFILL_TIMEOUT_S": "30"})}
    with started_together(specs, model, tmp_path, COMMON) as s:
        lens = (9, 37, 64)
        for i, n in enumerate(lens):
            p = _prompt(n, seed=i)
            assert _greedy(s["D"], p) == _greedy(s["C"], p), f"prompt of {n} tokens diverged"
        for name in ("C", "P", "D"):
            srv = s[name]
            ready = _event(srv, "model_runner_ready")
            assert ready["kv_dtype"] == "float8_e4m3fn" and ready["kv_layout"] == fp8.layout_id
            assert ready["kv_bytes_per_token"] == fp8.bytes_per_token
            assert _event(srv, "kv_cache_sized")["kv_bytes_per_token"] == fp8.bytes_per_token
            m = srv.metrics()
            assert m["moed_kv_cache_bytes_per_token"] == fp8.bytes_per_token
            # fp32 compute, 1 byte an element: a quarter of the fp32 cache, half of bf16's
            assert fp8.bytes_per_token * 2 == archs.kv_layout(load_spec(model), 4,
                                                              torch.bfloat16).bytes_per_token
        pm = s["P"].metrics()
        assert pm['moed_transfer_jobs_total{result="done",role="prefill"}'] == len(lens)
        # every prompt block went over NIXL once, at the fp8 layout's size
        blocks = sum(-(-n // 4) for n in lens)
        assert pm["moed_transfer_bytes_total"] == blocks * fp8.bytes_per_block
        # structured output composes: D's matcher takes P's first token, as colocated
        kw = dict(model="tiny", prompt="Pick one:", max_tokens=20, temperature=1.0, n=4, seed=5,
                  extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
        got = _client(s["D"]).completions.create(**kw)
        assert all(c.text in ("alpha", "beta", "gamma") for c in got.choices)
        assert [c.text for c in got.choices] == \
            [c.text for c in _client(s["C"]).completions.create(**kw).choices]


def test_fp8_prefill_and_bf16_decode_never_pair(moed_server, tiny_qwen3) -> None:
    """P has an fp8 cache, D and D_static the model's dtype: the layout ids differ. All three
    share the harness's cluster key (D_static's job reaches P's layout check)."""
    gossip = free_port()
    cluster = {"MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_SEEDS": f"127.0.0.1:{gossip}"}
    p_port = free_port()
    p = moed_server(model=tiny_qwen3, role="prefill", wait=None, port=p_port, args=["--node-name", "p8"],
                    env={**COMMON, **FP8_ENV, **cluster, "MOED_CLUSTER_BIND_PORT": str(gossip)})
    d_static = moed_server(model=tiny_qwen3, role="decode", wait=None, env={
        **COMMON, "MOED_TRANSFER_PREFILL_PEERS": f"http://127.0.0.1:{p_port}",
        "MOED_TRANSFER_PREFILL_TIMEOUT_S": "20", "MOED_TRANSFER_MAX_PREFILL_RETRIES": "0"})
    d = moed_server(model=tiny_qwen3, role="decode", ready_timeout=90, args=["--node-name", "d"],
                    env={**COMMON, **cluster, "MOED_CLUSTER_BIND_PORT": str(free_port()),
                         "MOED_TRANSFER_LOCAL_PREFILL_MAX_TOKENS": "8"})
    for srv in (p, d_static):
        _wait(lambda srv=srv: srv.get("/ready")[0] == 200, 90, f"{srv.url} ready")

    def members() -> dict[str, dict]:
        return {m["name"]: m for m in json.loads(d.get("/cluster")[1])["members"]}

    _wait(lambda: members().get("p8", {}).get("state") == "alive", 30, "p8 seen by d")
    view = members()
    assert view["p8"]["layout"] and view["d"]["layout"] and view["p8"]["layout"] != view["d"]["layout"]
    # the gauge, side by side: fp8 = a quarter of D's fp32 cache (half of a bf16 one)
    per_token = "moed_kv_cache_bytes_per_token"
    assert 4 * p.metrics()[per_token] == d.metrics()[per_token] > 0

    # gossip: P is never a candidate; a prompt past local_prefill_max_tokens has nowhere to go
    c = _client(d)
    with pytest.raises(openai.APIStatusError) as err:
        c.completions.create(model="tiny", prompt=_prompt(40, 1), max_tokens=3, temperature=0)
    assert err.value.status_code == 503 and "no prefill node available" in str(err.value)
    short = c.completions.create(model="tiny", prompt=_prompt(6, 2), max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length"          # prefilled on D itself
    assert not any(r.get("event") == "remote_prefill_attempt_failed" for r in d.log_records())

    # a static peer is tried, and the transfer handshake refuses the other layout by name
    with pytest.raises(openai.APIStatusError) as err:
        _client(d_static).completions.create(model="tiny", prompt=_prompt(40, 3), max_tokens=3,
                                             temperature=0)
    assert err.value.status_code == 503 and "a prefill node refused the job" in str(err.value)
    assert "127.0.0.1" not in str(err.value)                  # no internal address to a client
    failed = [r for r in d_static.log_records() if r.get("event") == "remote_prefill_attempt_failed"]
    assert len(failed) == 1 and "bad_metadata" in failed[0]["error"]
    assert "KV layout mismatch" in failed[0]["error"] and "float8_e4m3fn" in failed[0]["error"]
    done = p.metrics().get('moed_transfer_jobs_total{result="done",role="prefill"}', 0)
    assert done == 0 and p.metrics().get("moed_transfer_bytes_total", 0) == 0


def _wait(cond, timeout: float, what: str) -> None:
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_disk_tier_restores_fp8_blocks_and_only_into_fp8(moed_server, tiny_qwen3, tmp_path) -> None:
    l3 = tmp_path / "l3"
    env = {**COMMON, "MOED_ENGINE_NUM_KV_BLOCKS": "16", "MOED_MODEL_MAX_MODEL_LEN": "60",
           "MOED_TIERS_DISK_BYTES": str(1 << 24), "MOED_TIERS_DISK_DIR": str(l3),
           "MOED_SERVER_CACHE_METRICS_BATCH": "1"}
    prompts = [_prompt(30, seed=10 + i) for i in range(4)]     # 4 x 8 blocks > L1's 16
    srv = moed_server(model=tiny_qwen3, env={**env, **FP8_ENV})
    first = [_greedy(srv, p, 4) for p in prompts]
    assert srv.stop() == 0
    fp8_id = archs.kv_layout(load_spec(tiny_qwen3), 4, FP8).layout_id
    dirs = {d.name for d in l3.iterdir()}
    assert len(dirs) == 1 and next(iter(dirs)).startswith(fp8_id), dirs

    # the restarted node says fp8 with vLLM's flag instead: the same layout, so it restores
    again = moed_server(model=tiny_qwen3, env=env, args=["--kv-cache-dtype", "fp8_e4m3"])
    assert _event(again, "kv_tier_restored")["blocks"] > 0
    assert [_greedy(again, p, 4) for p in prompts] == first
    assert again.metrics()['moed_kv_tier_hit_blocks_total{tier="disk"}'] > 0
    assert again.stop() == 0

    other = moed_server(model=tiny_qwen3, env=env)        # the model's dtype: fp32 KV
    restored = [r for r in other.log_records() if r.get("event") == "kv_tier_restored"]
    assert all(r["blocks"] == 0 for r in restored)
    [_greedy(other, p, 4) for p in prompts]
    assert other.metrics().get('moed_kv_tier_hit_blocks_total{tier="disk"}', 0) == 0
    assert len(list(l3.iterdir())) == 2         # its own directory beside the fp8 one


def test_ep_group_with_fp8_answers_as_one_process(moed_server, tiny_qwen3) -> None:
    """Expert parallelism composes: an EP=2 group, each rank with an fp8 cache, answers as one
    fp8 process (the KV stays per rank; only the experts are spread)."""
    from ep_group import complete, launch_group, wait_ready

    args = ["--kv-cache-memory", "8", "--served-model-name", "m", "--dtype", "float32",
            "--kv-cache-dtype", "fp8"]
    groups = {n: launch_group(moed_server, tiny_qwen3, n, args=args) for n in (1, 2)}
    wait_ready([srv for g in groups.values() for srv in g], ready_timeout=90)
    prompts = ["the quick brown fox", "hello world, this is a longer prompt about", "1 2 3"]

    def outputs(ranks):
        out = []
        for i, p in enumerate(prompts):
            status, body = complete(ranks[i % len(ranks)], p, 6)
            assert status == 200, body
            out.append(body["choices"][0]["text"])
        return out

    assert outputs(groups[2]) == outputs(groups[1])
    for srv in groups[2]:
        assert _event(srv, "model_runner_ready")["kv_dtype"] == "float8_e4m3fn"
