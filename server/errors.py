"""OpenAI-shaped errors: every failure leaves as {"error": {"message", "type", "param", "code"}}.

Litestar's own exceptions (validation, 404 route, 405, 413 body size) and the engine's errors are mapped
here, so no path returns Litestar's default body or a bare traceback.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from jaxserve.errors import EngineDeadError, InvalidRequestError, QueueFullError

from .request_fields import unknown_fields, unknown_fields_message
from .response_types import ErrorInfo, ErrorResponse

log = logging.getLogger("jaxserve.server")

ECHO_LIMIT = 200  # characters of the bad input echoed back in a 400
NAME_ECHO_LIMIT = 100  # characters of an unknown model name echoed back in a 404

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(name: str) -> APIError:
    shown = name if len(name) <= NAME_ECHO_LIMIT else f"{name[:NAME_ECHO_LIMIT]}... ({len(name)} chars)"
    return APIError(404, f"The model `{shown}` does not exist.", param="model", code="model_not_found")


def error_response(err: APIError, headers: dict[str, str] | None = None) -> Response:
    return Response(content=msgspec.json.encode(err.body()), status_code=err.status, media_type="application/json",
                    headers=headers)


def _echo(data: bytes | None) -> str:
    if not data:
        return "(empty body)"
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= ECHO_LIMIT else text[:ECHO_LIMIT] + f"... ({len(text)} chars)"


# a \uXXXX escape of a UTF-16 surrogate without its pair (not itself escaped): no Unicode text holds one, and
# msgspec reports it as truncated input
_LONE_SURROGATE = re.compile(rb"(?<!\\)\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})(?<!\\)\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def lone_surrogate_message(body: bytes | None) -> str | None:
    """The 400's message for a JSON body that escapes a lone surrogate (e.g. in a stop string), else None."""
    m = _LONE_SURROGATE.search(body) if body else None
    if m is None:
        return None
    return (f"invalid JSON body: it holds a lone UTF-16 surrogate, {m.group().decode()} at byte {m.start()}: "
            "strings must be valid Unicode text (a surrogate escape needs its pair)")


def _validation_message(exc: ValidationException) -> tuple[str, str | None]:
    """msgspec's message says what and where (`Expected int, got str - at $.max_tokens`); keep it."""
    details: list[str] = []
    param = None
    extra = exc.extra
    items = extra if isinstance(extra, list) else [extra] if extra else []
    for item in items:
        if isinstance(item, dict):
            msg = item.get("message")
            key = item.get("key")
            if msg:
                details.append(str(msg))
            if key and key != "body" and param is None:
                param = str(key)
            if param is None and isinstance(msg, str) and "$." in msg:
                param = msg.rsplit("$.", 1)[1].strip("`")
        elif item:
            details.append(str(item))
    message = "; ".join(details) or str(exc.detail)
    return (f"{param}: {message}" if param else message), param


def to_api_error(exc: Exception) -> APIError:
    """The one mapping from an exception to an HTTP status + OpenAI body."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(exc.message, exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc) or "the server is at its waiting-queue limit; retry later", code="queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, ValidationException):
        message, param = _validation_message(exc)
        return bad_request(message, param)
    if isinstance(exc, HTTPException):
        status = exc.status_code
        message = str(exc.detail)
        if status == 500 and "disconnected prematurely" in message:
            # the body never arrived (the client left, or --read-timeout cut it): nobody reads this answer,
            # and it is no server fault (nginx's 499, "client closed request")
            return APIError(499, "the client closed the connection before its request body arrived",
                            code="client_closed")
        if status == 413:
            message = f"request body is too large ({message})"
            return APIError(413, message, code="request_too_large")
        if status == 404:
            return APIError(404, message, code="not_found")
        return APIError(status, message)
    if isinstance(exc, RecursionError):  # msgspec's depth guard on a deeply nested body (or a value inside one)
        return bad_request("the request is nested too deeply to decode", None)
    if isinstance(exc, ValueError):  # SamplingParams validation and friends
        return bad_request(str(exc), getattr(exc, "param", None))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def exception_handler(request: Request[Any, Any, Any], exc: Exception) -> Response:
    err = to_api_error(exc)
    if err.status == 400 and isinstance(exc, HTTPException):  # schema or JSON error: show what we got
        body = request._connection_state.body  # cached by Litestar when it read the body
        body = body if isinstance(body, bytes) else None
        unknown = unknown_fields(request.url.path, body) if "unknown field" in err.message else []
        surrogate = None if isinstance(exc, ValidationException) else lone_surrogate_message(body)
        if unknown:       # every field the request type lacks, not only the first msgspec met
            err = APIError(400, unknown_fields_message(unknown), param=unknown[0], code="unknown_parameter")
        elif surrogate is not None:
            err = APIError(400, surrogate)
        else:
            prefix = "" if isinstance(exc, ValidationException) else "invalid JSON body: "
            err.message = f"{prefix}{err.message}. Input: {_echo(body)}"
    elif err.status == 413:
        state = getattr(request.app.state, "serving", None)
        limit = state.args.max_body_bytes if state is not None else None
        if limit:
            err.message = f"request body is larger than the server's limit of {limit} bytes (--max-body-bytes)"
    if isinstance(exc, RecursionError):  # a hostile input, not a server fault: one line, no traceback
        log.warning("%s %s: 400, the request is nested too deeply", request.method, request.url.path)
        body = request._connection_state.body
        err.message = f"{err.message}. Input: {_echo(body if isinstance(body, bytes) else None)}"
    if err.status >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, err.message,
                  exc_info=exc if err.status == 500 else None)
    headers = None
    if err.status == 429:
        headers = {"Retry-After": "1"}
    elif err.status == 405 and isinstance(exc, HTTPException) and exc.headers:
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    return error_response(err, headers)
