"""Errors the API returns, in OpenAI's error format.

Every failure a client can cause or meet maps to one `APIError` subclass with
an HTTP status, an OpenAI error `type` and a stable `code`. The body is always
``{"error": {"message", "type", "param", "code"}}`` so the official clients
raise their typed exceptions (BadRequestError, NotFoundError, RateLimitError...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class APIError(Exception):
    """An error with everything needed to answer it.

    `code` is the label the error counter uses, so it must come from a small
    fixed set (never a message or a user-supplied value).
    """

    message: str
    status: int = 400
    type: str = "invalid_request_error"
    code: str = "invalid_request"
    param: str | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", "invalid_request", param)


def unsupported_parameter(param: str, detail: str = "") -> APIError:
    msg = f"parameter '{param}' is not supported by this server"
    return APIError(msg + (f": {detail}" if detail else ""), 400, "invalid_request_error",
                    "unsupported_parameter", param)


def context_length_exceeded(message: str, param: str = "messages") -> APIError:
    """`param`: the request field holding the prompt ("messages" for chat, "prompt" for completions)."""
    return APIError(message, 400, "invalid_request_error", "context_length_exceeded", param)


def request_too_large(max_bytes: int, got: int | None = None) -> APIError:
    size = f"{got} bytes" if got is not None else f"over {max_bytes} bytes"
    return APIError(f"the request body is {size}; this server takes at most {max_bytes} bytes "
                    "(--max-request-bytes)", 413, "invalid_request_error", "request_too_large")


def model_not_found(model: str, served: list[str]) -> APIError:
    return APIError(
        f"The model '{model}' does not exist on this server; it serves: {', '.join(served)}",
        404, "invalid_request_error", "model_not_found", "model",
    )


def route_not_found(path: str) -> APIError:
    return APIError(f"no route for {path}", 404, "invalid_request_error", "not_found")


def method_not_allowed(method: str, path: str) -> APIError:
    return APIError(f"method {method} is not allowed on {path}", 405, "invalid_request_error",
                    "method_not_allowed")


def queue_full(max_waiting: int, retry_after_s: int) -> APIError:
    return APIError(
        f"the server's queue is full ({max_waiting} requests waiting); retry after {retry_after_s}s",
        429, "rate_limit_error", "queue_full", None, {"Retry-After": str(retry_after_s)},
    )


def shutting_down() -> APIError:
    return APIError("the server is shutting down and accepts no new requests; retry on another replica",
                    503, "service_unavailable", "shutting_down", None, {"Retry-After": "1"})


def not_ready() -> APIError:
    return APIError("the model is still loading; retry when /ready answers 200",
                    503, "service_unavailable", "not_ready", None, {"Retry-After": "5"})


def engine_failed(detail: str) -> APIError:
    return APIError(f"the engine failed: {detail}", 500, "server_error", "engine_error")


def internal_error(detail: str) -> APIError:
    return APIError(f"internal server error: {detail}", 500, "server_error", "internal_error")


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the first bad field.

    Malformed JSON arrives here too (FastAPI reports it as a `json_invalid` error).
    """
    if not errors:
        return invalid_request("the request body is invalid")
    first = errors[0]
    kind = str(first.get("type", ""))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        reason = ctx.get("error", "") if isinstance(ctx, dict) else ""
        return APIError(f"the request body is not valid JSON{': ' + reason if reason else ''}",
                        400, "invalid_request_error", "invalid_json")
    param = ".".join(loc) if loc else None
    msg = str(first.get("msg", "invalid value"))
    # pydantic prefixes custom ValueError messages with "Value error, ".
    msg = msg.removeprefix("Value error, ")
    if kind == "missing":
        return invalid_request(f"missing required parameter '{param}'", param)
    if param is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        return invalid_request("the request body must be a JSON object")
    return invalid_request(f"invalid value for '{param}': {msg}" if param else msg, param)
