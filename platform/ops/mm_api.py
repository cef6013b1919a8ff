"""The multimodal api process: the platform's ASGI application under uvicorn on a unix socket, serving the image
requests the front api relays to it (gateway/handoff.py).

Run by ``manage.py serve`` as ``python -m ops.mm_api --uds PATH [--workers N]``. The socket is bound here, 0600
(uvicorn's own ``--uds`` binding would make the file 0666, world-writable), and handed to ``uvicorn.Server``; with
``--workers N`` it is shared by N server processes (the kernel spreads connections across them); when one exits,
the others are stopped and this process exits with its code, so the supervisor restarts the whole multimodal api.
A worker still alive ``--timeout-graceful-shutdown`` + ``STRAGGLER_GRACE_S`` seconds after it was told to stop has its
Python stacks written to the log (SIGUSR2, faulthandler) and is killed, so a stuck worker never holds up the restart.
"""

from __future__ import annotations

import argparse
import faulthandler
import multiprocessing
import os
import signal
import socket
import sys
import time

import uvicorn
from django.conf import settings

#: seconds a stopping worker gets past uvicorn's graceful shutdown (which cancels the requests still running) to exit,
#: before its stacks are dumped and it is killed
STRAGGLER_GRACE_S = 10.0


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
    # proxy headers only from the proxies the operator named (FORWARDED_ALLOW_IPS), as the front api (ops serve)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")  # as config.asgi, which uvicorn loads
    trusted = settings.FORWARDED_ALLOW_IPS
    return uvicorn.Config("config.asgi:application", uds=uds, access_log=False,
                          timeout_graceful_shutdown=graceful_s, proxy_headers=bool(trusted),
                          forwarded_allow_ips=trusted or None)


def _worker(uds: str, graceful_s: float, http_sock: socket.socket) -> None:
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the launcher's stack dump of a worker that will not exit
    uvicorn.Server(_config(uds, graceful_s)).run(sockets=[http_sock])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.mm_api", description=__doc__.split("\n\n")[0])
    parser.add_argument("--uds", required=True, help="unix socket for relayed requests")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout-graceful-shutdown", type=float, default=5.0)
    args = parser.parse_args(argv)
    # bound here, 0600: uvicorn's own --uds binding would make the file 0666 (world-writable)
    http_sock = bind_unix(args.uds)
    try:
        if args.workers <= 1:
            server = uvicorn.Server(_config(args.uds, args.timeout_graceful_shutdown))
            server.run(sockets=[http_sock])
            return 0 if server.started else 3
        return _run_workers(args, http_sock)
    finally:
        if os.path.exists(args.uds):
            os.unlink(args.uds)


def _run_workers(args, http_sock: socket.socket) -> int:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(args.uds, args.timeout_graceful_shutdown, http_sock))
             for _ in range(args.workers)]
    for p in procs:
        p.start()
    # the workers hold their own copies: once they all close theirs (a shutdown begins with that), new connections
    # are refused at once and the front serves image requests itself, instead of waiting on a socket nobody
    # accepts from
    http_sock.close()

    def stop(signum, _frame) -> None:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    from multiprocessing.connection import wait

    wait([p.sentinel for p in procs])  # the first to exit ends the group
    stop(signal.SIGTERM, None)
    stop_within(procs, args.timeout_graceful_shutdown + STRAGGLER_GRACE_S)
    return next((p.exitcode for p in procs if p.exitcode), 0)


def stop_within(procs, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` seconds in all for ``procs`` (multiprocessing processes already told to stop) to exit;
    each one still alive then gets SIGUSR2 (its worker wrote faulthandler's dump of every thread's stack to the log)
    and, half a second later, SIGKILL. Returns once all have exited."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in procs if p.is_alive()]) and (left := deadline - time.monotonic()) > 0:
        wait([p.sentinel for p in alive], timeout=left)
    for p in alive:
        print(f"ops.mm_api: worker {p.pid} still running {timeout_s:.0f} s after it was told to stop; its stacks "
              "follow, then it is killed", file=sys.stderr, flush=True)
        os.kill(p.pid, signal.SIGUSR2)
    if alive:
        wait([p.sentinel for p in alive], timeout=0.5)
    for p in alive:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


if __name__ == "__main__":
    sys.exit(main())
