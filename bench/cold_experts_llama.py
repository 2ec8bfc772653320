"""bench/cold_experts.py --llama-cpp BUILD: moed with cold experts against llama.cpp with mmap,
the same checkpoint, each in a fresh memory cgroup capped at the same value (bench/memcap.py).

The checkpoint is cold_experts.py's DeepSeek-V3-shaped one with the Zipf trace's router bias
written into it (`skewed_checkpoint`: the same values `set_bias` puts in memory, rounded to the
file's bf16), so both engines route the same skewed way; it is converted once to GGUF bf16 with
bench/peers.py's converter (llama.cpp's convert_hf_to_gguf.py takes DeepseekV3ForCausalLM).

The cap is what an operator would set for moed at `--llama-share`: moed's peak RSS at that share
(a run in an uncapped cgroup), printed in its parts (`cap_parts`: that share of the expert bytes,
experts.resident_bytes + the non-expert weights + moed's KV blocks + the runtime, the rest: torch
and the libraries, the slots' oneDNN copies, the read buffers, the checkpoint pages mapped at
load); or with --cap-search the least cap under which moed's run completes (`least_cap`); or
--cap-mib. Before each run the files it reads are evicted from the page cache, so what it maps
or reads is charged to its cgroup. Per round, in alternating order: `llama-batched-bench -npp
PROMPT -ntg STEPS -npl BATCH,BATCH` (mmap on: its default; the second batch is its steady
state) and `cold_experts.py --rss SHARE --checkpoint <skewed>` (a prefill of the batch, then
STEPS decode steps; the second half is its steady state); once, llama.cpp uncapped for
reference. Decode tok/s on both sides is batch x steps / the decode phase's time (S_TG).
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

import torch

import memcap                                              # bench/memcap.py
from cold_experts import BLOCK, MODEL, ROOT, zipf_bias
from common import load_average
from peers import convert, find_source, find_tool, parse_batched_bench


def skewed_checkpoint(ck: Path, cache: Path, zipf: float, beta: float) -> Path:
    """A copy of ck whose e_score_correction_bias is the Zipf trace's (set_bias, seed 1), each
    layer's bias written over the copy's bytes in place (no load of the whole file)."""
    from cold_checkpoint import patch_tensor            # bench/cold_checkpoint.py
    out = cache / f"{ck.name}-zipf{zipf}-beta{beta}"
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in ck.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    part = out / "model.safetensors.part"
    shutil.copyfile(ck / "model.safetensors", part)
    g = torch.Generator().manual_seed(1)
    layers = json.loads((ck / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):                     # every layer is MoE here (first_k_dense_replace 0)
        patch_tensor(part, f"model.layers.{i}.mlp.gate.e_score_correction_bias",
                     zipf_bias(MODEL["num_experts"], zipf, beta, g))
    part.rename(out / "model.safetensors")
    return out


def cap_parts(ck: Path, share: float, total: int, batch: int, hwm: int) -> dict[str, int]:
    """The cap an operator would set for moed at `share`, in its parts (bytes): the budget, the
    non-expert weights, the KV blocks, and the runtime: the rest of moed's measured peak RSS
    (`hwm`: torch and the libraries, the oneDNN copies of the slots, the read buffers)."""
    from safetensors import safe_open

    from moed.model import archs
    from moed.model.hf_config import load_spec
    non_expert = 0
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if ".experts." not in k:
                sl = f.get_slice(k)
                non_expert += torch.Size(sl.get_shape()).numel() * 2      # bf16, as served
    kv = archs.kv_layout(load_spec(ck), BLOCK, torch.bfloat16).bytes_per_block * (batch * 8 + 8)
    budget = int(share * total)
    return {"experts_budget": budget, "non_expert_weights": non_expert, "kv": kv,
            "runtime": hwm - budget - non_expert - kv}


def least_cap(cmd: list[str], lo: int, hi: int, files: list[Path], step: int = 16 << 20) -> int:
    """The least cap (a multiple of `step`) under which cmd completes, by bisection: lo is
    assumed to fail (the weights and KV without any runtime), hi to hold (the peak RSS: the
    mapped checkpoint pages of the load count in it, and they are reclaimable)."""
    lo, hi = lo // step * step, -(-hi // step) * step
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        memcap.evict(files)
        c = memcap.run(cmd, mid)
        print(f"  cap search: {mid >> 20} MiB -> rc {c.rc}", flush=True)
        lo, hi = (lo, mid) if c.rc == 0 else (mid, hi)
    return hi


def llama_peer(ck: Path, a, total: int) -> None:  # noqa: ANN001 - cold_experts' argparse namespace
    cache = Path(a.cache)
    build = a.llama_cpp.expanduser().resolve()
    batched = find_tool(build, "llama-batched-bench")
    skewed = skewed_checkpoint(ck, cache, a.zipf, a.rss_beta)
    gguf = cache / f"{skewed.name}.bf16.gguf"
    if not gguf.is_file():
        convert(a.llama_cpp_src or find_source(build), skewed, gguf)
    moed_cmd = [sys.executable, str(ROOT / "bench" / "cold_experts.py"), "--rss", str(a.llama_share),
                "--checkpoint", str(skewed), "--prefills", "1", "--steps", str(a.steps),
                "--batch", str(a.batch), "--prompt", str(a.prompt), "--threads", str(a.threads or 2),
                "--move-mb", str(a.move_mb), "--half-life", str(a.half_life), "--layers", str(a.layers),
                "--expert-width", str(a.expert_width),
                "--prefetch", str(a.prefetch)]
    sized = memcap.run(moed_cmd, 64 << 30)              # the operator's measurement: no cap
    if sized.rc != 0:
        raise SystemExit(f"moed at {a.llama_share} failed uncapped:\n{(sized.out + sized.err)[-2000:]}")
    hwm = int(json.loads(sized.out.strip().splitlines()[-1])["vm_hwm"].split()[0]) << 10
    parts = cap_parts(skewed, a.llama_share, total, a.batch, hwm)
    cap = (a.cap_mib << 20) or -(-hwm // (16 << 20)) * (16 << 20)      # peak RSS, up to 16 MiB
    if a.cap_search and not a.cap_mib:
        cap = least_cap(moed_cmd, sum(parts.values()) - parts["runtime"], cap, [*skewed.glob("*.safetensors")])
        parts["runtime"] = cap - sum(parts.values()) + parts["runtime"]
    print("cap: " + " + ".join(f"{k} {v / 2**20:.0f}" for k, v in parts.items())
          + f" = {sum(parts.values()) / 2**20:.0f} MiB; used {cap / 2**20:.0f} MiB "
          f"(cgroup {memcap.available()}); all experts {total / 2**20:.0f} MiB", flush=True)
    ctx = a.batch * (a.prompt + a.steps) + 64
    llama_cmd = [str(batched), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
                 "-npp", str(a.prompt), "-ntg", str(a.steps), "-npl", f"{a.batch},{a.batch}",
                 "-t", str(a.threads or 2), "--output-format", "jsonl"]

    def llama(limit: int) -> dict:
        for _ in range(3):      # its result line sometimes never reaches the pipe (rc 0): again
            memcap.evict([gguf])
            c = memcap.run(llama_cmd, limit or 64 << 30)
            rows = [r for r in parse_batched_bench(c.out + "\n" + c.err) if r["pl"] == a.batch]
            if rows or c.rc != 0:
                break
        ok = len(rows) == 2 and c.rc == 0
        return {"who": "llama.cpp", "capped": bool(limit), "rc": c.rc, "peak_mib": c.peak_bytes / 2**20,
                "oom_kills": c.oom_kills, "decode_tok_s": rows[0]["speed_tg"] if ok else None,
                "decode_tok_s_steady": rows[1]["speed_tg"] if ok else None,
                "load": load_average(), "tail": "" if ok else (c.out + c.err)[-1500:]}

    def moed() -> dict:
        memcap.evict(sorted(skewed.glob("*.safetensors")))
        c = memcap.run(moed_cmd, cap)
        res = json.loads(c.out.strip().splitlines()[-1]) if c.rc == 0 else {}
        return {"who": "moed", "capped": True, "rc": c.rc, "peak_mib": c.peak_bytes / 2**20,
                "oom_kills": c.oom_kills, "decode_tok_s": res.get("decode_tok_s"),
                "decode_tok_s_steady": res.get("decode_tok_s_second_half"),
                "vm_hwm": res.get("vm_hwm"), "resident_expert_mib": res.get("resident_expert_mib"),
                "hit_rate": res.get("hit_rate"), "hit_rate_second_half": res.get("hit_rate_second_half"),
                "load": load_average(), "tail": "" if res else (c.out + c.err)[-1500:]}

    first = json.loads(sized.out.strip().splitlines()[-1])
    runs = [{"who": "moed", "capped": False, "rc": 0, "peak_mib": sized.peak_bytes / 2**20, "oom_kills": 0,
             "decode_tok_s": first["decode_tok_s"], "decode_tok_s_steady": first["decode_tok_s_second_half"],
             "vm_hwm": first["vm_hwm"], "hit_rate": first.get("hit_rate"),
             "hit_rate_second_half": first.get("hit_rate_second_half"), "load": load_average(), "tail": ""},
            llama(0)]
    for r in range(a.rounds):
        for who in (("llama", "moed") if r % 2 == 0 else ("moed", "llama")):
            runs.append(llama(cap) if who == "llama" else moed())
    for x in runs:
        print(f"  {x['who']:9} capped={x['capped']!s:5} rc {x['rc']:>4} decode {x['decode_tok_s'] or 0:7.1f} "
              f"steady {x['decode_tok_s_steady'] or 0:7.1f} tok/s  cgroup peak {x['peak_mib']:6.0f} MiB  "
              f"oom_kills {x['oom_kills']}  load {x['load'][0]:.2f}"
              + (f"  in memory {x['hit_rate']:.1%} (2nd half {x['hit_rate_second_half']:.1%})" if x.get("hit_rate") else "") + (f"\n{x['tail']}" if x["tail"] else ""),
              flush=True)

    def med(who: str, capped: bool, key: str) -> float | None:
        xs = [x[key] for x in runs if x["who"] == who and x["capped"] == capped and x[key]]
        return statistics.median(xs) if xs else None
    fig = {f"{w}_{c}_{k}": med(who, cap_, key) for w, who in (("moed", "moed"), ("llama", "llama.cpp"))
           for c, cap_ in (("capped", True), ("uncapped", False)) for k, key in
           (("first", "decode_tok_s"), ("steady", "decode_tok_s_steady"))}
    ratios = {k: (fig[f"moed_capped_{k}"] / fig[f"llama_capped_{k}"]
                  if fig[f"moed_capped_{k}"] and fig[f"llama_capped_{k}"] else None) for k in ("first", "steady")}
    print(f"\ndecode tok/s, batch {a.batch}, prompt {a.prompt}, {a.steps} steps, cap {cap / 2**20:.0f} MiB "
          f"(moed at {a.llama_share:.0%} resident; medians of {a.rounds} runs):")
    for k, what in (("first", "from an evicted page cache (whole run)"),
                    ("steady", "steady (moed: 2nd half of the steps; llama: its 2nd batch)")):
        print(f"  {what}: moed {fig[f'moed_capped_{k}'] or 0:.1f}, llama.cpp {fig[f'llama_capped_{k}'] or 0:.1f} "
              f"(uncapped {fig[f'llama_uncapped_{k}'] or 0:.1f}); moed / llama.cpp "
              f"{'-' if ratios[k] is None else f'{ratios[k]:.2f}'}")
    out = Path(a.out).with_name(Path(a.out).stem + "_llama.json")     # cold_experts_llama.json by default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cap_bytes": cap, "cap_parts": parts, "share": a.llama_share,
                               "layers": a.layers, "expert_width": a.expert_width, "total_expert_bytes": total,
                               "batch": a.batch, "prompt": a.prompt, "steps": a.steps,
                               "gguf": str(gguf), "commands": {"llama": llama_cmd, "moed": moed_cmd},
                               "figures": fig, "ratios": ratios, "runs": runs,
                               "loadavg_end": load_average()}, indent=1))
    plot(runs, cap, a, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(runs: list[dict], cap: int, a, path: Path) -> None:  # noqa: ANN001
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    labels = {("moed", True): f"moed {a.llama_share:.0%} resident\n(capped)",
              ("moed", False): f"moed {a.llama_share:.0%} resident\n(uncapped)",
              ("llama.cpp", True): "llama.cpp mmap\n(capped)", ("llama.cpp", False): "llama.cpp mmap\n(uncapped)"}
    keys = [k for k in labels if any((x["who"], x["capped"]) == k for x in runs)]
    for i, k in enumerate(keys):
        xs = [x for x in runs if (x["who"], x["capped"]) == k]
        ax[0].scatter([i - 0.1] * len(xs), [x["decode_tok_s"] or 0 for x in xs], zorder=3, c="C0",
                      label="whole run, evicted cache" if i == 0 else None)
        ax[0].scatter([i + 0.1] * len(xs), [x["decode_tok_s_steady"] or 0 for x in xs], zorder=3, c="C1",
                      label="steady" if i == 0 else None)
        ax[1].scatter([i] * len(xs), [x["peak_mib"] for x in xs], zorder=3, c="C2")
    ax[0].legend()
    for j, (axis, what) in enumerate(((ax[0], "decode tok/s (0: killed)"), (ax[1], "cgroup peak MiB"))):
        axis.set_xticks(range(len(keys)), [labels[k] for k in keys])
        axis.set_ylabel(what)
        axis.grid(alpha=0.3)
    ax[1].axhline(cap / 2**20, color="red", ls=":", label="cap")
    ax[1].legend()
    fig.suptitle(f"cold experts vs llama.cpp mmap under one memory cap ({cap / 2**20:.0f} MiB), "
                 f"DeepSeek-V3-shaped, batch {a.batch}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
