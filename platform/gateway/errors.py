"""OpenAI error envelope and the gateway's HTTP errors (DESIGN.md §8).

Every non-2xx JSON body is ``{"error": {"message", "type", "param", "code"}}``. ``type`` follows OpenAI's
names (``invalid_request_error``, ``authentication_error``, ``permission_error``, ``not_found_error``,
``rate_limit_error``, ``server_error``); ``code`` is a short machine-readable string or null.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class ApiError(Exception):
    """An error answered as a real HTTP status with the OpenAI envelope.

    ``headers`` are extra response headers (e.g. ``Retry-After`` on 429/503).
    """

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> bytes:
        """The JSON envelope as bytes."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    """Serialise the OpenAI error envelope."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """HTTP 400 ``invalid_request_error``."""
    return ApiError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str = "Invalid or missing API key. Send 'Authorization: Bearer <key>'.") -> ApiError:
    """HTTP 401 ``authentication_error``."""
    return ApiError(401, message, "authentication_error", None, "invalid_api_key",
                    [("www-authenticate", 'Bearer realm="api"')])


def forbidden(message: str, param: str | None = None) -> ApiError:
    """HTTP 403 ``permission_error``."""
    return ApiError(403, message, "permission_error", param, "permission_denied")


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """HTTP 404 ``not_found_error``."""
    return ApiError(404, message, "not_found_error", param, code)


def unavailable(message: str, retry_after_s: int = 1, code: str = "server_overloaded") -> ApiError:
    """HTTP 503 ``server_error`` with ``Retry-After`` (seconds, at least 1)."""
    return ApiError(503, message, "server_error", None, code, [("retry-after", str(max(1, int(retry_after_s))))])
