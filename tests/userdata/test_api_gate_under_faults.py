"""The API gate when things go wrong: retries before the first byte and their budget, a full node's 503, a
lame-duck or draining gate that keeps serving what it holds, the pinned HAProxy's install, the scripts'
defaults held to the spec."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from clusterspec.sections.proxy import Proxy
from tests.conftest import ROOT
from tests.userdata.api_gate_peers import (
    Upstream,
    _gate,
    _port,
    completion,
    completion_doc,
    request,
)


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


def test_a_draining_gate_answers_new_requests_503_with_retry_after_while_a_running_stream_ends_and_undrains(gate: Any) -> None:
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
    # The block was extended after all (the collector sees its end move): the node serves again.
    assert g.api("undrain").returncode == 0
    assert completion(port, id="extended") == (200, completion_doc(upstream, "extended"))
    assert request(port, "GET", "/readiness")[0] == 200


def test_the_node_scripts_defaults_are_the_paths_and_bounds_the_spec_renders() -> None:
    """gptoss-api and the fleet document's reader run with defaults where their units set nothing: the gate's map and
    admin socket, the router's fleet document, and the roll's wait for a document without its line."""
    from node_render.haproxy import API_MAP, API_SOCKET
    from node_render.paths import ROUTER_FLEET

    api = (ROOT / "userdata" / "bin" / "gptoss-api").read_text()
    assert f'"GPTOSS_API_SOCKET", "{API_SOCKET}"' in api and f'"GPTOSS_API_MAP", "{API_MAP}"' in api
    assert f'"GPTOSS_ROUTER_FLEET", "{ROUTER_FLEET}"' in api
    p = Proxy()
    reader = (ROOT / "userdata" / "bin" / "gptoss_fleet.py").read_text()  # the fleet document's one reader (gptoss-members')
    assert f"DEFAULT_RESTART_GAP_S = {p.gate.lame_duck_s + p.router.request_timeout_s + p.router.restart_gap_s}\n" in reader
