"""Fixtures shared by every test folder: small checkpoints built once per session.
Server processes and free ports: tests/integration/moed_server.py.

Checkpoints are random-weight Hugging Face directories made by `moed.dev.checkpoint` (no model hub).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# Tests share 2 cores with each other's subprocesses: keep torch from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# No per-example deadline for hypothesis: the unit tests run two at a time on 2 cores (Makefile),
# where a scheduling stall is not a failure of the code under test.
settings.register_profile("moed", deadline=None)
settings.load_profile("moed")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _make(model_cache: Path, arch: str, preset: str = "tiny", seed: int = 0, **kw) -> Path:
    from moed.dev.checkpoint import init_checkpoint

    name = f"{arch}-{preset}-{seed}" + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
    out = model_cache / name
    if not (out / "config.json").exists():
        init_checkpoint(arch=arch, out=out, preset=preset, seed=seed, **kw)
    return out


@pytest.fixture(scope="session")
def make_checkpoint(model_cache: Path):
    """make_checkpoint(arch, preset="tiny", seed=0, **overrides) -> checkpoint dir (cached)."""
    return lambda arch, preset="tiny", seed=0, **kw: _make(model_cache, arch, preset, seed, **kw)


@pytest.fixture(scope="session")
def tiny_qwen3(make_checkpoint) -> Path:
    return make_checkpoint("qwen3_moe")


@pytest.fixture(scope="session")
def tiny_mixtral(make_checkpoint) -> Path:
    return make_checkpoint("mixtral")


def _within(fn, timeout: float = 5.0):
    """fn() on a thread that must finish within `timeout` (a blocked open fails the test)."""
    import threading

    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} still blocked after {timeout} s"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


@pytest.fixture
def within():
    """within(fn, timeout=5.0) -> fn(): fails the test if fn blocks (a FIFO opened, say)."""
    return _within
