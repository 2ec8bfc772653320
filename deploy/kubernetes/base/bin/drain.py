"""preStop hook of every moed container (deploy/kubernetes): drain through the admin API, the
way `moed plan --drain` does, and hold the hook until the node has exited.

Why a hook and not SIGTERM alone: a pod being deleted leaves its Services' endpoints while the
hook runs, but kube-proxy and ingress controllers learn it a moment later; the node keeps
taking requests for DRAIN_DELAY_S (5) first. Then POST /admin/drain (the admin token from
MOED_SERVER_ADMIN_TOKEN_FILE): /ready turns 503, the node leaves the gossip membership (routers
stop picking it at once), in-flight requests finish within server.shutdown_grace_s and moed
exits 0. The hook returns when the HTTP port has closed, i.e. every request is done: kubelet's
SIGTERM after the hook would be a second stop signal, which skips the grace, but by then only
moed's teardown is left, which it finishes (and exits 0) regardless. Waiting for the process
itself is not possible: it is PID 1, and the hook dies with it. Any failure here exits 1:
kubelet then sends SIGTERM, which drains the same way (only without the delay).
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

URL = os.environ.get("DRAIN_URL", "http://127.0.0.1:8000")


def main() -> int:
    time.sleep(float(os.environ.get("DRAIN_DELAY_S", "5")))
    path = os.environ.get("MOED_SERVER_ADMIN_TOKEN_FILE", "")
    try:
        with open(path, encoding="utf-8") as f:
            # the first token as moed reads the file (moed.api.auth.load_keys): blank and
            # '#' lines are not tokens
            token = next(ln.strip() for ln in f.read().splitlines()
                         if ln.strip() and not ln.strip().startswith("#"))
    except StopIteration:
        print(f"drain: no admin token in {path!r}", file=sys.stderr)
        return 1
    except (OSError, IndexError) as e:
        print(f"drain: no admin token in {path!r}: {e}", file=sys.stderr)
        return 1
    req = urllib.request.Request(URL + "/admin/drain", data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"drain: POST {URL}/admin/drain: {e}", file=sys.stderr)
        return 1
    grace = float(body.get("grace_s", 30.0))
    print(f"drain: {body}", file=sys.stderr)
    deadline = time.monotonic() + grace + 10      # bounded: kubelet's grace period ends it anyway
    while time.monotonic() < deadline:           # until the HTTP port closes: moed has exited
        try:
            with urllib.request.urlopen(URL + "/health", timeout=2):
                pass
        except (urllib.error.URLError, OSError):
            return 0
        time.sleep(0.5)
    print(f"drain: still serving {grace + 10:g} s after the drain", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
