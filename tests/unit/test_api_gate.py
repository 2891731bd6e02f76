"""The API gate in front of vLLM's router: the real HAProxy with the configuration the spec renders
(node_render/haproxy.py), in front of a stdlib HTTP server on loopback that stands in for the
router and records every request it gets: what the gate refuses must never reach it.

Only the OpenAI API and the health routes pass; heads, bodies and answers are bounded; a request
answered 500/502/504 or whose connection failed is sent again before any byte of its answer went
out, never on 429/503 and never after a byte; a lame-duck gate answers /readiness 503 and closes
answered connections while it serves what it holds. The admin routes are the pinned wheel's
(vllm-router 0.1.17); the same refusals against the real router are in tests/unit/test_router.py.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import re
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterspec.sections.proxy import Proxy
from node_render.haproxy import API_ROUTES, body_cap
from tests.api_gate import Gate, start_gate
from tests.conftest import ROOT

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


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    threading.Thread(target=up.serve_forever, daemon=True).start()
    yield up
    up.shutdown()


def _gate(tmp: Path, router_port: int, **gate: Any) -> Gate:
    return start_gate(
        tmp / "gate", _proxy(**gate), host="127.0.0.1", port=_port(), router_port=router_port, max_model_len=MAX_MODEL_LEN
    )


@pytest.fixture
def gate(upstream: Upstream, tmp_path: Path) -> Iterator[tuple[Upstream, int, Gate]]:
    g = _gate(tmp_path, upstream.server_address[1])
    yield upstream, g.port, g
    g.stop()


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


@pytest.mark.parametrize(("method", "path"), ADMIN)
def test_every_admin_route_is_refused_at_the_endpoint_and_never_reaches_the_router(gate: Any, method: str, path: str) -> None:
    upstream, port, _ = gate
    status, body, _ = request(port, method, path, b"{}" if method == "POST" else b"")
    assert status == 404, (status, body)
    assert json.loads(body)["error"]["type"] == "gptoss_api_gate"
    assert upstream.seen == [], f"{method} {path} reached the router"


def test_the_api_and_health_routes_pass_with_their_bodies_intact_on_one_kept_alive_connection(gate: Any) -> None:
    upstream, port, _ = gate
    prompt = json.dumps({"model": "openai/gpt-oss-120b", "prompt": "x" * 100_000, "max_tokens": 1}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=prompt, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    doc = json.loads(resp.read())
    assert resp.status == 200 and doc["sha256"] == hashlib.sha256(prompt).hexdigest() and doc["bytes"] == len(prompt), doc
    for path in ("/health", "/readiness", "/liveness", "/v1/models", "/health?verbose=1"):
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200, path
    conn.close()
    assert [(m, p) for m, p, _, _ in upstream.seen] == [("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/readiness"),
                                                       ("GET", "/liveness"), ("GET", "/v1/models"), ("GET", "/health?verbose=1")]  # fmt: skip
    assert request(port, "GET", "/v1/completions")[0] == 405, "an API path with another method is not passed on either"


def test_a_chunked_body_and_expect_100_continue_are_served(gate: Any) -> None:
    upstream, port, _ = gate
    out = raw(
        port,
        b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    )
    assert out.startswith(b"HTTP/1.1 200 "), out[:200]
    assert upstream.seen[-1][3] == b"{}"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
        )
        assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue"), "the client is told to send its body"
        s.sendall(b"{}")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert b"HTTP/1.1 200 " in got and upstream.seen[-1][3] == b"{}", got[:300]


@pytest.mark.parametrize(
    ("data", "statuses"),
    [
        # A second request behind an allowed one on the same connection: checked on its own, refused.
        (
            b"GET /health HTTP/1.1\r\nHost: e\r\n\r\nPOST /flush_cache HTTP/1.1\r\nHost: e\r\nContent-Length: 0\r\n\r\n",
            [200, 404],
        ),
        # A body longer than its Content-Length carrying a request: the router gets the 2 bytes; the rest is a request of its own, refused.
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\n\r\n{}POST /remove_worker?url=x HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
            [200, 404],
        ),
        # Both Transfer-Encoding and Content-Length: the length is dropped, the chunked body read, and the
        # connection closed after the answer (what follows is never read).
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
            b"GET /list_workers HTTP/1.1\r\nHost: e\r\n\r\n",
            [200],
        ),
        (b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}", [400]),
        (b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: +2\r\n\r\n{}", [400]),
        # An obsolete folded header line: unfolded into one header (RFC 9112 5.2), which the router gets on one line.
        (b"GET /health HTTP/1.1\r\nHost: e\r\nX-A: 1\r\n  folded\r\n\r\n", [200]),
        # A bare LF inside a header line (a second header smuggled past a parser that splits on CRLF only): two headers
        # to the gate, sent on to the router as two CRLF lines, so both read one chunked body; what follows is checked.
        (
            b"GET /health HTTP/1.1\r\nHost: e\r\nX: a\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /list_workers HTTP/1.1\r\nHost: e\r\n\r\n",
            [200, 404],
        ),
        # Absolute form naming an admin route: its path is checked.
        (b"GET http://router/remove_worker HTTP/1.1\r\nHost: router\r\n\r\n", [404]),
        (b"GET /health HTTP/1.1\r\nHost: e\r\nX-Big: " + b"a" * 400_000 + b"\r\n\r\n", [400]),
    ],
    ids=[
        "pipelined",
        "body-overrun",
        "te-and-cl",
        "two-lengths",
        "signed-length",
        "folded",
        "bare-lf-te",
        "absolute-form",
        "huge-head",
    ],
)
def test_smuggling_and_malformed_requests_pass_nothing_but_checked_requests(gate: Any, data: bytes, statuses: list[int]) -> None:
    upstream, port, _ = gate
    out = raw(port, data, wait_s=3)
    got = [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", out)]
    assert got == statuses, out[:300]
    reached = [(m, p.split("?")[0], b) for m, p, _, b in upstream.seen]
    assert all(p in ("/health", "/v1/completions") and b in (b"", b"{}") for _, p, b in reached), reached
    assert len(reached) == statuses.count(200), reached
    for _, _, headers, _ in upstream.seen:
        assert "folded" not in headers and headers.get("x-a", "1").split() in (["1"], ["1", "folded"]), headers


def test_a_bare_lf_header_is_one_header_to_the_gate_and_to_the_router(gate: Any) -> None:
    """Whatever the gate makes of a line, the router gets it as the gate understood it, in CRLF form."""
    upstream, port, _ = gate
    out = raw(port, b"GET /health HTTP/1.1\r\nHost: e\nX-B: 2\r\nConnection: close\r\n\r\n")
    statuses = [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", out)]
    assert len(statuses) == 1, out[:200]
    if statuses == [200]:
        assert upstream.seen[-1][2].get("x-b") == "2" and upstream.seen[-1][2].get("host") == "e", upstream.seen[-1][2]


def test_a_body_over_the_cap_is_refused_413_and_never_reaches_the_router(gate: Any) -> None:
    upstream, port, _ = gate
    cap = body_cap(_proxy(), MAX_MODEL_LEN)
    assert cap == MAX_MODEL_LEN * 16 + 64 * 1024
    status, body, _ = request(port, "POST", "/v1/completions", b"x" * (cap + 10))
    assert status == 413 and b"request body over" in body, (status, body[:200])
    chunked = raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                  + b"".join(b"%x\r\n%s\r\n" % (65536, b"y" * 65536) for _ in range(cap // 65536 + 2)) + b"0\r\n\r\n")  # fmt: skip
    assert chunked.startswith(b"HTTP/1.1 413 "), chunked[:200]
    assert upstream.seen == []
    status, _, _ = request(port, "POST", "/v1/completions", b"x" * (cap - 1000))
    assert status == 200, "a body under the cap passes"


def test_a_head_or_body_that_stops_arriving_is_answered_408_within_the_head_timeout(gate: Any) -> None:
    upstream, port, _ = gate
    t = time.monotonic()
    out = raw(port, b'POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 100\r\n\r\n{"model"', wait_s=10)
    took = time.monotonic() - t
    assert out.startswith(b"HTTP/1.1 408 ") and 1.5 <= took < 6, (out[:100], took)
    out = raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: e\r\n", wait_s=10)
    assert out.startswith(b"HTTP/1.1 408 "), out[:100]
    assert upstream.seen == [], "the router never saw half a request"


def test_an_answer_silent_longer_than_the_idle_timeout_is_cut_504(gate: Any) -> None:
    _, port, _ = gate
    t = time.monotonic()
    status, _ = completion(port, id="slow", sleep=5)  # idle_timeout_s 3
    assert status == 504 and 2.5 <= time.monotonic() - t < 5, status


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


def test_a_failed_prefill_is_sent_again_and_a_full_queue_or_an_answer_begun_is_not(gate: Any) -> None:
    upstream, port, _ = gate
    # The router's answer for a prefill server it could not reach (0.1.17, PD mode), then a good one.
    assert completion(port, id="prefill", answers=[500]) == (200, completion_doc(upstream, "prefill"))
    assert upstream.attempts["prefill"] == 2
    # 502 and 504 twice: the third attempt (the last of 1 + retries 2) serves.
    assert completion(port, id="twice", answers=[502, 504])[0] == 200 and upstream.attempts["twice"] == 3
    # Three failures: the client gets the last, after 3 attempts, never more.
    assert completion(port, id="thrice", answers=[500, 500, 500, 500])[0] == 500 and upstream.attempts["thrice"] == 3
    # A full queue or a refusal is the client's to retry (or the load balancer's other nodes'): once.
    for status in (429, 503, 400):
        assert completion(port, id=f"s{status}", answers=[status])[0] == status and upstream.attempts[f"s{status}"] == 1, status
    # A stream whose first byte went out is never sent again, even when it then breaks.
    out = raw(
        port, b'POST /v1/chat/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 6\r\nConnection: close\r\n\r\n"cut" ', wait_s=5
    )
    assert out.startswith(b"HTTP/1.1 200 ") and b"data: first" in out and upstream.attempts["stream"] == 1, out[:200]


def completion_doc(upstream: Upstream, rid: str) -> dict[str, Any]:
    body = upstream.seen[-1][3]
    return {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body), "attempt": upstream.attempts[rid]}


def test_a_router_that_refuses_connections_is_tried_three_times_then_answered_503(upstream: Upstream, tmp_path: Path) -> None:
    dead = _port()  # nothing listens there
    g = _gate(tmp_path, dead)
    try:
        t = time.monotonic()
        status, body, _ = request(g.port, "POST", "/v1/completions", b"{}")
        assert status == 503 and time.monotonic() - t < 10, (status, body)
        stat = g.api("state")
        assert stat.returncode == 0 and "router_requests=0" in stat.stdout, stat
    finally:
        g.stop()


def test_retries_stop_while_the_nodes_requests_fail_broadly(gate: Any) -> None:
    """The budget: once 10 requests of the last 10 s failed and they are over 10 % of all, a failure is final at its first attempt."""
    upstream, port, _ = gate
    for i in range(12):
        assert completion(port, id=f"down{i}", answers=[500, 500, 500])[0] == 500
    tried = [upstream.attempts[f"down{i}"] for i in range(12)]
    assert tried[:10] == [3] * 10 and tried[10:] == [1, 1], tried
    # Requests that succeed at once count too: the budget reopens as the share of failures falls below 10 %.
    for i in range(120):
        assert completion(port, id=f"ok{i}")[0] == 200
    assert completion(port, id="again", answers=[500])[0] == 200 and upstream.attempts["again"] == 2


def test_a_request_beyond_max_requests_is_answered_503_with_retry_after_at_once(gate: Any) -> None:
    upstream, port, _ = gate
    results: list[int] = []
    threads = [threading.Thread(target=lambda i=i: results.append(completion(port, id=f"busy{i}", sleep=2)[0])) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while sum(upstream.attempts[f"busy{i}"] for i in range(8)) < 8:
        assert time.monotonic() < deadline, "the 8 slow requests did not all reach the router"
        time.sleep(0.05)
    t0 = time.monotonic()
    status, body, headers = request(port, "POST", "/v1/completions", b'{"id": "ninth"}')
    # At once, not queued until one of the 8 ends (each holds the router 2 s).
    assert status == 503 and headers.get("retry-after") == "1" and time.monotonic() - t0 < 1.5, (status, body)
    for t in threads:
        t.join()
    assert results == [200] * 8 and upstream.attempts["ninth"] == 0


def test_lame_duck_readiness_503_closes_answered_connections_and_keeps_serving_streams(gate: Any) -> None:
    upstream, port, g = gate
    fleet = g.folder / "fleet"
    fleet.write_text("domain gptoss.internal\n")
    assert g.api("serving", str(fleet)).returncode == 0
    status, _, headers = request(port, "GET", "/readiness")
    assert status == 200 and headers["x-gptoss-fleet"] == hashlib.sha256(fleet.read_bytes()).hexdigest(), headers
    # A stream is running when the router's stop begins.
    body = b'{"model": "m", "messages": [], "stream": true}'
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: e\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    got = s.recv(4096)
    assert b"data: first" in got or got.startswith(b"HTTP/1.1 200"), got
    upstream.first_chunk_read.set()
    done: list[subprocess.CompletedProcess[str]] = []
    stopping = threading.Thread(
        target=lambda: done.append(g.api("lame-duck", extra={"GPTOSS_API_LAME_DUCK_S": "1", "GPTOSS_API_DRAIN_S": "60"}))
    )
    stopping.start()
    deadline = time.monotonic() + 5
    while request(port, "GET", "/readiness")[0] != 503:
        assert time.monotonic() < deadline, "readiness still 200 after the lame-duck began"
        time.sleep(0.05)
    status, _, headers = request(port, "GET", "/health", headers={"Connection": "keep-alive"})
    assert status == 200 and headers.get("connection") == "close", headers
    # The lame-duck waits for the stream: it has not ended while the stream runs.
    time.sleep(2)
    assert stopping.is_alive(), "the lame-duck ended while the router still held a stream"
    while b"data: 20\n\n" not in got:
        chunk = s.recv(4096)
        assert chunk, "the stream was cut during the lame-duck"
        got += chunk
    s.close()  # the client is done
    stopping.join(30)
    assert done and done[0].returncode == 0 and "it stops now" in done[0].stdout, done
    # The next start serves again.
    assert g.api("serving", str(fleet)).returncode == 0 and request(port, "GET", "/readiness")[0] == 200



def test_the_gate_passes_exactly_the_routes_the_docs_list() -> None:
    expected = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                ("GET", "/health"), ("GET", "/readiness"), ("GET", "/liveness")}  # fmt: skip
    assert expected == set(API_ROUTES)
    design = (Path(ROOT) / "docs" / "design.md").read_text()
    for method, path in sorted(API_ROUTES):
        assert f"`{method} {path}`" in design, f"docs/design.md does not list {method} {path}"


def test_lame_duck_without_a_running_gate_lets_the_router_stop(tmp_path: Path) -> None:
    env = {**os.environ, "GPTOSS_API_MAP": str(tmp_path / "api.map"), "GPTOSS_API_SOCKET": str(tmp_path / "none.sock")}

    out = subprocess.run(
        ["python3", str(ROOT / "userdata" / "bin" / "gptoss-api"), "lame-duck"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and "does not answer" in out.stdout, out


def test_a_production_router_nodes_gate_is_valid_haproxy_with_limits_sized_for_its_connections(tmp_path: Path) -> None:
    """The 3+8 layout's decode-0 as rendered: HAProxy accepts its configuration (`haproxy -c`, the unit's own
    check), the gate and the router hold 2 x (4,096 clients + 1,024 requests) + 256 open files each (a client
    and a router socket per request), the router's stop goes lame-duck first, and the gate ships with the scripts."""

    from clusterspec.loading import load_config
    from node_render.render import render_cluster
    from tests.api_gate import haproxy

    (r,) = [r for r in render_cluster(load_config({"config": "examples/production-3p8d.yaml"})) if r.node.name == "decode-0"]
    cfg = r.shared["/etc/gptoss/haproxy.cfg"][0]
    assert "bind 0.0.0.0:8000" in cfg and "server router 127.0.0.1:8010" in cfg and "retries 2" in cfg
    assert f"tune.bufsize {10240 * 16 + 64 * 1024 + 64 * 1024}" in cfg, "the largest body (the context's) and the head fit the buffer: retried whole"
    (tmp_path / "api.map").write_text("lame 0\nfleet none\n")
    local = cfg.replace("/run/gptoss/api.map", str(tmp_path / "api.map")).replace("/run/gptoss/haproxy.sock", str(tmp_path / "s.sock"))
    (tmp_path / "haproxy.cfg").write_text(local)
    check = subprocess.run([haproxy(), "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    api = r.files["/etc/systemd/system/gptoss-api.service"][0]
    router = r.files["/etc/systemd/system/gptoss-proxy.service"][0]
    assert "LimitNOFILE=10496" in api and "LimitNOFILE=10496" in router
    assert "ExecStartPre=/opt/gptoss/bin/gptoss-install-haproxy 2.8" in api and "ExecStart=/usr/sbin/haproxy -Ws -f /etc/gptoss/haproxy.cfg" in api
    assert "ExecStop=/opt/gptoss/bin/gptoss-api lame-duck" in router and "GPTOSS_API_LAME_DUCK_S=30" in router
    assert "gptoss-api.service" in r.units and "/etc/gptoss/haproxy.cfg" in r.files["/etc/gptoss/manifest"][0].split()


def test_the_node_runs_the_pinned_haproxy_and_installs_it_only_when_the_image_lacks_it(tmp_path: Path) -> None:
    """gptoss-install-haproxy: the machine's real HAProxy passes when pinned to its own release and is refused,
    naming the fix, when pinned to another; an image without HAProxy gets haproxy=<pin>.* from apt, and with no
    apt source reachable the start fails within its budget, naming the cause."""

    from tests.api_gate import haproxy
    from tests.conftest import fake_command

    script = str(ROOT / "userdata" / "bin" / "gptoss-install-haproxy")
    real = haproxy()
    mine = re.search(r"version (\d+\.\d+)", subprocess.run([real, "-v"], capture_output=True, text=True).stdout).group(1)  # type: ignore[union-attr]
    env = {**os.environ, "GPTOSS_HAPROXY": real}
    ok = subprocess.run([script, mine], env=env, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and f"HAProxy {mine}" in ok.stdout, ok
    other = "9.9"
    bad = subprocess.run([script, other], env=env, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and f"the node has HAProxy {mine}; the spec pins {other} (serving.proxy.gate.haproxy_version)" in bad.stderr, bad
    # No HAProxy on the image: apt installs the pinned release (here a stand-in that puts one in place).
    bindir = tmp_path / "bin"
    fake_command(bindir, "apt-get", f'echo "$*" >> "{tmp_path}/apt.log"\n[ "$1" = install ] || exit 0\n'
                 f'printf \'#!/bin/sh\\necho "HAProxy version {mine}.99-1 2026/01/01"\\n\' > "{tmp_path}/haproxy"; chmod +x "{tmp_path}/haproxy"\n')  # fmt: skip
    fake_command(bindir, "systemctl", f'echo "$*" >> "{tmp_path}/systemctl.log"\n')
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "GPTOSS_HAPROXY": str(tmp_path / "haproxy")}
    got = subprocess.run([script, mine], env=env, capture_output=True, text=True, timeout=30)
    assert got.returncode == 0 and f"install -y -q --no-install-recommends haproxy={mine}.*" in (tmp_path / "apt.log").read_text(), got
    assert "disable --now haproxy.service" in (tmp_path / "systemctl.log").read_text(), "the package's own unit does not run"
    # No apt source answers (network.egress=none): refused within the budget, naming the fix.
    (tmp_path / "haproxy").unlink()
    fake_command(bindir, "apt-get", "exit 100\n")
    t = time.monotonic()
    failed = subprocess.run([script, mine], env=env | {"GPTOSS_HAPROXY_FETCH_S": "3"}, capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1 and time.monotonic() - t < 30, failed
    assert f"apt did not install haproxy={mine}.* within 3s" in failed.stderr and "use an image that carries HAProxy" in failed.stderr, failed


def test_a_draining_gate_answers_new_requests_503_with_retry_after_while_a_running_stream_ends(gate: Any) -> None:
    """Before a Capacity Block's end (gptoss-api drain, which the node's collector runs): nothing new is taken,
    readiness included, each with a clean 503 and Retry-After; a stream that was running goes on to its end."""
    upstream, port, g = gate
    body = b'{"model": "m", "messages": [], "stream": true}'
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: e\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    got = s.recv(4096)
    upstream.first_chunk_read.set()
    assert g.api("drain", "120").returncode == 0
    status, answer, headers = request(port, "POST", "/v1/completions", b'{"id": "after"}')
    assert status == 503 and headers.get("retry-after") == "120" and json.loads(answer)["error"]["code"] == 503, (status, headers, answer)
    assert upstream.attempts["after"] == 0, "never reached the router"
    status, _, headers = request(port, "GET", "/readiness")
    assert status == 503 and headers.get("connection") == "close"
    while b"data: 20\n\n" not in got:
        chunk = s.recv(4096)
        assert chunk, "the running stream was cut by the drain"
        got += chunk
    s.close()


def test_the_node_scripts_defaults_are_the_paths_and_bounds_the_spec_renders() -> None:
    """gptoss-api and gptoss-members run with defaults where their units set nothing: the gate's map and
    admin socket, the router's fleet document, and the roll's wait for a document without its line."""
    from clusterspec.sections.proxy import Proxy
    from node_render.haproxy import API_MAP, API_SOCKET
    from node_render.paths import ROUTER_FLEET

    api = (ROOT / "userdata" / "bin" / "gptoss-api").read_text()
    assert f'"GPTOSS_API_SOCKET", "{API_SOCKET}"' in api and f'"GPTOSS_API_MAP", "{API_MAP}"' in api
    assert f'"GPTOSS_ROUTER_FLEET", "{ROUTER_FLEET}"' in api
    p = Proxy()
    members = (ROOT / "userdata" / "bin" / "gptoss-members").read_text()
    assert f"wait=${{wait:-{p.gate.lame_duck_s + p.router.request_timeout_s + p.router.restart_gap_s}}}" in members
