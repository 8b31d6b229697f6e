"""Serve an aiohttp runner until SIGTERM/SIGINT, then clean up: shared by the demo servers."""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web


async def until_signalled(runner: web.AppRunner) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
