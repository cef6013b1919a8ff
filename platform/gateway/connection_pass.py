"""Pass a client's TCP connection itself from the front api to the multimodal api (``SCM_RIGHTS``), instead of
relaying the request through the front.

Why: relaying an image chat (gateway/handoff.py) still costs the front api, on its own core, a copy of every body
byte in and every response byte out: 1.2 ms of CPU per 480 KB image chat, 7 ms per 4.3 MB one (measured),
and the text requests on that core queue behind it. Once the connection itself belongs to the multimodal api, the
front does no work at all for it: not for the rest of this body, not for the response, and not for later requests
on the same keep-alive connection (an image client's text requests are then served by the multimodal api too,
which runs the same application).

The protocol, on a unix socket only this user can reach (``MULTIMODAL_PASS_SOCKET``, a 0700 directory), one
connection per passed client connection:

1. front -> multimodal api: a header (the length ``n`` of what follows, a deadline on the host's monotonic clock,
   ``PASS_DEADLINE_S`` from now) with the client socket attached (``SCM_RIGHTS``), then ``n`` bytes: the request
   as the client sent it so far (request line, headers, the body read so far);
2. the multimodal api, once it has all ``n`` bytes and if the deadline has not passed, adopts the socket into its
   uvicorn server (a protocol of the server's own class, fed those bytes first, then reading the socket itself)
   and answers one byte, ``1``; past the deadline, or unable to adopt, it drops its copy unread and answers ``0``;
3. on ``1`` the front drops its copy of the socket without writing to it (closing one of two descriptors of a
   socket neither sends a FIN nor resets it). Otherwise it resumes reading the socket, which it paused before
   step 1 (exactly one process reads it at any time), and serves the request: relayed on ``0``, itself when the
   multimodal api cannot be reached, closed the link unanswered (died), or has not answered by the deadline plus
   ``ADOPT_GRACE_S`` (stopped, hung, overloaded: it will refuse when it gets to the pass). So a client never
   waits on a multimodal api that does not run for more than those two bounds.

The one case left open: a multimodal api whose loop stalls for longer than ``ADOPT_GRACE_S`` in the single loop
iteration between its deadline check and its answer; both processes would then answer the same request.

A connection can be passed only while its byte stream is still exact at the front: uvicorn's httptools protocol
(the front's cycle is read directly: its pending body bytes go along), plain HTTP (a TLS session cannot move),
a ``Content-Length`` body (a chunked one is mid-chunk), no byte of a next (pipelined) request parsed yet, and
no byte of an earlier response still waiting in the front's write buffer.
Other requests are relayed (gateway/handoff.py). These are uvicorn internals (pinned by
``tests/multimodal/test_connection_pass_live.py``); no server library exposes a way to pass a connection on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, cast

from django.conf import settings

log = logging.getLogger(__name__)

PASS_DEADLINE_S = 3.0  # the multimodal api adopts a connection only within this (a healthy one takes < 1 ms)
ADOPT_GRACE_S = 3.0  # how long past the deadline the front still waits for its answer
ADOPTED, REFUSED = b"1", b"0"
_HEAD = struct.Struct("!Id")  # prefix length, deadline (time.monotonic(): CLOCK_MONOTONIC, one per host)
MAX_PREFIX_BYTES = 64 * 1024 * 1024  # a prefix is at most the front's body limit plus the headers

Scope = dict[str, Any]  # ASGI scope and receive callable
Receive = Callable[[], Awaitable[dict[str, Any]]]
ASGIApp = Callable[..., Awaitable[None]]

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


def passable_cycle(scope: Scope, receive: Receive) -> RequestResponseCycle | None:
    """``_passable_cycle``, or None should uvicorn's internals differ from those read here (then the request is
    relayed, never failed)."""
    try:
        return _passable_cycle(scope, receive)
    except AttributeError:
        log.warning("uvicorn's request cycle is not as expected; relaying instead of passing", exc_info=True)
        return None


def _passable_cycle(scope: Scope, receive: Receive) -> RequestResponseCycle | None:
    """The front's uvicorn httptools request cycle behind ``receive`` when this request's connection can be passed
    (plain HTTP/1.x, a ``Content-Length`` body, nothing of a next request read yet, a pass socket configured),
    else None. Call it and ``pass_connection`` with no ``await`` between them."""
    if not settings.MULTIMODAL_PASS_SOCKET:
        return None
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
    except ImportError:  # httptools not installed: uvicorn runs h11, whose cycle is not read here
        return None
    cycle = getattr(receive, "__self__", None)
    if not isinstance(cycle, RequestResponseCycle) or cycle.disconnected or cycle.response_started:
        return None
    if cycle.transport.get_extra_info("sslcontext") is not None:  # the scope's scheme may come from a proxy
        return None
    if cycle.transport.get_extra_info("socket") is None:  # nothing to pass (not a socket transport)
        return None
    if cycle.transport.get_write_buffer_size():
        # an earlier response on this connection is not all out yet (a pipelining client reading slowly): the
        # multimodal api's answer would overtake it
        return None
    names = {k.lower() for k, _v in scope.get("headers", ())}
    if b"content-length" not in names or b"transfer-encoding" in names:
        return None
    if not cycle.more_body:
        # the whole body is in: the connection may already hold (part of) a pipelined request, parsed here and
        # lost to the multimodal api; uvicorn starts a new scope for each request it begins to parse
        protocol = getattr(cycle.on_response, "__self__", None)
        if not isinstance(protocol, HttpToolsProtocol) or protocol.pipeline or protocol.scope is not cycle.scope:
            return None
    return cycle


def request_head(scope: Scope) -> bytes:
    """The request line and headers of ``scope`` as HTTP/1.1 bytes, ``Expect`` left out (the front already
    answered ``100 Continue`` when it first read the body)."""
    target = scope.get("raw_path") or scope["path"].encode("latin-1")
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    lines = [scope["method"].encode() + b" " + target + b" HTTP/" + scope.get("http_version", "1.1").encode()]
    lines += [k + b": " + v for k, v in scope.get("headers", ()) if k.lower() != b"expect"]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def pass_connection(scope: Scope, cycle: RequestResponseCycle, body_read: list[bytes]) -> str:
    """Pass the client connection of ``cycle`` (from ``passable_cycle``) to the multimodal api, ``body_read`` being
    the body bytes this process has already taken from it. Returns ``"passed"`` (the multimodal api owns the
    connection; the caller returns without sending anything), ``"kept"`` (refused; nothing changed: relay or
    serve the request here) or ``"unreachable"`` (the multimodal api is down, dead, or did not answer in time;
    nothing changed: serve the request here). Takes at most ``PASS_DEADLINE_S + ADOPT_GRACE_S``."""
    loop = asyncio.get_running_loop()
    cycle.flow.pause_reading()
    prefix = request_head(scope) + b"".join(body_read) + bytes(cycle.body)
    client = cycle.transport.get_extra_info("socket")
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    link.setblocking(False)
    deadline = time.monotonic() + PASS_DEADLINE_S

    async def send() -> None:
        await loop.sock_connect(link, settings.MULTIMODAL_PASS_SOCKET)
        # a few bytes on a fresh connection never block; the descriptor travels with them
        socket.send_fds(link, [_HEAD.pack(len(prefix), deadline)], [client.fileno()])
        await loop.sock_sendall(link, prefix)

    try:
        answer = None
        try:
            await asyncio.wait_for(send(), PASS_DEADLINE_S)
            answer = await asyncio.wait_for(loop.sock_recv(link, 1),
                                            max(0.0, deadline + ADOPT_GRACE_S - time.monotonic()))
        except TimeoutError:
            # not all bytes taken by the deadline: it can never adopt; taken, but unanswered past the grace: it
            # is stalled, and refuses when it gets to the pass (deadline passed)
            log.warning("the multimodal api did not take a passed connection in time; serving it here")
        except OSError:  # not reachable, or died before answering (a reset: our bytes unread)
            pass
        if answer == ADOPTED:
            # this process never touches the connection again
            cycle.body = bytearray()
            cycle.disconnected = True  # uvicorn sends nothing more on it (no 500 for a response never started)
            cycle.transport.close()
            return "passed"
        cycle.flow.resume_reading()
        return "kept" if answer == REFUSED else "unreachable"
    finally:
        link.close()


async def serve_passed_connections(listener: socket.socket, protocol_factory: Callable[[], asyncio.Protocol],
                                   on_adopted: Callable[[], Awaitable[None]] | None = None) -> None:
    """Accept passed connections on ``listener`` (a bound, listening unix socket) forever and adopt each into this
    process's server: ``protocol_factory()`` builds a protocol of the server's own class, which is fed the
    passed bytes before it reads the socket. ``on_adopted`` is awaited once per adopted connection, before its
    first request is served (a metric)."""
    loop = asyncio.get_running_loop()
    listener.setblocking(False)
    tasks: set[asyncio.Task[None]] = set()
    while True:
        link, _addr = await loop.sock_accept(listener)
        task = asyncio.ensure_future(_adopt(link, protocol_factory, on_adopted))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def _adopt(link: socket.socket, protocol_factory: Callable[[], Any],
                 on_adopted: Callable[[], Awaitable[None]] | None) -> None:
    loop = asyncio.get_running_loop()
    client = None
    try:
        link.setblocking(False)
        await _readable(link)
        head, fds, _flags, _addr = socket.recv_fds(link, _HEAD.size, 1, socket.MSG_CMSG_CLOEXEC)
        if not fds:
            return
        client = socket.socket(fileno=fds[0])
        for extra in fds[1:]:
            socket.close(extra)
        client.set_inheritable(False)  # a process this one starts must never hold a client's connection
        while len(head) < _HEAD.size:
            more = await loop.sock_recv(link, _HEAD.size - len(head))
            if not more:
                return
            head += more
        n, deadline = _HEAD.unpack(head)
        if n > MAX_PREFIX_BYTES:
            await loop.sock_sendall(link, REFUSED)
            return
        prefix = bytearray()
        while len(prefix) < n:
            more = await loop.sock_recv(link, min(n - len(prefix), 1 << 20))
            if not more:
                return  # the front went away: it kept the connection
            prefix += more
        if client.type != socket.SOCK_STREAM or client.family not in (socket.AF_INET, socket.AF_INET6):
            await loop.sock_sendall(link, REFUSED)
            return
        if time.monotonic() > deadline:  # the front has given up, or will before this answer reaches it
            log.warning("a passed connection arrived after its deadline; left to the front")
            await loop.sock_sendall(link, REFUSED)
            return
        client.setblocking(False)

        def factory() -> asyncio.Protocol:
            protocol: Any = protocol_factory()  # the server's own protocol class (uvicorn's), patched below
            if on_adopted is not None:  # awaited before the first request on the connection is served
                protocol.app = _first_call_preceded_by(protocol.app, on_adopted)
            made = protocol.connection_made

            def connection_made(transport: asyncio.BaseTransport) -> None:
                made(transport)
                # before the transport's reader is registered (both are call_soon'd, in this order), so the
                # passed bytes are parsed before anything read from the socket
                protocol.data_received(bytes(prefix))

            protocol.connection_made = connection_made
            return cast(asyncio.Protocol, protocol)

        try:
            await loop.connect_accepted_socket(factory, client)
        except OSError:
            log.warning("could not adopt a passed connection", exc_info=True)
            await loop.sock_sendall(link, REFUSED)
            return
        client = None  # the transport owns it now
        try:
            await loop.sock_sendall(link, ADOPTED)
        except OSError:
            pass  # the front is gone; the connection is served here all the same
    except OSError:
        log.warning("a connection pass failed", exc_info=True)
    finally:
        if client is not None:
            client.close()
        link.close()


def _first_call_preceded_by(app: ASGIApp, hook: Callable[[], Awaitable[None]]) -> ASGIApp:
    """``app`` (an ASGI application) with ``hook`` awaited before its first call."""
    pending = [hook]

    async def wrapped(scope: Scope, receive: Receive, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if pending:
            await pending.pop()()
        return await app(scope, receive, send)

    return wrapped


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: None if ready.done() else ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())
