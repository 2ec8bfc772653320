"""DistributedExperts over real gloo process groups on 127.0.0.1 (world 2 and 4): each rank's
MoE output equals the single-process MoELayer's on the same weights, with zero-token ranks,
uneven splits and a replicated (redundant-slot) layout. bf16 (the fused CPU kernel path and
the oneDNN torch path) is bit for bit; fp32 within 1e-5: an expert that gets rows from two
ranks runs one 2-row matmul where EP=1 ran two 1-row ones, and fp32 GEMM is not
batch-invariant (the same holds for one process under another batch). The ranks are this
file run as a script."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(world: int, case: str) -> list[dict]:
    port = _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), str(port), case],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for r in range(world)]
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, se[-3000:]
        out.append(json.loads(so.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("world,case", [(2, "bf16"), (2, "fp32"), (4, "bf16"),
                                        (2, "bf16-torch"), (4, "bf16-replicas")])
def test_distributed_equals_local(world: int, case: str) -> None:
    results = _run_group(world, case)
    tol = 1e-5 if case == "fp32" else 0.0
    for r, res in enumerate(results):
        assert res["max_abs_diff"] <= tol, (r, res)
        assert res["checked"] > 0
        assert res["load_equal"], (r, res)     # the expert-load counts match EP=1's
    # some rank had no tokens in some round, and the splits were uneven
    assert any(res["zero_rounds"] for res in results)
    assert any(res["sent"] != res["received"] for res in results)


# ---- the rank --------------------------------------------------------------------------------

def _rank_main(rank: int, world: int, port: int, case: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from moed.model.context import ComputeContext
    from moed.model.kernels import cpu_kernels
    from moed.model.moe import MoELayer
    from moed.model.spec import ModelSpec
    from moed.parallel.dispatch import RankPlacement
    from moed.parallel.layout import EPLayout

    torch.set_num_threads(1)
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    E, H, I, K = 8, 64, 32, 3
    spec = ModelSpec.__new__(ModelSpec)
    object.__setattr__(spec, "top_k", K)
    object.__setattr__(spec, "norm_topk_prob", True)
    object.__setattr__(spec, "num_experts", E)
    g = torch.Generator().manual_seed(7)
    router = (torch.randn(E, H, generator=g) * 0.5).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.2).to(dtype)
    ctx = ComputeContext.build("cpu", dtype)
    if case == "bf16-torch":
        ctx = ComputeContext(ctx.device, dtype, ctx.pack, None)
    if case != "fp32" and case != "bf16-torch" and ctx.kernels is None:
        assert cpu_kernels() is None
    if case == "bf16-replicas":     # 12 slots for 8 experts: hot experts 0-3 twice, elsewhere
        layout = EPLayout.from_slots(E, world, [0, 1, 2, 3, 4, 5, 6, 7, 3, 2, 1, 0][: 12 - 12 % world])
    else:
        layout = EPLayout.contiguous(E, world)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    place = RankPlacement(layout, rank, torch.device("cpu"))
    mine = list(place.local_slots)
    ref = MoELayer(spec, router, gate_up, down, torch.zeros(E, dtype=torch.long), ctx)
    ep = MoELayer(spec, router, gate_up[mine].contiguous(), down[mine].contiguous(),
                  torch.zeros(E, dtype=torch.long), ctx, place)
    # rounds of tokens per rank: zero-token ranks, one token, uneven, and > FUSED_MAX_TOKENS
    rounds = [[3, 0, 5, 1], [0, 1, 0, 0], [1, 1, 1, 1], [17, 2, 0, 9], [600, 0, 3, 1]]
    tg = torch.Generator().manual_seed(100 + rank)
    diff, checked, zero = 0.0, 0, 0
    for counts in rounds:
        t = counts[rank % len(counts)]
        x = torch.randn(t, H, generator=tg).to(dtype)
        if t == 0:
            zero += 1
            ep.empty_step(dtype) if rank % 2 else ep(x)    # both ways of having no tokens
            continue
        want, got = ref(x), ep(x)
        d = float((want.float() - got.float()).abs().max()); diff = max(diff, d)
        checked += t
    st = place.stats
    print(json.dumps({"max_abs_diff": diff, "checked": checked, "zero_rounds": zero,
                      "sent": st.rows_sent, "received": st.rows_received,
                      "load_equal": bool(torch.equal(ref.router.load, ep.router.load))}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
