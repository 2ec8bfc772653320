"""`moed plan`: the scaling planner's loop around moed.balance.scale (docs/scaling.md).

Each interval: GET /cluster from any node (the admin token) → Snapshot → Planner.step →
print the desired count per role with the reason → on a change, the action hooks:

    --on-scale-out CMD   run once per node to add, e.g. 'systemctl start moed@{role}-{index}'
    --on-scale-in CMD    run per node chosen to go, e.g. 'systemctl stop moed@{node}'
                         (systemd's stop is SIGTERM: the node drains, then exits 0)
    --drain              POST {url}/admin/drain on each instead (same admin token)

A command is split like a shell line (shlex) and each word's {placeholders} filled in; it runs
without a shell, under --hook-timeout. Placeholders: {role}, {count} (the desired count),
{current}, {index} (scale-out: the count once this node is added), {node} and {url}
(scale-in: the node's membership name and HTTP address). An unknown placeholder is refused at
start. The loop blocks only its own process (a CLI, not a node's event loop).
"""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from moed.balance.scale import Decision, PlanConfig, Planner
from moed.balance.scale_view import PLANNED_ROLES, snapshot_of

PLACEHOLDERS = frozenset({"role", "count", "current", "index", "node", "url"})
OUT_PLACEHOLDERS = PLACEHOLDERS - {"node", "url"}


