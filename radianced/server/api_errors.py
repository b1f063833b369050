"""The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.

`ProtocolError` is a request the server answers with an error status instead
of running it; its `status` and `body()` are the HTTP answer, with `param`
naming the offending field (`messages[0].content`, `max_tokens`, ...).
`error_body` builds the same body for a status a route decides itself (401,
413, 429, 503, ...).
"""

from __future__ import annotations

import msgspec

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ProtocolError(Exception):
    """A request the server answers with an error status instead of running it.

    `param` names the request field at fault (None when no one field is), `type`
    defaults to OpenAI's for the status (400: invalid_request_error, ...).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.code = code

    def body(self) -> bytes:
        return _encoder.encode(ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code)))


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


_encoder = msgspec.json.Encoder()


def error_body(status: int, message: str, param: str | None = None, type: str | None = None,
               code: str | None = None) -> bytes:
    """The JSON error body for a status the route decides itself (401, 413, 429, 503, ...)."""
    return ProtocolError(status, message, param, type, code).body()
