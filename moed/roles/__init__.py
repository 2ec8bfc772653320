"""Role logic for disaggregated serving: prefill.py, decode.py (each opens with its lifecycle)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from moed.config import Config

if TYPE_CHECKING:
    from moed.app import Component


def role_component(cfg: Config, node: str) -> Component:
    """The app component for a prefill or decode node (imported lazily: NIXL is optional)."""
    if cfg.server.role == "prefill":
        from moed.roles.prefill import PrefillComponent
        return PrefillComponent(cfg, node)
    if cfg.server.role == "decode":
        from moed.roles.decode import DecodeComponent
        return DecodeComponent(cfg, node)
    raise ValueError(f"role {cfg.server.role!r} has no transfer component")
