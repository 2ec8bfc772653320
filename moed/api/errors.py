"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a fitting status.

Handlers raise APIError; the middleware turns it (and anything unexpected, as a 500 that names
only the request id) into a JSON response. No traceback ever reaches a client.
"""
from __future__ import annotations

import json
from typing import Mapping

from aiohttp import web
from aiohttp.http_exceptions import (BadHttpMessage, BadHttpMethod, HttpProcessingError,
                                     LineTooLong)

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    504: "timeout_error",
}
# every other 5xx is OpenAI's "server_error": the server failed, the request was fine
# (issue 33's error contract; never invalid_request_error)
SERVER_ERROR = "server_error"


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, err_type: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _TYPES.get(
            status, SERVER_ERROR if status >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.body()),
                            content_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unparsed_request_error(status: int, exc: BaseException | None) -> APIError:
    """The answer to a request that never reached the middleware: aiohttp's parser refused it
    (status 400) or the handler chain itself failed (500/504). aiohttp's own answer is text that
    quotes the offending bytes back; this one never echoes anything the client sent."""
    if isinstance(exc, LineTooLong):
        return APIError(431, "A request line or header field is too long "
                             "(server.max_header_bytes).", code="header_too_large")
    if isinstance(exc, BadHttpMessage) and exc.message.startswith("Too many headers"):
        return APIError(431, "Too many header fields (server.max_headers).",
                        code="too_many_headers")
    if isinstance(exc, BadHttpMethod):
        # 400, not 501: llhttp refuses any method it does not know before routing, the same way
        # as a malformed token, and client junk must not feed the 5xx alert.
        return APIError(400, "Unsupported or malformed HTTP method.", code="unsupported_method")
    if isinstance(exc, HttpProcessingError):
        return APIError(400, "Malformed HTTP request.", code="bad_http_request")
    if status == 504:
        return APIError(504, "Request handler timed out.", code="timeout")
    return APIError(500, "Internal server error.", code="internal_error")
