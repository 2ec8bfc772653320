"""Acceptance: a checkpoint whose experts exceed one rank's configured memory is refused at
EP=1 (serve and check-config, with the numbers) and served at EP=4 under the same limit; each
EP=4 rank reports ~1/4 of the expert bytes from the tensors it holds."""
from __future__ import annotations

import subprocess
import sys
import time

import torch
from ep_group import complete, start_group
from moed_server import ROOT, start_server

from moed.model.hf_config import load_spec
from moed.parallel.memory import rank_memory

ARGS = ["--kv-cache-memory", "2", "--served-model-name", "m", "--dtype", "bfloat16"]


def test_refused_at_ep1_served_at_ep4(moed_server, tiny_qwen3, tmp_path) -> None:
    spec = load_spec(tiny_qwen3)
    blocks = (2 << 20) // rank_memory(spec, torch.bfloat16, 1, 0, 1, 16, 0).kv_block_bytes
    need1 = rank_memory(spec, torch.bfloat16, 1, 0, blocks, 16, 0).total_bytes
    need4 = rank_memory(spec, torch.bfloat16, 4, 0, blocks, 16, 0).total_bytes
    limit_mb = -(-need4 // 2**20)
    assert need4 <= limit_mb << 20 < need1           # the experts are what does not fit
    env = {"MOED_PARALLEL_RANK_MEMORY_MB": str(limit_mb)}

    check = subprocess.run([sys.executable, "-m", "moed", "check-config", "--model", str(tiny_qwen3),
                            *ARGS], cwd=ROOT, env={**_clean_env(), **env}, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 2, check.stderr
    assert "parallel.rank_memory_mb" in check.stderr and "8 expert slots" in check.stderr
    srv = start_server(model=tiny_qwen3, role="colocated", env=env, args=ARGS, wait=None,
                       log_dir=tmp_path)
    assert srv.proc.wait(60) == 2
    assert "parallel.rank_memory_mb" in srv.logs()

    ranks = start_group(moed_server, tiny_qwen3, 4, args=ARGS, env=env)
    for srv in (ranks[0], ranks[3]):      # any rank's request wakes the idle group
        status, body = complete(srv, "hello", 4)
        assert status == 200, body
    # an idle group blocks: no rank burns CPU between requests
    cpu = lambda: [srv.metrics()["process_cpu_seconds_total"] for srv in ranks]  # noqa: E731
    before = cpu()
    time.sleep(3.0)
    used = [b - a for a, b in zip(before, cpu())]
    assert max(used) < 0.3, used
    total = rank_memory(spec, torch.bfloat16, 1, 0, 0, 16, 0).all_expert_bytes
    for srv in ranks:
        budget = [r for r in srv.log_records() if r.get("event") == "memory_budget"]
        assert budget and budget[0]["kv_blocks_fit"] >= blocks, budget   # room beside the weights
        held = srv.metrics()["moed_ep_resident_expert_bytes"]
        assert total / 4 <= held <= total / 4 * 1.05, (held, total)   # packed copies pad a little


def _clean_env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
