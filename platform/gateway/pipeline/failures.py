"""The table from the exceptions the pipeline's lower layers raise (and the typed errors its workers answer) to
the HTTP errors clients see."""

from __future__ import annotations

from gateway.errors import ApiError, ErrorCode, ErrorType, bad_request, engine_error, unavailable
from inference.api.admission import AdmissionRefused
from inference.api.engine_client import EngineUnavailableError
from inference.media.image import ImageError
from inference.protocol.openai import RequestValidationError
from inference.protocol.render import MM_QUEUE, RenderFailure
from inference.api.render_client import RenderUnavailableError
from tenancy.limits import RateLimitExceeded

# render/mm failure codes that are a worker's defect (500), with the message the client sees
_WORKER_DEFECTS: dict[str, str] = {ErrorCode.RENDER_INTERNAL_ERROR: "The renderer failed unexpectedly",
                                   ErrorCode.MM_INTERNAL_ERROR: "Image preprocessing failed unexpectedly"}
# what a pooling replica says when it refuses an input (inference/engine/pooling.py, runner.py RequestError)
_POOLING_INPUT_REFUSALS = ("out of range", "max_model_len")


def api_error_from(exc: BaseException, *, param_prefix: str = "") -> ApiError:
    """``exc`` as its ``ApiError``, by this table; re-raises an exception the table does not know.

    RequestValidationError  → 400 invalid_request_error, param named (input validation, input processing)
    AdmissionRefused        → 503 server_error server_overloaded + Retry-After (platform out of capacity)
    RateLimitExceeded       → 429 rate_limit_error, its code (rate_limit_exceeded / concurrency_limit_exceeded /
                              insufficient_quota) + Retry-After and x-ratelimit-* (this key or tenant)
    EngineUnavailableError  → 503 server_error engine_unavailable + Retry-After: 2
    RenderFailure           → by the code the render or mm worker gave it (inference.protocol.render):
                              render_internal_error / mm_internal_error → 500 server_error (a worker defect);
                              render_unavailable → 503 server_error + Retry-After: 2 (the worker ran out of time
                              outside the template); any other → 400 invalid_request_error, its param and code
    RenderUnavailableError  → 503 server_error render_unavailable (queue render) / mm_unavailable (queue mm)
                              + Retry-After: 2 (no worker answered in time)
    ImageError              → 400 invalid_request_error, its param and code (an image the api itself refused)
    a pooling output's error (``pooling_error``) → 400 invalid_request_error, param input, when the engine refused
                              the input (matched by its text: the engine sends no code yet); else 503
                              engine_error + Retry-After: 1

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
    if isinstance(exc, RenderFailure):
        return _render_failure(exc)
    if isinstance(exc, RenderUnavailableError):
        if exc.queue == MM_QUEUE:
            return unavailable("no multimodal worker answered in time; retry shortly", 2, ErrorCode.MM_UNAVAILABLE)
        return unavailable(f"{exc}: the render workers are busy or down, or the input could not be rendered "
                           f"within the render time limit", 2, ErrorCode.RENDER_UNAVAILABLE)
    if isinstance(exc, ImageError):
        return bad_request(exc.message, exc.param, exc.code)
    raise exc


def _render_failure(failure: RenderFailure) -> ApiError:
    defect = _WORKER_DEFECTS.get(failure.code)
    if defect is not None:
        return ApiError(500, defect, ErrorType.SERVER, None, failure.code)
    if failure.code == ErrorCode.RENDER_UNAVAILABLE:
        return unavailable(failure.message, 2, ErrorCode.RENDER_UNAVAILABLE)
    return bad_request(failure.message, failure.param, failure.code)


def pooling_error(message: str | None) -> ApiError:
    """The ``ApiError`` of a pooling (embeddings) request the engine failed with ``message``: 400 (param ``input``)
    when the engine refused the input (a token id out of its vocabulary, longer than its ``max_model_len``), else
    503 ``engine_error``. Matched by the engine's text (``_POOLING_INPUT_REFUSALS``) until the engine's outputs
    carry an error code."""
    msg = message or "the engine did not return an embedding"
    if any(marker in msg for marker in _POOLING_INPUT_REFUSALS):
        return bad_request(msg, "input")
    return engine_error(msg, retry_after=True)
