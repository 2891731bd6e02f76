"""The API gate in front of vLLM's router: the real HAProxy with the configuration the spec renders
(node_render/haproxy.py), in front of a stdlib HTTP server on loopback that stands in for the
router and records every request it gets: what the gate refuses must never reach it.

Only the OpenAI API and the health routes pass; heads, bodies and answers are bounded; a request
answered 500/502/504 or whose connection failed is sent again before any byte of its answer went
out, never on 429/503 and never after a byte; a lame-duck gate answers /readiness 503 and closes
answered connections while it serves what it holds. The admin routes are the pinned wheel's
(vllm-router 0.1.17); the same refusals against the real router are in tests/userdata/test_router.py.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from node_render.haproxy import API_ROUTES, body_cap
from tests.conftest import ROOT
from tests.userdata.api_gate_peers import (
    ADMIN,
    MAX_MODEL_LEN,
    _proxy,
    completion,
    completion_doc,
    raw,
    request,
)


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
        # to the sent on to the router as two CRLF lines, so both read one chunked body; what follows is checked.
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
    # Refused on its Content-Length, though the body is longer than HAProxy's buffer (64 KiB).
    status, body, _ = request(port, "POST", "/v1/completions", b"x" * (cap + 10))
    assert status == 413 and b"request body over" in body, (status, body[:200])
    assert upstream.seen == []
    status, _, _ = request(port, "POST", "/v1/completions", b"x" * (cap - 1000))
    assert status == 200 and upstream.seen[-1][3] == b"x" * (cap - 1000), "a body under the cap passes, whole"
    # A chunked body has no length to read: it passes, and the router refuses it past the same cap
    # (--max-payload-size, tests/userdata/test_router.py).


def test_a_body_that_fits_the_buffer_is_retried_and_a_longer_one_passes_whole_and_once(gate: Any) -> None:
    """64 KiB of buffer, 16 KiB of it kept for rewrites: a prompt of 8,000 tokens (about 32 KB) is held whole and
    sent again after the router's 500; a 100,000-byte one streams through to the router, intact, and its 500 is the client's."""
    upstream, port, _ = gate
    short = "t" * 32_000
    status, doc = completion(port, id="fits", answers=[500], prompt=short)
    assert status == 200 and upstream.attempts["fits"] == 2 and doc == completion_doc(upstream, "fits"), doc
    assert json.loads(upstream.seen[-1][3])["prompt"] == short
    long = "t" * 100_000
    status, doc = completion(port, id="long", answers=[500], prompt=long)
    assert status == 500 and upstream.attempts["long"] == 1, (status, doc)
    status, doc = completion(port, id="long-ok", prompt=long)
    assert status == 200 and json.loads(upstream.seen[-1][3])["prompt"] == long and doc == completion_doc(upstream, "long-ok"), doc


def test_a_head_or_body_that_stops_arriving_is_answered_408_within_the_head_timeout(gate: Any) -> None:
    upstream, port, _ = gate
    t = time.monotonic()
    out = raw(port, b'POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 100\r\n\r\n{"model"', wait_s=10)
    took = time.monotonic() - t
    assert out.startswith(b"HTTP/1.1 408 ") and 1.5 <= took < 6, (out[:100], took)
    out = raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: e\r\n", wait_s=10)
    assert out.startswith(b"HTTP/1.1 408 "), out[:100]
    assert upstream.seen == [], "the router never saw half a request"


def test_two_thousand_connections_that_send_nothing_are_closed_at_the_head_timeout_while_a_completion_is_served(gate: Any) -> None:
    """Idle sockets cannot hold the gate's connection slots: each connection that never sends a byte is answered
    408 and closed within the head timeout (2 s here), while a client that does send is served meanwhile."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    upstream, port, _ = gate
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2000)]
    try:
        t = time.monotonic()
        status, doc = completion(port, id="while-idle")
        assert status == 200 and doc == completion_doc(upstream, "while-idle"), (status, doc)
        answered = []
        for s in idle:
            s.settimeout(max(0.1, t + 6 - time.monotonic()))
            try:
                answered.append(s.recv(64))
            except TimeoutError:
                answered.append(b"still open")
        took = time.monotonic() - t
    finally:
        for s in idle:
            s.close()
    assert sum(a.startswith(b"HTTP/1.1 408 ") for a in answered) == 2000, sorted(set(a[:20] for a in answered))
    assert took < 6, took
    assert [r for r in upstream.seen if r[1] != "/v1/completions"] == [], "nothing of the idle connections reached the router"


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


