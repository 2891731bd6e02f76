"""vLLM's `--middleware` as the fake servers honour it (tests/fakes/vllm_pd.py on loopback, the guest's fake
`vllm`, which gets this file as /usr/local/lib/fakes/vllm_middleware.py).

vLLM imports each import path given to --middleware and, for a class, calls `app.add_middleware(cls)`:
the class is built around the app and every request goes through it first. Here each request's head
goes through the same class, built around a stand-in app that only notes that it was reached: when
the middleware passes the request on, the fake answers it as before; when it answers itself, its
answer is sent. The middleware's code is the project's own, run as shipped; only vLLM is faked.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any


def load(paths: list[str]) -> list[Any]:
    """The middleware classes of --middleware import paths, imported as vLLM imports them."""
    out = []
    for path in paths:
        module, _, name = path.rpartition(".")
        out.append(getattr(importlib.import_module(module), name))
    return out


def answer(middlewares: list[Any], method: str, target: str) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
    """What the middlewares answer to a request (status, headers, body), or None: they pass it on to the app."""
    if not middlewares:
        return None
    path, _, query = target.partition("?")
    reached = []
    sent: dict[str, Any] = {"body": b""}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(True)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            sent["status"], sent["headers"] = message["status"], message.get("headers", [])
        elif message["type"] == "http.response.body":
            sent["body"] += message.get("body", b"")

    handler: Any = app
    for cls in middlewares:  # app.add_middleware: the one added last is outermost (one here)
        handler = cls(handler)
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": query.encode(), "headers": []}
    asyncio.run(handler(scope, receive, send))
    if reached:
        return None
    return sent["status"], sent["headers"], sent["body"]


def respond(handler: Any, middlewares: list[Any]) -> bool:
    """Send what the middlewares answer to an http.server handler's request; True when they answered it
    themselves (the fake must not), False when they passed it on to the app."""
    got = answer(middlewares, handler.command, handler.path)
    if got is None:
        return False
    status, headers, body = got
    handler.send_response(status)
    for k, v in headers:
        handler.send_header(k.decode(), v.decode())
    handler.end_headers()
    handler.wfile.write(body)
    return True
