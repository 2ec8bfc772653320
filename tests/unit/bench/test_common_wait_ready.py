"""bench/common.py's wait_ready: a server that answers /ready, one that exited, one that never does."""
from __future__ import annotations

import http.server
import sys
import threading
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))
try:
    import common
finally:
    sys.path.remove(str(BENCH))


class _Proc:
    def __init__(self, code: int | None) -> None:
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode


class _Ready(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(self.status if self.path == "/ready" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _serve(status: int) -> tuple[http.server.HTTPServer, str]:
    handler = type("H", (_Ready,), {"status": status})
    srv = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_ready_server_answers_none():
    srv, url = _serve(200)
    try:
        assert common.wait_ready(url, _Proc(None), 5) is None
    finally:
        srv.shutdown()


def test_exited_process_and_a_server_that_stays_unready_say_why():
    srv, url = _serve(503)
    try:
        assert common.wait_ready(url, _Proc(3), 5) == "exited with 3"
        assert common.wait_ready(url, _Proc(None), 0.5) == "not ready in 0.5 s"   # 503 until the deadline
    finally:
        srv.shutdown()
