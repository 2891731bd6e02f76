"""vLLM's router as the nodes run it, over strict fake servers on loopback, with servers killed under load.

The router is the pinned wheel, installed by the node's own gptoss-install-router from a moto
S3 (the stack's asset) with the real AWS CLI, started by the node's gptoss-router with the
argv `plan` renders for a fleet of 2 decode servers and 6 prefill replicas. Each node gets its
own loopback address (127.N.1.x prefill, 127.N.2.x decode; N this run's own), so every server keeps its
rendered port. The fake servers (tests/fakes/vllm_pd.py) refuse a prefill request that does
not ask for a remote decode of one token and a decode request whose KV parameters are not
exactly what that prefill server returned, with its node's address.

The same load and the same faults then run through the toy proxy (the guest's stand-in of the
examples' toy_proxy_server.py, with its rendered argv): the numbers print side by side.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from clusterspec.loading import load_config
from node_render.command_lines import model_dir
from node_render.haproxy import body_cap
from node_render.paths import router_object_key
from node_render.quoting import env_file as render_env_file
from node_render.render import cluster_env, render_cluster
from tests.api_gate import start_gate
from tests.conftest import ROOT, fake_command, private_etc, with_etc
from tests.fakes.vllm_pd import engine_id
from tests.userdata.conftest import router_node
from tests.userdata.router_fleet import (
    CLIENTS,
    DECODE_MS,
    DURATION_S,
    FAKES,
    FAULT_CLIENTS,
    KILL_DECODE_AT,
    KILL_PREFILL_AT,
    NET,
    PORTS,
    PREFILL_MS,
    RESTART_PREFILL_AT,
    Balancer,
    RouterTelemetry,
    _address,
    _cfg,
    _fleet,
    _numbers,
    _scenario,
)
from tests.userdata.test_members import Ec2Fleet, _members, _members_env


def test_the_node_refuses_a_wheel_whose_sha256_is_not_the_pinned_one(tmp_path: Path, shipped: Any) -> None:
    cfg = _cfg("vllm-router")
    bindir = tmp_path / "bin"
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not the router")
    fake_command(bindir, "aws", f'cp "{bad}" "$4"\n')  # aws s3 cp --only-show-errors SRC DST
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "GPTOSS_ROUTER_FETCH_S": "3", **router_node(cfg, tmp_path, "assets")}
    res = subprocess.run([str(shipped("gptoss-install-router")), str(tmp_path / "venv"), "--", "true"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    r = cfg.serving.proxy.router
    assert f"no intact copy of s3://assets/{router_object_key(r.sha256)} (sha256 {r.sha256}) within 3s" in res.stderr
    assert not (tmp_path / "venv").exists()




def readme_first_request() -> str:
    """The README's first-request block (its ```sh block), as written."""
    section = (ROOT / "README.md").read_text().split("## Send your first request", 1)[1].split("\n## ", 1)[0]
    (body,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    return str(body)


def test_the_readmes_first_request_is_answered_through_the_router_and_its_gate(router_venv: Path, tmp_path: Path) -> None:
    """The README's curl lines and its OpenAI-client script, as written, with the port forward's localhost:8000
    standing for the endpoint: through the API gate (HAProxy) and vLLM's router to the fake servers, a
    completion, a stream of events and the client's text and chunks; the model they name is the one the
    default stack's servers serve (its path on the nodes)."""
    key = "gk-readme-" + "k" * 40
    fleet = _fleet("vllm-router", tmp_path, router_venv, server_args={"decode": ["--stream-ms-per-token", "1"]}, keys={"readme": key})
    try:
        host, port = fleet.endpoints[0]
        block = readme_first_request()
        assert block.count("http://localhost:8000") == 3, block
        # The gate takes only the cluster's keys (a router cluster's default): the block's default 'none' is refused.
        unkeyed = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://{host}:{port}/v1/completions", "-H",
                                  "Authorization: Bearer none", "-d", "{}"], capture_output=True, text=True, timeout=30)  # fmt: skip
        assert unkeyed.stdout == "401", unkeyed
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "GPTOSS_API_KEY": key}
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", block.replace("http://localhost:8000", f"http://{host}:{port}")],
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        fleet.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    # curl: one JSON completion, from the decode server, for the model the default stack serves.
    answer = json.loads(out[0])
    model = model_dir(load_config({}))
    assert answer["choices"][0]["text"] == " ok" and answer["model"] == model, answer
    assert re.findall(rf"model[\"']?:?\s*=?\s*[\"']{re.escape(model)}[\"']", block), f"the README names another model than {model}"
    # curl -N: server-sent events, 32 tokens, then [DONE].
    events = [line for line in out if line.startswith("data: ")]
    assert len(events) == 33 and events[-1] == "data: [DONE]", out
    # The OpenAI client: the text, then the streamed chunks on one line.
    assert out[-2:] == [" ok", "".join(f" t{i}" for i in range(32))], out[-2:]


