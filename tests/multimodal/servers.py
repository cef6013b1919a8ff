"""Local HTTP servers on loopback only (127.0.0.x / ::1) for the fetch tests: image, redirect, huge, stall."""

from __future__ import annotations

import http.server
import socket
import threading
import time


class _V6Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


def serve(host: str, routes: dict):
    """Start a threaded server on ``host`` (loopback) with ``routes`` path → callable(handler); returns
    (server, port). Callables write the whole response."""

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            fn = routes.get(self.path.split("?")[0])
            if fn is None:
                self.send_response(404)
                self.end_headers()
                return
            try:
                fn(self)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *a):
            pass

    assert host in ("127.0.0.1", "127.0.0.2", "::1"), "tests only ever listen on loopback"
    cls = _V6Server if ":" in host else http.server.ThreadingHTTPServer
    srv = cls((host, 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


def send_bytes(data: bytes, ctype: str = "image/png"):
    def fn(h):
        h.send_response(200)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    return fn


def redirect_to(url: str):
    def fn(h):
        h.send_response(302)
        h.send_header("Location", url)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return fn


def huge(n: int, with_length: bool, progress: dict | None = None):
    """Send ``n`` zero bytes; ``progress["sent"]`` counts what was written so far, ``progress["done"]`` is set
    once all of it was."""
    progress = {} if progress is None else progress
    progress.update(sent=0, done=False)

    def fn(h):
        h.send_response(200)
        if with_length:
            h.send_header("Content-Length", str(n))
        h.end_headers()
        chunk = b"\0" * 65536
        sent = 0
        while sent < n:
            h.wfile.write(chunk)
            sent += len(chunk)
            progress["sent"] = sent
        progress["done"] = True
    return fn


def stall(seconds: float, over: threading.Event | None = None, hits: list | None = None):
    """Send a PNG start, then nothing for ``seconds``; ``over`` is set when the stall ends; each request's path
    is appended to ``hits`` as it arrives."""
    def fn(h):
        if hits is not None:
            hits.append(h.path)
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        h.wfile.write(b"\x89PNG")
        h.wfile.flush()
        time.sleep(seconds)
        if over is not None:
            over.set()
    return fn


def _server_side_queues(conn) -> tuple[int, int] | None:
    """``(tx_queue, rx_queue)`` bytes of the server's end of the loopback TCP connection ``conn`` (our client
    socket), from /proc/net/tcp{,6}; ``None`` when the kernel lists no such socket."""
    server_port, client_port = conn.getpeername()[1], conn.getsockname()[1]
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == server_port and int(f[2].rsplit(":", 1)[1], 16) == client_port:
                tx, rx = f[4].split(":")
                return int(tx, 16), int(rx, 16)
    return None


def wait_server_read(conn, timeout: float = 60.0, backlog: bool = False) -> None:
    """Wait until the server has read everything sent on ``conn`` so far (its receive queue is empty) and, with
    ``backlog``, also has bytes it could not send yet (its send queue is not empty). Raises ``AssertionError``
    after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    q = None
    while time.monotonic() < deadline:
        q = _server_side_queues(conn)
        if q is not None and q[1] == 0 and (not backlog or q[0] > 0):
            return
        time.sleep(0.01)
    raise AssertionError(f"the server did not read what was sent (queues {q})")
