"""`make bench-proxy`: vLLM's router and the toy proxy over the same fake servers, on loopback.

Both run the command lines `plan` renders for a fleet of 2 decode servers and 6 prefill
replicas (each node on its own 127.N.x.y address, as tests/userdata/test_router.py does); the
fake servers answer at once (no model), so what is measured is the proxy's own cost. For each
number of concurrent clients (1, 32, 128; keep-alive connections, 6 s each):

- requests per second through the proxy (both endpoints, as the NLB spreads them);
- p50 and p99 latency end to end through the proxy: with servers that take no time, what the
  proxy adds plus the client's own cost, which is the same on both sides;
- what the API gate (HAProxy) costs: the same routers of the same fleet reached through their gates and at their
  own listening ports, in alternating rounds (--rounds of --seconds each way), so that both sides of each ratio
  ran under the same load of this machine; the median, lowest and highest of the rounds' ratios;
- for reference, the p50 of a client that makes the two calls itself (prefill, then decode with
  the returned parameters) against the same servers: no proxy at all.

Run it on an idle machine; it prints its conditions with the numbers.

    python -m tests.bench.bench_proxy [--seconds S] [--clients 1,32,128] [--rounds N]
                                      [--gate-threads N] [--gate-bufsize BYTES]

--gate-threads and --gate-bufsize measure a variant of the gate's configuration (HAProxy's nbthread, its
tune.bufsize), not what a node runs; the output says so.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from node_render.paths import WHEELS_DIR
from tests.userdata.router_fleet import NET, _cfg, _fleet


def _gate_variant(threads: int | None, bufsize: int | None) -> str:
    """Make the gates this process starts run a variant of the rendered configuration; say which ('' when none)."""
    if threads is None and bufsize is None:
        return ""
    from tests import api_gate

    rendered = api_gate.api_gate_config

    def variant(*args: Any, **kwargs: Any) -> str:
        cfg = rendered(*args, **kwargs)
        if threads is not None:
            cfg = re.sub(r"nbthread \d+", f"nbthread {threads}", cfg)
        if bufsize is not None:
            cfg = re.sub(r"tune\.bufsize \d+", f"tune.bufsize {bufsize}", cfg)
        return cfg

    api_gate.api_gate_config = variant  # type: ignore[assignment]
    return (f"A VARIANT of the gate, not what a node runs: nbthread {threads if threads is not None else '(rendered)'}, "
            f"tune.bufsize {bufsize if bufsize is not None else '(rendered)'}.")  # fmt: skip


def _router_venv(tmp: Path) -> Path:
    """The router's venv, made with the node's own two commands (gptoss-install-router), from the pinned wheel."""
    r = _cfg("vllm-router").serving.proxy.router
    wheel = WHEELS_DIR / r.wheel
    if not wheel.is_file():
        sys.exit(f"bench-proxy: {wheel} is missing: run `make setup`")
    venv = tmp / "router-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "--quiet", "--no-index", "--no-deps",
                    "--disable-pip-version-check", str(wheel)], check=True)  # fmt: skip
    return venv


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _drive(clients: int, seconds: float, one: Any) -> tuple[float, list[float]]:
    """`clients` threads calling `one(conn_state)` for `seconds`: (requests per second, latencies in ms)."""
    lat: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    errors = [0]

    def loop(i: int) -> None:
        state: dict[str, Any] = {"i": i, "n": 0}
        mine = []
        while time.monotonic() < stop:
            state["n"] += 1
            t = time.perf_counter()
            if one(state):
                mine.append((time.perf_counter() - t) * 1000)
            else:
                errors[0] += 1
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors[0]:
        print(f"  ({errors[0]} failed requests)", file=sys.stderr)
    return len(lat) / (time.monotonic() - t0), lat


# Every request's extra headers: with --keys, the bench key (the gate checks it; the router ignores it).
HEADERS: dict[str, str] = {}
BENCH_KEY = "gk-bench-" + "b" * 43


def _post(state: dict[str, Any], key: str, host: str, port: int, body: dict[str, Any]) -> dict[str, Any] | None:
    conn = state.get(key)
    if conn is None:
        conn = state[key] = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **HEADERS})
        resp = conn.getresponse()
        data = resp.read()
        return json.loads(data) if resp.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        conn.close()
        state.pop(key, None)
        return None


def _through(endpoints: list[tuple[str, int]]) -> Any:
    def one(state: dict[str, Any]) -> bool:
        host, port = endpoints[state["i"] % len(endpoints)]
        body = {"model": "gpt-oss", "prompt": f"c{state['i']} r{state['n']}", "max_tokens": 8}
        return _post(state, "proxy", host, port, body) is not None

    return one


def _direct(prefill: list[tuple[str, int]], decode: list[tuple[str, int]]) -> Any:
    """A client doing the handoff itself: the baseline both proxies add to."""

    def one(state: dict[str, Any]) -> bool:
        n = state["i"] + state["n"]
        p, d = prefill[n % len(prefill)], decode[n % len(decode)]
        prompt = f"c{state['i']} r{state['n']}"
        remote = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
                  "remote_host": None, "remote_port": None}  # fmt: skip
        first = _post(state, f"p{p}", p[0], p[1], {"model": "gpt-oss", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": remote})
        if first is None:
            return False
        params = dict(first["kv_transfer_params"])
        params["remote_host"] = p[0]
        return _post(state, f"d{d}", d[0], d[1], {"model": "gpt-oss", "prompt": prompt, "max_tokens": 8, "kv_transfer_params": params}) is not None

    return one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--clients", default="1,32,128")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the gate's cost, each --seconds / 2 a side")
    ap.add_argument("--gate-threads", type=int, help="a variant: HAProxy's nbthread (a node runs serving.proxy.gate.threads)")
    ap.add_argument("--gate-bufsize", type=int, help="a variant: HAProxy's tune.bufsize (a node runs serving.proxy.gate.buffer_kib)")
    ap.add_argument("--keys", action="store_true", help="the gates check an API key (serving.endpoint.auth=keys, its limits raised "
                    "past the load: what is measured is the check, not a refusal); every request carries it")
    args = ap.parse_args()
    keys = None
    if args.keys:
        HEADERS["Authorization"] = f"Bearer {BENCH_KEY}"
        keys = {"bench": BENCH_KEY}
    variant = _gate_variant(args.gate_threads, args.gate_bufsize)
    levels = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as d:
        tmp = Path(d)
        venv = _router_venv(tmp)
        rows: dict[str, dict[int, tuple[float, float, float]]] = {}
        direct: dict[int, tuple[float, list[float]]] = {}
        # The gate's cost, per level: one (gated, ungated) pair of (req/s, p50, p99) per round.
        pairs: dict[int, list[tuple[tuple[float, float, float], tuple[float, float, float]]]] = {}
        for kind in ("vllm-router", "toy"):
            run = tmp / kind
            run.mkdir()
            limits = {"serving.endpoint.key_requests_per_s": 100000, "serving.endpoint.key_concurrency": 100000} if keys else None
            fleet = _fleet(kind, run, None if kind == "toy" else venv, prefill_ms=0, decode_ms=0, overrides=limits,
                           keys=keys if kind == "vllm-router" else None)
            try:
                prefill = sorted((h, int(p)) for h, p in (n.split(":") for n in fleet.commands) if h.startswith(f"{NET}.1."))
                decode = sorted((h, int(p)) for h, p in (n.split(":") for n in fleet.commands) if h.startswith(f"{NET}.2."))
                rows[kind] = {}
                for c in levels:
                    if c not in direct:
                        direct[c] = _drive(c, args.seconds, _direct(prefill, decode))
                    rows[kind][c] = _point(*_drive(c, args.seconds, _through(fleet.endpoints)))
                    if kind == "vllm-router":
                        # The same routers at their own port (each listens on its node's address, its gate in front).
                        internal = _cfg("vllm-router").serving.proxy.router.internal_port
                        routers = [(ip, internal) for ip, _ in fleet.endpoints]
                        pairs[c] = []
                        for _ in range(args.rounds):
                            gated = _point(*_drive(c, args.seconds / 2, _through(fleet.endpoints)))
                            pairs[c].append((gated, _point(*_drive(c, args.seconds / 2, _through(routers)))))
            finally:
                fleet.stop()
    print(f"bench-proxy: {os.cpu_count()} CPUs ({platform.machine()}), loopback, fake servers that answer at once, 2 endpoints, "
          f"6 prefill + 2 decode servers, {args.seconds:g} s per point. Latency is end to end through the proxy: with servers that "
          "take no time it is what the proxy adds, plus the client's own cost (the same on both sides).")  # fmt: skip
    if variant:
        print(variant)
    if keys:
        print("With API keys: every gate checks each request's key (serving.endpoint.auth=keys; sha256, its map, its per-key "
              "stick table; its limits above the load, so nothing is refused); the toy proxy and the routers' own port take no key.")
    print(f"{'clients':>7} | {'req/s router':>12} {'toy':>6} {'ratio':>6} | {'p50 ms router':>13} {'toy':>7} | {'p99 ms router':>13} {'toy':>7} | {'direct p50':>10}")
    for c in levels:
        r, t = rows["vllm-router"][c], rows["toy"][c]
        print(f"{c:>7} | {r[0]:>12.0f} {t[0]:>6.0f} {r[0] / t[0]:>5.1f}x | {r[1]:>13.2f} {t[1]:>7.2f} | {r[2]:>13.2f} {t[2]:>7.2f} | {statistics.median(direct[c][1]):>10.2f}")
    print("direct: a client that makes the two calls itself (prefill, then decode), no proxy, same servers and concurrency.")
    print(f"The API gate's cost: the same routers through their gates (HAProxy) and at their own port, {args.rounds} alternating "
          f"rounds of {args.seconds / 2:g} s a side per level; medians of the rounds, and the gated/ungated req/s ratio's lowest and highest:")  # fmt: skip
    print(f"{'clients':>7} | {'req/s gated':>11} {'ungated':>8} {'ratio':>6} {'lowest':>6} {'highest':>7} | {'p50 ms gated':>12} {'ungated':>8} | {'p99 ms gated':>12} {'ungated':>8}")
    for c in levels:
        ratios = sorted(g[0] / u[0] for g, u in pairs[c])
        med = [statistics.median(x[side][k] for x in pairs[c]) for side in (0, 1) for k in range(3)]
        print(f"{c:>7} | {med[0]:>11.0f} {med[3]:>8.0f} {statistics.median(ratios):>6.2f} {ratios[0]:>6.2f} {ratios[-1]:>7.2f} | "
              f"{med[1]:>12.2f} {med[4]:>8.2f} | {med[2]:>12.2f} {med[5]:>8.2f}")
    return 0


def _point(rps: float, lat: list[float]) -> tuple[float, float, float]:
    """(req/s, p50 ms, p99 ms) of one measurement."""
    return rps, _percentile(lat, 0.5), _percentile(lat, 0.99)


if __name__ == "__main__":
    sys.exit(main())