def test_the_gate_passes_exactly_the_routes_the_docs_list() -> None:
    expected = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                ("GET", "/health"), ("GET", "/readiness"), ("GET", "/liveness")}  # fmt: skip
    assert expected == set(API_ROUTES)
    design = (Path(ROOT) / "docs" / "design.md").read_text()
    for method, path in sorted(API_ROUTES):
        assert f"`{method} {path}`" in design, f"docs/design.md does not list {method} {path}"


def test_a_production_router_nodes_gate_is_valid_haproxy_with_limits_sized_for_its_connections(tmp_path: Path) -> None:
    """The 3+8 layout's decode-0 as rendered: HAProxy accepts its configuration (`haproxy -c`, the unit's own
    check), the gate and the router hold 2 x (4,096 clients + 1,024 requests) + 256 open files each (a client
    and a router socket per request), the router's stop goes lame-duck first, and the gate ships with the scripts."""

    from clusterspec.loading import load_config
    from node_render.command_lines import router_settings
    from node_render.render import render_cluster
    from tests.api_gate import haproxy

    spec = load_config({"config": "examples/production-3p8d.yaml"})
    (r,) = [r for r in render_cluster(spec) if r.node.name == "decode-0"]
    cfg = r.shared["/etc/gptoss/haproxy.cfg"][0]
    assert "bind 0.0.0.0:8000" in cfg and "server router 127.0.0.1:8010" in cfg and "retries 2" in cfg
    assert "nbthread 1\n" in cfg and "tune.bufsize 65536\n" in cfg and "tune.maxrewrite 16384\n" in cfg
    assert "if { req.hdr_val(content-length) gt 229376 }" in cfg, "the body cap: 10,240 tokens x 16 B + 64 KiB"
    settings = router_settings(spec)
    assert settings[settings.index("--max-payload-size") + 1] == "229376", "the router caps any body, a chunked one too, the same"
    # API keys, the production layout's default: a valid key, its rate and concurrency, 401/429 otherwise.
    assert "http-request return status 401" in cfg and "hdr WWW-Authenticate Bearer" in cfg and "map(/run/gptoss/api-keys.map)" in cfg
    assert "map_str_int(/run/gptoss/api-key-rate.map,20)" in cfg and "map_str_int(/run/gptoss/api-key-concurrency.map,256)" in cfg
    assert "/etc/systemd/system/gptoss-keys.timer" in r.shared and "OnUnitInactiveSec=30" in r.shared["/etc/systemd/system/gptoss-keys.timer"][0]
    assert r.shared["/etc/gptoss/keys.env"][0] == "GPTOSS_KEYS_SECRET=gptoss/gptoss-prod/api-keys\n"
    (tmp_path / "api.map").write_text("lame 0\nfleet none\n")
    local = cfg.replace("/run/gptoss/api.map", str(tmp_path / "api.map")).replace("/run/gptoss/haproxy.sock", str(tmp_path / "s.sock"))
    for name in ("api-keys.map", "api-key-rate.map", "api-key-concurrency.map"):
        (tmp_path / name).write_text("")
        local = local.replace(f"/run/gptoss/{name}", str(tmp_path / name))
    (tmp_path / "haproxy.cfg").write_text(local)
    check = subprocess.run([haproxy(), "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    api = r.files["/etc/systemd/system/gptoss-api.service"][0]
    router = r.files["/etc/systemd/system/gptoss-proxy.service"][0]
    assert "LimitNOFILE=10496" in api and "LimitNOFILE=10496" in router
    assert "ExecStartPre=/opt/gptoss/bin/gptoss-install-haproxy 2.8" in api and "ExecStart=/usr/sbin/haproxy -Ws -f /etc/gptoss/haproxy.cfg" in api
    assert "ExecStop=/opt/gptoss/bin/gptoss-api lame-duck" in router and "GPTOSS_API_LAME_DUCK_S=30" in router
    assert "gptoss-api.service" in r.units and "/etc/gptoss/haproxy.cfg" in r.files["/etc/gptoss/manifest"][0].split()
