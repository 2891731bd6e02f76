"""A server leaves vLLM's routers before it restarts in place (gptoss_drain.py, gptoss-drain, gptoss-apply).

The middleware is the shipped module, loaded as vLLM loads a --middleware class (tests/fakes/vllm_middleware.py
runs each request's head through it, as the fake servers do). The drain under load runs the real router wheel
behind the real HAProxy gates, the fake servers of tests/fakes/vllm_pd.py with the plan's middleware, and the
real gptoss-drain with the drain.env the node renders.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from node_render.paths import DRAIN_ENV
from node_render.render import render_cluster
from tests.conftest import ROOT
from tests.fakes import vllm_middleware
from tests.userdata.router_fleet import Balancer, _address, _cfg, _fleet, _wait

BIN = ROOT / "userdata" / "bin"


@pytest.fixture
def drain_class(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Any, Path]:
    """The Drain class as vLLM imports it (from the node's bin folder), its drain file in tmp_path."""
    marker = tmp_path / "servers-draining"
    monkeypatch.setenv("GPTOSS_DRAIN_FILE", str(marker))
    monkeypatch.setenv("GPTOSS_DRAIN_HEALTH_PATH", "/health")
    monkeypatch.syspath_prepend(str(BIN))
    (cls,) = vllm_middleware.load(["gptoss_drain.Drain"])
    return cls, marker


def test_the_health_route_answers_503_while_the_drain_file_holds_and_nothing_else_changes(drain_class: tuple[Any, Path]) -> None:
    cls, marker = drain_class
    assert vllm_middleware.answer([cls], "GET", "/health") is None, "no drain file: vLLM answers its health route"
    marker.write_text(f"{time.time() + 60:.0f}\n")
    status, headers, body = vllm_middleware.answer([cls], "GET", "/health") or (0, [], b"")
    assert status == 503 and (b"content-type", b"application/json") in headers and b"draining" in body
    assert vllm_middleware.answer([cls], "GET", "/health?x=1") is not None, "the path, whatever the query"
    for method, path in (("POST", "/v1/completions"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/healthz")):
        assert vllm_middleware.answer([cls], method, path) is None, f"{method} {path} is served while it drains"
    marker.write_text(f"{time.time() - 1:.0f}\n")
    assert vllm_middleware.answer([cls], "GET", "/health") is None, "a drain file past its time counts no more (a drain that never ended)"
    marker.write_text("")
    assert vllm_middleware.answer([cls], "GET", "/health") is not None, "a file without a time (made by hand) counts until it goes"
    marker.unlink()
    assert vllm_middleware.answer([cls], "GET", "/health") is None


def test_a_decode_server_leaves_the_routers_finishes_its_streams_and_restarts_while_no_client_request_fails(
    router_venv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two decode servers behind two routers (each behind its HAProxy gate and the balancer's stand-in), 32
    streaming clients. decode-1's server restarts as gptoss-apply restarts it: `gptoss-drain start` (its health
    route answers 503; the routers' checks take it out; what it holds finishes), `gptoss-drain end`, then the
    process is killed and started again. No request fails, none is cut, and the restarted server serves again.
    Then the same restart without the drain, like for like: the streams it held are cut."""
    cfg = _cfg("vllm-router")
    fleet = _fleet("vllm-router", tmp_path, router_venv, server_args={"decode": ["--stream-ms-per-token", "25"]}, drain=True)
    server = f"{_address('decode-1')}:{cfg.serving.decode.http_port}"
    # The drain.env decode-1 renders, its metrics at the node's own loopback address here.
    rendered = next(r for r in render_cluster(cfg) if r.node.name == "decode-1").files[DRAIN_ENV][0]
    drain_env = tmp_path / "drain.env"
    drain_env.write_text(rendered.replace(f"127.0.0.1:{cfg.serving.decode.http_port}", server))
    env = {**os.environ, "GPTOSS_DRAIN_ENV": str(drain_env), "GPTOSS_DRAIN_FILE": str(fleet.drain_files[server]), "GPTOSS_DRAIN_POLL_S": "0.2"}
    balancer = Balancer(fleet.endpoints)
    results: list[tuple[float, str]] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    done = threading.Event()
    steps: dict[str, float] = {}

    def client(i: int) -> None:
        n = 0
        while not done.is_set():
            n += 1
            body = json.dumps({"model": "gpt-oss", "prompt": f"client {i} stream {n}", "max_tokens": 24, "stream": True})
            outcome = "cut"
            try:
                conn = http.client.HTTPConnection(*balancer.pick(), timeout=60)
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                outcome = f"status {resp.status}" if resp.status != 200 else ("ok" if data.count(b"data: {") == 24 and b"data: [DONE]" in data else "cut")
                conn.close()
            except (OSError, http.client.HTTPException) as e:
                outcome = f"cut ({type(e).__name__})"
            with lock:
                results.append((time.monotonic() - t0, outcome))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    try:
        for t in threads:
            t.start()
        time.sleep(3.0)
        served_before = fleet.stats(server)["served"]
        steps["drain"] = time.monotonic() - t0
        drained = subprocess.run([str(BIN / "gptoss-drain"), "start", "gptoss-decode.service"], env=env, capture_output=True, text=True, timeout=120)
        assert drained.returncode == 0, drained.stdout + drained.stderr
        steps["drained"] = time.monotonic() - t0
        held = fleet.stats(server)["served"]
        assert subprocess.run([str(BIN / "gptoss-drain"), "end"], env=env, timeout=30).returncode == 0
        assert not fleet.drain_files[server].exists()
        fleet.kill(server)
        steps["killed"] = time.monotonic() - t0
        fleet.start(server)
        _wait(f"http://{server}/health")
        steps["started"] = time.monotonic() - t0
        deadline = time.monotonic() + 30
        while fleet.stats(server)["served"] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        steps["serves again"] = time.monotonic() - t0
        time.sleep(3.0)
        # The control: the same kill and start, without the drain.
        steps["killed undrained"] = time.monotonic() - t0
        fleet.kill(server)
        fleet.start(server)
        _wait(f"http://{server}/health")
        time.sleep(5.0)
    finally:
        done.set()
        for t in threads:
            t.join()
        balancer.stop.set()
        fleet.stop()
    outcomes = Counter(o for t, o in results if t < steps["killed undrained"])
    control = Counter(o for t, o in results if t >= steps["killed undrained"])
    with capsys.disabled():
        print(f"\na decode server drained and restarted under 32 streaming clients (24 events, 25 ms apart; 2 decode servers, 2 routers "
              f"behind their gates, loopback): {dict(outcomes)}; {', '.join(f'{k} at {v:.1f}s' for k, v in steps.items())}; "
              f"served {served_before} before the drain, {held} when it ended; {drained.stdout.strip().splitlines()[-1]}; "
              f"the same restart without the drain: {dict(control)}")  # fmt: skip
    assert "no request left on gptoss-decode.service" in drained.stdout, drained.stdout + drained.stderr
    assert len(results) > 200 and outcomes == {"ok": sum(outcomes.values())}, outcomes
    assert sum(n for o, n in control.items() if o != "ok") > 0, f"without the drain the restart cuts what it held: {control}"
    assert held > served_before > 0, "it served until the routers took it out"
    assert steps["serves again"] - steps["started"] < 30, "the restarted server serves again"
