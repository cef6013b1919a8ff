"""Error dialects: how a route family writes the errors it answers and the headers of its responses.

Every layer below the routes raises ``ApiError`` (OpenAI's vocabulary: status, ``type``, ``param``, ``code``,
docs/ARCHITECTURE.md §8). A route family whose clients expect another protocol's envelope (Anthropic's Messages API)
maps those errors at the edge, in one place, instead of raising other exceptions below: the consumer
(``gateway.http.GatewayConsumer.dialect``) and the refusals from the headers (``gateway.ingress``) both write through
the route's ``Dialect``.

``OPENAI`` (every route but the Messages API) writes ``ApiError.body()`` with the error's own status and headers, an
in-band ``data: <envelope>`` event and ``data: [DONE]`` after the 200, and leaves every header as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.errors import ApiError

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
