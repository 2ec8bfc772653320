"""The operator's release commands against a running node's admin API (moed/api/admin.py,
moed/roles/router.py): canary, config history|rollback|show, and the scaling planner (plan).
An answer they cannot use is AdminCallFailed: one line and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from moed.cli.settings import to_toml


class AdminCallFailed(Exception):
    """The admin call did not get an answer it could use; str() is the one-line reason."""


def _admin_token(args: argparse.Namespace) -> str:
    if args.token_file:
        try:
            text = Path(args.token_file).read_text().strip()
        except OSError as e:
            raise AdminCallFailed(f"--token-file {args.token_file}: {e.strerror or e}") from None
    elif args.token_env:
        text = os.environ.get(args.token_env, "").strip()
        if not text:
            raise AdminCallFailed(f"--token-env {args.token_env}: the variable is unset or empty")
    else:
        raise AdminCallFailed("give the admin token: --token-file FILE or --token-env VAR")
    return text.splitlines()[0].split(",")[0].strip()    # the first of several (rotation)


def _admin_call(args: argparse.Namespace, method: str, path: str) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of an admin call; AdminCallFailed when there is no JSON answer."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(args.url.rstrip("/") + path, method=method, data=(
        b"" if method == "POST" else None), headers={
        "Authorization": f"Bearer {_admin_token(args)}"})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise AdminCallFailed(f"{args.url}: {getattr(e, 'reason', e)}") from None
    try:
        body = json.loads(raw)
    except ValueError:
        raise AdminCallFailed(f"{args.url}{path}: HTTP {status}, not JSON") from None
    if not isinstance(body, dict):
        raise AdminCallFailed(f"{args.url}{path}: HTTP {status}, unexpected body")
    return status, body


def _refused(status: int, body: dict[str, Any]) -> str:
    err = body.get("error")
    msg = err.get("message", "") if isinstance(err, dict) else str(err or body)
    return f"HTTP {status}: {msg}"


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


CANARY_EXIT = {"healthy": 0, "unhealthy": 1, "insufficient_data": 3}


def cmd_canary(args: argparse.Namespace) -> int:
    """Canary vs baseline from a router; exit 0 healthy, 1 unhealthy, 3 too little data."""
    status, body = _admin_call(args, "GET", "/admin/canary")
    if status != 200:
        raise AdminCallFailed(_refused(status, body))
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        print(f"canary label {body['label'] or '(none)'}  share {body['share']:g}  "
              f"window {body['window_s']:g} s")
        print(f"{'':10} {'attempts':>9} {'errors':>7} {'err rate':>9} {'TTFT p50':>10} "
              f"{'TTFT p95':>10} {'ITL p50':>10}")
        for side in ("canary", "baseline"):
            f = body[side]
            print(f"{side:10} {f['requests']:>9} {f['errors']:>7} {f['error_rate']:>9.3f} "
                  f"{_ms(f['ttft_p50_s']):>10} {_ms(f['ttft_p95_s']):>10} "
                  f"{_ms(f['itl_p50_s']):>10}")
    verdict = body.get("verdict")
    if not isinstance(verdict, dict):
        print("moed: no canary configured (canary.label)", file=sys.stderr)
        return 2
    if not args.json:
        print(f"verdict: {verdict['health']}")
        for reason in verdict["reasons"]:
            print(f"  - {reason}")
    return CANARY_EXIT.get(verdict["health"], 2)


def cmd_plan(args: argparse.Namespace) -> int:
    """Desired prefill/decode node counts from any node's /cluster (moed/ops/planner.py)."""
    from moed.ops import planner

    try:
        return planner.run(args, _admin_token(args))
    except planner.PlanError as e:
        raise AdminCallFailed(f"plan: {e}") from None


def cmd_config_history(args: argparse.Namespace) -> int:
    status, body = _admin_call(args, "GET", "/admin/config/history")
    if status != 200:
        raise AdminCallFailed(_refused(status, body))
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    for e in body["entries"]:
        mark = "  <- running" if e["hash"] == body["running"] else ""
        print(f"{e['time']}  {e['hash']}  {e['source']}{mark}")
    return 0


def cmd_config_rollback(args: argparse.Namespace) -> int:
    from urllib.parse import quote

    status, body = _admin_call(args, "POST", f"/admin/config/rollback?to={quote(args.hash)}")
    if status != 200:
        if "result" not in body:
            raise AdminCallFailed(_refused(status, body))
        why = body.get("error") or "only restart-only fields differ: " + ", ".join(
            c["key"] for c in body.get("needs_restart", []))
        raise AdminCallFailed(f"rollback {body['result']}, nothing changed: {why}")
    print(f"rollback {body['result']}: running {body['hash']} (config v{body['version']})")
    for c in body.get("applied", []):
        print(f"  {c['key']}: {c['old']!r} -> {c['new']!r}")
    for c in body.get("needs_restart", []):
        print(f"  {c['key']}: needs a restart, left at {c['old']!r}")
    if body.get("file_differs"):
        print("moed: the config file still says otherwise; the next reload reads it again: "
              "restore it (moed config show HASH)", file=sys.stderr)
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    """A history entry as TOML, from the state directory (full values: the admin API
    redacts anything named like a key, which a restored file needs)."""
    from moed.config import from_dict
    from moed.ops.history import FILE, MAX_FILE_BYTES, ConfigHistory, parse
    from moed.safefile import FileRefused, read_regular_file

    directory = args.state_dir or os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if not directory:
        raise AdminCallFailed("give --state-dir DIR (the node's server.state_dir)")
    try:
        entries = parse(read_regular_file(Path(directory) / FILE, MAX_FILE_BYTES))
    except (OSError, FileRefused, ValueError) as e:
        raise AdminCallFailed(f"{Path(directory) / FILE}: {e}") from None
    entry = ConfigHistory(None, max(1, len(entries)), entries).find(args.hash)
    if entry is None:
        raise AdminCallFailed(f"no config {args.hash} in {Path(directory) / FILE}")
    sys.stdout.write(to_toml(from_dict(entry.config, f"history entry {entry.hash}")))
    return 0


def add_admin_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the node's HTTP address (default: %(default)s)")
    p.add_argument("--token-file", metavar="FILE", help="file holding the admin token")
    p.add_argument("--token-env", metavar="VAR", help="environment variable holding it")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the answer (default: %(default)s)")
