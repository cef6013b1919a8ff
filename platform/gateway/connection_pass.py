"""Pass a client's TCP connection itself from the front api to the multimodal api (``SCM_RIGHTS``), instead of
relaying the request through the front.

Why: relaying an image chat (gateway/handoff.py) still costs the front api, on its own core, a copy of every body
byte in and every response byte out: 1.2 ms of CPU per 480 KB image chat, 7 ms per 4.3 MB one (measured, issue 6),
and the text requests on that core queue behind it. Once the connection itself belongs to the multimodal api, the
front does no work at all for it: not for the rest of this body, not for the response, and not for later requests
on the same keep-alive connection (an image client's text requests are then served by the multimodal api too,
which runs the same application).

The protocol, on a unix socket only this user can reach (``MULTIMODAL_PASS_SOCKET``, a 0700 directory), one
connection per passed client connection:

1. front -> multimodal api: a 4-byte big-endian length ``n`` with the client socket attached (``SCM_RIGHTS``),
   then ``n`` bytes: the request as the client sent it so far (request line, headers, the body read so far);
2. the multimodal api adopts the socket into its uvicorn server (a protocol of the server's own class, fed those
   bytes first, then reading the socket itself) and answers one byte, ``1`` (adopted) or ``0`` (refused);
3. on ``1`` the front drops its copy of the socket without writing to it (closing one of two descriptors of a
   socket neither sends a FIN nor resets it); on ``0`` the front resumes reading and relays the request; when
   the multimodal api cannot be reached or takes longer than ``ACK_TIMEOUT_S`` to read the bytes, the front
   resumes reading and serves the request itself. Before step 3 the front has paused reading the
   socket, so exactly one process reads it at any time.

If the answer has not come after ``ACK_TIMEOUT_S`` (the multimodal api is stopped or overloaded), the front
cannot know who owns the connection; it closes its copy without writing (counted ``failed``), the one choice that
can never put two answers on one connection. A multimodal api that comes back later still adopts the connection
and serves the waiting client (then also counted ``passed``).

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
from typing import Awaitable, Callable

from django.conf import settings

log = logging.getLogger(__name__)

ACK_TIMEOUT_S = 10.0
ADOPTED, REFUSED = b"1", b"0"
_LENGTH = struct.Struct("!I")
MAX_PREFIX_BYTES = 64 * 1024 * 1024  # a prefix is at most the front's body limit plus the headers

Scope = dict
Receive = Callable[[], Awaitable[dict]]


def passable_cycle(scope: Scope, receive: Receive):
    """``_passable_cycle``, or None should uvicorn's internals differ from those read here (then the request is
    relayed, never failed)."""
    try:
        return _passable_cycle(scope, receive)
    except AttributeError:
        log.warning("uvicorn's request cycle is not as expected; relaying instead of passing", exc_info=True)
        return None


def _passable_cycle(scope: Scope, receive: Receive):
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


async def pass_connection(scope: Scope, cycle, body_read: list[bytes]) -> str:
    """Pass the client connection of ``cycle`` (from ``passable_cycle``) to the multimodal api, ``body_read`` being
    the body bytes this process has already taken from it. Returns ``"passed"`` (the multimodal api owns the
    connection; the caller returns without sending anything), ``"kept"`` (refused; nothing changed: relay or
    serve the request here), ``"unreachable"`` (the multimodal api is down, hung or died mid-pass; nothing
    changed: serve the request here) or ``"lost"`` (the outcome is unknown after ``ACK_TIMEOUT_S``; the front's
    copy was closed without a word)."""
    loop = asyncio.get_running_loop()
    cycle.flow.pause_reading()
    prefix = request_head(scope) + b"".join(body_read) + bytes(cycle.body)
    client = cycle.transport.get_extra_info("socket")
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    link.setblocking(False)
    deadline = loop.time() + ACK_TIMEOUT_S

    async def send() -> None:
        await loop.sock_connect(link, settings.MULTIMODAL_PASS_SOCKET)
        # four bytes on a fresh connection never block; the descriptor travels with them
        socket.send_fds(link, [_LENGTH.pack(len(prefix))], [client.fileno()])
        await loop.sock_sendall(link, prefix)

    try:
        try:
            await asyncio.wait_for(send(), ACK_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            # not reachable, or too slow to take the bytes (stopped, overloaded): it adopts only after reading
            # all of them, and on losing this link it drops its copy unread, so the connection is still ours
            cycle.flow.resume_reading()
            return "unreachable"
        try:
            answer = await asyncio.wait_for(loop.sock_recv(link, 1), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            answer = None
        except OSError:  # reset: it died with our bytes unread, so before adopting
            answer = b""
        if answer == REFUSED:
            cycle.flow.resume_reading()
            return "kept"
        if answer == b"":  # gone before adopting (an adoption is answered before anything is read from it)
            cycle.flow.resume_reading()
            return "unreachable"
        # adopted, or unknown: this process never touches the connection again
        cycle.body = bytearray()
        cycle.disconnected = True  # uvicorn sends nothing more on it (no 500 for a response never started)
        cycle.transport.close()
        if answer != ADOPTED:
            log.warning("the multimodal api took a passed connection without answering; dropped it here")
            return "lost"
        return "passed"
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
    tasks: set[asyncio.Task] = set()
    while True:
        link, _addr = await loop.sock_accept(listener)
        task = asyncio.ensure_future(_adopt(link, protocol_factory, on_adopted))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def _adopt(link: socket.socket, protocol_factory, on_adopted) -> None:
    loop = asyncio.get_running_loop()
    client = None
    try:
        link.setblocking(False)
        await _readable(link)
        head, fds, _flags, _addr = socket.recv_fds(link, _LENGTH.size, 1, socket.MSG_CMSG_CLOEXEC)
        if not fds:
            return
        client = socket.socket(fileno=fds[0])
        for extra in fds[1:]:
            socket.close(extra)
        client.set_inheritable(False)  # a process this one starts must never hold a client's connection
        while len(head) < _LENGTH.size:
            more = await loop.sock_recv(link, _LENGTH.size - len(head))
            if not more:
                return
            head += more
        (n,) = _LENGTH.unpack(head)
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
        client.setblocking(False)

        def factory() -> asyncio.Protocol:
            protocol = protocol_factory()
            if on_adopted is not None:  # awaited before the first request on the connection is served
                protocol.app = _first_call_preceded_by(protocol.app, on_adopted)
            made = protocol.connection_made

            def connection_made(transport) -> None:
                made(transport)
                # before the transport's reader is registered (both are call_soon'd, in this order), so the
                # passed bytes are parsed before anything read from the socket
                protocol.data_received(bytes(prefix))

            protocol.connection_made = connection_made
            return protocol

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


def _first_call_preceded_by(app, hook: Callable[[], Awaitable[None]]):
    """``app`` (an ASGI application) with ``hook`` awaited before its first call."""
    pending = [hook]

    async def wrapped(scope, receive, send):
        if pending:
            await pending.pop()()
        return await app(scope, receive, send)

    return wrapped


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())
