"""What the engine itself said about a request, read off the wire: a Redis ``MONITOR`` connection that decodes
every ``XADD`` to an api process's output stream (``{prefix}:api:*:outputs``) under one link prefix.

The api process deletes output entries once read (XDEL), so the streams keep no history; MONITOR sees each
command as Redis executes it, so nothing is missed. Tests use it to check an abort from the engine's side:
the engine's last output for the request says ``finish_reason="abort"`` and it produced far fewer tokens than
``max_tokens`` (a broken abort ends with ``length`` after all of them), whatever the machine's speed.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from urllib.parse import urlparse

from inference.protocol.engine import EngineCoreOutput, EngineCoreOutputs

_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_ESC = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)", re.S)
_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b", b'"': b'"', b"\\": b"\\"}


def _unescape(raw: bytes) -> bytes:
    """Inverse of Redis's ``sdscatrepr`` (how MONITOR quotes arguments)."""
    def sub(m: re.Match) -> bytes:
        s = m.group(1)
        return bytes([int(s[1:], 16)]) if s[:1] == b"x" and len(s) == 3 else _SIMPLE.get(s, s)
    return _ESC.sub(sub, raw)


class EngineTap:
    """Record engine outputs under ``prefix`` from Redis at ``redis_url`` (a context manager; a thread reads).

    ``outputs(request_id)``: the ``EngineCoreOutput`` list the engine published for that id, in order.
    """

    def __init__(self, redis_url: str, prefix: str):
        u = urlparse(redis_url)
        self._sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout=10)
        if u.password:
            self._cmd(b"AUTH", *([u.username.encode()] if u.username else []), u.password.encode())
        self._cmd(b"MONITOR")
        self._key = re.compile(rb"^" + re.escape(prefix.encode()) + rb":api:[^:]+:outputs$")
        self._out: dict[str, list[EngineCoreOutput]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _cmd(self, *args: bytes) -> None:
        self._sock.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
        line = b""
        while not line.endswith(b"\r\n"):
            line += self._sock.recv(1)
        if not line.startswith(b"+"):
            raise RuntimeError(f"redis refused {args[0]!r}: {line!r}")

    def _run(self) -> None:
        buf = b""
        while not self._stop.is_set():
            try:
                data = self._sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            buf += data
            *lines, buf = buf.split(b"\r\n")
            for line in lines:
                self._line(line)

    def _line(self, line: bytes) -> None:
        if b'"XADD"' not in line[:200].upper():
            return
        args = [_unescape(a) for a in _ARG.findall(line)]
        if len(args) < 4 or args[0].upper() != b"XADD" or not self._key.match(args[1]):
            return
        try:
            payload = args[args.index(b"o", 2) + 1]
            msg = EngineCoreOutputs.from_wire(payload)
        except (ValueError, IndexError, Exception):  # noqa: BLE001 - not an engine output message
            return
        with self._lock:
            for o in msg.outputs:
                self._out.setdefault(o.request_id, []).append(o)

    def request_ids(self) -> list[str]:
        """Every request id the engine published outputs for, first seen first."""
        with self._lock:
            return list(self._out)

    def outputs(self, request_id: str) -> list[EngineCoreOutput]:
        """The engine's outputs for ``request_id`` so far."""
        with self._lock:
            return list(self._out.get(request_id, []))

    def finished(self, request_id: str, timeout: float = 30.0) -> EngineCoreOutput | None:
        """Wait (at most ``timeout`` s) for the engine's final output for ``request_id`` and return it."""
        deadline = time.monotonic() + timeout
        while True:
            outs = self.outputs(request_id)
            if outs and outs[-1].finish_reason is not None:
                return outs[-1]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def produced(self, request_id: str) -> int:
        """Tokens the engine generated for ``request_id``."""
        return sum(len(o.new_token_ids) for o in self.outputs(request_id))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> EngineTap:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def assert_engine_aborted(tap: EngineTap, tag: str, max_tokens: int, want: int = 1, timeout: float = 60.0) -> None:
    """The engine ended each of the ``want`` requests whose id contains ``tag`` with ``finish_reason="abort"``
    before producing all ``max_tokens`` (a broken abort lets them end with ``length``)."""
    deadline = time.monotonic() + timeout
    ids: list[str] = []
    while time.monotonic() < deadline:
        ids = [i for i in tap.request_ids() if tag in i]
        if len(ids) >= want and all(tap.finished(i, 0) for i in ids):
            break
        time.sleep(0.05)
    assert len(ids) == want, (tag, tap.request_ids())
    for rid in ids:
        last = tap.finished(rid, 0)
        assert last is not None, f"the engine never ended {rid} (produced {tap.produced(rid)})"
        assert last.finish_reason == "abort", (rid, last, tap.produced(rid))
        assert tap.produced(rid) < max_tokens, (rid, tap.produced(rid))
