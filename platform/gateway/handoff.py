"""Hand image requests from the front api process to a multimodal api process over a unix socket.

Why: an image chat costs the api process that serves it 12-18 ms of CPU (body parsing and hashing, the feature
cache, the mm queue, the engine link), a text ``/tokenize`` 1.7 ms (measured). On one asyncio loop and
one GIL, text requests queue behind that work, so their p99 grows with the image load. ``manage.py serve``
therefore runs a second server ("api-mm", ``python -m ops.mm_api``, ``--mm-api-workers``) on a unix socket and
points the front api at it (``MULTIMODAL_API_SOCKET``); with ``--frontend-cores`` the two also run on different
cores. Why a relay and not a passed connection: docs/handoff.md.

The front api reads the request body of ``HANDOFF_PATHS`` (a chat body) until it names an ``"image_url"`` part,
then forwards the request unchanged (method, path, headers, the body read so far and the rest as it arrives) to
the multimodal api and relays its answer byte for byte (status, headers, streamed body). The multimodal api is
the same Django/Channels application: it authenticates the key, validates, admits, streams and records usage
itself, so a handed-off request behaves exactly as one served by the front (same errors, same envelope, same
stream). Other bodies are replayed to the local gateway.

Failure rules (nothing lost, nothing served twice):

* the socket is missing or refuses the connection (the multimodal api is down or restarting): the front serves
  the request itself (outcome ``fallback``);
* the connection fails after the request went out but before a response started: 503 in the OpenAI envelope
  with ``Retry-After: 1`` (the request may have been admitted there; serving it again here could run it twice);
* the connection fails mid-response: a streamed (SSE) response gets an in-band error event and ``[DONE]``, as
  the gateway does for failures after the first byte; any other response is cut short;
* the client disconnects: the upstream connection is closed, which the multimodal api sees as a disconnect and
  handles as its own (the engine request is aborted, the admission reservation and limits released).

Counts per outcome are kept in Redis (``<prefix>:handoff``) and exported by ``/metrics`` as
``gateway_handoffs_total{outcome}``: ``forwarded`` is counted by the multimodal api as a relayed request arrives
(so the front spends no Redis round trip on it), ``fallback`` and ``failed`` by the front.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
from django.conf import settings
from multidict import CIMultiDict

from gateway import ingress
from gateway.errors import ApiError, ErrorCode, unavailable
from gateway.clients import redis

log = logging.getLogger(__name__)

HANDOFF_PATHS = frozenset({"/v1/chat/completions", "/v1/chat/completions/render", "/tokenize"})
IMAGE_MARKER = b'"image_url"'
# Request headers not forwarded: per-connection (RFC 9110 §7.6.1) or recomputed by the client library.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                         b"upgrade", b"expect"})
_RESPONSE_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "date", "server"})
_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
OUTCOMES = ("forwarded", "fallback", "failed")
# Set on forwarded requests: a process that receives one never forwards it again (no loop when a multimodal api
# is itself, by mistake, given a MULTIMODAL_API_SOCKET). Believed only on a unix-socket listener: the router
# removes it from any other request (gateway/ingress.py), so a client sending it over TCP changes nothing.
HANDED_OFF_HEADER = b"x-llmp-handed-off"

Scope = dict[str, Any]  # ASGI scope, receive and send callables
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def handoff_key(prefix: str) -> str:
    """Redis hash of handoff counts per outcome."""
    return f"{prefix}:handoff"


def wants_handoff(scope: Scope) -> bool:
    """True when this process forwards image requests and ``scope`` is a request that may carry one."""
    if not settings.MULTIMODAL_API_SOCKET or scope.get("method") != "POST" or scope["path"] not in HANDOFF_PATHS:
        return False
    return not any(k == HANDED_OFF_HEADER for k, _v in scope.get("headers", ()))


class _Upstream:
    """One pooled aiohttp session per event loop, over the multimodal api's unix socket. aiohttp, not httpx: its C
    parser makes a relay of a 480 KB image chat cost the front 0.5 ms of CPU instead of 1.75 ms (measured)."""

    def __init__(self) -> None:
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def session(self) -> aiohttp.ClientSession:
        loop_id = id(asyncio.get_running_loop())
        s = self._sessions.get(loop_id)
        if s is None:
            # Idle connections are dropped after 2 s, well before uvicorn closes them (5 s by default), so a request
            # never goes out on a connection the server is closing at that moment (it would end as a 503).
            connector = aiohttp.UnixConnector(path=settings.MULTIMODAL_API_SOCKET, limit=0, keepalive_timeout=2.0)
            # no overall timeout: a generation may stream for minutes; the connect timeout bounds a hung socket.
            # Bodies are relayed as they are (no decompression), so Content-Length stays true.
            s = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                      timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0))
            self._sessions[loop_id] = s
        return s


_upstream = _Upstream()


async def count(outcome: str) -> None:
    """Add one to the handoff count of ``outcome`` (one of ``OUTCOMES``); never raises."""
    try:
        await redis().hincrby(handoff_key(settings.LINK_PREFIX), outcome, 1)
    except Exception:  # a metric must never fail a request
        log.warning("could not count a handoff outcome", exc_info=True)


def handed_off(scope: Scope) -> bool:
    """True when ``scope`` is a request a front api forwarded to this (multimodal api) process: it carries
    ``HANDED_OFF_HEADER`` and came in on a unix-socket listener (a client over TCP cannot claim it; the router
    also strips the header from such requests, gateway/ingress.py)."""
    return (not settings.MULTIMODAL_API_SOCKET and ingress.via_unix_socket(scope)
            and any(k == HANDED_OFF_HEADER for k, _v in scope.get("headers", ())))


async def route(scope: Scope, receive: Receive, send: Send, local_app: App, max_body_bytes: int) -> None:
    """Serve one ``HANDOFF_PATHS`` request. The body is read until ``IMAGE_MARKER`` shows up in it or it ends: with
    the marker, the request is forwarded to the multimodal api, the part read so far and then the rest streamed as
    it arrives (a 4 MB image body is never held whole here, and the two hops overlap); without it, or when that api
    is down, ``local_app`` runs with what was read replayed. A body over ``max_body_bytes`` goes to ``local_app``
    unread past the limit (it answers 413); a forwarded one is refused the same way by the multimodal api."""
    chunks: list[bytes] = []
    size = 0
    tail = b""  # the last len(IMAGE_MARKER) - 1 bytes read: a marker split across two chunks is still found
    more = True
    found = False
    while more and not found:
        message = await receive()
        if message["type"] != "http.request":  # disconnected before the body was complete
            return
        chunk = message.get("body", b"")
        more = bool(message.get("more_body"))
        size += len(chunk)
        chunks.append(chunk)
        keep = len(IMAGE_MARKER) - 1
        found = IMAGE_MARKER in chunk or IMAGE_MARKER in tail + chunk[:keep]
        tail = (tail + chunk[-keep:])[-keep:]
        if size > max_body_bytes:  # let the gateway refuse it with its own 413
            break
    if found and size <= max_body_bytes and await _forward(scope, chunks, more, receive, send):
        return
    replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": more}]
    await local_app(scope, _replay(replay, receive), send)


def _replay(messages: list[dict[str, Any]], receive: Receive) -> Receive:
    """A ``receive`` that yields ``messages`` first, then the connection's own."""
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


