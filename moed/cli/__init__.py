"""`moed` command line: serve, check-config, model init, model kernels, and the operator's
release commands against a running node's admin API: canary, config history|rollback|show,
and the scaling planner (plan).

Precedence of settings: defaults < TOML (--config) < MOED_<SECTION>_<FIELD> environment <
flags. Each flag of `flags.FLAGS` sets one config field; the flags vLLM operators know take vLLM's
names, and one moed cannot honour (`REFUSED`) is an error, never ignored. Errors in any of
them stop the command with a one-line message and exit code 2; `serve` and `check-config`
refuse the same things (moed/preflight.py).

Modules: flags (the flag table), settings (argv -> Config, the effective config as TOML),
serve (serve, check-config), model (model init|kernels), admin (the release commands); this
one builds the parser and runs a command.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from moed import __version__
from moed.cli.admin import (AdminCallFailed, add_admin_flags, cmd_canary, cmd_config_history,
                            cmd_config_rollback, cmd_config_show, cmd_plan)
from moed.cli.flags import add_config_flags
from moed.cli.model import cmd_model_init, cmd_model_kernels
from moed.cli.serve import cmd_check_config, cmd_serve
from moed.config import ConfigError


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moed", description="Mixture-of-Experts serving daemon")
    parser.add_argument("--version", action="version", version=f"moed {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a node (HTTP API, engine, membership)")
    serve.add_argument("model_pos", nargs="?", metavar="MODEL",
                       help="checkpoint directory (model.path), as --model")
    add_config_flags(serve)
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check-config", help="run serve's checks without serving; print "
                           "the effective config")
    check.add_argument("config_pos", nargs="?", metavar="CONFIG", help="TOML config, as --config")
    add_config_flags(check)
    check.set_defaults(func=cmd_check_config)

    model = sub.add_parser("model", help="model utilities")
    msub = model.add_subparsers(dest="model_command", required=True)
    init = msub.add_parser("init", help="write a random-weight Hugging Face checkpoint")
    argv = sys.argv[1:] if argv is None else argv
    if list(argv[:2]) == ["model", "init"]:   # lazy: the init module imports torch and transformers
        from moed.dev import checkpoint as model_init

        model_init.add_arguments(init)
    init.set_defaults(func=cmd_model_init)
    kern = msub.add_parser("kernels", help="build every variant of the native CPU kernels ahead of time and print the .so paths")
    kern.add_argument("--cache", metavar="DIR",
                      help="where to put them (default: $MOED_KERNEL_CACHE, $CACHE_DIRECTORY or ~/.cache/moed)")
    kern.set_defaults(func=cmd_model_kernels)

    can = sub.add_parser("canary", help="a router's canary vs baseline figures and verdict "
                         "(exit 0 healthy, 1 unhealthy, 3 too few canary requests)")
    add_admin_flags(can)
    can.add_argument("--json", action="store_true", help="the report as JSON")
    can.set_defaults(func=cmd_canary)

    plan = sub.add_parser("plan", help="the scaling planner: desired prefill and decode "
                          "node counts for TTFT/ITL targets, with the reason; optional action "
                          "hooks (docs/scaling.md)")
    add_admin_flags(plan)
    if list(argv[:1]) == ["plan"]:     # lazy: `moed serve` never imports the planner
        from moed.ops.planner import add_arguments as add_plan_arguments

        add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    conf = sub.add_parser("config", help="a node's config history and rollback")
    csub = conf.add_subparsers(dest="config_command", required=True)
    hist = csub.add_parser("history", help="configs the node applied, oldest first")
    add_admin_flags(hist)
    hist.add_argument("--json", action="store_true", help="entries with their configs, as JSON")
    hist.set_defaults(func=cmd_config_history)
    back = csub.add_parser("rollback", help="apply an earlier config (by hash) through the "
                           "reload path")
    back.add_argument("hash", metavar="HASH", help="from `moed config history`")
    add_admin_flags(back)
    back.set_defaults(func=cmd_config_rollback)
    show = csub.add_parser("show", help="print a history entry as TOML (to restore the file)")
    show.add_argument("hash", metavar="HASH")
    show.add_argument("--state-dir", metavar="DIR",
                      help="the node's state directory (default: $STATE_DIRECTORY)")
    show.set_defaults(func=cmd_config_show)
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
    except AdminCallFailed as e:
        print(f"moed: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
