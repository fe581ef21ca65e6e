"""A fast stop with open browser streams: the page's server-sent-event streams never end on
their own, so uvicorn's graceful shutdown would wait its whole timeout for them and then
cancel them (``ERROR: Cancel N running task(s)``). The stop signal sets :class:`Shutdown`
first (uvicorn's ``handle_exit``, see ``specprefill_server.cli.Server``); every stream wrapped by
:meth:`Shutdown.until` ends at once, its connection closes, and the server stops."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


class Shutdown:
    """Set once the server is stopping; safe to set from a signal handler or another thread."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    def bind(self) -> None:
        """Remember the running loop (the app's lifespan start), which :meth:`begin` wakes."""
        self.loop = asyncio.get_running_loop()

    def begin(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.event.set)

    @property
    def started(self) -> bool:
        return self.event.is_set()

    async def until(self, body: AsyncIterator[str]) -> AsyncIterator[str]:
        """``body``'s items until it ends or the server stops (then ``body`` is closed)."""
        items = body.__aiter__()
        stopping = asyncio.ensure_future(self.event.wait())
        try:
            while True:
                step = asyncio.ensure_future(items.__anext__())
                await asyncio.wait({step, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await step
                    return
                try:
                    item = step.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            stopping.cancel()
            close = getattr(items, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()

