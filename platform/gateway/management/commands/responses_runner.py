"""``manage.py responses_runner``: the background runner of the Responses API (``gateway.responses_runner``)."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from django.core.management.base import BaseCommand

from gateway.responses_runner import ResponsesRunner


class Command(BaseCommand):
    help = ("Run background responses (POST /v1/responses with 'background': true) until stopped; any number of "
            "runners may serve one platform.")

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--concurrency", type=int, default=64,
                            help="background responses this process runs at once (default 64)")

    def handle(self, *args: Any, **opts: Any) -> None:
        asyncio.run(_main(opts["concurrency"]))


async def _main(concurrency: int) -> None:
    """Run until SIGTERM or SIGINT."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: task.cancel() if task else None)
    try:
        await ResponsesRunner(concurrency).run_forever()
    except asyncio.CancelledError:
        pass