def test_a_router_restart_goes_lame_duck_first_and_cuts_no_stream(router_venv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A router restarts as its unit does it (ExecStop gptoss-api lame-duck, SIGTERM, a new start that tells the
    gate its fleet document) under 64 streaming clients behind the balancer's stand-in: no stream is cut,
    no request fails, the node leaves the balancer before its router stops and comes back after."""
    fleet = _fleet("vllm-router", tmp_path, router_venv, server_args={"decode": ["--stream-ms-per-token", "25"]})
    node = "decode-0"
    gate = fleet.gates[node]
    argv, env = fleet.router_commands[node]
    fleet_doc = tmp_path / "router-fleet.started"
    fleet_doc.write_text("domain gptoss.internal\n")
    assert gate.api("serving", str(fleet_doc)).returncode == 0
    balancer = Balancer(fleet.endpoints)
    results: list[tuple[float, str, tuple[str, int]]] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    stop = t0 + 24.0
    restart_log: list[tuple[str, float]] = []

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            n += 1
            endpoint = balancer.pick()
            body = json.dumps({"model": "gpt-oss", "prompt": f"client {i} stream {n}", "max_tokens": 24, "stream": True})
            outcome = "cut"
            try:
                conn = http.client.HTTPConnection(*endpoint, timeout=30)
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                if resp.status != 200:
                    outcome = f"status {resp.status}"
                else:
                    data = resp.read()
                    outcome = "ok" if data.rstrip().endswith(b"data: [DONE]") and data.count(b"data: {") == 24 else "cut"
                conn.close()
            except (OSError, http.client.HTTPException) as e:
                outcome = f"cut ({type(e).__name__})"
            with lock:
                results.append((time.monotonic() - t0, outcome, endpoint))

    def restart() -> None:
        restart_log.append(("lame-duck", time.monotonic() - t0))
        lame = gate.api("lame-duck", extra={"GPTOSS_API_LAME_DUCK_S": "2", "GPTOSS_API_DRAIN_S": "60"})
        assert lame.returncode == 0, lame
        restart_log.append(("stop", time.monotonic() - t0))
        fleet.routers[node].terminate()
        fleet.routers[node].wait(30)
        log = (tmp_path / f"proxy-{node}.log").open("ab")
        fleet.routers[node] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        assert gate.api("serving", str(fleet_doc)).returncode == 0
        restart_log.append(("started", time.monotonic() - t0))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        time.sleep(4.0)
        restart()
        for t in threads:
            t.join()
    finally:
        balancer.stop.set()
        fleet.stop()
    outcomes = Counter(o for _, o, _ in results)
    mine = gate.host, gate.port
    back = [t for t, o, e in results if e == mine and t > restart_log[-1][1] and o == "ok"]
    with capsys.disabled():
        print(f"\nrouter restart under {CLIENTS} streaming clients (24 events, 25 ms apart) over 2 nodes behind the balancer's stand-in: "
              f"{dict(outcomes)}; {', '.join(f'{k} at {v:.1f}s' for k, v in restart_log)}; node out of the balancer at "
              f"{[round(t - t0, 1) for t in balancer.out_at[mine]]}s; served again from {min(back) if back else -1:.1f}s")  # fmt: skip
    assert len(results) > 500 and outcomes == {"ok": len(results)}, outcomes
    stopped = dict(restart_log)["stop"]
    assert balancer.out_at[mine] and balancer.out_at[mine][0] - t0 < stopped, "the node left the balancer before its router stopped"
    assert back, "the restarted router serves again"


def test_a_running_router_admits_a_replaced_prefill_node_at_its_new_address_without_a_restart(
    router_venv: Path, moto_url: str, tmp_path: Path, shipped: Any
) -> None:
    """The router of decode-0 over 2 prefill replicas and 1 decode server, with its /etc/hosts kept by
    gptoss-members from EC2 (moto). prefill-1's instance dies; its group launches one of the same
    identity at a new address. The members' next sync rewrites the name; the router's health checks
    reach the new server, and it serves again: the same router process, no restart."""
    cfg = load_config({"decode_instances": 1, "prefill_per_decode": 2, "replicas_per_prefill_instance": 1, "serving.proxy.kind": "vllm-router", **PORTS})
    env, ec2 = _members_env(tmp_path, moto_url, node="decode-0")
    env_file = Path(env["GPTOSS_CLUSTER_ENV"])
    env_file.write_text(render_env_file(cluster_env(cfg, next(n for n in cfg.layout.nodes if n.name == "decode-0"))))
    fleet = Ec2Fleet(ec2)
    ips = {"prefill-0": f"{NET}.1.1", "prefill-1": f"{NET}.1.2", "decode-0": f"{NET}.2.1"}
    for node, ip in ips.items():
        fleet.launch(node, ip)
    etc = private_etc(tmp_path, {})
    assert _members(shipped, env, "hosts").returncode == 0
    port, dport = cfg.serving.prefill.http_port(0), cfg.serving.decode.http_port
    engines = {engine_id(ip, port): [ip, 5559] for ip in (*ips.values(), f"{NET}.1.200")}

    def server(role: str, ip: str, p: int) -> subprocess.Popen[bytes]:
        extra = ["--engines", json.dumps(engines)] if role == "decode" else ["--side-channel-port", "5559"]
        return subprocess.Popen([sys.executable, str(FAKES), "--role", role, "--host", ip, "--port", str(p), *extra],
                                env={**os.environ, "VLLM_NIXL_SIDE_CHANNEL_HOST": ip}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

    procs = [server("prefill", ips["prefill-0"], port), server("prefill", ips["prefill-1"], port), server("decode", ips["decode-0"], dport)]
    (svc,) = [s for r in render_cluster(cfg) if r.node.name == "decode-0" for s in r.services if s.unit == "gptoss-proxy.service"]
    argv = [str(router_venv / "bin" / "python"), str(ROOT / "userdata" / "bin" / "gptoss-router"), *svc.argv[2:]]
    argv[argv.index("--host") + 1] = ips["decode-0"]
    argv[argv.index("--prometheus-host") + 1] = ips["decode-0"]
    assert "http://prefill-1.gptoss.internal:28100" in argv, "the router's pool names nodes, not addresses"
    router = subprocess.Popen(with_etc(argv, etc), stdout=(tmp_path / "router.log").open("wb"), stderr=subprocess.STDOUT)
    procs.append(router)
    try:  # the router and the fakes go with a gate that did not start
        gate = start_gate(tmp_path / "gate", cfg.serving.proxy, host=ips["decode-0"], port=cfg.serving.proxy.port, router_host=ips["decode-0"],
                          router_port=cfg.serving.proxy.router.internal_port)  # fmt: skip
    except BaseException:
        for p in procs:
            p.kill()
        raise
    base = f"http://{ips['decode-0']}:{cfg.serving.proxy.port}"

    def readiness() -> dict[str, Any]:
        try:
            return dict(json.loads(urllib.request.urlopen(f"{base}/readiness", timeout=5).read()))
        except OSError as e:
            body = getattr(e, "read", lambda: b"{}")()
            return dict(json.loads(body or b"{}"))

    def wait(cond: Any, what: str, timeout: float = 90) -> float:
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout, f"{what} not within {timeout}s: {readiness()}"
            time.sleep(0.2)
        return time.monotonic() - t0

    def completions(n: int) -> int:
        ok = 0
        for i in range(n):
            body = json.dumps({"model": "m", "prompt": f"after {i}", "max_tokens": 4}).encode()
            try:
                req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
                ok += json.loads(urllib.request.urlopen(req, timeout=10).read())["choices"][0]["text"] == " ok"
            except OSError:
                pass
        return ok

    try:
        wait(lambda: readiness().get("prefill") == {"healthy": 2, "total": 2}, "both prefill servers healthy")
        assert completions(10) == 10
        procs[1].kill()
        fleet.replace("prefill-1", f"{NET}.1.200")
        wait(lambda: readiness().get("prefill") == {"healthy": 1, "total": 2}, "the dead server out of rotation")
        assert completions(10) == 10, "the router serves with the live replica meanwhile"
        procs.append(server("prefill", f"{NET}.1.200", port))
        res = _members(shipped, env, "sync")
        assert res.returncode == 0 and f"{NET}.1.200 prefill-1.gptoss.internal" in (etc / "hosts").read_text(), res.stdout + res.stderr
        admitted = wait(lambda: readiness().get("prefill") == {"healthy": 2, "total": 2}, "the replacement admitted")
        assert router.poll() is None, "the same router process: it was not restarted"
        assert completions(20) == 20
        stats = json.loads(urllib.request.urlopen(f"http://{NET}.1.200:28100/stats", timeout=5).read())
        assert stats["served"] > 0 and stats["violations"] == [], stats
        print(f"\nreplacement admitted {admitted:.1f}s after the members' sync; it served {stats['served']} of 20 prefills")
    finally:
        gate.stop()
        for p in procs:
            p.kill()


def test_the_pinned_routers_admin_routes_answer_on_loopback_and_never_at_the_endpoint(router_venv: Path, tmp_path: Path) -> None:
    """The real router (the pinned wheel) behind its API gate (HAProxy), as the node starts them: every admin route
    sent to the endpoint is refused and changes nothing (the pool stays whole, completions pass); the
    same route on the router's own port answers, so it is the gate that refuses it."""
    cfg = load_config({"decode_instances": 1, "prefill_per_decode": 1, "replicas_per_prefill_instance": 1, "serving.proxy.kind": "vllm-router", **PORTS})
    ips = {"prefill-0": f"{NET}.1.31", "decode-0": f"{NET}.2.31"}
    port, dport = cfg.serving.prefill.http_port(0), cfg.serving.decode.http_port
    engines = {engine_id(ips["prefill-0"], port): [ips["prefill-0"], 5559]}
    procs = [
        subprocess.Popen([sys.executable, str(FAKES), "--role", "prefill", "--host", ips["prefill-0"], "--port", str(port), "--side-channel-port", "5559"],
                         env={**os.environ, "VLLM_NIXL_SIDE_CHANNEL_HOST": ips["prefill-0"]}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen([sys.executable, str(FAKES), "--role", "decode", "--host", ips["decode-0"], "--port", str(dport), "--engines", json.dumps(engines)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]  # fmt: skip
    (svc,) = [s for r in render_cluster(cfg) if r.node.name == "decode-0" for s in r.services if s.unit == "gptoss-proxy.service"]
    argv = [str(router_venv / "bin" / "python"), str(ROOT / "userdata" / "bin" / "gptoss-router"), *svc.argv[2:]]
    internal_port = PORTS["serving.proxy.router.internal_port"]
    assert argv[2:6] == ["--host", "127.0.0.1", "--port", str(internal_port)], argv[2:6]
    # This node's own address for the router and its gate (every router of this machine on its own loopback address).
    argv[3] = ips["decode-0"]
    argv[argv.index("--prometheus-host") + 1] = ips["decode-0"]
    router = subprocess.Popen(with_etc(argv, private_etc(tmp_path, ips)), stdout=(tmp_path / "router.log").open("wb"), stderr=subprocess.STDOUT)
    procs.append(router)
    try:  # the router and the fakes go with a gate that did not start
        gate = start_gate(tmp_path / "gate", cfg.serving.proxy, host=ips["decode-0"], port=cfg.serving.proxy.port, router_host=ips["decode-0"],
                          router_port=internal_port)  # fmt: skip
    except BaseException:
        for p in procs:
            p.kill()
        raise
    endpoint, internal = f"http://{ips['decode-0']}:{cfg.serving.proxy.port}", f"http://{ips['decode-0']}:{internal_port}"

    def call(base: str, method: str, path: str) -> tuple[int, bytes]:
        req = urllib.request.Request(f"{base}{path}", b"{}" if method == "POST" else None, {"Content-Type": "application/json"}, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except OSError:
            return 0, b""  # not listening yet

    def ready() -> bool:
        status, body = call(endpoint, "GET", "/readiness")
        return status == 200 and json.loads(body).get("prefill") == {"healthy": 1, "total": 1}

    try:
        deadline = time.monotonic() + 90
        while not ready():
            assert router.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()[-3000:]
            time.sleep(0.2)
        admin = [("POST", f"/remove_worker?url=http://prefill-0.gptoss.internal:{port}"), ("POST", "/flush_cache"), ("GET", "/list_workers"),
                 ("GET", "/get_loads"), ("POST", "/add_worker?url=http://evil:1"), ("GET", "/get_server_info"), ("GET", "/workers")]  # fmt: skip
        for method, path in admin:
            status, body = call(endpoint, method, path)
            assert status == 404 and json.loads(body)["error"]["type"] == "gptoss_api_gate", (method, path, status, body)
        assert ready(), "after every admin route at the endpoint the pool is whole"
        status, body = call(internal, "GET", "/list_workers")
        assert status == 200 and f"prefill-0.gptoss.internal:{port}".encode() in body, "the route exists: the router answers it on its own port"
        prompt = json.dumps({"model": "m", "prompt": "through the gate " * 2000, "max_tokens": 4}).encode()
        req = urllib.request.Request(f"{endpoint}/v1/completions", prompt, {"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(req, timeout=30).read())["choices"][0]["text"] == " ok"
        # A chunked body has no length for the gate to read: the router refuses it past the same cap (10,240 tokens x 16 B + 64 KiB).
        assert body_cap(cfg.serving.proxy, cfg.serving.shape.max_model_len) == 229_376

        def chunked(body: bytes) -> bytes:
            with socket.create_connection((ips["decode-0"], cfg.serving.proxy.port), timeout=30) as conn:
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                             b"Connection: close\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 16384]), body[i:i + 16384])
                                                                     for i in range(0, len(body), 16384)) + b"0\r\n\r\n")  # fmt: skip
                out = b""
                while chunk := conn.recv(65536):
                    out += chunk
            return out

        # Under the cap (200,000 B, longer than the gate's buffer) it is served; over it (245,760 B) the router answers 413.
        under = json.dumps({"model": "m", "prompt": "y" * (200_000 - 45), "max_tokens": 4}).encode()
        assert len(under) == 200_000, len(under)
        answer = chunked(under)
        assert answer.startswith(b"HTTP/1.1 200 ") and b'" ok"' in answer, answer[:300]
        answer = chunked(b"y" * 245_760)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"gptoss_api_gate" not in answer and b"content-type: text/plain" in answer.lower(), answer[:300]  # the router's own
    finally:
        gate.stop()
        for p in procs:
            p.kill()


def test_the_pinned_routers_power_of_two_balances_on_a_route_vllm_does_not_serve(router_venv: Path, tmp_path: Path) -> None:
    """Why the default policy is round_robin: with power_of_two, the pinned router asks every server for
    /get_load (SGLang's route), which a vLLM API server answers 404 (the fakes serve only vLLM's routes:
    /health, /metrics, the API); with the default it asks nothing of the kind."""
    for policy, expect_get_load in (("power_of_two", True), (None, False)):
        overrides = {} if policy is None else {"serving.proxy.router.prefill_policy": policy, "serving.proxy.router.decode_policy": policy}
        (tmp_path / str(policy)).mkdir()
        fleet = _fleet("vllm-router", tmp_path / str(policy), router_venv, overrides=overrides)
        try:
            for i in range(12):
                host, port = fleet.endpoints[i % len(fleet.endpoints)]
                body = json.dumps({"model": "m", "prompt": f"load {i}", "max_tokens": 2}).encode()
                req = urllib.request.Request(f"http://{host}:{port}/v1/completions", body, {"Content-Type": "application/json"})
                assert json.loads(urllib.request.urlopen(req, timeout=30).read())["choices"][0]["text"] == " ok"
            time.sleep(2)  # the routers' load polls (power_of_two's run every second or so)
            asked = {name: fleet.stats(name)["asked"] for name in fleet.procs}
        finally:
            fleet.stop()
        get_load = sum(a.get("/get_load", 0) for a in asked.values())
        assert (get_load > 0) is expect_get_load, (policy, asked)
        assert not any(set(a) - {"/get_load", "/metrics"} for a in asked.values()), asked


def test_router_keeps_serving_when_a_prefill_replica_or_a_decode_server_dies(
    router_venv: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg("vllm-router")
    r = cfg.serving.proxy.router
    # How long a dead server can still be picked: failed checks in a row, two seconds' slack. A killed
    # server refuses connections, so its checks fail at once, not after the check's timeout (a
    # server that stops answering takes the timeout more: bench-health's hung and dead rows).
    window = r.health_failure_threshold * r.health_check_interval_s + 2
    assert KILL_PREFILL_AT + window < RESTART_PREFILL_AT and KILL_DECODE_AT + window < DURATION_S, "each window ends inside the run"
    probe = RouterTelemetry(f"http://{_address('decode-0')}:{r.metrics_port}/metrics")
    run, _, who = _scenario("vllm-router", tmp_path_factory.mktemp("router-run"), router_venv, probe)
    router = _numbers(run, who, window)
    toy_run, _, toy_who = _scenario("toy", tmp_path_factory.mktemp("toy-run"), None)
    toy = _numbers(toy_run, toy_who, window)
    with capsys.disabled():
        print(f"\n{FAULT_CLIENTS} clients for {DURATION_S:.0f}s over 2 endpoints, 6 prefill replicas ({PREFILL_MS} ms) and 2 decode servers "
              f"({DECODE_MS} ms), loopback; prefill replica killed at {KILL_PREFILL_AT:.0f}s, back at {RESTART_PREFILL_AT:.0f}s; "
              f"decode server killed at {KILL_DECODE_AT:.0f}s; health window {window}s")  # fmt: skip
        print(f"{'':<58}{'router':>10}{'toy':>10}")
        for key in router:
            print(f"{key:<58}{router[key]:>10}{toy[key]:>10}")
        print(f"failures by kind: router {dict(run.kinds)}; toy {dict(toy_run.kinds)}")
    # Every completion went prefill -> decode with the parameters that prefill returned.
    assert run.violations == [], run.violations[:3]
    assert router["requests"] > 1000, router
    # A request the router sent to a dead server is answered 500 before any byte, and the API gate sends
    # it again through the router (2 more attempts), which picks anew: it fails only when all three
    # picks were the dead server, before its health checks take it out: a 1/6 x 1/6 share of the
    # dead replica's 1/6 in the window, a 1/2 x 1/2 share of the dead decode server's 1/2 (twice that
    # here, for the machine's load). Without retries every request sent there fails (1/6 and 1/2 of the
    # window's requests: the 235 and 946 of docs/benchmarks.md before the gate retried).
    # Nothing fails once the server is out of rotation. The toy proxy keeps failing until the server is back.
    rate = router["requests"] / DURATION_S
    assert router["failed while the replica was dead"] <= 2 * rate * window / 6 / 36, router
    assert router["failed after the decode kill"] <= 2 * rate * window / 2 / 4, router
    assert set(run.kinds) <= {"500"}, run.kinds
    assert router["failed after the health window"] == 0, router
    assert toy["failed after the health window"] > 0, toy
    # The replica that came back is used again within the health interval (plus its own start).
    assert 0 <= router["replica used again after (s)"] <= r.health_check_interval_s * r.health_success_threshold + 3, router
    # Decode traffic moved to the live server.
    assert router["decode requests on the live server after its peer died"] > 100, router
    # The node's collector reads the real router's metrics: what it served, what failed, who is out.
    first, last = probe.values
    assert first["RouterUnhealthyServers"] == 0 and last["RouterUnhealthyServers"] == 1, probe.values
    seen = run.total(0.5, DURATION_S - 0.5) / 2  # half the clients use this router
    # A rate the collector derives over its own interval: the clients' rate, within a factor the machine's load cannot break.
    assert 0.5 * seen / (DURATION_S - 1) <= last["RouterRequestsPerSecond"] <= 1.5 * seen / (DURATION_S - 1), (last, seen)
    assert 0 < last["RouterErrorPercent"] < 25 and last["RouterErrorsPerSecond"] > 0, last
