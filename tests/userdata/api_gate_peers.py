"""What the API gate's tests share: a stdlib HTTP server on loopback that stands in for vLLM's router and
records every request it gets, the real HAProxy in front of it with the configuration the spec renders,
and raw clients."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from clusterspec.sections.proxy import Proxy
from tests.api_gate import Gate, start_gate

# Every admin route of the pinned router (its Rust binary's route table), as a client would try them.
ADMIN = [("POST", "/add_worker?url=http://evil:1"), ("POST", "/remove_worker?url=http://prefill-0.gptoss.internal:8100"),
         ("POST", "/flush_cache"), ("GET", "/list_workers"), ("GET", "/get_loads"), ("GET", "/get_load"), ("GET", "/workers"),
         ("DELETE", "/workers/http%3A%2F%2Fdecode-0.gptoss.internal%3A8200"), ("GET", "/get_server_info"), ("GET", "/get_model_info"),
         ("GET", "/metrics"), ("POST", "/generate"), ("POST", "/v1/generate"), ("GET", "/health_generate"), ("POST", "/v1/rerank"),
         ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel"), ("GET", "/scheduling/diagnostics"),
         ("POST", "/finish_session"), ("GET", "/v1/completions/../../remove_worker"), ("GET", "//remove_worker")]  # fmt: skip
# The test's own gate settings: short timeouts so that a test waits seconds, small caps so that it reaches them.
GATE = {"head_timeout_s": 2, "idle_timeout_s": 3, "max_requests": 8, "lame_duck_s": 1}
MAX_MODEL_LEN = 10240


class Upstream(http.server.ThreadingHTTPServer):
    """The router's stand-in: records (method, path, headers, body) of every request it gets.

    A completion's JSON body steers its answer: "answers": statuses for its first attempts (then
    200), "sleep": seconds before answering, "id": which attempts count together."""

    daemon_threads = True

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.attempts: Counter[str] = Counter()
        self.first_chunk_read = threading.Event()
        self.stream_broken = threading.Event()
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        """A connection the gate dropped mid-request (the tests do that on purpose): nothing to print."""


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _record(self) -> bytes:
        body = self._body()
        with self.server.lock:
            self.server.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        return body

    def _json(self, doc: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
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
            try:
                doc = json.loads(body)
            except ValueError:
                doc = {}
            with self.server.lock:
                self.server.attempts[doc.get("id", "")] += 1
                attempt = self.server.attempts[doc.get("id", "")]
            time.sleep(doc.get("sleep", 0))
            answers = doc.get("answers", [])
            if attempt <= len(answers):
                return self._json({"error": f"attempt {attempt}"}, answers[attempt - 1])
            return self._json({"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body), "attempt": attempt})
        # A token stream: the second event only once the client has read the first (a gate that
        # buffered would never deliver it), then events until the client goes away, or ("cut") the stream breaks.
        cut = b'"cut"' in body
        with self.server.lock:
            self.server.attempts["stream"] += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            self.wfile.write(b"data: first\n\n")
            self.wfile.flush()
            if cut:
                self.connection.shutdown(socket.SHUT_RDWR)  # a byte went out, then the server died
                return
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


def _proxy(**gate: Any) -> Proxy:
    return Proxy.model_validate({"gate": {**GATE, **gate}})


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gate(tmp: Path, router_port: int, **gate: Any) -> Gate:
    return start_gate(
        tmp / "gate", _proxy(**gate), host="127.0.0.1", port=_port(), router_port=router_port, max_model_len=MAX_MODEL_LEN
    )


def raw(port: int, data: bytes, wait_s: float = 5) -> bytes:
    """Send `data` as is, return every byte until the gate closes the connection or is silent for wait_s."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out


def request(
    port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body or None, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def completion(port: int, **doc: Any) -> tuple[int, dict[str, Any]]:
    status, body, headers = request(port, "POST", "/v1/completions", json.dumps({"model": "m", "prompt": "p", **doc}).encode())
    assert headers.get("content-type") == "application/json", (status, headers, body[:200])
    return status, json.loads(body)



def completion_doc(upstream: Upstream, rid: str) -> dict[str, Any]:
    body = upstream.seen[-1][3]
    return {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body), "attempt": upstream.attempts[rid]}
