"""Steps 3-5 of the request path (docs/ARCHITECTURE.md §2): authenticate, parse and validate, request ids, resolve
the model. Everything here runs before the request holds anything."""

from __future__ import annotations

import asyncio
import functools
import secrets
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar, cast

from pydantic import BaseModel

from gateway import auth
from gateway.errors import ApiError, ErrorCode, bad_request, not_found
from gateway.http import OFF_LOOP_PARSE_BYTES, GatewayConsumer, json_body
from gateway.model_cache import ModelSnapshot, get_model
from gateway.pipeline import limits
from gateway.pipeline.failures import api_error_from
from inference.protocol.openai import MAX_REQUEST_ID_LEN, RequestValidationError, validate_request
from tenancy.limits import LimitGrant
from tenancy.selectors import AuthContext


Req = TypeVar("Req")
"""A validated request body: a pydantic schema's instance, or what a validation function returns."""
JsonBody = dict[str, object]
"""A parsed JSON request body (``json_body``), before validation."""


def clean_request_id(value: str) -> str:
    """``value`` with only printable ASCII other than space kept (``!`` to ``~``): a request id is echoed as
    the ``X-Request-Id`` header, so every route keeps the same characters (empty when none is left)."""
    return "".join(ch for ch in value if 32 < ord(ch) < 127)


def client_request_id(header_value: bytes | None, body_value: str | None) -> str:
    """The client's request id: ``X-Request-Id`` header, else body ``request_id``, else random.

    Capped at ``MAX_REQUEST_ID_LEN`` characters: a longer value, or a header value with control characters
    (it is echoed as a header), raises ``ApiError`` 400 (param ``X-Request-Id`` or ``request_id``); only
    printable ASCII is kept.
    """
    raw = None
    if header_value:
        raw = header_value.decode("latin-1")
        if len(raw) > MAX_REQUEST_ID_LEN:
            raise bad_request(f"X-Request-Id is longer than {MAX_REQUEST_ID_LEN} characters", "X-Request-Id")
        if any(ord(ch) < 32 or ord(ch) == 127 for ch in raw):
            raise bad_request("X-Request-Id must not contain control characters", "X-Request-Id")
    elif body_value:
        if len(body_value) > MAX_REQUEST_ID_LEN:  # the schemas cap it too; this keeps every caller bounded
            raise bad_request(f"request_id is longer than {MAX_REQUEST_ID_LEN} characters", "request_id")
        raw = body_value
    if raw:
        cleaned = clean_request_id(raw)
        if cleaned:
            return cleaned
    return secrets.token_hex(8)


async def validated_body(body: bytes, validate: Callable[[JsonBody], Req]) -> Req:
    """``validate(await json_body(body))``: the validation too runs in a worker thread when the body is over
    ``OFF_LOOP_PARSE_BYTES``, as its parsing does (validating a large body, e.g. 2,048 messages or a long
    token-id list, takes milliseconds: not on the event loop). Raises what they raise
    (``RequestValidationError``)."""
    data = await json_body(body)
    if len(body) > OFF_LOOP_PARSE_BYTES:
        return await asyncio.to_thread(validate, data)
    return validate(data)


async def authenticate(consumer: GatewayConsumer, scope: str = "inference",
                       credentials: auth.Credentials = auth.BEARER) -> AuthContext:
    """The caller's ``AuthContext`` (401 without a valid key where ``credentials`` reads it, 403 without ``scope``)."""
    ctx = await auth.authenticate(consumer.scope["headers"], credentials)
    auth.require_scope(ctx, scope)
    return ctx


