"""What the ASGI router does to a gateway request before any of its body is read .

* ``early_authenticate``: a keyed route (``KEYED_PATHS``) whose ``Authorization`` header carries no valid key is
  answered 401 from its headers alone, with ``Connection: close``: no body byte is read (nor ``100 Continue``
  sent), so an unauthenticated client cannot make the api process buffer up to ``MAX_REQUEST_BODY_BYTES``.
  The consumer authenticates again (a per-process cache hit, gateway/auth.py) and checks scopes and models.
* ``BodyDeadline``: the body must arrive within ``REQUEST_BODY_TIMEOUT_S`` in all, and no gap between two
  chunks may exceed ``REQUEST_BODY_IDLE_TIMEOUT_S``; otherwise the client gets 408 in the OpenAI envelope with
  ``Connection: close`` and the application sees ``http.disconnect`` (as if the client had gone). Once the body
  is complete, ``receive()`` is passed through untouched (a streamed response waits on it for the disconnect).
* ``trusted_handoff_scope``: the hand-off header (gateway/handoff.py ``HANDED_OFF_HEADER``) is believed only on a
  unix-socket listener (the multimodal api's ``--uds``; uvicorn gives such a scope no client address and a server
  address without a port); anywhere else it is removed from the scope, so a client cannot claim it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from django.conf import settings

from gateway import auth
from gateway.errors import ApiError, ErrorCode, ErrorType

REQUEST_BODY_TIMEOUT_S = settings.REQUEST_BODY_TIMEOUT_S
REQUEST_BODY_IDLE_TIMEOUT_S = settings.REQUEST_BODY_IDLE_TIMEOUT_S

# Every gateway route that needs an API key (``/health`` and unknown routes do not).
KEYED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/chat/completions/render", "/v1/completions", "/v1/completions/render",
    "/v1/embeddings", "/tokenize", "/detokenize", "/inference/v1/generate", "/inference/v1/abort_requests",
    "/v1/models", "/metrics",
})

Scope = dict[str, Any]  # ASGI scope, receive and send callables
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def is_keyed(path: str) -> bool:
    """True when ``path`` is a gateway route that needs an API key."""
    return path in KEYED_PATHS or path.startswith("/v1/models/")


def declares_body(scope: Scope) -> bool:
    """True when the request announces a body (a non-zero ``Content-Length`` or any ``Transfer-Encoding``)."""
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"0", b"")):
            return True
    return False


async def send_envelope(send: Send, err: ApiError, *, close: bool) -> None:
    """Answer ``err`` as a complete JSON envelope; ``close`` adds ``Connection: close`` (uvicorn then closes the
    connection once it is sent, whatever of the body is still unread)."""
    body = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in err.headers]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def early_authenticate(scope: Scope, send: Send) -> bool:
    """Authenticate a keyed route's request from its headers. Returns True when it was answered here (401: no
    or unknown key), False when the application should serve it. Never reads the body."""
    if not is_keyed(scope["path"]):
        return False
    try:
        await auth.authenticate(scope.get("headers", []))
    except ApiError as err:
        await send_envelope(send, err, close=declares_body(scope))
        return True
    return False


def body_timeout_error() -> ApiError:
    """408 ``request_timeout`` in the OpenAI envelope."""
    return ApiError(408, f"The request body did not arrive in time (at most {REQUEST_BODY_IDLE_TIMEOUT_S:g} s "
                    f"without data, {REQUEST_BODY_TIMEOUT_S:g} s in all)", ErrorType.INVALID_REQUEST, None,
                    ErrorCode.REQUEST_TIMEOUT)


class BodyDeadline:
    """A ``receive`` that enforces the body deadlines over ``inner`` (the server's ``receive``) and answers 408
    through ``send`` when one passes (module docstring). ``total_s``/``idle_s`` default to the settings."""

    def __init__(self, inner: Receive, send: Send, total_s: float | None = None, idle_s: float | None = None):
        self.inner = inner
        self._send = send
        self._deadline = time.monotonic() + (REQUEST_BODY_TIMEOUT_S if total_s is None else total_s)
        self._idle_s = REQUEST_BODY_IDLE_TIMEOUT_S if idle_s is None else idle_s
        self._body_done = False
        self._timed_out = False

    async def __call__(self) -> dict[str, Any]:
        if self._body_done:
            return await self.inner()
        if self._timed_out:
            return {"type": "http.disconnect"}
        wait = min(self._idle_s, self._deadline - time.monotonic())
        try:
            if wait <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(self.inner(), wait)
        except TimeoutError:
            self._timed_out = True
            try:
                await send_envelope(self._send, body_timeout_error(), close=True)
            except Exception:  # noqa: BLE001 - the client may be gone already; nothing more to tell it
                pass
            return {"type": "http.disconnect"}
        if message["type"] != "http.request" or not message.get("more_body"):
            self._body_done = True
        return message


def via_unix_socket(scope: Scope) -> bool:
    """True when ``scope`` came in on a unix-socket listener: uvicorn (``--uds``) gives it no client address and
    a server address without a port (a TCP connection, adopted ones included, has both)."""
    server = scope.get("server")
    return scope.get("client") is None and (server is None or server[1] is None)


def trusted_handoff_scope(scope: Scope, header: bytes) -> Scope:
    """``scope`` unchanged on a unix-socket listener; elsewhere a copy without any ``header`` request header (a
    client over TCP may not claim to be a front api's relay)."""
    if via_unix_socket(scope):
        return scope
    headers = scope.get("headers", ())
    if not any(k.lower() == header for k, _v in headers):
        return scope
    return {**scope, "headers": [(k, v) for k, v in headers if k.lower() != header]}
