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

import hashlib
import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest

from clusterspec.loading import load_config
from node_render import telemetry
from node_render.command_lines import router_fleet
from node_render.paths import WHEELS_DIR, router_parameter
from node_render.quoting import env_file as render_env_file
from node_render.render import cluster_env, render_cluster
from tests.api_gate import Gate, start_gate
from tests.conftest import ROOT, fake_command, private_etc, real_aws_cli, serve_health, with_etc
from tests.fakes.vllm_pd import engine_id

FAKES = ROOT / "tests" / "fakes" / "vllm_pd.py"
GUEST_FAKES = ROOT / "tests" / "vm" / "guest" / "rootfs" / "usr" / "local" / "lib" / "fakes"
TOY = ROOT / "tests" / "vm" / "guest" / "examples"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-2"}
# A loopback network of this run's own (127.N.0.0/16, N from the process id): two runs on one machine
# bind different addresses. Ports of their own too, so a service of this machine on the defaults cannot collide.
NET = f"127.{16 + os.getpid() % 224}"
PORTS = {"serving.proxy.port": 28000, "serving.proxy.group_health_port": 28001, "serving.decode.http_port": 28200,
         "serving.prefill.http_port_base": 28100, "serving.proxy.router.metrics_port": 28029, "serving.proxy.router.internal_port": 28010}  # fmt: skip
FLEET = {"decode_instances": 2, "prefill_per_decode": 3, "replicas_per_prefill_instance": 3, **PORTS}
CLIENTS = 64
DURATION_S = 20.0
KILL_PREFILL_AT, RESTART_PREFILL_AT, KILL_DECODE_AT = 2.0, 10.0, 12.0
PREFILL_MS, DECODE_MS = 30, 120


def _address(node: str) -> str:
    role, index = node.split("-")
    return f"{NET}.{1 if role == 'prefill' else 2}.{int(index) + 1}"


