"""Running a service process: logging, signals, and one asyncio loop until told to stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from shared.telemetry.logs import configure_logging

log = logging.getLogger(__name__)


def run_service(name: str, level: str, main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``main(stop)``; SIGTERM and SIGINT set ``stop`` (a second one exits at once)."""
    configure_logging(name, level)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if stop.is_set():
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                raise SystemExit(1)
            log.info("%s: stopping", signal.Signals(signum).name)
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        await main(stop)

    try:
        asyncio.run(runner())
    except ConnectionError as exc:  # a server we need is unreachable: a clear line, not a traceback
        log.error("%s", exc)
        return 1
    return 0
