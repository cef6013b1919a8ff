"""The one table from the exceptions the pipeline's lower layers raise to the HTTP errors clients see."""

from __future__ import annotations

from gateway.errors import ApiError, ErrorCode, ErrorType, bad_request, unavailable
from inference.admission import AdmissionRefused
from inference.engine_client import EngineUnavailableError
from inference.protocol.openai import RequestValidationError
from tenancy.limits import RateLimitExceeded

ERROR_TABLE = """
RequestValidationError  → 400 invalid_request_error, param named (input validation, input processing)
AdmissionRefused        → 503 server_error server_overloaded + Retry-After (platform out of capacity)
RateLimitExceeded       → 429 rate_limit_error, its code (rate_limit_exceeded / concurrency_limit_exceeded /
                          insufficient_quota) + Retry-After and x-ratelimit-* (this key or tenant)
EngineUnavailableError  → 503 server_error engine_unavailable + Retry-After: 2
"""


def api_error_from(exc: BaseException, *, param_prefix: str = "") -> ApiError:
    """``exc`` as the ``ApiError`` of ``ERROR_TABLE``; re-raises an exception the table does not know.

    ``param_prefix`` goes before a validation error's param other than ``token_ids`` (``sampling_params.`` on
    ``/inference/v1/generate``)."""
    if isinstance(exc, RequestValidationError):
        param = exc.param
        if param_prefix and param not in (None, "token_ids"):
            param = param_prefix + param
        return bad_request(exc.message, param, exc.code)
    if isinstance(exc, AdmissionRefused):
        return unavailable(exc.message, exc.retry_after_s, ErrorCode.SERVER_OVERLOADED)
    if isinstance(exc, RateLimitExceeded):
        return ApiError(429, exc.message, ErrorType.RATE_LIMIT, None, exc.code, list(exc.str_headers))
    if isinstance(exc, EngineUnavailableError):
        return unavailable(str(exc), 2, ErrorCode.ENGINE_UNAVAILABLE)
    raise exc

