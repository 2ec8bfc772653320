"""`moed` command line: serve, check-config, model init.

Precedence of settings: defaults < TOML (--config) < MOED_<SECTION>_<FIELD> environment <
flags. Errors in any of them stop the command with a one-line message and exit code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, MutableMapping, Sequence

from moed.config import ROLES, Config, ConfigError, load


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {
        "server": {"role": getattr(args, "role", None), "host": getattr(args, "host", None),
                   "port": getattr(args, "port", None),
                   "node_name": getattr(args, "node_name", None),
                   "log_format": getattr(args, "log_format", None),
                   "log_level": getattr(args, "log_level", None)},
        "model": {"path": getattr(args, "model", None)},
    }


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=ROLES)
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (model.path)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--node-name", dest="node_name")
    p.add_argument("--log-format", dest="log_format", choices=("json", "console"),
                   help="console: human-readable lines instead of JSON")
    p.add_argument("--log-level", dest="log_level", choices=("debug", "info", "warning", "error"))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def to_toml(cfg: Config) -> str:
    lines = [f"# effective config (digest {cfg.digest()})"]
    for sec in dataclasses.fields(cfg):
        lines.append(f"\n[{sec.name}]")
        for k, v in dataclasses.asdict(getattr(cfg, sec.name)).items():
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _load(args: argparse.Namespace) -> Config:
    from moed.ops.daemon import load_key_source

    cfg = load(args.config, environ=os.environ, overrides=_overrides(args))
    # a key source that cannot be read (missing, a FIFO, not UTF-8) is a config error, found
    # before serving
    load_key_source(cfg.server.api_keys_file, cfg.server.api_keys_env, "api_keys")
    return cfg


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _load(args)
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


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _load(args)
    thp = kv_transfer_env(cfg.server.role, os.environ)   # before the engine allocates anything
    import structlog
    import uvloop

    from moed.app import App, node_name
    from moed.obs import log as obslog

    obslog.configure(cfg.server.log_format, cfg.server.log_level, role=cfg.server.role,
                     node=node_name(cfg))
    if cfg.server.role != "router":
        structlog.get_logger(__name__).info("cpu_huge_pages", thp_alloc=thp)
    # torch threads are set by Engine.from_config, in the loader thread (the router never
    # imports torch at all).

    async def main() -> int:
        return await App(cfg, config_path=args.config, overrides=_overrides(args)).run()

    return uvloop.run(main())


def cmd_model_init(args: argparse.Namespace) -> int:
    from moed.model import init as model_init

    return int(model_init.main(args) or 0)


def cmd_model_kernels(args: argparse.Namespace) -> int:
    """Build (or find) the native CPU kernels and print the .so path; 1 with the reason if not."""
    from moed.model import kernels
    from moed.obs import log as obslog

    obslog.configure("console")      # log lines on stderr: stdout is just the path
    try:
        path = kernels.build(Path(args.cache) if args.cache else None)
    except kernels.KernelUnavailable as e:
        print(f"moed: CPU kernels cannot be built here: {e}", file=sys.stderr)
        return 1
    print(path)                          # stdout: just the path, whatever follows
    if not kernels.cpu_flags_ok():       # built for another machine (e.g. an image build)
        print("moed: built, not loaded: this CPU lacks AVX512-BF16", file=sys.stderr)
        return 0
    try:
        kernels.CpuKernels(path)
    except (kernels.KernelUnavailable, OSError) as e:
        print(f"moed: {path} does not load: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moed", description="Mixture-of-Experts serving daemon")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a node (HTTP API, engine, membership)")
    serve.add_argument("--config", metavar="FILE", help="TOML config (default: built-in defaults)")
    _add_config_flags(serve)
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check-config", help="validate a config and print the effective one")
    check.add_argument("config", metavar="FILE")
    _add_config_flags(check)
    check.set_defaults(func=cmd_check_config)

    model = sub.add_parser("model", help="model utilities")
    msub = model.add_subparsers(dest="model_command", required=True)
    init = msub.add_parser("init", help="write a random-weight Hugging Face checkpoint")
    argv = sys.argv[1:] if argv is None else argv
    if list(argv[:2]) == ["model", "init"]:   # lazy: the init module imports torch and transformers
        from moed.model import init as model_init

        model_init.add_arguments(init)
    init.set_defaults(func=cmd_model_init)
    kern = msub.add_parser("kernels", help="build the native CPU kernels ahead of time and print the .so path")
    kern.add_argument("--cache", metavar="DIR",
                      help="where to put them (default: $MOED_KERNEL_CACHE, $CACHE_DIRECTORY or ~/.cache/moed)")
    kern.set_defaults(func=cmd_model_kernels)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if list(sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
        from moed.ops.signals import hold_sighup

        hold_sighup()    # before the heavy imports: an early SIGHUP must not kill the node
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"moed: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
