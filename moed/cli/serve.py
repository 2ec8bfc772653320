"""`moed serve` and `moed check-config`: the same config, the same pre-flight checks
(moed/preflight.py); check-config prints the effective config instead of serving.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import MutableMapping, NoReturn

from moed.cli.settings import configure_logs, load_config, overrides, to_toml


def cmd_check_config(args: argparse.Namespace) -> int:
    from moed import preflight

    cfg = load_config(args)
    configure_logs(cfg, args)   # on stderr: stdout is the config alone
    preflight.check(cfg)
    sys.stdout.write(to_toml(cfg))
    return 0


# torch's CPU allocator puts large tensors in transparent huge pages when this is set (read at
# each allocation): NIXL then moves KV at >= 60% of memcpy speed, far less without it
# (bench/kv_transfer.py). Nodes that transfer KV get it unless the operator chose otherwise.
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def kv_transfer_env(role: str, environ: MutableMapping[str, str]) -> bool:
    """Set THP_MEM_ALLOC_ENABLE=1 for prefill/decode nodes when unset; True if it is on."""
    if role in ("prefill", "decode"):
        environ.setdefault(THP_ENV, "1")
    return environ.get(THP_ENV, "") not in ("", "0")


# libgomp's spins at a barrier before the thread sleeps on a futex, read once, when torch loads.
# An engine's OpenMP work runs in one pool (moed/engine/step_thread.py), which spins 300,000
# times by default (6-8 ms on the 2-core dev VM): on cores another process keeps busy a 2-thread
# team then waits out its partner's preemption at every barrier, and served decode went 10-40x
# slower (bench checkpoint, one busy core beside it). 1,000 spins (~25 us) measured as robust
# there as the old throttled pool and keep most of the full spin's speed on idle cores
# (docs/benchmarks.md). The operator's GOMP_SPINCOUNT or OMP_WAIT_POLICY wins: 300000 for
# cores nothing else uses.
SPIN_ENV, SPIN_DEFAULT = "GOMP_SPINCOUNT", "1000"


def omp_spin_env(role: str, environ: MutableMapping[str, str]) -> str:
    """Set GOMP_SPINCOUNT for a node that runs an engine when neither it nor OMP_WAIT_POLICY is
    set; -> the spin count in effect ("" = libgomp's own)."""
    if role != "router" and not environ.get("OMP_WAIT_POLICY"):
        environ.setdefault(SPIN_ENV, SPIN_DEFAULT)
    return environ.get(SPIN_ENV, "")


def cmd_serve(args: argparse.Namespace) -> NoReturn:
    cfg = load_config(args)
    thp = kv_transfer_env(cfg.server.role, os.environ)   # before the engine allocates anything
    omp_spin_env(cfg.server.role, os.environ)            # before the pre-flight imports torch
    import structlog
    import uvloop

    from moed import preflight
    from moed.app import App

    configure_logs(cfg, args)
    preflight.check(cfg)         # what check-config checks: refused before listening
    if cfg.server.role != "router":
        structlog.get_logger(__name__).info("cpu_huge_pages", thp_alloc=thp)
    # torch threads are set by Engine.from_config, on the engine's step thread, which also
    # loads the weights and runs every step: one OpenMP pool (moed/engine/step_thread.py; the
    # router never imports torch at all).

    async def main() -> int:
        return await App(cfg, config_path=args.config, overrides=overrides(args)).run()

    exit_after_stop(uvloop.run(main()))


def exit_after_stop(code: int) -> NoReturn:
    """End the process once the node has stopped in order (components stopped, history and
    traces flushed, "stopped" logged). Skips what exit() would still run: C++ static
    destructors and C atexit handlers of native libraries (UCX and NIXL, torch's thread pools),
    which race their own still-running threads; CI saw a node that had logged "stopped" die
    there with SIGSEGV (after faulthandler is gone, so without a trace). Nothing of ours is
    left to run; only the buffered streams are flushed."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)
