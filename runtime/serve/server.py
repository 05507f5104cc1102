"""uvicorn's server, with a shutdown that answers every request (uvicorn's own, past its
timeout, cancels the handlers: a stream is cut mid-body, a plain request gets 500 text)."""

from __future__ import annotations

import asyncio

import uvicorn

MARGIN = 2.0  # seconds the 503s have to reach their clients after the grace


class GracefulServer(uvicorn.Server):
    """On SIGTERM: no new connections; requests in flight run on for `grace` seconds; then
    `cut()` ends the rest with OpenAI's 503 error object (a stream: an error event, then
    `data: [DONE]`), and uvicorn waits up to MARGIN more for them to be sent."""

    def __init__(self, app, cut, grace: float, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace + MARGIN, **config))
        self.cut, self.grace = cut, grace

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace, self.cut)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
