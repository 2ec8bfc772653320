"""The checks `moed serve` runs before it listens or loads weights; `moed check-config` runs
the same ones, so it refuses exactly what serve refuses, with the same one-line ConfigError.

Each check reads what the node itself reads at start, with the node's own functions:
- the cluster key, when the node signs node-to-node calls (moed.api.internal.InternalAuth,
  which also refuses a prefill/decode node without a key off loopback);
- the API-key and admin-token sources (moed.ops.daemon.load_key_source);
- for a node with a model: config.json (its model_type served by moed/model/archs), the weight
  files it names present, model.max_model_len within the checkpoint's context, the device
  available, one KV block within engine.kv_cache_memory_mb (this imports torch, as
  moed/model/spec.py does; the weights are never read);
- for prefill/decode: the KV transfer backend importable.
"""
from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from typing import Iterator

from moed.config import Config, ConfigError

# what each transfer.backend imports when its agent starts (moed/transfer/nixl_backend.py)
TRANSFER_IMPORTS = {"nixl": "nixl._api"}


def check(cfg: Config) -> None:
    """Every check, in the order the node's start meets them (moed.app.build_components, then
    the engine); a ConfigError naming the first that fails."""
    if needs_cluster_key(cfg):
        cluster_key(cfg)
    key_sources(cfg)
    if cfg.server.role != "router":
        model(cfg)
    if cfg.server.role in ("prefill", "decode"):
        transfer_backend(cfg.transfer.backend)


def needs_cluster_key(cfg: Config) -> bool:
    """The condition under which moed.app.build_components signs node-to-node calls."""
    return cfg.server.role in ("prefill", "decode") or cfg.cluster.enabled


def key_sources(cfg: Config) -> None:
    from moed.ops.daemon import load_key_source

    s = cfg.server
    load_key_source(s.api_keys_file, s.api_keys_env, "api_keys")
    load_key_source(s.admin_token_file, s.admin_token_env, "admin_token")


def cluster_key(cfg: Config) -> None:
    from moed.api.internal import InternalAuth
    from moed.app import node_name

    InternalAuth.from_config(cfg, node_name(cfg))


def model(cfg: Config) -> None:
    from moed.model.loader import checkpoint_files
    from moed.model.runner import auto_num_blocks, resolve_device, resolve_dtype
    from moed.model.spec import load_spec

    m, e = cfg.model, cfg.engine
    # a malformed config.json surfaces as any of these (a list where a table belongs, ...)
    with _refused("model.path", OSError, ValueError, TypeError, KeyError, AttributeError):
        spec = load_spec(m.path)
        checkpoint_files(Path(m.path))
    if m.max_model_len > spec.max_position_embeddings:    # the engine would cap it, unsaid
        raise ConfigError(f"model.max_model_len: {m.max_model_len} is beyond the checkpoint's "
                          f"max_position_embeddings {spec.max_position_embeddings}")
    with _refused("model.device", ValueError, RuntimeError):
        device = resolve_device(m.device)
    if not e.num_kv_blocks:
        with _refused("engine.kv_cache_memory_mb", ValueError):
            auto_num_blocks(spec, e.block_size, resolve_dtype(m.dtype, spec, device),
                            e.kv_cache_memory_mb)


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
