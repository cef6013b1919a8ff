"""The multimodal api process: the platform's ASGI application under uvicorn on a unix socket (requests relayed
by the front api), which also adopts client connections the front passes to it (gateway/connection_pass.py).

Run by ``manage.py serve`` as ``python -m ops.mm_api --uds PATH --pass-socket PATH [--workers N]``. uvicorn's
command line has no hook for a second listener, so this wraps ``uvicorn.Server``: after the server's own start-up
it accepts passed connections and builds their protocols exactly as the server builds its own (same class,
config, server state and lifespan state), so graceful shutdown, limits and timeouts cover them too. With
``--workers N`` both sockets are bound here and shared by N server processes (the kernel spreads connections and
passes across them); when one exits, the others are stopped and this process exits with its code, so the
supervisor restarts the whole multimodal api.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import socket
import sys

import uvicorn


class PassingServer(uvicorn.Server):
    """``uvicorn.Server`` that also adopts connections passed on ``pass_listener`` (a bound unix socket, listened
    on once the server has started)."""

    def __init__(self, config: uvicorn.Config, pass_listener: socket.socket) -> None:
        super().__init__(config)
        self.pass_listener = pass_listener
        self._pass_task: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:
            return
        from gateway.connection_pass import serve_passed_connections

        def protocol_factory() -> asyncio.Protocol:
            return self.config.http_protocol_class(config=self.config, server_state=self.server_state,
                                                   app_state=self.lifespan.state)

        # listening only now that the application is loaded: until then a pass is refused at once and the front
        # serves the request itself, instead of the pass waiting on a process that is still starting
        self.pass_listener.listen(2048)
        self._pass_task = asyncio.ensure_future(serve_passed_connections(self.pass_listener, protocol_factory,
                                                                         _count_passed))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._pass_task is not None:
            self._pass_task.cancel()  # no new adoptions; adopted connections are shut down with the server's own
        self.pass_listener.close()
        await super().shutdown(sockets=sockets)


async def _count_passed() -> None:
    from gateway.handoff import count

    await count("passed")


def bind_unix(path: str, mode: int = 0o600) -> socket.socket:
    """A unix stream socket bound at ``path`` (a stale file there is replaced), ``mode`` on the file, not yet
    listening (connections are refused until a server that is ready listens on it)."""
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, mode)
    return sock


def _config(uds: str, graceful_s: float) -> uvicorn.Config:
    return uvicorn.Config("config.asgi:application", uds=uds, access_log=False,
                          timeout_graceful_shutdown=graceful_s)


def _worker(uds: str, graceful_s: float, http_sock: socket.socket, pass_sock: socket.socket) -> None:
    PassingServer(_config(uds, graceful_s), pass_sock).run(sockets=[http_sock])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.mm_api", description=__doc__.split("\n\n")[0])
    parser.add_argument("--uds", required=True, help="unix socket for relayed requests")
    parser.add_argument("--pass-socket", required=True, help="unix socket on which passed connections arrive")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout-graceful-shutdown", type=float, default=5.0)
    args = parser.parse_args(argv)
    # both sockets are bound here, 0600: uvicorn's own --uds binding would make the file 0666 (world-writable)
    pass_sock = bind_unix(args.pass_socket)
    try:
        http_sock = bind_unix(args.uds)
        if args.workers <= 1:
            server = PassingServer(_config(args.uds, args.timeout_graceful_shutdown), pass_sock)
            server.run(sockets=[http_sock])
            return 0 if server.started else 3
        return _run_workers(args, http_sock, pass_sock)
    finally:
        for path in (args.uds, args.pass_socket):
            if os.path.exists(path):
                os.unlink(path)


def _run_workers(args, http_sock: socket.socket, pass_sock: socket.socket) -> int:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(args.uds, args.timeout_graceful_shutdown, http_sock, pass_sock))
             for _ in range(args.workers)]
    for p in procs:
        p.start()
    # the workers hold their own copies: once they all close theirs (a shutdown begins with that), connections
    # waiting to be passed are refused at once and the front serves them itself, instead of waiting on a socket
    # nobody accepts from
    http_sock.close()
    pass_sock.close()

    def stop(signum, _frame) -> None:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    from multiprocessing.connection import wait

    wait([p.sentinel for p in procs])  # the first to exit ends the group
    stop(signal.SIGTERM, None)
    for p in procs:
        p.join()
    return next((p.exitcode for p in procs if p.exitcode), 0)


if __name__ == "__main__":
    sys.exit(main())
