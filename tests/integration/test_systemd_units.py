"""systemd units: `systemd-analyze verify` passes, and the directives the operations contract needs
are there (notify + watchdog + SIGHUP reload + credentials + hardening, stop timeout > drain grace).

verify checks that ExecStart's binary exists, so the units are verified as installed with moed at
this venv's `moed` instead of /opt/moed/bin/moed (the only substitution).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moed.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "systemd"
MOED_BIN = Path(sys.executable).with_name("moed")


def _directives(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def _seconds(v: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", v)
    assert m, v
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not installed (apt-get install systemd)")
@pytest.mark.parametrize("unit,instance", [("moed.service", "moed.service"),
                                           ("moed@.service", "moed@decode.service"),
                                           ("moed@.service", "moed@router.service")])
def test_systemd_analyze_verify(tmp_path: Path, unit: str, instance: str) -> None:
    assert MOED_BIN.exists(), "the moed console script is not installed in this venv"
    text = (UNITS / unit).read_text()
    assert "/opt/moed/bin/moed" in text
    (tmp_path / unit).write_text(text.replace("/opt/moed/bin/moed", str(MOED_BIN)))
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / instance)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # Unknown or misspelled keys only warn (exit 0): any line about our unit is a failure.
    ours = [ln for ln in proc.stderr.splitlines() if unit in ln or instance in ln]
    assert ours == [], "\n".join(ours)
    # The sandbox stays tight: systemd's own exposure score (0 best … 10 worst; 2.0 today).
    sec = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(tmp_path / instance)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", sec.stdout)
    assert m and float(m.group(1)) <= 2.5, sec.stdout[-2000:] + sec.stderr


@pytest.mark.parametrize("unit", ["moed.service", "moed@.service"])
def test_operations_contract(unit: str) -> None:
    d = _directives(UNITS / unit)
    one = {k: v[-1] for k, v in d.items()}
    assert one["Type"] == "notify"
    assert _seconds(one["WatchdogSec"]) > 0
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert one["Restart"] == "on-failure"
    assert _seconds(one["TimeoutStopSec"]) > ServerConfig().shutdown_grace_s
    creds = {c.split(":", 1)[0] for c in d["LoadCredential"]}
    assert {"api-keys", "cluster-key"} <= creds
    env = "\n".join(d["Environment"])
    for var in ("MOED_SERVER_API_KEYS_FILE=%d/api-keys", "MOED_CLUSTER_KEY_FILE=%d/cluster-key",
                "THP_MEM_ALLOC_ENABLE=1"):
        assert var in env
    assert one["User"] == "moed"
    for k, v in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                 "PrivateTmp": "yes", "CapabilityBoundingSet": ""}.items():
        assert one[k] == v, k
    assert ("%i.toml" in one["ExecStart"]) == (unit == "moed@.service")
