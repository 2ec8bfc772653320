"""The internal continuation endpoint: a migrated stream resumes on this node.

    POST /internal/continue/v1/completions
    POST /internal/continue/v1/chat/completions
    body {"request": <the client's original body>, "prompt_token_ids": [...],
          "output_token_ids": [...], "replay": "decode" | "prefill"}
    (replay: how the sent tokens are recomputed, moed.engine.resume; default "decode")

Only a router may call it, with a request signed by the cluster secret (moed.api.internal;
a tenant API key gets 403, nothing else 401): a continuation makes the node emit text it did
not sample, so it is not a tenant capability. The answer is the same SSE stream /v1 gives,
minus what the client already has (the role delta, prompt ids, echo), with the output tokens
already sent counted as output (moed.engine.resume) and in usage.

Refused (400, the router then ends the stream with a server_error event): a non-streamed body,
n > 1 or several prompts, tool calling (the tool parser's state is not replayed).
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from moed.api import openai
from moed.api.errors import bad_request
from moed.api.generate import Continuation
from moed.api.internal import require_signed
from moed.api.openai import _read_body
from moed.api.state import STATE
from moed.types import REPLAYS

PREFIX = "/internal/continue"


def _ids(body: dict[str, Any], key: str, empty_ok: bool) -> list[int]:
    v = body.get(key)
    if not isinstance(v, list) or not all(type(t) is int for t in v) or (not v and not empty_ok):
        raise bad_request(f"'{key}' must be a list of token ids", key)
    return v


def parse(raw: bytes) -> Continuation:
    """Body bytes → the continuation, or APIError(400)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad_request("Malformed JSON body.") from None
    req = body.get("request") if isinstance(body, dict) else None
    if not isinstance(req, dict):
        raise bad_request("'request' must be the original request body", "request")
    if req.get("stream") is not True:
        raise bad_request("only a stream is continued", "stream")
    if req.get("n", 1) != 1 or req.get("best_of", 1) not in (1, None) or \
            isinstance(req.get("prompt"), list) and req["prompt"] and \
            not isinstance(req["prompt"][0], int):
        raise bad_request("a continuation has one choice of one prompt", "n")
    if req.get("tools"):
        raise bad_request("tool-calling streams are not continued", "tools")
    replay = body.get("replay", "decode")
    if replay not in REPLAYS:
        raise bad_request(f"'replay' must be one of {', '.join(REPLAYS)}", "replay")
    return Continuation(json.dumps(req).encode(), _ids(body, "prompt_token_ids", False),
                        _ids(body, "output_token_ids", True), replay)


async def handle(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await _read_body(request, state.config.server.max_body_bytes)
    require_signed(request, raw)
    return await openai._serve(request, request.path.endswith("/chat/completions"),
                               parse(raw))


def add_routes(app: web.Application) -> None:
    app.router.add_post(PREFIX + "/v1/completions", handle)
    app.router.add_post(PREFIX + "/v1/chat/completions", handle)