def _cfg(kind: str, overrides: dict[str, Any] | None = None) -> Any:
    return load_config({**FLEET, "serving.proxy.kind": kind} | (overrides or {}))


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def _wait(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not answer within {timeout_s}s") from None
            time.sleep(0.1)


@pytest.fixture(scope="module")
def router_venv(tmp_path_factory: pytest.TempPathFactory, shipped: Any, moto_url: str) -> Path:
    """The router's venv as a node builds it: the wheel from S3, checked, installed offline."""
    cfg = _cfg("vllm-router")
    r = cfg.serving.proxy.router
    wheel = WHEELS_DIR / r.wheel
    assert wheel.is_file(), f"{wheel} is missing: `make setup` fetches the pinned router wheel"
    tmp = tmp_path_factory.mktemp("router")
    url = moto_url
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-2", **{k.lower(): v for k, v in CREDS.items() if k != "AWS_DEFAULT_REGION"})
    s3.create_bucket(Bucket="assets", CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    s3.upload_file(str(wheel), "assets", "0e2d912c.whl")
    bindir = tmp / "bin"
    real_aws_cli(bindir)
    env_file = tmp / "cluster.env"
    node = next(n for n in cfg.layout.nodes if n.name == "decode-0")
    env_file.write_text(render_env_file(cluster_env(cfg, node)))
    venv = tmp / "venv"
    env = {**os.environ, **CREDS, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "AWS_ENDPOINT_URL": url,
           "GPTOSS_CLUSTER_ENV": str(env_file), "GPTOSS_ROUTER_URI": "s3://assets/0e2d912c.whl", "GPTOSS_ROOT": str(tmp)}  # fmt: skip
    res = subprocess.run([str(shipped("gptoss-install-router")), str(venv), "--", "true"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (venv / ".gptoss-wheel-sha256").read_text().strip() == r.sha256
    # A second start installs nothing and needs no S3.
    res = subprocess.run([str(shipped("gptoss-install-router")), str(venv), "--", "echo", "started"],
                         env=env | {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == "started", res.stdout + res.stderr
    return venv


def test_the_node_refuses_a_wheel_whose_sha256_is_not_the_pinned_one(tmp_path: Path, shipped: Any) -> None:
    cfg = _cfg("vllm-router")
    bindir = tmp_path / "bin"
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not the router")
    fake_command(bindir, "aws", f'cp "{bad}" "$4"\n')  # aws s3 cp --only-show-errors SRC DST
    env_file = tmp_path / "cluster.env"
    node = next(n for n in cfg.layout.nodes if n.name == "decode-0")
    env_file.write_text(render_env_file(cluster_env(cfg, node)))
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "GPTOSS_CLUSTER_ENV": str(env_file),
           "GPTOSS_ROUTER_URI": "s3://assets/x.whl", "GPTOSS_ROOT": str(tmp_path), "GPTOSS_ROUTER_FETCH_S": "3"}  # fmt: skip
    res = subprocess.run([str(shipped("gptoss-install-router")), str(tmp_path / "venv"), "--", "true"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert f"no intact copy of s3://assets/x.whl (sha256 {cfg.serving.proxy.router.sha256}) within 3s" in res.stderr
    assert not (tmp_path / "venv").exists()


@dataclass
class Fleet:
    """The fake servers of one run, each its own process, and the endpoints clients use."""

    kind: str
    tmp: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    endpoints: list[tuple[str, int]] = field(default_factory=list)
    routers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    gates: dict[str, Gate] = field(default_factory=dict)
    router_commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)

    def start(self, name: str) -> None:
        log = (self.tmp / f"{name.replace(':', '_')}.log").open("ab")
        self.procs[name] = subprocess.Popen(self.commands[name], env=self.envs[name], stdout=log, stderr=subprocess.STDOUT)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stats(self, name: str) -> dict[str, Any]:
        host, port = name.split(":")
        return json.loads(urllib.request.urlopen(f"http://{host}:{port}/stats", timeout=5).read())

    def stop(self) -> None:
        for p in [*self.procs.values(), *self.routers.values()]:
            if p.poll() is None:
                p.kill()
                p.wait()
        for g in self.gates.values():
            g.stop()


def _substitute(argv: list[str], names: dict[str, str]) -> list[str]:
    out = []
    for a in argv:
        for node, ip in names.items():
            a = a.replace(f"<{node}>", ip)
        out.append(a)
    return out


def _fleet(kind: str, tmp: Path, router_venv: Path | None, prefill_ms: float = PREFILL_MS, decode_ms: float = DECODE_MS, gate: bool = True,
           overrides: dict[str, Any] | None = None, server_args: dict[str, list[str]] | None = None) -> Fleet:  # fmt: skip
    """Start the fake servers and the rendered proxies or routers of a 2-decode, 6-replica fleet (gate=False: each
    router bound to the endpoint itself, without its API gate: only `make bench-proxy` asks, to measure the gate's cost).
    `overrides` change the spec (the benchmarks' policies); `server_args` add flags of the fake servers by role."""
    cfg = _cfg(kind, overrides)
    extra = server_args or {}
    s = cfg.serving
    fleet = Fleet(kind, tmp)
    names = {n.name: _address(n.name) for n in cfg.layout.nodes}
    engines = {}
    renders = render_cluster(cfg)
    for r in renders:
        for svc in r.services:
            if not svc.unit.startswith("gptoss-prefill@"):
                continue
            ip, port = names[r.node.name], int(svc.environment["GPTOSS_HTTP_PORT"])
            side = _substitute([svc.environment["VLLM_NIXL_SIDE_CHANNEL_HOST"]], names)[0]
            side_port = int(svc.environment["VLLM_NIXL_SIDE_CHANNEL_PORT"])
            # The decode server's check: the address a KV handshake must reach is the node's.
            engines[engine_id(ip, port)] = [ip, side_port]
            name = f"{ip}:{port}"
            fleet.commands[name] = [sys.executable, str(FAKES), "--role", "prefill", "--host", ip, "--port", str(port),
                                    "--side-channel-port", str(side_port), "--latency-ms", str(prefill_ms), *extra.get("prefill", [])]  # fmt: skip
            fleet.envs[name] = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_HOST": side}
    for n in cfg.layout.decode_nodes:
        name = f"{names[n.name]}:{s.decode.http_port}"
        fleet.commands[name] = [sys.executable, str(FAKES), "--role", "decode", "--host", names[n.name], "--port", str(s.decode.http_port),
                                "--latency-ms", str(decode_ms), "--engines", json.dumps(engines), *extra.get("decode", [])]  # fmt: skip
        fleet.envs[name] = dict(os.environ)
    for name in fleet.commands:
        host, port = name.split(":")
        assert _free(host, int(port)), f"{name} is taken on this machine"
        fleet.start(name)
    for name in fleet.commands:
        _wait(f"http://{name}/health")
    for r in renders:
        for svc in r.services:
            if svc.unit != "gptoss-proxy.service":
                continue
            ip = names[r.node.name]
            argv = _substitute(svc.argv, names)
            # Each node binds its own address (the spec's 0.0.0.0 would take the port on all of them;
            # the router's loopback its internal port, for every router of this machine at once).
            argv[argv.index("--host") + 1] = ip
            if kind == "vllm-router":
                if gate:
                    # The node's API gate: HAProxy with the rendered configuration, in front of the router.
                    fleet.gates[r.node.name] = start_gate(tmp / f"gate-{r.node.name}", s.proxy, host=ip, port=s.proxy.port, router_host=ip,
                                                          router_port=s.proxy.router.internal_port, max_model_len=s.shape.max_model_len)  # fmt: skip
                else:
                    argv[argv.index("--port") + 1] = str(s.proxy.port)
            env = dict(os.environ)
            if kind == "vllm-router":
                assert argv[:2] == [f"{router_venv_path(cfg)}/bin/python", "/opt/gptoss/bin/gptoss-router"], argv[:2]
                argv[:2] = [str(router_venv / "bin" / "python"), str(ROOT / "userdata" / "bin" / "gptoss-router")]  # type: ignore[operator]
                argv[argv.index("--prometheus-host") + 1] = ip
            else:
                assert argv[:2] == ["python3", f"/opt/gptoss/vllm-neuron/{s.proxy.script}"], argv[:2]
                argv[:2] = [sys.executable, str(TOY / s.proxy.script)]
                env |= {"PYTHONPATH": str(GUEST_FAKES), "FAKES_RECORDS": str(tmp / "records")}
            if kind == "vllm-router":
                # The router reaches every server by its node's name, which the node's /etc/hosts holds.
                argv = with_etc(argv, private_etc(tmp / f"etc-{r.node.name}", names))
            log = (tmp / f"proxy-{r.node.name}.log").open("ab")
            fleet.router_commands[r.node.name] = (argv, env)
            fleet.routers[r.node.name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            fleet.endpoints.append((ip, s.proxy.port))
    try:
        for ip, port in fleet.endpoints:
            _wait(f"http://{ip}:{port}{cfg.proxy_health_path}")
    except BaseException:
        fleet.stop()  # no server or router outlives a fleet that did not come up
        raise
    return fleet


def router_venv_path(cfg: Any) -> str:
    from node_render.paths import router_venv

    return router_venv(cfg.serving.proxy.router.version, cfg.serving.proxy.router.sha256)


@dataclass
class Run:
    """What the clients saw: (time since start, ok, endpoint) per request, and the servers' own counts."""

    results: list[tuple[float, bool]]
    served: dict[str, list[float]]
    violations: list[str]
    t0: float
    kinds: Counter[str] = field(default_factory=Counter)

    def failed(self, start: float, end: float) -> int:
        return sum(1 for t, ok in self.results if start <= t < end and not ok)

    def total(self, start: float, end: float) -> int:
        return sum(1 for t, _ in self.results if start <= t < end)


def _load(fleet: Fleet, faults: list[tuple[float, Any]]) -> Run:
    """CLIENTS clients for DURATION_S seconds, spread over the endpoints as the NLB would; faults at their times."""
    results: list[tuple[float, bool]] = []
    kinds: Counter[str] = Counter()
    lock = threading.Lock()
    t0 = time.monotonic()
    stop = t0 + DURATION_S

    def client(i: int) -> None:
        host, port = fleet.endpoints[i % len(fleet.endpoints)]
        n = 0
        conn = http.client.HTTPConnection(host, port, timeout=30)
        while time.monotonic() < stop:
            n += 1
            body = json.dumps({"model": "gpt-oss", "prompt": f"client {i} request {n}", "max_tokens": 8})
            ok, kind = False, ""
            try:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                ok = resp.status == 200 and json.loads(data).get("choices", [{}])[0].get("text") == " ok"
                kind = str(resp.status) if resp.status != 200 else "bad answer"
                if resp.getheader("Connection", "").lower() == "close":
                    conn.close()
            except (OSError, http.client.HTTPException, ValueError) as e:
                kind = type(e).__name__
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=30)
            with lock:
                results.append((time.monotonic() - t0, ok))
                if not ok:
                    kinds[kind] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for at, action in faults:
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        action()
    for t in threads:
        t.join()
    served: dict[str, list[float]] = {}
    violations: list[str] = []
    wall = time.time() - (time.monotonic() - t0)
    for name, proc in fleet.procs.items():
        if proc.poll() is None:
            st = fleet.stats(name)
            served[name] = [t - wall for t in st["times"]]
            violations += st["violations"]
    return Run(results, served, violations, t0, kinds)


def _scenario(kind: str, tmp: Path, router_venv: Path | None, collect: Any = None) -> tuple[Run, Fleet, dict[str, str]]:
    fleet = _fleet(kind, tmp, router_venv)
    prefill = sorted(n for n in fleet.commands if n.startswith(f"{NET}.1."))
    decodes = sorted(n for n in fleet.commands if n.startswith(f"{NET}.2."))
    victim, dead_decode = prefill[1], decodes[1]
    faults = [(KILL_PREFILL_AT, lambda: fleet.kill(victim)), (RESTART_PREFILL_AT, lambda: fleet.start(victim)),
              (KILL_DECODE_AT, lambda: fleet.kill(dead_decode))]  # fmt: skip
    if collect:
        faults = sorted([(0.5, collect), *faults, (DURATION_S - 0.5, collect)], key=lambda f: f[0])
    try:
        run = _load(fleet, faults)
    finally:
        fleet.stop()
    return run, fleet, {"victim": victim, "dead_decode": dead_decode, "live_decode": decodes[0]}


class RouterTelemetry:
    """The node's collector (gptoss-telemetry) reading one real router's metrics, as it does every interval."""

    def __init__(self, url: str) -> None:
        from tests.unit.test_node_gate_and_telemetry import _collector

        cfg = {"cluster": "c", "node": "decode-0", "role": "decode", "interval_s": 60, "neuron": False, "servers": [], "units": [],
               "metrics": [m.name for m in telemetry.ALL_METRICS], "router_metrics_url": url}  # fmt: skip
        self.collector = _collector().Collector(cfg)
        self.values: list[dict[str, float]] = []

    def __call__(self) -> None:
        out: dict[str, float] = {}
        self.collector.router(time.monotonic(), lambda name, value, unit, dims: out.__setitem__(name, value), [])
        self.values.append(out)


def _numbers(run: Run, who: dict[str, str], health_window_s: float) -> dict[str, float]:
    after_restart = [t for t in run.served.get(who["victim"], []) if t >= RESTART_PREFILL_AT]
    return {
        "requests": run.total(0, DURATION_S),
        "failed": run.failed(0, DURATION_S),
        "failed while the replica was dead": run.failed(KILL_PREFILL_AT, RESTART_PREFILL_AT),
        "failed after the health window": run.failed(KILL_PREFILL_AT + health_window_s, RESTART_PREFILL_AT)
        + run.failed(KILL_DECODE_AT + health_window_s, DURATION_S),
        "failed after the decode kill": run.failed(KILL_DECODE_AT, DURATION_S),
        "replica used again after (s)": round(min(after_restart) - RESTART_PREFILL_AT, 1) if after_restart else -1,
        "decode requests on the live server after its peer died": sum(1 for t in run.served.get(who["live_decode"], []) if t >= KILL_DECODE_AT),
        "violations": len(run.violations),
    }


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
        print(f"\n{CLIENTS} clients for {DURATION_S:.0f}s over 2 endpoints, 6 prefill replicas ({PREFILL_MS} ms) and 2 decode servers "
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


class Balancer:
    """The load balancer's stand-in (an NLB cannot run here): it checks each node's /readiness every
    INTERVAL_S, a node is in after 2 answers 200 in a row and out after 2 failures (the target group's
    thresholds, its 10 s interval scaled down), and each new connection goes to a node that is in."""

    INTERVAL_S = 0.25

    def __init__(self, endpoints: list[tuple[str, int]]) -> None:
        self.endpoints = endpoints
        self.healthy = {e: True for e in endpoints}
        self.streak = {e: 0 for e in endpoints}
        self.out_at: dict[tuple[str, int], list[float]] = {e: [] for e in endpoints}
        self.stop = threading.Event()
        self.turn = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.INTERVAL_S):
            for e in self.endpoints:
                try:
                    ok = urllib.request.urlopen(f"http://{e[0]}:{e[1]}/readiness", timeout=1).status == 200
                except OSError:
                    ok = False
                self.streak[e] = (max(self.streak[e], 0) + 1) if ok else (min(self.streak[e], 0) - 1)
                if self.healthy[e] and self.streak[e] <= -2:
                    self.healthy[e] = False
                    self.out_at[e].append(time.monotonic())
                elif not self.healthy[e] and self.streak[e] >= 2:
                    self.healthy[e] = True

    def pick(self) -> tuple[str, int]:
        ready = [e for e in self.endpoints if self.healthy[e]] or self.endpoints
        self.turn += 1
        return ready[self.turn % len(ready)]


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


def _members_env(tmp: Path, url: str, node: str = "decode-1", kind: str = "vllm-router") -> tuple[dict[str, str], Any]:
    """The environment of gptoss-members on `node`, and an EC2 client of the same moto."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=10)
    cfg = _cfg(kind)
    values = cluster_env(cfg, next(n for n in cfg.layout.nodes if n.name == node))
    env_file = tmp / "cluster.env"
    env_file.write_text(render_env_file(values))
    bindir = tmp / "bin"
    real_aws_cli(bindir)
    fake_command(bindir, "systemctl", f'echo "$*" >> "{tmp}/systemctl.log"\n')
    env = {**os.environ, **CREDS, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "AWS_ENDPOINT_URL": url,
           "GPTOSS_CLUSTER_ENV": str(env_file), "GPTOSS_MEMBERS_ENV": str(tmp / "members.env"), "GPTOSS_HOSTS_FILE": str(tmp / "etc" / "hosts")}  # fmt: skip
    ec2 = boto3.client("ec2", endpoint_url=url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    if kind == "vllm-router":
        # The routers' settings and pool: the stack's one SSM parameter (gptoss-members copies it to the node).
        ssm = boto3.client("ssm", endpoint_url=url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
        proxy = next(p for p in cfg.layout.proxies if p.kind == "vllm-router")
        ssm.put_parameter(Name=router_parameter(cfg.cluster_name), Value=router_fleet(cfg, proxy), Type="String", Overwrite=True)
        env["GPTOSS_ROUTER_FLEET"] = str(tmp / "router-fleet")
    return env, ec2


class Ec2Fleet:
    """The fleet's instances as EC2 reports them (moto): each tagged with its identity, at an address of the test's."""

    def __init__(self, ec2: Any, cidr: str = f"{NET}.0.0/16", cluster: str = "gptoss-8k1k") -> None:
        self.ec2, self.cluster = ec2, cluster
        vpc = ec2.create_vpc(CidrBlock=cidr)["Vpc"]["VpcId"]
        self.subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=cidr)["Subnet"]["SubnetId"]
        self.ids: dict[str, str] = {}

    def launch(self, node: str, ip: str, cluster: str | None = None, group: bool = True) -> str:
        """An instance of `node` at `ip`; launched by its group (which adds aws:autoscaling:groupName), or not."""
        tags = [{"Key": "gptoss:cluster", "Value": cluster or self.cluster}, {"Key": "gptoss:node", "Value": node}]
        if group:
            tags.append({"Key": "aws:autoscaling:groupName", "Value": f"{cluster or self.cluster}-{node}"})
        i = self.ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, SubnetId=self.subnet, PrivateIpAddress=ip,
                                   TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])["Instances"][0]  # fmt: skip
        if cluster is None:
            self.ids[node] = i["InstanceId"]
        return str(i["InstanceId"])

    def replace(self, node: str, ip: str) -> None:
        """What the node's group does when its instance fails: the old one goes, one of the same identity comes."""
        self.ec2.terminate_instances(InstanceIds=[self.ids[node]])
        self.launch(node, ip)


FLEET_IPS = {"prefill-0": f"{NET}.1.1", "prefill-1": f"{NET}.1.2", "decode-0": f"{NET}.2.1", "decode-1": f"{NET}.2.2"}


def _members(shipped: Any, env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(shipped("gptoss-members")), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_members_come_from_ec2_by_identity_tag_and_only_the_hosts_block_changes(moto_url: str, tmp_path: Path, shipped: Any) -> None:
    env, ec2 = _members_env(tmp_path, moto_url)
    fleet = Ec2Fleet(ec2)
    for node, ip in FLEET_IPS.items():
        fleet.launch(node, ip)
    fleet.launch("decode-0", f"{NET}.9.9", cluster="another-cluster")  # same node name, another cluster: never a member
    # An instance someone tagged as decode-1 of this cluster, launched after it, but by no group of the
    # cluster's (its aws:autoscaling:groupName only Auto Scaling sets): never a member, newer or not.
    fleet.launch("decode-1", f"{NET}.9.10", group=False)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hosts").write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost\n")
    res = _members(shipped, env, "hosts")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = (tmp_path / "etc" / "hosts").read_text().splitlines()
    assert lines[:2] == ["127.0.0.1 localhost", "::1 localhost ip6-localhost"], "the operator's lines stay"
    assert sorted(lines[3:-1]) == sorted(f"{ip} {n}.gptoss.internal" for n, ip in FLEET_IPS.items()) and lines[-1] == "# END gptoss members"
    # Two instances of one node that Auto Scaling holds in no group (so neither stays): the newer launch wins;
    # an unchanged list rewrites nothing. (Instances of a real group: the next test.)
    fleet.launch("prefill-1", f"{NET}.1.22")
    stat = (tmp_path / "etc" / "hosts").stat()
    assert _members(shipped, env, "sync").returncode == 0
    assert f"{NET}.1.22 prefill-1.gptoss.internal" in (tmp_path / "etc" / "hosts").read_text()
    assert (tmp_path / "etc" / "hosts").stat().st_ino != stat.st_ino, "replaced whole (by rename), never half-written"
    again = (tmp_path / "etc" / "hosts").stat()
    assert _members(shipped, env, "sync").returncode == 0
    assert (tmp_path / "etc" / "hosts").stat().st_ino == again.st_ino, "nothing changed: nothing written"
    assert not (tmp_path / "systemctl.log").exists(), "a router follows names: nothing restarts"


def test_a_surge_replacement_takes_its_nodes_name_only_when_its_group_lets_the_old_instance_go(
    moto_url: str, tmp_path: Path, shipped: Any
) -> None:
    """A surge (rollout.surge): prefill-1's group (moto's Auto Scaling) grows to two; the new instance
    runs but does not serve yet, so the name stays with the old one; when the group takes the old one
    out of service (here Standby: any state but InService or Pending* is leaving, as Terminating:Wait
    is while the drain hook holds it), the next sync moves the name to the new one."""
    env, ec2 = _members_env(tmp_path, moto_url)
    autoscaling = boto3.client("autoscaling", endpoint_url=moto_url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    fleet = Ec2Fleet(ec2)
    for node, ip in FLEET_IPS.items():
        if node != "prefill-1":
            fleet.launch(node, ip)
    ec2.create_launch_template(LaunchTemplateName="prefill-1", LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "t3.micro"})
    group = "gptoss-8k1k-prefill-1"
    tags = [{"Key": k, "Value": v, "PropagateAtLaunch": True, "ResourceId": group, "ResourceType": "auto-scaling-group"}
            for k, v in (("gptoss:cluster", "gptoss-8k1k"), ("gptoss:node", "prefill-1"))]  # fmt: skip
    autoscaling.create_auto_scaling_group(AutoScalingGroupName=group, MinSize=1, MaxSize=2, DesiredCapacity=1, Tags=tags,
                                          LaunchTemplate={"LaunchTemplateName": "prefill-1"}, VPCZoneIdentifier=fleet.subnet)  # fmt: skip

    def instances() -> list[dict[str, Any]]:
        found = ec2.describe_instances(Filters=[{"Name": "tag:aws:autoscaling:groupName", "Values": [group]}])
        return sorted((i for r in found["Reservations"] for i in r["Instances"]), key=lambda i: i["LaunchTime"])

    (old,) = instances()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hosts").write_text("127.0.0.1 localhost\n")

    def named() -> str:
        res = _members(shipped, env, "sync")
        assert res.returncode == 0, res.stdout + res.stderr
        line = next(x for x in (tmp_path / "etc" / "hosts").read_text().splitlines() if x.endswith(" prefill-1.gptoss.internal"))
        return line.split()[0]

    assert named() == old["PrivateIpAddress"]
    time.sleep(1.1)  # a later LaunchTime (EC2 reports seconds)
    autoscaling.set_desired_capacity(AutoScalingGroupName=group, DesiredCapacity=2)
    new = next(i for i in instances() if i["InstanceId"] != old["InstanceId"])
    assert new["LaunchTime"] > old["LaunchTime"] and new["PrivateIpAddress"] != old["PrivateIpAddress"]
    assert named() == old["PrivateIpAddress"], "a replacement that does not serve yet never takes the name"
    autoscaling.enter_standby(AutoScalingGroupName=group, InstanceIds=[old["InstanceId"]], ShouldDecrementDesiredCapacity=True)
    assert named() == new["PrivateIpAddress"], "the group let the old instance go: the name moves to its replacement"
    # Every other member kept its address throughout.
    hosts = (tmp_path / "etc" / "hosts").read_text()
    assert all(f"{ip} {n}.gptoss.internal" in hosts for n, ip in FLEET_IPS.items() if n != "prefill-1"), hosts


def test_a_new_router_setting_or_member_restarts_the_routers_one_node_at_a_time(moto_url: str, tmp_path: Path, shipped: Any) -> None:
    """The fleet's router document (the stack's SSM parameter) changes: each router node's members sync
    copies it and restarts its router only once the router before it (decode-<i-1>) serves the new
    document (its API gate's /readiness: 200 and X-Gptoss-Fleet, the document's sha256); decode-0 goes
    first; the roll stops at a router that does not come back; an unchanged document restarts nothing."""
    env, ec2 = _members_env(tmp_path, moto_url)  # decode-1: index 1
    ssm = boto3.client("ssm", endpoint_url=moto_url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    fleet = Ec2Fleet(ec2)
    for node, ip in FLEET_IPS.items():
        fleet.launch(node, ip)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    env |= {"GPTOSS_RUN_DIR": str(tmp_path), "GPTOSS_SYSTEMCTL": str(tmp_path / "bin" / "systemctl")}
    doc = tmp_path / "router-fleet"
    res = _members(shipped, env, "hosts")
    assert res.returncode == 0 and "the fleet's router settings and pool" in res.stdout, res.stdout + res.stderr
    assert doc.read_text() == router_fleet(_cfg("vllm-router"), _cfg("vllm-router").layout.proxies[0])
    # The router starts with it (gptoss-router-pool keeps a copy of what it started with).
    subprocess.run([str(shipped("gptoss-router-pool")), str(doc), "--", "true"], check=True, timeout=30)
    assert _members(shipped, env, "sync").returncode == 0 and not (tmp_path / "systemctl.log").exists(), "nothing changed: nothing restarts"
    changed = doc.read_text().replace("arg --health-check-timeout-secs\narg 10\n", "arg --health-check-timeout-secs\narg 12\n")
    assert changed != doc.read_text()
    want = hashlib.sha256(changed.encode()).hexdigest()
    ssm.put_parameter(Name="/gptoss/gptoss-8k1k/router", Value=changed, Type="String", Overwrite=True)
    res = _members(shipped, env, "sync")
    assert res.returncode == 0 and "this node's router restarts once decode-0 serves them (its readiness now: no answer; at most 1950s)" in res.stdout, res.stdout
    assert doc.read_text() == changed and not (tmp_path / "systemctl.log").exists(), "decode-0 has not restarted yet"
    # decode-0's API gate (at its address in the hosts block), as its readiness answers while its router rolls.
    answer = {"status": 200, "fleet": "0" * 64}

    class Readiness(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(answer["status"] if self.path == "/readiness" else 404)
            self.send_header("X-Gptoss-Fleet", str(answer["fleet"]))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    predecessor = http.server.ThreadingHTTPServer((FLEET_IPS["decode-0"], PORTS["serving.proxy.port"]), Readiness)
    threading.Thread(target=predecessor.serve_forever, daemon=True).start()
    try:
        res = _members(shipped, env, "sync")  # decode-0 still runs the old document
        assert f"(its readiness now: 200 {'0' * 64}; at most 1950s)" in res.stdout and not (tmp_path / "systemctl.log").exists(), res.stdout
        assert _members(shipped, env, "sync").stdout == "", "said once, not at every poll"
        answer.update(status=503, fleet=want)  # restarted with it, not ready yet
        res = _members(shipped, env, "sync")
        assert f"(its readiness now: 503 {want}" in res.stdout and not (tmp_path / "systemctl.log").exists(), res.stdout
        answer.update(status=200)
        res = _members(shipped, env, "sync")
        assert "restarting this node's router with the fleet's new settings and pool (decode-0 serves them); it goes lame-duck first" in res.stdout, res.stdout
        assert (tmp_path / "systemctl.log").read_text() == "--no-block try-restart gptoss-proxy.service\n"
        # Once restarted (gptoss-router-pool copies the new document), nothing is due any more.
        subprocess.run([str(shipped("gptoss-router-pool")), str(doc), "--", "true"], check=True, timeout=30)
        assert _members(shipped, env, "sync").returncode == 0 and (tmp_path / "systemctl.log").read_text().count("try-restart") == 1
        # A router that does not come back stops the roll: this node waits the document's restart_gap, then says so once and keeps its router.
        again = changed + "pool decode 9 9 8200 8200\n"
        ssm.put_parameter(Name="/gptoss/gptoss-8k1k/router", Value=again, Type="String", Overwrite=True)
        assert "restarts once decode-0 serves them" in _members(shipped, env, "sync").stdout
        since = tmp_path / "router-roll-since"
        since.write_text(f"{int(time.time()) - 1951} {hashlib.sha256(again.encode()).hexdigest()}\n")
        res = _members(shipped, env, "sync")
        assert (f"the roll stops here: decode-0 has not served the fleet's new router settings and pool within 1950s of this node seeing them "
                f"(its readiness: 200 {want}); this node's router keeps the settings it has until decode-0 serves") in res.stdout, res.stdout  # fmt: skip
        assert _members(shipped, env, "sync").stdout == "" and (tmp_path / "systemctl.log").read_text().count("try-restart") == 1
    finally:
        predecessor.shutdown()
        predecessor.server_close()
    # decode-0 (index 0) restarts at the first sync that sees a change.
    env0 = env | {"GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster0.env")}
    (tmp_path / "cluster0.env").write_text(Path(env["GPTOSS_CLUSTER_ENV"]).read_text().replace("GPTOSS_NODE=decode-1", "GPTOSS_NODE=decode-0"))
    res = _members(shipped, env0, "sync")
    assert "restarting this node's router with the fleet's new settings and pool; it goes lame-duck first" in res.stdout, res.stdout
    assert (tmp_path / "systemctl.log").read_text().count("try-restart") == 2


def test_the_toy_proxys_members_wait_for_its_group_and_restart_it_when_one_is_replaced(moto_url: str, tmp_path: Path, shipped: Any) -> None:
    env, ec2 = _members_env(tmp_path, moto_url, node="decode-1", kind="toy")
    # The node's gptoss-group-health unit, as rendered: the group's health routes a replaced member must answer.
    (render,) = [r for r in render_cluster(_cfg("toy")) if r.node.name == "decode-1"]
    unit = tmp_path / "gptoss-group-health.service"
    unit.write_text(render.files["/etc/systemd/system/gptoss-group-health.service"][0])
    env["GPTOSS_GROUP_HEALTH_UNIT"] = str(unit)
    fleet = Ec2Fleet(ec2)
    fleet.launch("decode-1", FLEET_IPS["decode-1"])
    fleet.launch("prefill-0", FLEET_IPS["prefill-0"])  # another group's: never waited for
    # The timer's first sync can run before the proxy's start wrote the file: it restarts nothing.
    res = _members(shipped, env, "sync")
    assert res.returncode == 0 and "is not written yet" in res.stdout and not (tmp_path / "systemctl.log").exists(), res.stdout + res.stderr
    assert not (tmp_path / "members.env").exists()
    # The proxy's start waits for its group (prefill-1 holds decode-1's replicas); it appears while the script asks.
    proc = subprocess.Popen([str(shipped("gptoss-members")), "write"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "waiting for the members prefill-1 to run" in first, first
    fleet.launch("prefill-1", FLEET_IPS["prefill-1"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, first + out + err
    assert (tmp_path / "members.env").read_text().splitlines() == [f"GPTOSS_HOST_DECODE_1={NET}.2.2", f"GPTOSS_HOST_PREFILL_1={NET}.1.2"]
    res = _members(shipped, env, "sync")
    assert res.returncode == 0 and not (tmp_path / "systemctl.log").exists(), res.stdout + res.stderr
    fleet.replace("prefill-1", f"{NET}.1.99")
    # Launched, not serving yet (staging, compiling): the proxy keeps serving with the members it has.
    res = _members(shipped, env, "sync")
    silent = " ".join(f"http://{NET}.1.99:{port}/health" for port in (28100, 28101, 28102))  # prefill-1's three replicas of decode-1's group
    assert res.returncode == 0 and f"a member's address changed (GPTOSS_HOST_PREFILL_1={NET}.1.99); the proxy restarts once its servers answer there (not yet: {silent})" in res.stdout, res.stdout + res.stderr
    assert f"GPTOSS_HOST_PREFILL_1={NET}.1.2" in (tmp_path / "members.env").read_text() and not (tmp_path / "systemctl.log").exists()
    res = _members(shipped, env, "sync")  # the next poll, nothing new: said once, not at every poll
    assert res.returncode == 0 and res.stdout == "" and not (tmp_path / "systemctl.log").exists(), res.stdout + res.stderr
    # Two of its three replicas answer: still not.
    servers = [serve_health(f"{NET}.1.99", port) for port in (28100, 28101)]
    res = _members(shipped, env, "sync")
    assert f"(not yet: http://{NET}.1.99:28102/health)" in res.stdout and not (tmp_path / "systemctl.log").exists(), res.stdout + res.stderr
    servers.append(serve_health(f"{NET}.1.99", 28102))
    res = _members(shipped, env, "sync")
    for server in servers:
        server.shutdown()
        server.server_close()
    assert res.returncode == 0 and "a member's address changed and its servers answer there" in res.stdout, res.stdout + res.stderr
    assert f"GPTOSS_HOST_PREFILL_1={NET}.1.99" in (tmp_path / "members.env").read_text()
    assert (tmp_path / "systemctl.log").read_text() == "try-restart gptoss-proxy.service gptoss-group-health.service\n"
    # A member gone (its group replacing it): the proxy keeps the addresses it has, nothing restarts.
    ec2.terminate_instances(InstanceIds=[fleet.ids["prefill-1"]])
    res = _members(shipped, env, "sync")
    assert res.returncode == 0 and "not running now: prefill-1" in res.stdout, res.stdout
    assert (tmp_path / "systemctl.log").read_text().count("try-restart") == 1


def test_a_member_that_never_runs_fails_the_wait_by_name(moto_url: str, tmp_path: Path, shipped: Any) -> None:
    env, ec2 = _members_env(tmp_path, moto_url, node="decode-1", kind="toy")
    Ec2Fleet(ec2).launch("prefill-0", FLEET_IPS["prefill-0"])
    res = _members(shipped, env | {"GPTOSS_MEMBERS_TIMEOUT_S": "3"}, "write")
    assert res.returncode == 1
    assert "no running instance of decode-1 prefill-1 in gptoss-8k1k within 3s; giving up" in res.stderr, res.stderr  # prefill-0 is not its group
    assert not (tmp_path / "members.env").exists()


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
