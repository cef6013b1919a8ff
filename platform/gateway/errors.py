"""OpenAI error envelope, error codes, and the exception → HTTP error table (docs/ARCHITECTURE.md §8).

Every non-2xx JSON body on every surface (gateway, REST API, Django error pages, the body-limit middleware) is
``{"error": {"message", "type", "param", "code"}}``, written by ``error_body`` / ``error_dict`` here. ``type``
follows OpenAI's names (``ErrorType``); ``code`` is one of ``ErrorCode`` or null.

The lower layers' exceptions become ``ApiError`` in ``gateway.pipeline.failures.api_error_from``; engine outputs
that failed, in ``failures.pooling_error`` (embeddings) and ``GenerationRun.raise_for_engine_error`` (generation). The envelope writer and the enums live in
``inference.protocol.errors`` (shared with the REST API and Django's error pages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inference.protocol.errors import INTERNAL_ERROR_MESSAGE, ErrorCode, ErrorType, error_body, error_dict

__all__ = ["ApiError", "ErrorCode", "ErrorType", "INTERNAL_ERROR_MESSAGE", "error_body", "error_dict",
           "bad_request", "unauthorized", "forbidden", "not_found", "unavailable", "internal_error", "engine_error"]


@dataclass
class ApiError(Exception):
    """An error answered as a real HTTP status with the OpenAI envelope.

    ``headers`` are extra response headers (e.g. ``Retry-After`` on 429/503).
    """

    status: int
    message: str
    type: str = ErrorType.INVALID_REQUEST
    param: str | None = None
    code: str | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> bytes:
        """The JSON envelope as bytes."""
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """HTTP 400 ``invalid_request_error``."""
    return ApiError(400, message, ErrorType.INVALID_REQUEST, param, code)


def unauthorized(message: str = "Invalid or missing API key. Send 'Authorization: Bearer <key>'.") -> ApiError:
    """HTTP 401 ``authentication_error``."""
    return ApiError(401, message, ErrorType.AUTHENTICATION, None, ErrorCode.INVALID_API_KEY,
                    [("www-authenticate", 'Bearer realm="api"')])


def forbidden(message: str, param: str | None = None) -> ApiError:
    """HTTP 403 ``permission_error``."""
    return ApiError(403, message, ErrorType.PERMISSION, param, ErrorCode.PERMISSION_DENIED)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """HTTP 404 ``not_found_error``."""
    return ApiError(404, message, ErrorType.NOT_FOUND, param, code)


def unavailable(message: str, retry_after_s: int = 1, code: str = ErrorCode.SERVER_OVERLOADED) -> ApiError:
    """HTTP 503 ``server_error`` with ``Retry-After`` (seconds, at least 1)."""
    return ApiError(503, message, ErrorType.SERVER, None, code, [("retry-after", str(max(1, int(retry_after_s))))])


def database_unavailable() -> ApiError:
    """503 ``database_unavailable`` (``Retry-After: 1``): a lookup the request needs (its key, its model) could not
    reach the database (a PostgreSQL restart); the next request connects again (``channels.db``)."""
    return unavailable("The platform's database is unreachable at the moment. Retry shortly.", 1,
                       ErrorCode.DATABASE_UNAVAILABLE)


def redis_unavailable() -> ApiError:
    """503 ``service_unavailable`` (``Retry-After: 1``): the platform's Redis (limits, admission, the engine link)
    did not answer, e.g. while it restarts; a retry a second later is served."""
    return unavailable("The platform's shared state is unreachable at the moment. Retry shortly.", 1,
                       ErrorCode.SERVICE_UNAVAILABLE)


def internal_error() -> ApiError:
    """HTTP 500 ``server_error`` (a defect; details go to the log, never to the client)."""
    return ApiError(500, INTERNAL_ERROR_MESSAGE, ErrorType.SERVER, None, ErrorCode.INTERNAL_ERROR)


def engine_error(message: str, *, retry_after: bool) -> ApiError:
    """HTTP 503 ``engine_error``: the engine failed a request it had accepted (``retry_after``: add
    ``Retry-After: 1``; the in-stream form carries no headers)."""
    return ApiError(503, message, ErrorType.SERVER, None, ErrorCode.ENGINE_ERROR,
                    [("retry-after", "1")] if retry_after else [])