def validator(schema: type[Req] | Callable[[JsonBody], Req]) -> Callable[[JsonBody], Req]:
    """``schema`` as a function of the JSON body: a pydantic schema class validates with ``validate_request``
    (``RequestValidationError`` naming the field); a function is used as it is."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return cast(Callable[[JsonBody], Req], functools.partial(validate_request, schema))
    return cast(Callable[[JsonBody], Req], schema)


async def parse(body: bytes, validate: type[Req] | Callable[[JsonBody], Req]) -> Req:
    """``body`` parsed and validated by ``validate`` (a pydantic schema class or a function of the JSON dict);
    ``ApiError`` 400 naming the field."""
    try:
        return await validated_body(body, validator(validate))
    except RequestValidationError as exc:
        raise api_error_from(exc) from None


def echo_request_id(consumer: GatewayConsumer, request_id: str) -> None:
    """Echo ``request_id`` as the response's ``X-Request-Id``."""
    consumer.extra_headers.append((b"x-request-id", request_id.encode()))


@dataclass
class Preamble(Generic[Req]):
    """An authenticated, validated request: ``ctx`` (``AuthContext``), ``req`` (the validated body, ``Req``),
    ``base_id`` (the client's id, echoed), ``external_id`` (``id_prefix + base_id``, shown in responses) and
    ``grant``, the key's request and concurrency limits taken before the body was parsed (the caller releases
    it: ``request_scope(grant=...)`` or ``limits.held(grant=...)``)."""

    ctx: AuthContext
    req: Req
    base_id: str
    external_id: str
    grant: LimitGrant


def _body_request_id(req: object) -> str | None:
    value = getattr(req, "request_id", None)
    return value if isinstance(value, str) else None


async def preamble(consumer: GatewayConsumer, body: bytes, schema: type[Req] | Callable[[JsonBody], Req],
                   id_prefix: str, body_id: Callable[[Req], str | None] = _body_request_id,
                   on_refused: Callable[[AuthContext, ApiError, str], None] | None = None,
                   credentials: auth.Credentials = auth.BEARER) -> Preamble[Req]:
    """docs/ARCHITECTURE.md §2 steps 3-4 for the inference endpoints: authenticate (401; 403 without the ``inference``
    scope), take the key's request (RPM) and concurrency limits before any work (``limits.acquire`` of 0
    tokens; 429: the body is never parsed), parse and validate ``body`` with ``schema`` (400 naming the
    field), and echo the client's request id (``X-Request-Id`` header, else ``body_id(req)``, else random).
    On any failure after the limits were taken they are released (settled on 0 tokens) before raising.
    ``on_refused(ctx, err, client_id)`` is called when the limits refuse the request (``client_id``: the cleaned
    ``X-Request-Id`` header, or empty; it records the 429's usage: the
    request holds nothing yet, and its body is never read). ``credentials``: where the route reads the key."""
    ctx = await authenticate(consumer, credentials=credentials)
    try:
        grant = await limits.acquire(consumer, ctx, 0)
    except ApiError as err:
        if on_refused is not None:
            header = consumer.header(b"x-request-id")
            on_refused(ctx, err, clean_request_id(header.decode("latin-1"))[:200] if header else "")
        raise
    try:
        req = await parse(body, schema)
        base_id = client_request_id(consumer.header(b"x-request-id"), body_id(req))
    except BaseException:
        await limits.settle(grant, 0)
        raise
    echo_request_id(consumer, base_id)
    return Preamble(ctx, req, base_id, id_prefix + base_id, grant)


async def resolve_model(ctx: AuthContext, name: str | None, *, generate: bool = False) -> ModelSnapshot:
    """The served model for ``name`` (400 when missing, 404 when unknown, 403 when the key may not use it; with
    ``generate``, 400 ``model_not_generative`` when it is an embedding model, before any work: its replicas would
    refuse the request as an engine error, a 503 that clients retry)."""
    if not name:
        raise bad_request("'model' is required", "model")
    snap = await get_model(name)
    if snap is None:
        raise not_found(f"The model '{name}' does not exist or is not served here", "model",
                        ErrorCode.MODEL_NOT_FOUND)
    auth.require_model(ctx, name)
    if generate and snap.task != "generate":
        raise bad_request(f"The model '{name}' is an embedding model (its task is '{snap.task}'): it does not "
                          "generate text; use /v1/embeddings", "model", ErrorCode.MODEL_NOT_GENERATIVE)
    return snap
