"""The router fleet on loopback that the router tests share: vLLM's router as a node builds and runs it
(its venv from the pinned wheel, behind the API gate), strict fake servers, a client load with faults."""

from __future__ import annotations

import dataclasses
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

from clusterspec.loading import load_config
from node_render import telemetry
from node_render.haproxy import KeyCheck
from node_render.render import render_cluster
from tests.api_gate import Gate, start_gate
from tests.conftest import ROOT, private_etc, with_etc
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
# The fault test's clients (tests/userdata/test_router.py::..._dies): 16 keep its every bound (each a share of the
# requests it counts) at a quarter of 64's CPU; GPTOSS_FAULT_CLIENTS=64 reproduces the runs of docs/benchmarks.md.
FAULT_CLIENTS = int(os.environ.get("GPTOSS_FAULT_CLIENTS", "16"))
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
    drain_files: dict[str, Path] = field(default_factory=dict)  # a server's drain file (drain=True)

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


def _fleet(kind: str, tmp: Path, router_venv: Path | None, prefill_ms: float = PREFILL_MS, decode_ms: float = DECODE_MS,
           overrides: dict[str, Any] | None = None, server_args: dict[str, list[str]] | None = None, drain: bool = False,
           keys: dict[str, str] | None = None) -> Fleet:  # fmt: skip
    """Start the fake servers and the rendered proxies or routers of a 2-decode, 6-replica fleet, each router behind its
    node's API gate (clients reach the gate; the router listens on its node's address at its internal port).
    `overrides` change the spec (the benchmarks' policies); `server_args` add flags of the fake servers by role;
    `drain`: each server runs the plan's drain middleware (its --middleware and environment), with its own drain file;
    `keys` ({name: key}): each gate checks them (serving.endpoint's limits), as gptoss-keys leaves its maps."""
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
    if drain:
        # As the plan runs every server behind the router (node_render.command_lines.drain_env), the module
        # from the repository's userdata/bin; one drain file per server, as each server is a node's own.
        plan = next(svc for r in renders for svc in r.services if svc.unit == "gptoss-decode.service")
        middleware = plan.argv[plan.argv.index("--middleware") : plan.argv.index("--middleware") + 2]
        for name in fleet.commands:
            fleet.drain_files[name] = tmp / f"draining-{name.replace(':', '_')}"
            fleet.commands[name] += middleware
            fleet.envs[name] |= {"PYTHONPATH": str(ROOT / "userdata" / "bin"), "GPTOSS_DRAIN_FILE": str(fleet.drain_files[name]),
                                 "GPTOSS_DRAIN_HEALTH_PATH": plan.environment["GPTOSS_DRAIN_HEALTH_PATH"]}  # fmt: skip
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
                # The node's API gate: HAProxy with the rendered configuration, in front of the router.
                folder = tmp / f"gate-{r.node.name}"
                check = None
                if keys:
                    folder.mkdir(parents=True, exist_ok=True)
                    check = dataclasses.replace(KeyCheck.of(s.endpoint), keys_map=str(folder / "k.map"), rate_map=str(folder / "r.map"),
                                                concurrency_map=str(folder / "c.map"))  # fmt: skip
                    (folder / "k.map").write_text("".join(f"{hashlib.sha256(k.encode()).hexdigest().upper()} {n}\n" for n, k in keys.items()))
                    (folder / "r.map").write_text("")
                    (folder / "c.map").write_text("")
                fleet.gates[r.node.name] = start_gate(folder, s.proxy, host=ip, port=s.proxy.port, router_host=ip, keys=check,
                                                      router_port=s.proxy.router.internal_port, max_model_len=s.shape.max_model_len)  # fmt: skip
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
    """FAULT_CLIENTS clients for DURATION_S seconds, spread over the endpoints as the NLB would; faults at their times."""
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

    threads = [threading.Thread(target=client, args=(i,)) for i in range(FAULT_CLIENTS)]
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
        from tests.userdata.test_telemetry import _collector

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
