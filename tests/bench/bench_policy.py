"""`make bench-policy`: what each of vLLM's router policies balances on, over servers that serve only what vLLM serves.

vllm-router 0.1.17's power_of_two asks its servers for `/get_load` (a route of SGLang's servers;
vLLM's API server answers 404). The fake servers here (tests/fakes/vllm_pd.py) answer exactly
vLLM's routes and count every other path asked. Their engines are bounded and their work uneven,
so a policy that balances on nothing queues where another does not:

- prefill: 6 replicas, each running one prefill at a time (--slots 1), costing 5 ms + 2 ms per
  prompt word; half the prompts are 10 words, half 150 (about 25 ms or 305 ms);
- decode: 2 servers of 4 slots, 5 ms + 4 ms per output token; half the requests ask 8 tokens,
  half 128 (about 37 ms or 517 ms);
- CLIENTS closed-loop clients spread over both routers as the NLB does, for SECONDS each run;
  the same seeded request sequence for every policy. Nothing fails or is killed.

Per policy (both roles set to it; the rendered router argv of the 2-decode, 6-replica fleet
otherwise): completions per second, client p50/p99 latency, the time requests waited for an
engine slot at the prefill replicas and at the decode servers (mean, p99), the spread of work
(the busiest server's share over the idlest's), and how often the routers asked for /get_load.

    python -m tests.bench.bench_policy [--seconds S] [--clients N] [--policies a,b]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.bench.bench_proxy import _percentile, _router_venv
from tests.userdata.router_fleet import PORTS, _fleet

POLICIES = ("random", "round_robin", "power_of_two", "cache_aware", "consistent_hash")
SERVERS = {
    "prefill": ["--slots", "1", "--ms-per-token", "2"],
    "decode": ["--slots", "4", "--ms-per-token", "4"],
}
PREFILL_MS = DECODE_MS = 5


def completion(host: str, port: int, body: str, timeout: float) -> bool:
    """One completion through an endpoint, on its own connection: whether it answered with text."""
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        ok = resp.status == 200 and bool(json.loads(resp.read())["choices"][0]["text"])
        conn.close()
        return ok
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError):
        return False


def _run(policy: str, venv: Path, tmp: Path, clients: int, seconds: float) -> dict[str, Any]:
    fleet = _fleet("vllm-router", tmp, venv, prefill_ms=PREFILL_MS, decode_ms=DECODE_MS, server_args=SERVERS,
                   overrides={"serving.proxy.router.prefill_policy": policy, "serving.proxy.router.decode_policy": policy})  # fmt: skip
    try:
        latencies: list[float] = []
        failed = 0
        lock = threading.Lock()
        stop = time.monotonic() + seconds

        def client(i: int) -> None:
            nonlocal failed
            rng = random.Random(i)  # the same requests for every policy
            host, port = fleet.endpoints[i % len(fleet.endpoints)]
            n = 0
            while time.monotonic() < stop:
                n += 1
                words = 10 if rng.random() < 0.5 else 150
                body = json.dumps({"model": "gpt-oss", "prompt": " ".join([f"c{i}r{n}"] * words), "max_tokens": rng.choice([8, 128])})
                t = time.monotonic()
                ok = completion(host, port, body, 60)
                with lock:
                    if ok:
                        latencies.append((time.monotonic() - t) * 1000)
                    else:
                        failed += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        row: dict[str, Any] = {"policy": policy, "rps": len(latencies) / seconds, "failed": failed,
                               "p50": _percentile(latencies, 0.5), "p99": _percentile(latencies, 0.99), "get_load": 0}  # fmt: skip
        for role in ("prefill", "decode"):
            waits: list[float] = []
            served = []
            for name in fleet.procs:
                st = fleet.stats(name)
                if name.endswith(f":{PORTS['serving.decode.http_port']}") != (role == "decode"):
                    continue
                waits += st["waits_ms"]
                served.append(st["served"])
                row["get_load"] += st["asked"].get("/get_load", 0)
                for path, n in st["asked"].items():
                    if path != "/get_load":
                        row.setdefault("other_paths", {})[path] = row.get("other_paths", {}).get(path, 0) + n
            row[role] = {"wait_mean": statistics.fmean(waits) if waits else float("nan"), "wait_p99": _percentile(waits, 0.99),
                         "spread": max(served) / max(1, min(served)), "served": served}  # fmt: skip
        return row
    finally:
        fleet.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--policies", default=",".join(POLICIES))
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-policy-") as d:
        venv = _router_venv(Path(d))
        for policy in a.policies.split(","):
            tmp = Path(d) / policy
            tmp.mkdir()
            rows.append(_run(policy, venv, tmp, a.clients, a.seconds))
    print(f"bench-policy: vllm-router 0.1.17 over fakes serving only vLLM's routes; {a.clients} clients x {a.seconds:.0f} s per policy; "
          f"prefill 6 x 1 slot (25 or 305 ms), decode 2 x 4 slots (37 or 517 ms); {os.cpu_count()} cores, {platform.python_version()}")  # fmt: skip
    print(f"{'policy':<16}{'req/s':>7}{'fail':>6}{'p50 ms':>8}{'p99 ms':>8}{'prefill wait':>14}{'p99':>7}{'spread':>8}{'decode wait':>13}{'p99':>7}{'spread':>8}{'get_load':>10}")
    for r in rows:
        p, dd = r["prefill"], r["decode"]
        print(f"{r['policy']:<16}{r['rps']:>7.1f}{r['failed']:>6}{r['p50']:>8.0f}{r['p99']:>8.0f}{p['wait_mean']:>11.0f} ms{p['wait_p99']:>7.0f}"
              f"{p['spread']:>8.2f}{dd['wait_mean']:>10.0f} ms{dd['wait_p99']:>7.0f}{dd['spread']:>8.2f}{r['get_load']:>10}")  # fmt: skip
    for r in rows:
        if r.get("other_paths"):
            print(f"{r['policy']}: the routers also asked for {json.dumps(r['other_paths'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
