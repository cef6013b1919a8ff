"""Error dialects: how a route family writes the errors it answers and the headers of its responses.

Every layer below the routes raises ``ApiError`` (OpenAI's vocabulary: status, ``type``, ``param``, ``code``,
docs/ARCHITECTURE.md §8). A route family whose clients expect another protocol's envelope (Anthropic's Messages API)
maps those errors at the edge, in one place, instead of raising other exceptions below: the consumer
(``gateway.http.GatewayConsumer.dialect``) and the refusals from the headers (``gateway.ingress``) both write through
the route's ``Dialect``.

``OPENAI`` (every route but the Messages API) writes ``ApiError.body()`` with the error's own status and headers, an
in-band ``data: <envelope>`` event and ``data: [DONE]`` after the 200, and leaves every header as it is.

``AnthropicDialect`` (``/v1/messages``, ``/v1/messages/count_tokens``) writes ``{"type": "error", "error": {"type",
"message"}, "request_id"}`` with Anthropic's statuses (``inference.protocol.anthropic.error_status_type``: 402
``billing_error`` for an exhausted budget, 529 ``overloaded_error`` when admission sheds), the field the error is
about at the start of its message (the envelope has no ``param``), an ``event: error`` after the 200, a
``request-id`` header on every response, and the key limits' headers under Anthropic's names
(``anthropic-ratelimit-requests-limit`` ... ``-tokens-reset``, the reset as an RFC 3339 time).
"""

from __future__ import annotations

import datetime
import re
import secrets
import time
from dataclasses import dataclass
from typing import Protocol

from gateway.errors import ApiError
from inference.protocol.anthropic import anthropic_param, error_body, error_status_type

Headers = list[tuple[bytes, bytes]]
"""Response headers as ASGI sends them (lower-case names)."""


@dataclass(frozen=True)
class ErrorReply:
    """An error as it goes out: its HTTP status, its JSON body and its own headers (``Retry-After``, rate limits)."""

    status: int
    body: bytes
    headers: Headers


class Dialect(Protocol):
    """A route family's error envelope and response headers (module docstring)."""

    stream_end: bytes
    """The last bytes of a stream that ended with an in-band error (OpenAI: ``data: [DONE]``)."""

    def new_request_id(self) -> str | None:
        """The id this dialect gives each response (``None``: none of its own)."""

    def reply(self, err: ApiError, request_id: str | None) -> ErrorReply:
        """``err`` as this dialect's status, body and headers, before any byte of the response went out."""

    def stream_error(self, err: ApiError, request_id: str | None) -> bytes:
        """``err`` as an in-band event, after a stream's 200 went out."""

    def request_headers(self, request_id: str | None) -> Headers:
        """The headers every response of the route carries (its request id), errors included."""

    def headers(self, headers: Headers) -> Headers:
        """``headers`` as this dialect names them (called on every response's headers as they are sent)."""


class OpenAIDialect:
    """OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``, the ``ApiError`` as it is."""

    stream_end = b"data: [DONE]\n\n"

    def new_request_id(self) -> str | None:
        """None: the OpenAI routes echo the client's ``X-Request-Id`` (``preamble.echo_request_id``) instead."""
        return None

    def reply(self, err: ApiError, request_id: str | None) -> ErrorReply:
        """The error's own status, envelope and headers."""
        return ErrorReply(err.status, err.body(), [(k.encode(), v.encode()) for k, v in err.headers])

    def stream_error(self, err: ApiError, request_id: str | None) -> bytes:
        """``data: <envelope>``."""
        return b"data: " + err.body() + b"\n\n"

    def request_headers(self, request_id: str | None) -> Headers:
        """None."""
        return []

    def headers(self, headers: Headers) -> Headers:
        """``headers`` unchanged."""
        return headers


OPENAI = OpenAIDialect()


_RATE_HEADER = re.compile(rb"x-ratelimit-(limit|remaining|reset)-(requests|tokens)")
_DURATION = re.compile(r"(\d+)(ms|h|m|s)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def reset_time(duration: bytes, now: float) -> bytes:
    """An OpenAI reset duration (``"20ms"``, ``"1m5s"``) as the RFC 3339 UTC time it ends, ``now`` a Unix time."""
    seconds = sum(int(n) * _UNIT_S[unit] for n, unit in _DURATION.findall(duration.decode("ascii", "replace")))
    when = datetime.datetime.fromtimestamp(now + seconds, datetime.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ").encode()


class AnthropicDialect:
    """Anthropic's error envelope and header names (module docstring); the internal request's field names in messages
    become the protocol's (``inference.protocol.anthropic.anthropic_param``)."""

    stream_end = b""

    def new_request_id(self) -> str | None:
        """``req_<24 hex>``."""
        return f"req_{secrets.token_hex(12)}"

    def message(self, err: ApiError) -> str:
        """``err``'s message, starting with the field it is about when it does not already."""
        param = anthropic_param(err.param)
        if param and not err.message.startswith(param):
            return f"{param}: {err.message}"
        return err.message

    def reply(self, err: ApiError, request_id: str | None) -> ErrorReply:
        """Anthropic's status and envelope; the error's own headers (``Retry-After``, the limits')."""
        status, type_ = error_status_type(err.status, err.code)
        return ErrorReply(status, error_body(type_, self.message(err), request_id),
                          [(k.encode(), v.encode()) for k, v in err.headers])

    def stream_error(self, err: ApiError, request_id: str | None) -> bytes:
        """``event: error`` with the envelope."""
        _status, type_ = error_status_type(err.status, err.code)
        return b"event: error\ndata: " + error_body(type_, self.message(err), request_id) + b"\n\n"

    def request_headers(self, request_id: str | None) -> Headers:
        """``request-id``."""
        return [(b"request-id", request_id.encode())] if request_id else []

    def headers(self, headers: Headers) -> Headers:
        """The ``x-ratelimit-*`` headers under Anthropic's names (``anthropic-ratelimit-<what>-<field>``)."""
        out: Headers = []
        now = time.time()
        for name, value in headers:
            m = _RATE_HEADER.fullmatch(name)
            if m is None:
                out.append((name, value))
                continue
            field, what = m.group(1), m.group(2)
            out.append((b"anthropic-ratelimit-" + what + b"-" + field,
                        reset_time(value, now) if field == b"reset" else value))
        return out


ANTHROPIC = AnthropicDialect()
