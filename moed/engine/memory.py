"""The KV cache's size from a share of the memory this process can still use
(engine.kv_cache_memory_fraction), for operators who size by "most of what is left" rather
than by a fixed MB figure.

What is left: on a CPU, /proc/meminfo's MemAvailable, capped by the cgroup's (v2) memory.max
minus memory.current (a container or a systemd unit's MemoryMax= is the real limit); on a GPU,
torch.cuda.mem_get_info's free bytes. Measured before the weights are read, so the weights this
process will hold (this rank's, with expert parallelism) are taken off first; the fraction of
the rest goes to KV, and the remainder stays free for activations, the allocator and the rest
of the host.
"""
from __future__ import annotations

from pathlib import Path

MB = 1 << 20


def parse_meminfo_available(text: str) -> int | None:
    """MemAvailable from /proc/meminfo's text, in bytes (None when absent)."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            return int(parts[1]) * 1024 if len(parts) >= 2 and parts[1].isdigit() else None
    return None


def cgroup_room(memory_max: str | None, memory_current: str | None) -> int | None:
    """Bytes the cgroup still allows (None: no limit, or unreadable)."""
    if memory_max is None or memory_current is None:
        return None
    limit, used = memory_max.strip(), memory_current.strip()
    if limit == "max" or not limit.isdigit() or not used.isdigit():
        return None
    return max(0, int(limit) - int(used))


def host_memory_available(root: Path = Path("/")) -> int:
    """What this process may still allocate on the host: MemAvailable, capped by its cgroup."""
    def read(p: Path) -> str | None:
        try:
            return p.read_text()
        except OSError:
            return None
    text = read(root / "proc/meminfo")
    avail = parse_meminfo_available(text) if text else None
    if avail is None:
        raise ValueError("cannot read MemAvailable from /proc/meminfo")
    cg = root / "sys/fs/cgroup"
    room = cgroup_room(read(cg / "memory.max"), read(cg / "memory.current"))
    return avail if room is None else min(avail, room)


def kv_share_mb(fraction: float, available: int, weights: int) -> int:
    """MB for the KV cache: `fraction` of what `available` bytes leave beside `weights`."""
    if not 0 < fraction < 1:
        raise ValueError(f"the fraction must be in (0, 1), not {fraction}")
    left = available - weights
    if left <= 0:
        raise ValueError(f"{available / MB:,.0f} MB available does not hold the weights "
                         f"({weights / MB:,.0f} MB)")
    mb = int(left * fraction) // MB
    if mb < 1:
        raise ValueError(f"{fraction} of the {left / MB:,.0f} MB left beside the weights is "
                         f"under 1 MB")
    return mb


def kv_memory_mb(cfg, spec, dtype, device) -> tuple[int, str, dict[str, float]]:
    """(MB for the KV cache, the key that decided it, figures for the log) from cfg.engine:
    kv_cache_memory_fraction when set, else kv_cache_memory_mb (num_kv_blocks, when set, is
    the caller's and wins over both)."""
    e = cfg.engine
    if e.kv_cache_memory_fraction <= 0:
        return e.kv_cache_memory_mb, "engine.kv_cache_memory_mb", {}
    from moed.parallel.memory import rank_memory

    p = cfg.parallel
    from moed.model.quant import formats

    m = cfg.model
    quant = formats.plan(m.path, m.quantization, m.quantization_group_size, m.quantization_lm_head) if m.path else None
    weights = rank_memory(spec, dtype, p.ep_size, p.ep_rank, 0, e.block_size, 0,
                          p.redundant_experts, quant,
                          mtp=int(cfg.speculative.method == "mtp")).weights_bytes
    if getattr(device, "type", "cpu") == "cuda":
        import torch
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = host_memory_available()
    mb = kv_share_mb(e.kv_cache_memory_fraction, available, weights)
    return mb, "engine.kv_cache_memory_fraction", {"available_mb": round(available / MB, 1),
                                                   "weights_mb": round(weights / MB, 1)}
