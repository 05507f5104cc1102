"""OpenAI's error object: {"error": {"message", "type", "param", "code"}} with a 4xx/5xx
status (its `code` never null), and `shown`, the one way a value of the request is echoed in
a message (short)."""

from __future__ import annotations

import json
import reprlib

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 415: "invalid_request_error", 421: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
# The code an error object carries when its raise names none (OpenAI's and vLLM's spellings
# where they have one); the request's field at fault makes a 400 "invalid_value".
CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
         415: "unsupported_media_type", 421: "misdirected_request", 429: "rate_limit_exceeded",
         500: "internal_error", 503: "service_unavailable"}
ECHO_CHARS = 64  # a value of the request is echoed at most this long, then "..."

_echo = reprlib.Repr()
_echo.maxstring = _echo.maxother = ECHO_CHARS
_echo.maxlist = _echo.maxdict = 4
_echo.maxlevel = 2


def shown(value) -> str:
    """`value` as a message quotes it: repr, at most ECHO_CHARS characters and "..."."""
    if isinstance(value, str) and len(value) > ECHO_CHARS:
        return repr(value[:ECHO_CHARS]) + "..."
    text = _echo.repr(value)
    return text if len(text) <= ECHO_CHARS + 8 else text[:ECHO_CHARS] + "..."


def default_code(status: int, param: str | None) -> str:
    """The code of an error whose raise gives none: never null."""
    if status == 400:
        return "invalid_value" if param else "invalid_request"
    return CODES.get(status, "server_error" if status >= 500 else "invalid_request")


class ApiError(Exception):
    """A request refused: status, one-line message, the parameter it names (or None), and
    its code (a specific one where the raise gives it, else `default_code`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.code = code or default_code(status, param)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        """The body's bytes (ASCII: a message holding any character cannot fail to encode)."""
        return json.dumps(self.body()).encode()
