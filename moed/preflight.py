"""The checks `moed serve` runs before it listens or loads weights; `moed check-config` runs
the same ones, so it refuses exactly what serve refuses, with the same one-line ConfigError.

Each check reads what the node itself reads at start, with the node's own functions:
- the cluster key, when the node signs node-to-node calls (moed.api.internal.InternalAuth,
  which also refuses a prefill/decode node without a key off loopback);
- the API-key and admin-token sources (moed.ops.daemon.load_key_source);
- for a node with a model: config.json (its model_type served by moed/model/archs), the weight
  files it names present, its quantization_config served and every quantized tensor's scales
  shaped as declared (headers only; moed/model/quant), model.max_model_len within the checkpoint's context, the device
  available, one KV block within engine.kv_cache_memory_mb (this imports torch, as
  moed/model/spec.py does; the weights are never read); with parallel.rank_memory_mb, dense
  weights + this rank's expert slots + the KV blocks within it (moed/parallel/memory.py);
  on a CPU, a kernel variant forced by MOED_CPU_ISA that this CPU runs (moed/model/kernels);
- for prefill/decode: the KV transfer backend importable;
- with trace.endpoint set: the OpenTelemetry extra importable (moed/obs/trace.py);
- with tiers.disk_bytes: tiers.disk_dir given and writable (moed/kvcache/tiers).
The rules across settings alone are moed/config/rules.py's (`parallel`, `tiers_disk`,
`needs_cluster_key`); the checks here read what those settings name.
"""
from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from typing import Iterator

from moed.config import Config, ConfigError, node_name, rules

# what each transfer.backend imports when its agent starts (moed/transfer/nixl_backend.py)
TRANSFER_IMPORTS = {"nixl": "nixl._api"}


def check(cfg: Config) -> None:
    """Every check, in the order the node's start meets them (moed.app.build_components, then
    the engine); a ConfigError naming the first that fails."""
    if rules.needs_cluster_key(cfg):
        cluster_key(cfg)
    key_sources(cfg)
    if cfg.trace.endpoint:          # the trace extra installed, its headers file readable
        from moed.obs import trace
        trace.check(cfg.trace)
    rules.parallel(cfg)
    tiers(cfg)
    if cfg.server.role != "router":
        model(cfg)
    if cfg.server.role in ("prefill", "decode"):
        transfer_backend(cfg.transfer.backend)
    if cfg.kv_events.active:
        kv_events()


def kv_events() -> None:
    """The KV-events publisher's packages (the kvevents extra) import."""
    for module in ("zmq", "msgspec"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"kv_events: cannot import {module} ({e}); install "
                              f"moed[kvevents]") from None


def tiers(cfg: Config) -> None:
    """[tiers]: a disk tier needs a directory (moed/config/rules.py) the node can write."""
    t = cfg.tiers
    rules.tiers_disk(cfg)
    if t.disk_bytes > 0:
        d = Path(t.disk_dir)
        while not d.exists() and d.parent != d:     # created at start: its parent must be
            d = d.parent
        if not d.is_dir() or not os.access(d, os.W_OK | os.X_OK):
            raise ConfigError(f"tiers.disk_dir: {t.disk_dir} is not a directory this node "
                              f"can write")
        if t.disk_io == "nixl":
            from moed.kvcache.tiers.fileio import make
            try:
                make("nixl")
            except RuntimeError as e:
                raise ConfigError(f"tiers.disk_io: {e}") from None


def key_sources(cfg: Config) -> None:
    from moed.ops.daemon import load_key_source

    s = cfg.server
    load_key_source(s.api_keys_file, s.api_keys_env, "api_keys", cfg.priority.values)
    load_key_source(s.admin_token_file, s.admin_token_env, "admin_token")
    load_key_source(s.metrics_token_file, s.metrics_token_env, "metrics_token")


def cluster_key(cfg: Config) -> None:
    from moed.api.internal import InternalAuth

    InternalAuth.from_config(cfg, node_name(cfg))


