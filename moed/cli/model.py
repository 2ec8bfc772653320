"""`moed model init` and `moed model kernels`: development and image-build utilities."""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def cmd_model_init(args: argparse.Namespace) -> int:
    from moed.dev import checkpoint as model_init

    return int(model_init.main(args) or 0)


def cmd_model_kernels(args: argparse.Namespace) -> int:
    """Build (or find) every variant of the native CPU kernels and print each .so path (one a
    line, fastest variant first); load those this CPU runs. 1 with the reason if one fails.
    The variants build at once, their sources too: one compiler a core over all of them
    (kernels/compile.py holds the slots), so an image build's cores all work."""
    from moed.model import kernels
    from moed.obs import log as obslog

    obslog.configure("console")      # log lines on stderr: stdout is just the paths
    cache = Path(args.cache) if args.cache else None
    # a cache made on one machine serves every CPU that shares it; build() installs each file
    # atomically, so compilers running side by side never see each other's half-written .so
    with ThreadPoolExecutor(max_workers=len(kernels.ISAS)) as pool:
        builds = {isa: pool.submit(kernels.build, cache, isa) for isa in kernels.ISAS}
    for isa in kernels.ISAS:
        try:
            path = builds[isa].result()
        except kernels.KernelUnavailable as e:
            print(f"moed: CPU kernels cannot be built here: {e}", file=sys.stderr)
            return 1
        print(path)                      # stdout: just the paths, whatever follows
        if why := kernels.isa_missing(isa):      # built for another machine (e.g. an image build)
            print(f"moed: {isa} built, not loaded: {why}", file=sys.stderr)
            continue
        try:
            kernels.CpuKernels(path, isa)
        except (kernels.KernelUnavailable, OSError) as e:
            print(f"moed: {path} does not load: {e}", file=sys.stderr)
            return 1
    return 0
