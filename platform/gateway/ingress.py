"""What the ASGI router does to a gateway request before any of its body is read .

* ``early_authenticate``: a keyed route (``KEYED_PATHS``) whose ``Authorization`` header carries no valid key is
  answered 401 from its headers alone, with ``Connection: close``: no body byte is read (nor ``100 Continue``
  sent), so an unauthenticated client cannot make the api process buffer up to ``MAX_REQUEST_BODY_BYTES``.
  The consumer authenticates again (a per-process cache hit, gateway/auth.py) and checks scopes and models.
* ``early_refuse``: before that, a request whose ``Content-Length`` is over ``MAX_REQUEST_BODY_BYTES`` is
  answered 413, one to a path that is no gateway route 404, and ``/health`` with a body 413 (it takes none), all
  from the headers, with ``Connection: close`` when a body is announced: no body byte is read.
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
import re
import time
from typing import Any, Awaitable, Callable

from django.conf import settings

from gateway import auth
from gateway.dialects import ANTHROPIC, OPENAI, Dialect
from gateway.errors import ApiError, ErrorCode, ErrorType

REQUEST_BODY_TIMEOUT_S = settings.REQUEST_BODY_TIMEOUT_S
REQUEST_BODY_IDLE_TIMEOUT_S = settings.REQUEST_BODY_IDLE_TIMEOUT_S

# Every gateway route that needs an API key (``/health`` and unknown routes do not).
KEYED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/chat/completions/render", "/v1/completions", "/v1/completions/render",
    "/v1/embeddings", "/tokenize", "/detokenize", "/inference/v1/generate", "/inference/v1/abort_requests",
    "/v1/models", "/metrics", "/v1/messages", "/v1/messages/count_tokens",
})

# Every gateway route (gateway/routing.py): the keyed ones, the public ``/health`` and ``/v1/openapi.json``
# (gateway/endpoints/openapi.py), and ``/v1/models/{model}``.
ROUTE_PATHS = KEYED_PATHS | {"/health", "/v1/openapi.json"}
_MODEL_PATH = re.compile(r"/v1/models/[^/]+")
# The Responses API's routes (gateway/endpoints/responses.py): create and count, and one stored response's routes
_RESPONSES_PATH = re.compile(r"/v1/responses(/input_tokens|/[^/]+(/cancel|/input_items)?)?")
MAX_REQUEST_BODY_BYTES = settings.MAX_REQUEST_BODY_BYTES
# Routes whose errors are written in another protocol's dialect, or whose key is read from other headers than
# ``Authorization: Bearer`` (gateway/dialects.py, gateway/auth.py); every other route is OpenAI's, with a bearer key.
ROUTE_DIALECTS: dict[str, Dialect] = {"/v1/messages": ANTHROPIC, "/v1/messages/count_tokens": ANTHROPIC}
ROUTE_CREDENTIALS: dict[str, auth.Credentials] = {"/v1/messages": auth.API_KEY_OR_BEARER,
                                                  "/v1/messages/count_tokens": auth.API_KEY_OR_BEARER}

Scope = dict[str, Any]  # ASGI scope, receive and send callables
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def dialect_for(path: str) -> Dialect:
    """The error dialect of the route at ``path`` (``OPENAI`` unless ``ROUTE_DIALECTS`` names another)."""
    return ROUTE_DIALECTS.get(path, OPENAI)


def is_keyed(path: str) -> bool:
    """True when ``path`` is a gateway route that needs an API key."""
    return path in KEYED_PATHS or path.startswith("/v1/models/") or _RESPONSES_PATH.fullmatch(path) is not None


def declares_body(scope: Scope) -> bool:
    """True when the request announces a body (a non-zero ``Content-Length`` or any ``Transfer-Encoding``)."""
    for name, value in scope.get("headers", ()):
        name = name.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"0", b"")):
            return True
    return False


def is_route(path: str) -> bool:
    """True when ``path`` is one of the gateway's routes (anything else under its prefixes is answered 404)."""
    return path in ROUTE_PATHS or _MODEL_PATH.fullmatch(path) is not None or \
        _RESPONSES_PATH.fullmatch(path) is not None


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` in bytes; ``None`` when it has none. One that is not a non-negative
    integer counts as larger than any cap (uvicorn refuses most such requests before the application)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            text = value.strip()
            return int(text) if text.isdigit() else MAX_REQUEST_BODY_BYTES + 1
    return None


async def early_refuse(scope: Scope, send: Send) -> bool:
    """Answer from the headers alone, reading no body byte: 413 when the declared ``Content-Length`` is over
    ``MAX_REQUEST_BODY_BYTES``; 404 (``unknown_route``) for a path that is no gateway route; 413 for a body sent
    to ``/health``, which takes none. ``Connection: close`` whenever a body is announced. Returns True when it
    answered, False when the request goes on."""
    path = scope["path"]
    length = declared_length(scope)
    err: ApiError | None = None
    if length is not None and length > MAX_REQUEST_BODY_BYTES:
        err = ApiError(413, f"Request body too large: the limit is {MAX_REQUEST_BODY_BYTES} bytes",
                       ErrorType.INVALID_REQUEST, None, ErrorCode.REQUEST_TOO_LARGE)
    elif not is_route(path):
        err = ApiError(404, f"Unknown route: {scope.get('method')} {path}", ErrorType.NOT_FOUND, None,
                       ErrorCode.UNKNOWN_ROUTE)
    elif path == "/health" and declares_body(scope):
        err = ApiError(413, "/health takes no request body", ErrorType.INVALID_REQUEST, None,
                       ErrorCode.REQUEST_TOO_LARGE)
    if err is None:
        return False
    await send_envelope(send, err, close=declares_body(scope), dialect=dialect_for(path))
    return True


async def send_envelope(send: Send, err: ApiError, *, close: bool, dialect: Dialect = OPENAI) -> None:
    """Answer ``err`` as a complete JSON envelope in the route's ``dialect``; ``close`` adds ``Connection: close``
    (uvicorn then closes the connection once it is sent, whatever of the body is still unread)."""
    request_id = dialect.new_request_id()
    reply = dialect.reply(err, request_id)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(reply.body)).encode())]
    headers += dialect.request_headers(request_id) + reply.headers
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": reply.status, "headers": dialect.headers(headers)})
    await send({"type": "http.response.body", "body": reply.body, "more_body": False})


async def early_authenticate(scope: Scope, send: Send) -> bool:
    """Authenticate a keyed route's request from its headers. Returns True when it was answered here (401: no
    or unknown key), False when the application should serve it. Never reads the body."""
    path = scope["path"]
    if not is_keyed(path):
        return False
    try:
        await auth.authenticate(scope.get("headers", []), ROUTE_CREDENTIALS.get(path, auth.BEARER))
    except ApiError as err:
        await send_envelope(send, err, close=declares_body(scope), dialect=dialect_for(path))
        return True
    return False


def body_timeout_error() -> ApiError:
    """408 ``request_timeout`` in the OpenAI envelope."""
    return ApiError(408, f"The request body did not arrive in time (at most {REQUEST_BODY_IDLE_TIMEOUT_S:g} s "
                    f"without data, {REQUEST_BODY_TIMEOUT_S:g} s in all)", ErrorType.INVALID_REQUEST, None,
                    ErrorCode.REQUEST_TIMEOUT)


class BodyDeadline:
    """A ``receive`` that enforces the body deadlines over ``inner`` (the server's ``receive``) and answers 408
    through ``send`` when one passes (module docstring), in the route's ``dialect``. ``total_s``/``idle_s`` default to
    the settings."""

    def __init__(self, inner: Receive, send: Send, total_s: float | None = None, idle_s: float | None = None,
                 dialect: Dialect = OPENAI):
        self.inner = inner
        self._send = send
        self._dialect = dialect
        self._deadline = time.monotonic() + (REQUEST_BODY_TIMEOUT_S if total_s is None else total_s)
        self._idle_s = REQUEST_BODY_IDLE_TIMEOUT_S if idle_s is None else idle_s
        self._body_done = False
        self._timed_out = False

    @property
    def timed_out(self) -> bool:
        """True once a deadline passed (408 sent; the caller should answer nothing more)."""
        return self._timed_out

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
                await send_envelope(self._send, body_timeout_error(), close=True, dialect=self._dialect)
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