def model(cfg: Config) -> None:
    from moed.model.loader import checkpoint_files
    from moed.model.runner import auto_num_blocks, resolve_device, resolve_dtype
    from moed.model.hf_config import load_spec

    m, e = cfg.model, cfg.engine
    # a malformed config.json surfaces as any of these (a list where a table belongs, ...)
    with _refused("model.path", OSError, ValueError, TypeError, KeyError, AttributeError):
        spec = load_spec(m.path)
        checkpoint_files(Path(m.path))
    quantization(cfg)
    if cfg.speculative.method == "mtp" and spec.num_mtp_layers < 1:
        raise ConfigError("speculative.method mtp: the checkpoint has no MTP layer (config.json "
                          "num_nextn_predict_layers is 0 or absent)")
    if m.max_model_len > spec.max_position_embeddings:    # the engine would cap it, unsaid
        raise ConfigError(f"model.max_model_len: {m.max_model_len} is beyond the checkpoint's "
                          f"max_position_embeddings {spec.max_position_embeddings}")
    with _refused("model.device", ValueError, RuntimeError):
        device = resolve_device(m.device)
    dtype = resolve_dtype(m.dtype, spec, device)
    if device.type == "cpu":        # a forced kernel variant this CPU cannot run: refused here
        from moed.model import kernels
        try:
            kernels.isa_from_env()
        except kernels.IsaRefused as err:
            raise ConfigError(f"environment: {err}") from None
    num_blocks = e.num_kv_blocks
    if not num_blocks:
        from moed.engine.memory import kv_memory_mb
        key = ("engine.kv_cache_memory_fraction" if e.kv_cache_memory_fraction
               else "engine.kv_cache_memory_mb")
        with _refused(key, ValueError, RuntimeError):
            kv_mb, _, _ = kv_memory_mb(cfg, spec, dtype, device)
            num_blocks = auto_num_blocks(spec, e.block_size, dtype, kv_mb, e.kv_cache_dtype,
                                         mtp=cfg.speculative.method == "mtp")
    memory_budget(cfg, spec, dtype, num_blocks)


def quantization(cfg: Config) -> None:
    """config.json's quantization_config served (moed/model/quant/formats.py), model.quantization
    compatible with it, and every quantized tensor's scales shaped as the config declares (the
    safetensors headers only; no weight is read)."""
    from moed.model.quant import formats
    from moed.model.quant.preflight import check_headers

    m = cfg.model
    try:
        plan = formats.plan(m.path, m.quantization, m.quantization_group_size, m.quantization_lm_head)
        formats.check_activations(plan, m.quantization_activations)
    except formats.QuantConfigError as e:
        raise ConfigError(str(e)) from None
    if plan.checkpoint is not None:
        with _refused("model.path", ValueError, OSError):
            check_headers(Path(m.path), plan.checkpoint)


def memory_budget(cfg: Config, spec: object, dtype: object, num_blocks: int) -> None:
    """Expert parallelism needs experts; parallel.rank_memory_mb must hold dense weights +
    this rank's expert slots + the KV blocks (moed/parallel/memory.py), numbers in the error."""
    from moed.model.kv_layout import kv_cache_dtype
    from moed.parallel.memory import rank_memory

    p = cfg.parallel
    if p.ep_size > 1 and spec.num_experts < 1:              # type: ignore[attr-defined]
        raise ConfigError(f"parallel.ep_size: {p.ep_size}, but the checkpoint has no routed "
                          f"experts to spread over ranks")
    if p.ep_size > 1:
        from moed.parallel.layout import EPLayout
        try:
            EPLayout.contiguous(spec.num_experts, p.ep_size, p.redundant_experts)  # type: ignore[attr-defined]
        except ValueError as e:
            raise ConfigError(f"parallel.redundant_experts: {e}") from None
    if p.rank_memory_mb:
        from moed.model.quant import formats
        m = cfg.model
        b = rank_memory(spec, dtype, p.ep_size, p.ep_rank, num_blocks,  # type: ignore[arg-type]
                        cfg.engine.block_size, p.rank_memory_mb, p.redundant_experts,
                        quant=formats.plan(m.path, m.quantization, m.quantization_group_size, m.quantization_lm_head),
                        kv_dtype=kv_cache_dtype(cfg.engine.kv_cache_dtype, dtype),  # type: ignore[arg-type]
                        mtp=int(cfg.speculative.method == "mtp"),
                        resident_bytes=cfg.experts.resident_bytes)
        if not b.fits:
            raise ConfigError(f"parallel.rank_memory_mb: {b.message()}")
        import structlog     # a fitting rank says how much KV its memory leaves room for

        structlog.get_logger(__name__).info(
            "memory_budget", ep_size=p.ep_size, limit_mb=p.rank_memory_mb,
            dense_mb=round(b.dense_bytes / 2**20, 1), expert_mb=round(b.expert_bytes / 2**20, 1),
            kv_blocks=b.kv_blocks, kv_blocks_fit=b.kv_blocks_fit)


@contextlib.contextmanager
def _refused(field: str, *errors: type[BaseException]) -> Iterator[None]:
    """`errors` raised inside become one-line ConfigErrors naming `field`."""
    try:
        yield
    except errors as e:
        raise ConfigError(f"{field}: {e}") from None


def transfer_backend(backend: str) -> None:
    module = TRANSFER_IMPORTS[backend]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"transfer.backend {backend}: cannot import {module} ({e}); "
                          f"install moed[{backend}]") from None
