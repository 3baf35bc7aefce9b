"""Errors as OpenAI's error object, ``{"error": {"message", "type", "param",
"code"}}``, with the HTTP status a client of OpenAI's API expects: the one
place where an error becomes a status."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from outrider import errors
from outrider.logging import get_contextvars, get_logger

log = get_logger(__name__)


class UnknownModel(errors.OutriderError):
    """The request names a model this server does not serve."""


STATUS_OF: dict[type[errors.OutriderError], tuple[int, str, str | None]] = {
    # domain error: (HTTP status, OpenAI error type, code)
    errors.InvalidArgument: (400, "invalid_request_error", None),
    errors.FailedPrecondition: (400, "invalid_request_error", None),
    errors.Unauthenticated: (401, "authentication_error", "invalid_api_key"),
    UnknownModel: (404, "invalid_request_error", "model_not_found"),
    errors.ResourceExhausted: (429, "rate_limit_error", "server_busy"),
    errors.Unavailable: (503, "service_unavailable_error", None),
    errors.SessionNotFound: (503, "service_unavailable_error", None),
}
HTTP_ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error"}


def error_object(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def status_and_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error object of a domain error; anything
    else is an internal error, logged here and not described to the client."""
    if isinstance(exc, errors.OutriderError):
        for cls in type(exc).__mro__:
            if cls in STATUS_OF:
                status, error_type, code = STATUS_OF[cls]
                param = exc.param if isinstance(exc, errors.InvalidArgument) else None
                return status, error_object(str(exc), error_type, param=param, code=code)
    log.error("internal error", exc_info=exc)
    request_id = get_contextvars().get("request_id", "")
    return 500, error_object(f"internal error (request id {request_id})", "server_error")


def error_response(exc: BaseException) -> JSONResponse:
    status, body = status_and_error(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def body_error(problems: list[dict[str, Any]]) -> errors.InvalidArgument:
    """The first problem pydantic (or the JSON decoder) found in a body, as
    one InvalidArgument naming the field: ``messages[0].content``."""
    problem = problems[0]
    path = [part for part in problem["loc"] if part != "body"]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    kind = problem["type"]
    if kind == "json_invalid":
        detail = problem.get("ctx", {}).get("error", problem["msg"])
        return errors.InvalidArgument(f"the body is not valid JSON: {detail}")
    if kind == "extra_forbidden":
        # OpenAI's own words for a field its API does not have.
        return errors.InvalidArgument(
            f"Unrecognized request argument supplied: {param}", param=param
        )
    if kind == "model_attributes_type":
        return errors.InvalidArgument("the body must be a JSON object")
    message = problem["msg"]
    if kind == "missing":
        message = "this field is required"
    elif kind.endswith("_type") and kind != "union_type":
        message = f"{message[0].lower()}{message[1:]}, not {type(problem['input']).__name__}"
    return errors.InvalidArgument(f"{param}: {message}" if param else message, param=param or None)


async def on_outrider_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


async def on_invalid_body(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(body_error(list(exc.errors())))


async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (no such route, wrong method, body too large)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}: the API is under /v1"
    else:
        message = str(exc.detail)
    error_type = HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
    return JSONResponse(
        error_object(message, error_type), status_code=exc.status_code, headers=exc.headers
    )


async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)
