"""Daemon-side behaviour of one real decode node (`moed serve --role decode`) whose only prefill
peer is down (nothing listens on its port):
- a SIGHUP sent while the process is still importing is held, not fatal, and reloads once ready;
- the node allocates its tensors in transparent huge pages (for NIXL KV transfer speed).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from moed_server import ServerProcess, _wait_ready, free_port, start_server

pytestmark = pytest.mark.timeout(120)

ENV = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
       "MOED_ENGINE_BLOCK_SIZE": "4", "MOED_MODEL_SERVED_NAME": "tiny",
       "MOED_ADMISSION_RETRY_AFTER_S": "2"}


def _sighup_caught(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) & (1 << (signal.SIGHUP - 1)))


@pytest.fixture(scope="module")
def node(tiny_qwen3, tmp_path_factory):
    dead_peer = f"http://127.0.0.1:{free_port()}"      # nothing listens there
    srv = start_server(model=tiny_qwen3, role="decode", wait=None,
                       log_dir=tmp_path_factory.mktemp("decode-node"),
                       env={**ENV, "MOED_TRANSFER_PREFILL_PEERS": dead_peer})
    try:
        deadline = time.monotonic() + 10
        while not _sighup_caught(srv.proc.pid):    # `moed serve` holds SIGHUP from its start
            assert srv.alive and time.monotonic() < deadline, srv.tail()
            time.sleep(0.001)
        srv.send_signal(signal.SIGHUP)                 # long before the reload handler exists
        _wait_ready(srv, "/ready", time.monotonic() + 90)
        yield srv
    finally:
        srv.stop(timeout=10)


def _events(srv: ServerProcess, name: str) -> list[dict]:
    return [r for r in srv.log_records() if r.get("event") == name]


def test_sighup_during_import_is_held_then_reloaded(node) -> None:
    assert node.alive
    deferred = _events(node, "config_reload_deferred")
    assert [r["reason"] for r in deferred] == ["signal during process start"], node.tail()
    deadline = time.monotonic() + 10
    while node.metrics().get('moed_config_reloads_total{result="unchanged"}', 0) < 1:
        assert time.monotonic() < deadline, node.tail()
        time.sleep(0.05)


def test_tensors_use_transparent_huge_pages(node) -> None:
    assert [r["thp_alloc"] for r in _events(node, "cpu_huge_pages")] == [True]
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" not in mode:          # the kernel may have THP off; then only the setting counts
        rollup = Path(f"/proc/{node.proc.pid}/smaps_rollup").read_text()
        huge_kb = next(int(line.split()[1]) for line in rollup.splitlines()
                       if line.startswith("AnonHugePages:"))
        assert huge_kb >= 2048, rollup
