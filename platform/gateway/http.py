"""Base Channels HTTP consumer for the OpenAI-compatible routes.

Channels' ``AsyncHttpConsumer`` runs ``handle()`` inside its message loop, so an ``http.disconnect`` is not
seen until ``handle()`` returns; a streaming handler would never learn that its client went away. This base
runs the handler as a task instead and cancels it when the client disconnects, so the request's engine work
is aborted and its resources released (docs/ARCHITECTURE.md §2, step 2). It also caps the body size while it arrives
(413), turns ``ApiError`` into the OpenAI envelope with its real status, and turns anything unexpected into a logged 500
(a defect to fix, docs/ARCHITECTURE.md §8).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import orjson

from channels.exceptions import StopConsumer
from channels.consumer import get_handler_name
from channels.generic.http import AsyncHttpConsumer
from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from gateway.dialects import OPENAI, Dialect
from gateway.disconnect import ClientGone, bind
from gateway.errors import ApiError, ErrorCode, ErrorType, internal_error, redis_unavailable
from inference.protocol.openai import parse_json_body

log = logging.getLogger(__name__)

MAX_BODY_BYTES = settings.MAX_REQUEST_BODY_BYTES
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class GatewayConsumer(AsyncHttpConsumer):
    """Base for gateway endpoints: subclasses implement ``async handle_request(body: bytes)``."""

    channel_layer_alias = "__gateway_no_layer__"  # no channel layer round trips per request
    methods: tuple[str, ...] = ("POST",)
    dialect: Dialect = OPENAI  # how this route writes its errors and names its headers (gateway/dialects.py)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._size = 0
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._response_complete = False
        self._client_gone = ClientGone()  # for handlers whose cancellation was lost (gateway/disconnect.py)
        self.request_id = self.dialect.new_request_id()
        self.extra_headers: list[tuple[bytes, bytes]] = self.dialect.request_headers(self.request_id)

    # ------------------------------------------------------------------ ASGI plumbing
    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' ``AsyncConsumer.dispatch`` without its ``aclose_old_connections()`` before every
        message: that call runs on asgiref's one thread-sensitive executor thread, so under load every
        request (each body chunk, each disconnect) queued behind every other one there (measured: most of a
        503's time under overload). The gateway touches the ORM only through ``thread_sensitive=False``
        calls, whose connections that call would not clean up anyway."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    async def http_request(self, message: dict[str, Any]) -> None:
        """Accumulate the body (413 past ``MAX_BODY_BYTES``), then start the handler task."""
        if self._task is not None:
            return
        chunk = message.get("body", b"")
        self._size += len(chunk)
        if self._size > MAX_BODY_BYTES:
            self.body = []
            self._task = asyncio.get_running_loop().create_task(self._reject_too_large())
            return
        if chunk:
            self.body.append(chunk)
        if not message.get("more_body"):
            body = b"".join(self.body)
            self.body = []
            self._task = asyncio.get_running_loop().create_task(self._run(body))

    async def http_disconnect(self, message: dict[str, Any]) -> None:
        """The connection ended. Before the response was complete the client went away: cancel the handler
        (its ``finally`` blocks abort engine work and record usage). After it completed, let the handler
        finish its post-response work (usage event, releases) undisturbed."""
        if self._task is not None and not self._task.done():
            if not self._response_complete:
                self._client_gone.gone = True
                self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing: the task's own failure is moot
                pass
        raise StopConsumer()

    async def send_body(self, body: bytes, *, more_body: bool = False) -> None:
        """Send a body chunk; remembers when the response is complete."""
        if not more_body:
            self._response_complete = True
        await super().send_body(body, more_body=more_body)

    async def _reject_too_large(self) -> None:
        await self.send_error(ApiError(413, f"Request body too large: the limit is {MAX_BODY_BYTES} bytes",
                                       ErrorType.INVALID_REQUEST, None, ErrorCode.REQUEST_TOO_LARGE))

    async def _run(self, body: bytes) -> None:
        bind(self._client_gone)
        try:
            if self.scope.get("method") not in self.methods:
                raise ApiError(405, f"Method {self.scope.get('method')} is not allowed on {self.scope.get('path')}",
                               ErrorType.INVALID_REQUEST, None, ErrorCode.METHOD_NOT_ALLOWED,
                               [("allow", ", ".join(self.methods))])
            await self.handle_request(body)
        except asyncio.CancelledError:
            raise
        except ApiError as err:
            if self._started:
                await self.send_sse_error(err)
            else:
                await self.send_error(err)
        except (RedisConnectionError, RedisTimeoutError) as exc:  # Redis restarting: retryable, not a defect
            log.warning("Redis unreachable on %s: %s", self.scope.get("path"), exc)
            if self._started:
                await self.send_sse_error(redis_unavailable())
            else:
                await self.send_error(redis_unavailable())
        except Exception:  # a 500 is a defect, but the client still gets an envelope
            log.exception("unhandled error on %s", self.scope.get("path"))
            internal = internal_error()
            if self._started:
                await self.send_sse_error(internal)
            else:
                await self.send_error(internal)

    async def handle_request(self, body: bytes) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    def header(self, name: bytes) -> bytes | None:
        """First request header ``name`` (lower-case bytes), or ``None``."""
        for key, value in self.scope.get("headers", []):
            if key.lower() == name:
                return bytes(value)
        return None

    async def send_json(self, status: int, payload: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Send a complete JSON response."""
        await self._send_complete(status, json.dumps(payload, separators=(",", ":"), allow_nan=False).encode(),
                                  headers or [])

    async def _send_complete(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """Send a whole JSON ``body`` with its ``Content-Length`` (so HTTP/1.0 clients and proxies get a plain,
        not a chunked, body)."""
        await self.send_headers(status=status, headers=JSON_HEADERS + self.extra_headers + headers + [
            (b"content-length", str(len(body)).encode())])
        await self.send_body(body)

    async def send_json_fast(self, status: int, payload: Any,
                             headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """``send_json`` through orjson, which also writes numpy arrays (float32 ones as the shortest
        decimals that read back to the same float32): ~25x faster than ``json`` on a batch of embeddings.
        The payload must hold only finite floats (orjson would write NaN as ``null``)."""
        await self._send_complete(status, orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), headers or [])

    async def send_headers(self, *, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Start the response: ``headers`` as the route's dialect names them."""
        await super().send_headers(status=status, headers=self.dialect.headers(headers or []))

    async def send_error(self, err: ApiError) -> None:
        """Send ``err`` as the route's dialect writes it (OpenAI's: its envelope with its status and headers)."""
        reply = self.dialect.reply(err, self.request_id)
        await self._send_complete(reply.status, reply.body, reply.headers)

    async def start_sse(self, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        """Send 200 + SSE headers; after this, errors go in-band."""
        await self.send_headers(status=200, headers=SSE_HEADERS + self.extra_headers + (headers or []))
        self._started = True

    async def send_event(self, payload: Any) -> None:
        """Send one ``data: <json>`` SSE event."""
        await self.send_body(b"data: " + json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
                             + b"\n\n", more_body=True)

    async def end_sse(self) -> None:
        """Send ``data: [DONE]`` and close the response."""
        await self.send_body(b"data: [DONE]\n\n", more_body=False)

    async def send_sse_error(self, err: ApiError) -> None:
        """In-band error after the stream started (only failures after the first byte), then the end of the stream
        (OpenAI's: ``data: <envelope>``, then ``[DONE]``)."""
        try:
            await self.send_body(self.dialect.stream_error(err, self.request_id), more_body=True)
            await self.send_body(self.dialect.stream_end, more_body=False)
        except Exception:  # noqa: BLE001 - client may be gone
            pass


OFF_LOOP_PARSE_BYTES = 256 * 1024


async def json_body(body: bytes) -> dict[str, Any]:
    """``parse_json_body(body)``, in a worker thread when the body is over ``OFF_LOOP_PARSE_BYTES`` (a
    4 MB image ``data:`` URL takes 1.5-5 ms to parse and check: too long for the event loop). Raises as
    ``parse_json_body``."""
    if len(body) > OFF_LOOP_PARSE_BYTES:
        return await asyncio.to_thread(parse_json_body, body)
    return parse_json_body(body)

