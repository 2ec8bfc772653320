"""The shipped router config loads and says what the router needs."""
from __future__ import annotations

from pathlib import Path

from moed.config import load

ROOT = Path(__file__).resolve().parents[3]


def test_router_toml_is_valid() -> None:
    cfg = load(ROOT / "conf/router.toml", environ={"MOED_CLUSTER_KEY_FILE": "/dev/null"})
    assert cfg.server.role == "router" and cfg.cluster.enabled
    assert cfg.router.backend_roles == ("decode", "colocated") and cfg.router.max_attempts == 3
    unit = (ROOT / "systemd/moed@.service").read_text()
    stop = next(ln.split("=", 1)[1] for ln in unit.splitlines() if ln.startswith("TimeoutStopSec="))
    assert stop.endswith("s") and cfg.server.shutdown_grace_s < int(stop[:-1])   # drain fits


def test_systemd_readme_field_table_matches_config() -> None:
    import dataclasses
    import re

    from moed.config import Config

    table = {}
    for line in (ROOT / "systemd/README.md").read_text().splitlines():
        m = re.match(r"\| `\[(\w+)\]` \| (.*) \| (.*) \|$", line)
        if m:
            table[m.group(1)] = (set(re.findall(r"`(\w+)`", m.group(2))),
                                 set(re.findall(r"`(\w+)`", m.group(3))))
    for sec in dataclasses.fields(Config):
        fields = dataclasses.fields(sec.default_factory)
        live = {f.name for f in fields if f.metadata.get("live")}
        assert table.get(sec.name) == (live, {f.name for f in fields} - live), sec.name
