"""Building an engine: the runner, tokenizer and KV budget from the config (`build_engine`),
the step thread's pool size, and the pieces the engine hangs on its KV manager (the tiers
below L1, the KV-events recorder). Apart from the engine class, which only runs steps."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from moed.config import Config, TiersConfig

if TYPE_CHECKING:
    from moed.engine.engine import Engine
    from moed.model.cold import ColdSettings
    from moed.kvcache.events import KVEventRecorder
    from moed.kvcache.tiers import TieredCache

log = structlog.get_logger(__name__)

E = TypeVar("E", bound="Engine")


def build_engine(cfg: Config, cls: type[E], **kw: Any) -> E:
    """Build the ModelRunner and Tokenizer from cfg.model / cfg.engine, then the engine."""
    import torch

    from moed.model.runner import ModelRunner, auto_num_blocks, resolve_device, resolve_dtype
    from moed.model.hf_config import load_spec
    from moed.model.kernels.compile import cores_available
    from moed.model.tokenizer import Tokenizer

    e, m = cfg.engine, cfg.model
    threads, why = step_threads(e.num_threads, cores_available(), os.environ)
    if threads:
        torch.set_num_threads(threads)
    # libgomp read these when torch loaded; with one pool (moed.engine.step_thread) a barrier
    # spins GOMP_SPINCOUNT times (default 300000) before it sleeps
    log.info("engine_threads", torch_threads=torch.get_num_threads(),
             cores_available=cores_available(), chosen_by=why,
             gomp_spincount=os.environ.get("GOMP_SPINCOUNT") or "default",
             omp_wait_policy=os.environ.get("OMP_WAIT_POLICY") or "default")
    spec = load_spec(m.path)
    device = resolve_device(m.device)
    dtype = resolve_dtype(m.dtype, spec, device)
    from moed.engine.memory import kv_memory_mb
    sized: dict[str, float] = {}
    sized_by = "engine.num_kv_blocks"
    num_blocks = e.num_kv_blocks
    if not num_blocks:
        kv_mb, sized_by, sized = kv_memory_mb(cfg, spec, dtype, device)
        num_blocks = auto_num_blocks(spec, block_size=e.block_size, dtype=dtype,
                                     memory_mb=kv_mb, kv_dtype=e.kv_cache_dtype,
                                     mtp=cfg.speculative.method == "mtp")
    ep = None
    if cfg.parallel.ep_size > 1:    # plan (which experts to load), load, then rendezvous
        from moed.parallel.runtime import EPRuntime
        ep = EPRuntime.plan(cfg.parallel, spec.num_experts, device)
    runner = ModelRunner(m.path, dtype=dtype, device=device, spec=spec,
                         attention_backend=e.attention_backend, num_blocks=num_blocks,
                         block_size=e.block_size, kv_dtype=e.kv_cache_dtype,
                         placement=None if ep is None else ep.placement,
                         quantization=m.quantization,
                         quantization_group_size=m.quantization_group_size,
                         quantization_lm_head=m.quantization_lm_head,
                         quantization_activations=m.quantization_activations,
                         mtp=cfg.speculative.method == "mtp", batch_invariant=m.batch_invariant,
                         cold=cold_settings(cfg))
    if ep is not None:
        ep.join()
        ep.attach(runner.model)     # the expert balancer, if parallel.eplb_interval_s
    from moed.model.identity import model_id
    engine = cls(runner, Tokenizer.from_dir(m.path), e, max_model_len=m.max_model_len or None,
                 balance=cfg.balance, ep=ep, tiers=cfg.tiers, model_id=model_id(m.path),
                 kv_events=cfg.kv_events, structured=cfg.structured,
                 speculative=cfg.speculative, **kw)
    # what the KV budget buys: requests of the model's full context that fit at once
    tokens = num_blocks * e.block_size
    log.info("kv_cache_sized", kv_blocks=num_blocks, block_size=e.block_size,
             kv_mb=round(num_blocks * runner.kv_layout.bytes_per_block / 2**20, 1),
             kv_dtype=runner.kv_layout.dtype_name, kv_bytes_per_token=runner.kv_layout.bytes_per_token,
             sized_by=sized_by, **sized,
             kv_tokens=tokens, max_model_len=engine.max_model_len,
             max_concurrency_at_max_len=round(tokens / engine.max_model_len, 2),
             max_num_seqs=e.max_num_seqs)
    return engine


def cold_settings(cfg: Config) -> ColdSettings | None:
    """[experts] as the runner takes it (moed/model/cold); None: every expert resident."""
    x = cfg.experts
    if not x.tiered:
        return None
    from moed.model.cold import ColdSettings, policy
    return ColdSettings(x.resident_bytes, x.move_bytes_per_step, x.heat_half_life_steps,
                        policy.prefetch_setting(x.prefetch_experts, cfg.parallel.ep_size))


def make_tiers(engine: Engine, t: TiersConfig | None) -> TieredCache | None:
    """The L2/L3 cache over this engine's KV tensor, hooked to L1's evictions."""
    if t is None:
        return None
    # load-or-recompute's prediction before the cost model is fitted: the tiers' and the
    # peer reads' (moed.roles.kvshare, tiers.peer_reuse without L2/L3) alike
    engine.scheduler.set_recompute_s_per_token(t.recompute_us_per_token * 1e-6)
    if not t.enabled:
        return None
    from moed.config.rules import tiers_need_prefix_caching
    tiers_need_prefix_caching(engine.cfg, t)
    from moed.kvcache.tiers import TieredCache, TierSettings
    from moed.kvcache.tiers.kvio import KVBlockIO

    layout = engine.runner.kv_layout
    if t.disk_bytes and not engine._model_id:
        raise ValueError("a disk KV tier needs the checkpoint's model id (Engine model_id)")
    cache = TieredCache(TierSettings(
        host_bytes=t.host_bytes, disk_bytes=t.disk_bytes, disk_dir=t.disk_dir,
        disk_io=t.disk_io, write_through=t.write_through, load_threads=t.load_threads,
        read_timeout_s=t.read_timeout_s, host_bandwidth=t.host_bandwidth_mbps * 1e6,
        disk_bandwidth=t.disk_bandwidth_mbps * 1e6, half_life_s=t.reuse_half_life_s),
        KVBlockIO(engine.runner.kv_cache, layout),
        f"{layout.layout_id}.m-{engine._model_id}" if engine._model_id else layout.layout_id)
    engine.kv.set_tier_hooks(cache.offer, cache.on_cached)
    engine.scheduler.attach_tiers(cache)
    return cache


def make_kv_events(engine: Engine) -> KVEventRecorder | None:
    """The recorder on L1 and the tiers: a fresh process holds nothing (AllBlocksCleared
    first), except the disk blocks an earlier one left (announced without tokens)."""
    if engine._kv_events_cfg is None:
        return None
    from moed.kvcache.events import KVEventRecorder

    rec = KVEventRecorder(engine.kv.block_size, keep_tokens=engine.tiers is not None)
    rec.cleared()
    engine.kv.set_events(rec)
    if engine.tiers is not None:
        for tier, key in engine.tiers.held():
            rec.tier_changed(tier, key, True)
        engine.tiers.on_change = rec.tier_changed
    return rec


def step_threads(configured: int, cores: int, environ: Mapping[str, str]) -> tuple[int, str]:
    """The step thread's torch/OpenMP pool size -> (threads, why); 0 threads = leave torch's.

    engine.num_threads > 0 is taken as is. 0 (auto): OMP_NUM_THREADS, when set, is the
    operator's choice and torch has already read it; otherwise one core fewer than this process
    may use (its affinity mask), so the event loop (HTTP, SSE, the scheduler) keeps a core
    while the pool computes: with every core in the pool, the client's inter-token latency was
    3.3x the engine's step (29 vs 8.8 ms on a 2-core AMX Xeon, issue 16; 16.6 ms with one
    thread). A many-core node gives up 1/cores of its compute for it."""
    if configured > 0:
        return configured, "engine.num_threads"
    if environ.get("OMP_NUM_THREADS"):
        return 0, "OMP_NUM_THREADS"
    return max(1, cores - 1), "auto: cores available - 1"


