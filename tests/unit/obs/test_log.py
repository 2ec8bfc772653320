"""obs.log: JSON lines with role, node and the bound request_id; stdlib loggers too."""
from __future__ import annotations

import io
import json
import logging

import structlog

from moed.obs import log as obslog


def test_json_lines_carry_role_node_and_request_id():
    buf = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        obslog.configure("json", "info", role="decode", node="d1", stream=buf)
        with structlog.contextvars.bound_contextvars(request_id="r-9"):
            structlog.get_logger("t").info("hello", tokens=3)
            logging.getLogger("aiohttp.server").error("from stdlib")
        structlog.get_logger("t").debug("hidden")          # below the level
        lines = [json.loads(x) for x in buf.getvalue().splitlines()]
        assert [x["event"] for x in lines] == ["hello", "from stdlib"]
        for x in lines:
            assert (x["role"], x["node"], x["request_id"]) == ("decode", "d1", "r-9")
            assert x["timestamp"].endswith("Z")
        assert lines[0]["tokens"] == 3 and lines[1]["level"] == "error"
        buf.truncate(0)
        buf.seek(0)
        obslog.configure("console", "debug", role="router", node="r", stream=buf)
        structlog.get_logger("t").debug("shown")
        assert "shown" in buf.getvalue() and not buf.getvalue().startswith("{")
    finally:
        structlog.reset_defaults()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
