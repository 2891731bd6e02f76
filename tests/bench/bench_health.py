"""`make bench-health`: the routers' health checks under saturation, a dead server and a hung engine, old and new settings.

The pinned router (rendered argv of the 2-decode, 6-replica fleet, behind its API gate) over fake
servers that answer /health on the same one event loop that tokenizes prompts, as vLLM's API
server does (tests/fakes/vllm_pd.py --loop-ms-per-word): a burst of long prompts delays /health
by seconds without anything being wrong. Three scenarios per setting, SECONDS each:

- saturated: CLIENTS clients of 150-word prompts (0.75 s of loop time each at 5 ms a word) and
  nothing dies. Every ejection is a false one; a flap is an ejection followed by readmission;
- dead: 16 clients of short prompts; one prefill replica killed at 3 s. "out after" is when both
  routers had taken it out of rotation; failed requests are what the clients saw;
- dead-decode: the same with one of the two decode servers killed at 3 s (what the gate's retries
  cannot always hide: a request whose three picks all land on it before the routers take it out);
- hung: 16 clients of short prompts; one prefill replica's engine stops finishing requests at 3 s
  while its /health answers. The routers cannot see it (nothing of theirs looks past /health);
  the node's engine watch (gptoss-engine-watch, from vLLM's own /metrics) is what finds it.

Ejections are read from each router's /readiness (healthy servers), polled every 0.1 s.

    python -m tests.bench.bench_health [--seconds S] [--clients N] [--thresholds 1,2,3]

--thresholds compares the shipped settings at each failure threshold instead of the old and new settings.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.bench.bench_policy import completion
from tests.bench.bench_proxy import _router_venv
from tests.userdata.router_fleet import PORTS, _fleet

OLD = {"health_check_interval_s": 1, "health_check_timeout_s": 1, "health_failure_threshold": 2, "health_success_threshold": 1}


def _new() -> dict[str, int]:
    from clusterspec.sections.proxy import Router

    r = Router()
    new = {k: getattr(r, k) for k in OLD}
    if os.environ.get("BENCH_HEALTH_NEW"):  # trying other values: BENCH_HEALTH_NEW=interval,timeout,failures,successes
        new = dict(zip(OLD, map(int, os.environ["BENCH_HEALTH_NEW"].split(",")), strict=True))
    return new


def _scenario(kind: str, settings: dict[str, int], venv: Path, tmp: Path, clients: int, seconds: float) -> dict[str, Any]:
    # Prefill tokenizes the long prompts on its loop (5 ms a word); a decode server's loop does less per request (0.5 ms).
    servers: dict[str, list[str]] = {"prefill": ["--loop-ms-per-word", "5"], "decode": ["--loop-ms-per-word", "0.5"]}
    fleet = _fleet("vllm-router", tmp, venv, prefill_ms=30, decode_ms=60, server_args=servers,
                   overrides={f"serving.proxy.router.{k}": v for k, v in settings.items()})  # fmt: skip
    decode_port = f":{PORTS['serving.decode.http_port']}"
    victim = sorted(n for n in fleet.procs if (n.endswith(decode_port) if kind == "dead-decode" else not n.endswith(decode_port)))[0]
    internal = [(host, PORTS["serving.proxy.router.internal_port"]) for host, _ in fleet.endpoints]
    try:
        if kind == "hung":
            # The same replica started again with its engine set to hang 3 s from now.
            fleet.kill(victim)
            fleet.commands[victim] += ["--hang-after-s", "3"]
            fleet.start(victim)
            time.sleep(0.5)
        t0 = time.monotonic()
        stop = t0 + seconds
        failed: list[float] = []
        ok = [0]
        healthy: dict[int, list[tuple[float, int]]] = {i: [] for i in range(len(internal))}
        lock = threading.Lock()
        words = 150 if kind == "saturated" else 5

        def client(i: int) -> None:
            host, port = fleet.endpoints[i % len(fleet.endpoints)]
            n = 0
            while time.monotonic() < stop:
                n += 1
                body = json.dumps({"model": "m", "prompt": " ".join([f"c{i}r{n}"] * words), "max_tokens": 4})
                good = completion(host, port, body, max(5.0, stop - time.monotonic() + 1))
                with lock:
                    if good:
                        ok[0] += 1
                    else:
                        failed.append(time.monotonic() - t0)

        def watch(i: int) -> None:
            host, port = internal[i]
            while time.monotonic() < stop:
                try:
                    conn = http.client.HTTPConnection(host, port, timeout=2)
                    conn.request("GET", "/readiness")
                    doc = json.loads(conn.getresponse().read())
                    conn.close()
                    healthy[i].append((time.monotonic() - t0, doc["prefill"]["healthy"] + doc["decode"]["healthy"]))
                except (OSError, http.client.HTTPException, ValueError, KeyError):
                    pass
                time.sleep(0.1)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients if kind == "saturated" else 16)]
        threads += [threading.Thread(target=watch, args=(i,)) for i in range(len(internal))]
        for th in threads:
            th.start()
        killed_at = None
        if kind in ("dead", "dead-decode"):
            time.sleep(max(0.0, t0 + 3 - time.monotonic()))
            fleet.procs[victim].send_signal(signal.SIGKILL)
            killed_at = time.monotonic() - t0
        for th in threads:
            th.join()
        ejections = flaps = 0
        out_at: list[float] = []
        for samples in healthy.values():
            total = samples[0][1] if samples else 0
            low = total
            for _, h in samples:
                if h < low:
                    ejections += low - h
                elif h > low:
                    flaps += h - low
                low = h
            if killed_at is not None:
                gone = [t for t, h in samples if t >= killed_at and h < total]
                out_at.append((gone[0] - killed_at) if gone else float("nan"))
        row: dict[str, Any] = {"ok": ok[0], "failed": len(failed), "ejections": ejections, "flaps": flaps}
        if kind in ("dead", "dead-decode"):
            row["out_after_s"] = max(out_at) if out_at else float("nan")
            row["failed_after_out"] = sum(1 for t in failed if killed_at is not None and t > killed_at + row["out_after_s"] + 1)
        return row
    finally:
        fleet.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--thresholds", help="comma-separated failure thresholds to compare, the rest as shipped")
    a = ap.parse_args()
    settings = {"old": OLD, "new": _new()}
    if a.thresholds:
        settings = {f"out@{n}": _new() | {"health_failure_threshold": int(n)} for n in a.thresholds.split(",")}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-health-") as d:
        venv = _router_venv(Path(d))
        for name, s in settings.items():
            for kind in ("saturated", "dead", "dead-decode", "hung"):
                tmp = Path(d) / f"{name}-{kind}"
                tmp.mkdir()
                rows[(name, kind)] = _scenario(kind, s, venv, tmp, a.clients, a.seconds)
    print(f"bench-health: vllm-router 0.1.17, 2 routers over 6 prefill replicas + 2 decode servers (fakes whose /health waits for the "
          f"tokenizing event loop, 5 ms a prompt word); {a.seconds:.0f} s a scenario; {os.cpu_count()} cores, {platform.python_version()}")  # fmt: skip
    for name, s in settings.items():
        print(f"  {name}: every {s['health_check_interval_s']} s, timeout {s['health_check_timeout_s']} s, out after "
              f"{s['health_failure_threshold']} failures, back after {s['health_success_threshold']} passes")  # fmt: skip
    print(f"{'settings':<9}{'scenario':<12}{'ok':>7}{'failed':>8}{'ejections':>11}{'readmitted':>12}{'out after':>11}{'failed after out':>18}")
    for (name, kind), r in rows.items():
        out = f"{r['out_after_s']:.1f} s" if "out_after_s" in r else "-"
        after = str(r["failed_after_out"]) if "failed_after_out" in r else "-"
        print(f"{name:<9}{kind:<12}{r['ok']:>7}{r['failed']:>8}{r['ejections']:>11}{r['flaps']:>12}{out:>11}{after:>18}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