class _ClientGone(Exception):
    """The client disconnected while its body was being forwarded."""


async def _forward(scope: Scope, chunks: list[bytes], more: bool, receive: Receive, send: Send) -> bool:
    """Forward the request (its body: ``chunks`` read so far, then, when ``more``, the rest from ``receive``) and
    relay the answer. Returns False (nothing read past ``chunks``, nothing sent) when the multimodal api could not
    be reached, so the caller serves the request itself; True when this call answered the client (or it left)."""
    forwarding = _Forwarding(scope, chunks, more, receive, send)
    relay_task = asyncio.ensure_future(forwarding.relay())
    disconnect_task = asyncio.ensure_future(forwarding.watch_disconnect())
    try:
        await asyncio.wait({relay_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        relay_task.cancel()
        disconnect_task.cancel()
        raise
    if relay_task.done():
        disconnect_task.cancel()
        return relay_task.result()
    # the client went away first: closing the upstream connection makes the multimodal api abort the request
    relay_task.cancel()
    try:
        await relay_task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone; nothing to answer
        pass
    return True


class _Forwarding:
    """One request on its way to the multimodal api: its body streamed up (``body``), the answer relayed down
    (``relay``), and the client's disconnect watched once the body is through (``watch_disconnect``)."""

    def __init__(self, scope: Scope, chunks: list[bytes], more: bool, receive: Receive, send: Send) -> None:
        self.scope, self.chunks, self.more, self.receive, self.send = scope, chunks, more, receive, send
        self.gone = False  # the client disconnected while its body was being forwarded
        self.body_done = asyncio.Event()
        if not more:
            self.body_done.set()

    def upstream_headers(self) -> CIMultiDict[str]:
        """The client's own headers less the hop-by-hop ones, plus ``HANDED_OFF_HEADER``."""
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.scope.get("headers", [])
                   if k.lower() not in _HOP_BY_HOP]
        headers.append((HANDED_OFF_HEADER.decode(), "1"))
        return CIMultiDict(headers)

    async def body(self) -> AsyncIterator[bytes]:
        """The body: ``chunks``, then the rest from ``receive``; raises ``_ClientGone`` if the client leaves."""
        for chunk in self.chunks:
            yield chunk
        remaining = self.more
        while remaining:
            message = await self.receive()
            if message["type"] != "http.request":
                self.gone = True
                raise _ClientGone()  # aiohttp drops the connection: the multimodal api sees the client leave
            remaining = bool(message.get("more_body"))
            yield message.get("body", b"")
        self.body_done.set()

    async def relay(self) -> bool:
        """Send the request up and relay the answer down; ``_forward``'s return value."""
        scope = self.scope
        path = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
        try:
            # the client's own headers only: nothing added (no User-Agent, Accept or Content-Type of aiohttp's);
            # its Content-Length is kept, so the body goes on unchanged, not re-chunked
            response = await _upstream.session().post("http://mm-api" + path, data=self.body(),
                                                      headers=self.upstream_headers(),
                                                      skip_auto_headers=_AUTO_HEADERS)
        except aiohttp.ClientConnectorError:
            await count("fallback")
            return False
        except (aiohttp.ClientError, _ClientGone):
            if self.gone:
                return True
            log.warning("the multimodal api failed before answering on %s", scope["path"], exc_info=True)
            await count("failed")
            await _send_unavailable(self.send)
            return True
        try:
            await self.relay_response(response)
        finally:
            response.close()  # no-op after release(); else the connection is dropped (the multimodal api aborts)
        return True

    async def relay_response(self, response: aiohttp.ClientResponse) -> None:
        """Relay ``response`` (status, headers, body as it streams); a failure mid-response ends a streamed (SSE)
        answer with an in-band error event and ``[DONE]``, any other answer is cut short."""
        send = self.send
        sse = response.headers.get("content-type", "").startswith("text/event-stream")
        try:
            out_headers = [(k, v) for k, v in response.raw_headers if k.decode("latin-1").lower() not in _RESPONSE_DROP]
            await send({"type": "http.response.start", "status": response.status, "headers": out_headers})
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            response.release()
        except aiohttp.ClientError:
            if self.gone:
                return
            log.warning("the multimodal api failed mid-response on %s", self.scope["path"], exc_info=True)
            await count("failed")
            if sse:
                err = ApiError(503, "The multimodal frontend failed while streaming this response; retry the "
                               "request.", "server_error", None, ErrorCode.UPSTREAM_FAILED)
                await send({"type": "http.response.body", "body": b"data: " + err.body() + b"\n\ndata: [DONE]\n\n",
                            "more_body": False})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def watch_disconnect(self) -> None:
        """Return once the client disconnects (after the body: until then ``body`` owns ``receive``)."""
        await self.body_done.wait()
        await _wait_disconnect(self.receive)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_unavailable(send: Send) -> None:
    err = unavailable("The multimodal frontend failed while handling this request; retry the request.", 1,
                      ErrorCode.UPSTREAM_FAILED)
    body = err.body()
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        + [(k.encode(), v.encode()) for k, v in err.headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