class PlanError(Exception):
    """A flag is wrong or the cluster cannot be read; str() is the one-line reason."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("targets and damping")
    g.add_argument("--ttft-ms", type=float, default=2000.0,
                   help="TTFT target (default: %(default)s)")
    g.add_argument("--itl-ms", type=float, default=100.0,
                   help="inter-token latency target (default: %(default)s)")
    g.add_argument("--util-high", type=float, default=0.8,
                   help="scale out above this utilisation (default: %(default)s)")
    g.add_argument("--util-low", type=float, default=0.5,
                   help="scale in only below this, at one node fewer (default: %(default)s)")
    g.add_argument("--cooldown-out", type=float, default=60.0, metavar="S",
                   help="a scale-out counts as done this long: the node is loading "
                   "(default: %(default)s)")
    g.add_argument("--cooldown-in", type=float, default=300.0, metavar="S",
                   help="no scale-in sooner than this after the role's last change "
                   "(default: %(default)s)")
    g.add_argument("--in-stable", type=int, default=3, metavar="N",
                   help="intervals in a row that must want a scale-in (default: %(default)s)")
    g.add_argument("--drain-window", type=float, default=30.0, metavar="S",
                   help="a backlog past the TTFT target is to drain within this; 0 = the TTFT "
                   "target itself (default: %(default)s)")
    g.add_argument("--interval", type=float, default=10.0, metavar="S",
                   help="seconds between looks (default: %(default)s)")
    g.add_argument("--prompt-tokens", type=int, default=512,
                   help="a typical prompt when none is queued (default: %(default)s)")
    g.add_argument("--context-tokens", type=int, default=1024,
                   help="a typical decode context (default: %(default)s)")
    g.add_argument("--max-batch", type=int, default=64,
                   help="a decode node's batch cap, engine.max_num_seqs (default: %(default)s)")
    g.add_argument("--min", action="append", default=[], metavar="ROLE=N",
                   help="fewest nodes of a role (default 1; may repeat)")
    g.add_argument("--max", action="append", default=[], metavar="ROLE=N",
                   help="most nodes of a role (default 64; may repeat)")
    a = p.add_argument_group("output and actions")
    a.add_argument("--watch", action="store_true", help="keep planning every --interval")
    a.add_argument("--json", action="store_true", help="one JSON object per interval")
    a.add_argument("--on-scale-out", metavar="CMD", help="command per node to add")
    a.add_argument("--on-scale-in", metavar="CMD", help="command for the node to drain")
    a.add_argument("--drain", action="store_true",
                   help="scale-in: POST /admin/drain on the chosen node")
    a.add_argument("--hook-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a hook command may run (default: %(default)s)")


def _counts(items: list[str], flag: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        role, sep, n = item.partition("=")
        if not sep or role not in PLANNED_ROLES or not n.isdigit():
            raise PlanError(f"{flag} {item!r}: give ROLE=N, ROLE one of "
                            f"{', '.join(PLANNED_ROLES)}")
        out[role] = int(n)
    return out


def _template(cmd: str | None, flag: str, allowed: frozenset[str]) -> list[str] | None:
    if cmd is None:
        return None
    try:
        words = shlex.split(cmd)
    except ValueError as e:
        raise PlanError(f"{flag}: {e}") from None
    if not words:
        raise PlanError(f"{flag}: empty command")
    for w in words:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(w) if f is not None}
        except ValueError as e:
            raise PlanError(f"{flag}: {w!r}: {e}") from None
        bad = names - allowed
        if bad:
            raise PlanError(f"{flag}: unknown placeholder {{{sorted(bad)[0]}}} (known: "
                            f"{', '.join('{' + x + '}' for x in sorted(allowed))})")
    return words


def plan_config(args: argparse.Namespace) -> PlanConfig:
    lo, hi = _counts(args.min, "--min"), _counts(args.max, "--max")
    if args.interval <= 0 or args.hook_timeout <= 0:
        raise PlanError("--interval and --hook-timeout must be positive")
    if args.drain and args.on_scale_in:
        raise PlanError("--drain and --on-scale-in: give one scale-in action")
    try:
        return PlanConfig(
            ttft_target_s=args.ttft_ms / 1000, itl_target_s=args.itl_ms / 1000,
            util_high=args.util_high, util_low=args.util_low,
            cooldown_out_s=args.cooldown_out, cooldown_in_s=args.cooldown_in,
            in_stable=args.in_stable, drain_s=args.drain_window,
            prompt_tokens=args.prompt_tokens,
            context_tokens=args.context_tokens, max_batch=args.max_batch,
            min_nodes={r: lo.get(r, 1) for r in PLANNED_ROLES},
            max_nodes={r: hi.get(r, 64) for r in PLANNED_ROLES})
    except ValueError as e:
        raise PlanError(str(e)) from None


def _request(url: str, token: str, timeout: float, method: str = "GET") -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise PlanError(f"{url}: {getattr(e, 'reason', e)}") from None
    try:
        return status, json.loads(raw)
    except ValueError:
        raise PlanError(f"{url}: HTTP {status}, not JSON") from None


def fetch_cluster(url: str, token: str, timeout: float) -> dict[str, Any]:
    status, body = _request(url.rstrip("/") + "/cluster", token, timeout)
    if status != 200 or not isinstance(body, dict):
        msg = body.get("error", {}).get("message", "") if isinstance(body, dict) and \
            isinstance(body.get("error"), dict) else ""
        raise PlanError(f"{url}/cluster: HTTP {status} {msg}".rstrip())
    return body


def run_hook(words: list[str], values: dict[str, Any], timeout: float) -> tuple[bool, str]:
    argv = [w.format(**values) for w in words]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{shlex.join(argv)}: {e}"
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
    return done.returncode == 0, f"{shlex.join(argv)}: exit {done.returncode} {tail[0]}".rstrip()


def act(d: Decision, args: argparse.Namespace, token: str, out_cmd: list[str] | None,
        in_cmd: list[str] | None) -> list[str]:
    """Run the hooks for one decision; -> one line per action taken."""
    lines = []
    base = {"role": d.role, "count": d.desired, "current": d.current}
    if d.action == "out" and out_cmd:
        for index in range(d.current + 1, d.desired + 1):
            ok, what = run_hook(out_cmd, {**base, "index": index, "node": "", "url": ""},
                                args.hook_timeout)
            lines.append(f"{'ran' if ok else 'FAILED'}: {what}")
    elif d.action == "in":
        for node in d.drain:
            values = {**base, "index": d.desired, "node": node.name, "url": node.http}
            if in_cmd:
                ok, what = run_hook(in_cmd, values, args.hook_timeout)
                lines.append(f"{'ran' if ok else 'FAILED'}: {what}")
            elif args.drain:
                try:
                    status, _ = _request(node.http.rstrip("/") + "/admin/drain", token,
                                         args.timeout, "POST")
                    lines.append(f"{'drained' if status == 202 else 'FAILED'}: POST "
                                 f"{node.http}/admin/drain: HTTP {status}")
                except PlanError as e:
                    lines.append(f"FAILED: {e}")
    return lines


def _print(t: float, decisions: list[Decision], actions: list[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"t": round(t, 3), "roles": [d.to_dict() for d in decisions],
                          "actions": actions}), flush=True)
        return
    stamp = time.strftime("%H:%M:%S", time.localtime(t))
    for d in decisions:
        drain = f" (drain {', '.join(n.name for n in d.drain)})" if d.drain else ""
        print(f"{stamp} {d.role:9} {d.current} -> {d.desired} {d.action}{drain}: {d.reason}",
              flush=True)
    for line in actions:
        print(f"{stamp}   {line}", flush=True)


def run(args: argparse.Namespace, token: str,
        clock: Callable[[], float] = time.time) -> int:
    """Plan once, or every --interval with --watch until SIGTERM/SIGINT; 0, or 1 when a hook
    failed on the last interval of a one-shot run."""
    cfg = plan_config(args)
    out_cmd = _template(args.on_scale_out, "--on-scale-out", OUT_PLACEHOLDERS)
    in_cmd = _template(args.on_scale_in, "--on-scale-in", PLACEHOLDERS)
    planner = Planner(cfg)
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    if args.watch:
        signal.signal(signal.SIGTERM, on_term)
    failed = False
    while True:
        t0 = time.monotonic()
        try:
            snap = snapshot_of(fetch_cluster(args.url, token, args.timeout), clock())
        except (PlanError, ValueError) as e:
            if not args.watch:
                raise PlanError(str(e)) from None
            print(f"moed: plan: skipped an interval: {e}", file=sys.stderr, flush=True)
        else:
            decisions = planner.step(snap)
            actions = [line for d in decisions for line in act(d, args, token, out_cmd, in_cmd)]
            failed = any(a.startswith("FAILED") for a in actions)
            _print(snap.t, decisions, actions, args.json)
        if not args.watch or stop:
            return 1 if failed else 0
        deadline = t0 + args.interval
        while not stop and time.monotonic() < deadline:
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
        if stop:
            return 0
