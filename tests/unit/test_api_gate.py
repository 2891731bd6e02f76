"""The API gate in front of vLLM's router (userdata/bin/gptoss-router --api): only the OpenAI API and
the health routes pass, one request per connection, bodies and streams intact.

The gate runs as shipped (its serve(), in its own process, a stand-in child for the router) in
front of a stdlib HTTP server on loopback that records every request it gets: what the gate
refuses must never reach it. The admin routes are the pinned wheel's (vllm-router 0.1.17); the
same refusals against the real router are in tests/unit/test_router.py.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

GATE = ROOT / "userdata" / "bin" / "gptoss-router"
RUN = """
import asyncio, importlib.machinery, importlib.util, subprocess, sys
spec = importlib.util.spec_from_loader("gate", importlib.machinery.SourceFileLoader("gate", sys.argv[1]))
gate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gate)
gate.BODY_IDLE_S = float(sys.argv[3])
router = subprocess.Popen(["sleep", "600"])  # the router's stand-in: the gate lives as long as its child
print(router.pid, flush=True)
sys.exit(asyncio.run(gate.serve("127.0.0.1", 0, ("127.0.0.1", int(sys.argv[2])), router.pid)))
"""
# Every admin route of the pinned router (its Rust binary's route table), as a client would try them.
ADMIN = [("POST", "/add_worker?url=http://evil:1"), ("POST", "/remove_worker?url=http://prefill-0.gptoss.internal:8100"),
         ("POST", "/flush_cache"), ("GET", "/list_workers"), ("GET", "/get_loads"), ("GET", "/get_load"), ("GET", "/workers"),
         ("DELETE", "/workers/http%3A%2F%2Fdecode-0.gptoss.internal%3A8200"), ("GET", "/get_server_info"), ("GET", "/get_model_info"),
         ("GET", "/metrics"), ("POST", "/generate"), ("POST", "/v1/generate"), ("GET", "/health_generate"), ("POST", "/v1/rerank"),
         ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel"), ("GET", "/scheduling/diagnostics"),
         ("POST", "/finish_session"), ("GET", "/v1/completions/../../remove_worker"), ("GET", "//remove_worker")]  # fmt: skip


class Upstream(http.server.ThreadingHTTPServer):
    """The router's stand-in: records (method, path, headers, body) of every request it gets."""

    daemon_threads = True

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.first_chunk_read = threading.Event()
        self.stream_broken = threading.Event()
        super().__init__(("127.0.0.1", 0), Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        """A connection the gate dropped mid-request (the tests do that on purpose): nothing to print."""


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def _record(self) -> bytes:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        return body

    def _json(self, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._record()
        self._json({"status": "ok"})

    do_DELETE = do_GET

    def do_POST(self) -> None:
        body = self._record()
        if self.path != "/v1/chat/completions":
            return self._json({"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)})
        # A token stream: the second event only once the client has read the first (a gate that
        # buffered would never deliver it), then events until the client goes away.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            self.wfile.write(b"data: first\n\n")
            self.wfile.flush()
            if not self.server.first_chunk_read.wait(30):
                self.wfile.write(b"data: the gate held the first event back\n\n")
                return
            for i in range(600):
                self.wfile.write(f"data: {i}\n\n".encode())
                self.wfile.flush()
                threading.Event().wait(0.05)
        except OSError:
            self.server.stream_broken.set()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gate() -> Iterator[tuple[Upstream, int, subprocess.Popen[str]]]:
    upstream = Upstream()
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(GATE), str(upstream.server_address[1]), "2"],  # a body idle 2 s is dropped
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        router_pid = int(proc.stdout.readline())
        line = proc.stdout.readline()
        assert line.startswith("gptoss-router: API gate on 127.0.0.1:"), line + (proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        port = int(line.split()[4].rpartition(":")[2])
        proc.router_pid = router_pid  # type: ignore[attr-defined]
        yield upstream, port, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        upstream.shutdown()


def raw(port: int, data: bytes) -> bytes:
    """Send `data` as is, return every byte until the gate closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def request(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    head = f"{method} {path} HTTP/1.1\r\nHost: endpoint\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    out = raw(port, head.encode() + body)
    status = int(out.split(b" ", 2)[1])
    return status, out.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize(("method", "path"), ADMIN)
def test_every_admin_route_is_refused_at_the_endpoint_and_never_reaches_the_router(gate: Any, method: str, path: str) -> None:
    upstream, port, _ = gate
    status, body = request(port, method, path, b"{}" if method == "POST" else b"")
    assert status == 404, (status, body)
    assert json.loads(body)["error"]["type"] == "gptoss_api_gate"
    assert upstream.seen == [], f"{method} {path} reached the router"


def test_the_api_and_health_routes_pass_with_their_bodies_intact_and_one_request_per_connection(gate: Any) -> None:
    upstream, port, _ = gate
    prompt = json.dumps({"model": "openai/gpt-oss-120b", "prompt": "x" * 300_000, "max_tokens": 1}).encode()
    status, body = request(port, "POST", "/v1/completions", prompt)
    assert status == 200 and json.loads(body) == {"sha256": hashlib.sha256(prompt).hexdigest(), "bytes": len(prompt)}
    for path in ("/health", "/readiness", "/liveness", "/v1/models", "/health?verbose=1"):
        assert request(port, "GET", path)[0] == 200, path
    assert [(m, p) for m, p, _, _ in upstream.seen] == [("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/readiness"),
                                                       ("GET", "/liveness"), ("GET", "/v1/models"), ("GET", "/health?verbose=1")]  # fmt: skip
    assert all(h.get("connection") == "close" for _, _, h, _ in upstream.seen), "the router closes after each answer"
    assert request(port, "GET", "/v1/completions")[0] == 405, "an API path with another method is not passed on either"


@pytest.mark.parametrize(
    ("data", "status"),
    [
        # A second request behind an allowed one on the same connection: never read, never passed on.
        (b"GET /health HTTP/1.1\r\nHost: e\r\n\r\nPOST /flush_cache HTTP/1.1\r\nHost: e\r\nContent-Length: 0\r\n\r\n", 200),
        # A body longer than its Content-Length carrying a request: the router gets the 2 bytes, nothing more.
        (b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\n\r\n{}POST /remove_worker?url=x HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 200),
        # Connection: keep-alive asked for: replaced by close.
        (b"GET /health HTTP/1.1\r\nHost: e\r\nConnection: keep-alive\r\n\r\nGET /list_workers HTTP/1.1\r\nHost: e\r\n\r\n", 200),
        (b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411),
        (b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: +2\r\n\r\n{}", 400),
        (b"GET /health HTTP/1.1\r\nHost: e\r\nX-A: 1\r\n  folded\r\n\r\n", 400),
        (b"GET http://router/remove_worker HTTP/1.1\r\nHost: e\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nHost: e\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    ],
)
def test_smuggling_and_malformed_requests_pass_nothing_beyond_one_checked_request(gate: Any, data: bytes, status: int) -> None:
    upstream, port, _ = gate
    out = raw(port, data)
    assert out.startswith(f"HTTP/1.1 {status} ".encode()) or out.startswith(f"HTTP/1.0 {status} ".encode()), out[:200]
    assert len(re.findall(rb"(?:^|\r\n)HTTP/1\.[01] \d{3} ", out)) == 1, "one answer per connection"
    reached = [(m, p.split("?")[0], b) for m, p, _, b in upstream.seen]
    if status == 200:
        assert len(reached) == 1 and reached[0][1] in ("/health", "/v1/completions") and reached[0][2] in (b"", b"{}"), reached
    else:
        assert reached == [], reached


def test_a_body_that_stops_arriving_is_dropped_with_the_routers_connection(gate: Any) -> None:
    upstream, port, _ = gate
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 100\r\n\r\n{\"model\"")
        assert s.recv(1024) == b"", "closed without an answer once the body stopped arriving (2 s here)"
    # The router's connection was closed under it: it read the 8 bytes that came and then the end,
    # never the 100 the request announced (whether its handler has recorded that yet is a race).
    assert [b for _, _, _, b in upstream.seen] in ([], [b'{"model"']), upstream.seen


def test_a_token_stream_flows_as_it_comes_and_a_client_that_hangs_up_ends_it(gate: Any) -> None:
    upstream, port, _ = gate
    body = b'{"model": "m", "messages": [], "stream": true}'
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: e\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: first" not in got:
            chunk = s.recv(4096)
            assert chunk, f"the stream ended before its first event: {got!r}"
            got += chunk
        upstream.first_chunk_read.set()  # the first event arrived while the server holds the rest
        while b"data: 3\n\n" not in got:
            got += s.recv(4096)
        assert b"held the first event back" not in got
    # The client is gone: the router's connection is closed, so it stops generating.
    assert upstream.stream_broken.wait(30), "the router kept streaming to a client that hung up"


def test_the_gate_ends_with_the_router_and_a_stop_reaches_the_router(gate: Any) -> None:
    import os

    _, _, proc = gate
    os.kill(proc.router_pid, signal.SIGKILL)
    assert proc.wait(30) != 0, "the router died: the unit fails and systemd restarts it"
    assert "gptoss-router: the router exited (-9); the API gate stops" in proc.stderr.read()


def test_a_stop_signal_stops_the_router_and_the_gate_cleanly(gate: Any) -> None:
    import os

    _, _, proc = gate
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(proc.router_pid, 0)  # reaped: the router got the stop and ended


def test_the_gate_passes_exactly_the_routes_the_docs_list() -> None:
    import importlib.machinery
    import importlib.util

    spec = importlib.util.spec_from_loader("gate", importlib.machinery.SourceFileLoader("gate", str(GATE)))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                ("GET", "/health"), ("GET", "/readiness"), ("GET", "/liveness")}  # fmt: skip
    assert expected == module.API_ROUTES
    design = (Path(ROOT) / "docs" / "design.md").read_text()
    for method, path in sorted(module.API_ROUTES):
        assert f"`{method} {path}`" in design, f"docs/design.md does not list {method} {path}"


def test_a_router_that_outlasts_its_request_timeout_after_a_stop_is_killed(tmp_path: Path) -> None:
    """The unit's stop timeout is only a backstop (the request timeout is the fleet's setting, not the
    unit's): the gate gives the router its drain bound (here 1 s), then kills it, and exits 0."""
    import os
    import subprocess
    import sys

    ready = tmp_path / "ignoring"
    stubborn = f'[sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, \'w\'); time.sleep(600)"]'
    run = RUN.replace('["sleep", "600"]', stubborn).replace("router.pid)))", "router.pid, drain_s=1.0)))")
    script = tmp_path / "run.py"
    script.write_text(run)
    proc = subprocess.Popen([sys.executable, str(script), str(GATE), "9", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    pid = int(proc.stdout.readline())
    line = proc.stdout.readline()
    assert line.startswith("gptoss-router: API gate on 127.0.0.1:"), line
    import time

    deadline = time.monotonic() + 30
    while not ready.exists():  # the stand-in ignores stops from here on
        assert time.monotonic() < deadline, "the router's stand-in did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, "a stop is an orderly end"
    err = proc.stderr.read()
    assert "the router did not end within 1 s of the stop; killing it" in err, err
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
