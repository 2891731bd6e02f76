"""The deploy gate tests this instance's own servers: a request pinned to its decode server, a
prefill request to each replica (loopback fakes of vLLM's P/D servers)."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.userdata.test_signal import _amz

Shipped = Callable[[str], Path]


# ---- the deploy gate tests this instance's own servers ----------------------------------------------


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A decode server whose /health answers while it refuses every request (it cannot take KV): a 503."""

    posts = 0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts += 1
        body = b'{"error": "KV transfer failed"}'
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def pd_pair(tmp_path: Path) -> Iterator[Callable[[str], tuple[int, int]]]:
    """Strict loopback vLLM fakes (tests/fakes/vllm_pd.py): start(role) -> (port, its side channel port).
    A decode server accepts only the KV transfer parameters the prefill server returned for the prompt."""
    procs: list[subprocess.Popen[bytes]] = []
    fake = Path(__file__).resolve().parent.parent / "fakes" / "vllm_pd.py"

    def start(role: str, engines: dict[str, list[Any]] | None = None) -> tuple[int, int]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        side = port + 1
        argv = [sys.executable, str(fake), "--role", role, "--host", "127.0.0.1", "--port", str(port), "--side-channel-port", str(side)]
        if engines is not None:
            argv += ["--engines", json.dumps(engines)]
        procs.append(subprocess.Popen(argv, env={**os.environ, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                return port, side
            except OSError:
                assert time.monotonic() < deadline, f"the {role} fake did not start"
                time.sleep(0.1)

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _stats(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as r:
        return dict(json.loads(r.read()))


def test_a_router_nodes_replacement_proves_its_own_decode_server_with_a_request_pinned_to_it(
    signal_node: Any, peers: Any, pd_pair: Any, tmp_path: Path
) -> None:
    """A surge replacement of decode-1, a router node: the completion through its router succeeds, but the
    router reaches "decode-1" by name, which is the old instance until it leaves. The gate also sends a
    disaggregated request whose decode half goes to this instance's own decode server, its prefill half to
    a prefill server of the fleet's document (by name, as the router's): the strict fakes accept only a
    handoff exactly as a NIXL proxy makes it."""
    from tests.fakes.vllm_pd import engine_id

    prefill, side = pd_pair("prefill")
    decode, _ = pd_pair("decode", {engine_id("127.0.0.1", prefill): ["127.0.0.1", side]})
    fleet = tmp_path / "router-fleet"
    fleet.write_text(f"domain gptoss.internal\nrestart_gap 60\narg --policy\narg round_robin\npool prefill 0 0 {prefill} {prefill}\npool decode 0 1 8200 8200\n")
    health = f"gptoss-decode.service http://127.0.0.1:{decode}/health decode\ngptoss-proxy.service {peers.url}/readiness proxy\n"
    r = signal_node(health=health, node_env="GPTOSS_MEMBERS_FORM=hosts\n", hosts={"prefill-0": "127.0.0.1"},
                    extra_env={"GPTOSS_ROUTER_FLEET": str(fleet)})  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    (put,) = peers.puts
    assert put["doc"]["Status"] == "SUCCESS", put
    assert put["doc"]["Reason"] == (f"prefill-0: its own decode server http://127.0.0.1:{decode}/v1/completions returned 16 tokens; a "
                                    f"completion through {peers.url}/v1/completions returned 16 tokens")  # fmt: skip
    assert (_stats(prefill)["served"], _stats(decode)["served"]) == (1, 1)
    assert _stats(prefill)["violations"] == [] and _stats(decode)["violations"] == []


def test_a_router_nodes_replacement_whose_own_decode_server_refuses_never_signals_success(
    signal_node: Any, peers: Any, pd_pair: Any, tmp_path: Path
) -> None:
    """Its decode server answers /health but refuses every request (it cannot take KV), while the completion
    through the router succeeds: the old instance still holds the name decode-1 and serves it. The node
    never says SUCCESS: at its deadline (a 302 s gate: 2 s) it says FAILURE, naming its own decode server."""
    prefill, _ = pd_pair("prefill")
    own = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("D", (_Refusing,), {"posts": 0}))
    threading.Thread(target=own.serve_forever, daemon=True).start()
    fleet = tmp_path / "router-fleet"
    fleet.write_text(f"domain gptoss.internal\npool prefill 0 0 {prefill} {prefill}\n")
    health = f"gptoss-decode.service http://127.0.0.1:{own.server_address[1]}/health decode\ngptoss-proxy.service {peers.url}/readiness proxy\n"
    try:
        r = signal_node(health=health, node_env="GPTOSS_MEMBERS_FORM=hosts\n", hosts={"prefill-0": "127.0.0.1"}, timeout=302,
                        query=_amz(signed_ago_s=0), extra_env={"GPTOSS_ROUTER_FLEET": str(fleet)})  # fmt: skip
    finally:
        own.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p["doc"]["Status"] for p in peers.puts] == ["FAILURE"], "never SUCCESS"
    reason = peers.puts[0]["doc"]["Reason"]
    assert reason.startswith(f"prefill-0: not ready before the deploy gate's timeout: its own decode server http://127.0.0.1:{own.server_address[1]}"
                             "/v1/completions refused a request: HTTP 503"), reason  # fmt: skip
    assert own.RequestHandlerClass.posts >= 1  # type: ignore[attr-defined]


def test_a_prefill_node_proves_each_of_its_own_replicas_with_a_prefill_request(signal_node: Any, peers: Any, pd_pair: Any) -> None:
    """A prefill node (no proxy: a router layout) tells its gate SUCCESS once every one of its replicas took a
    real prefill request (the strict fake answers only the handoff a proxy sends); a replica that refuses
    holds the node at wait and is named."""
    ports = [pd_pair("prefill")[0] for _ in range(2)]
    health = "".join(f"gptoss-prefill@{i}.service http://127.0.0.1:{p}/health prefill_{i}\n" for i, p in enumerate(ports))
    r = signal_node(health=health, completion=False)
    assert r.returncode == 0, r.stdout + r.stderr
    (put,) = peers.puts
    assert put["doc"]["Reason"] == "prefill-0: its 2 prefill replicas each took a prefill request"
    assert [_stats(p)["served"] for p in ports] == [1, 1] and all(_stats(p)["violations"] == [] for p in ports)
