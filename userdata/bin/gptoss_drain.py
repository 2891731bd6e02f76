#!/usr/bin/env python3
"""gptoss_drain.Drain: vLLM's ASGI middleware (`vllm serve ... --middleware gptoss_drain.Drain`) on a
server behind vLLM's router, so that the server can leave the routers before it restarts.

While the file GPTOSS_DRAIN_FILE exists (gptoss-drain makes it), the server answers its health route
(GPTOSS_DRAIN_HEALTH_PATH, the path the routers check) 503: every router takes it out of rotation by
its own health checks (the pinned router re-admits no server it was told to remove in PD mode, but it
does re-admit one whose health comes back). Everything else it serves as before: what it holds
finishes, and what a router still sends before its checks fail is served too. The file goes before
the server restarts; the new process answers its health route once it can serve, and the routers take
it back. The file holds the time (epoch seconds) after which it counts no more: a drain whose
gptoss-drain never came back (killed) does not keep the server out of the routers for good.
vLLM adds a class given to --middleware with app.add_middleware(); standard library only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
BODY = b'{"error": "draining: this server leaves its routers before a restart; what it holds finishes"}'


class Drain:
    """The health route answers 503 while the drain file exists; every other request passes."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.marker = os.environ.get("GPTOSS_DRAIN_FILE", "")
        self.path = os.environ.get("GPTOSS_DRAIN_HEALTH_PATH", "/health")

    def draining(self) -> bool:
        """The drain file exists and its time has not passed."""
        try:
            with open(self.marker) as f:
                until = f.read().strip()
        except OSError:
            return False
        try:
            return time.time() < float(until)
        except ValueError:  # a file without a time (made by hand): it counts until it goes
            return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "http" and scope.get("path") == self.path and self.marker and self.draining():
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": BODY})
            return
        await self.app(scope, receive, send)
