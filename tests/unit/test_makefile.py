"""`make serve`'s set-up: one line per phase on the terminal (torch, moed, demo model, serving),
pip quiet (-q) with everything it prints in the set-up log; a failed step names the log and
prints its tail. The recipe runs for real with a stand-in for the venv's python (a real pip
install takes minutes and the network)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def _make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_dry_run_of_serve_on_a_fresh_clone_has_one_line_per_phase(tmp_path: Path) -> None:
    r = _make("-n", "serve", f"VENV={tmp_path}/v", f"DEMO_MODEL={tmp_path}/dm")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    phases = [next(i for i, line in enumerate(lines) if f"moed: [{p}]" in line)
              for p in ("torch", "moed", "demo model", "serving")]
    assert phases == sorted(phases)
    assert f"pip's output: {tmp_path}/v/setup.log" in lines[phases[0]]
    pip = [line for line in lines if " -m pip " in line]
    assert [line.split(" install -q ")[1].strip() for line in pip] == [
        "--upgrade pip", "torch==2.13.0", "-e '.[init]'"]
    for line in pip:      # through the step runner: pip's output goes to the log, not the screen
        assert '>>"$log" 2>&1' in line
    model = [line for line in lines if "model init" in line]
    assert len(model) == 1 and '>>"$log" 2>&1' in model[0]


def _venv(tmp_path: Path, script: str) -> Path:
    """A venv whose python is a stand-in: `make` then skips creating it and runs `pip` as it."""
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text("#!/bin/sh\n" + script)
    py.chmod(0o755)
    return venv


def test_setup_prints_phases_and_keeps_pip_output_in_the_log(tmp_path: Path) -> None:
    venv = _venv(tmp_path, 'for i in $(seq 40); do echo "WARNING: pip says $i" >&2; done\n'
                           'echo "Successfully installed $*"\n')
    r = _make("setup-serve", f"VENV={venv}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        f"moed: [torch] torch==2.13.0 into {venv} (a few minutes the first time; pip's "
        f"output: {venv}/setup.log)",
        f"moed: [moed] moed and its runtime dependencies (pip install -e '.[init]'; output: "
        f"{venv}/setup.log)"]
    assert "WARNING" not in r.stdout + r.stderr
    log = (venv / "setup.log").read_text()
    assert log.count("WARNING: pip says 40") == 3 and "install -q -e .[init]" in log
    assert (venv / ".torch-done").exists() and (venv / ".setup-serve").exists()
    assert "moed:" not in _make("setup-serve", f"VENV={venv}").stdout   # done: no phase


def test_a_failed_step_names_the_log_and_prints_its_tail(tmp_path: Path) -> None:
    venv = _venv(tmp_path, 'echo "noise" >&2\n'
                           'case "$*" in *torch==*) echo "ERROR: No matching distribution '
                           'found for torch==2.13.0" >&2; exit 1;; esac\n')
    r = _make("setup-serve", f"VENV={venv}")
    assert r.returncode != 0
    out = r.stdout
    assert out.startswith("moed: [torch] ")
    assert f"moed: failed (exit 1): {venv}/bin/python -m pip install -q torch==2.13.0" in out
    assert f"moed: the last lines of {venv}/setup.log:" in out
    assert out.rstrip().endswith("ERROR: No matching distribution found for torch==2.13.0")
    assert "[moed]" not in out and not (venv / ".torch-done").exists()
