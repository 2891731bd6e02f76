"""Run the benchmark unit on a proxy node and read back the measured leg's key metrics."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from typing import Any

from cluster_ops.remote import find_nodes, run_command
from clusterspec.config import ClusterConfig

METRICS = (
    ("median_tpot_ms", "median TPOT (ms)"),
    ("p99_tpot_ms", "p99 TPOT (ms)"),
    ("output_throughput", "output throughput (tok/s)"),
    ("total_token_throughput", "total token throughput (tok/s)"),
    ("mean_ttft_ms", "mean TTFT (ms)"),
    ("p99_ttft_ms", "p99 TTFT (ms)"),
)
UNIT = "gptoss-bench.service"


class BenchError(RuntimeError):
    """The benchmark did not produce a result."""


def run(
    cfg: ClusterConfig,
    ec2: Any,
    ssm: Any,
    *,
    node: str | None = None,
    timeout_s: float = 6 * 3600,
    poll_s: float = 60,
    on_poll: Callable[[str, float], None] = lambda state, t: None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, float]:
    """Start the bench unit (it never starts by itself), wait for it, return the metrics."""
    # The benchmark runs where clients connect: a proxy node, or the one server of a single-instance recipe.
    proxy_nodes = [p.node for p in cfg.layout.proxies] or [n.name for n in cfg.layout.nodes]
    target = node or proxy_nodes[0]
    if target not in proxy_nodes:
        raise BenchError(f"node={target!r}: the benchmark runs on a proxy node ({', '.join(proxy_nodes)})")
    nodes = find_nodes(ec2, cfg.cluster_name)
    if target not in nodes:
        raise BenchError(f"{target}: no running instance tagged gptoss:cluster={cfg.cluster_name}")
    iid = nodes[target].instance_id
    status, _ = run_command(ssm, iid, [f"systemctl start --no-block {UNIT}"], sleep=sleep)
    if status != "Success":
        raise BenchError(f"{target}: could not start {UNIT} ({status})")
    waited = 0.0
    while True:
        sleep(poll_s)
        waited += poll_s
        # Its state and result, then its last log line (the benchmark's own progress).
        _, out = run_command(ssm, iid, [f"systemctl show -p ActiveState,Result --value {UNIT}; "
                                        f"journalctl -u {UNIT} -n 1 -o cat --no-pager 2>/dev/null | tail -c 200"], sleep=sleep)  # fmt: skip
        lines = out.splitlines()
        state, result = [*lines[:2], "unknown", "unknown"][:2]
        last = lines[2].strip() if len(lines) > 2 else ""
        on_poll(f"{state}" + (f" · {last}" if last and state not in {"inactive", "failed"} else ""), waited)
        if state in {"inactive", "failed"}:
            break
        if waited >= timeout_s:
            run_command(ssm, iid, [f"systemctl stop --no-block {UNIT}"], sleep=sleep)
            raise BenchError(f"{target}: {UNIT} still {state} after {timeout_s:.0f}s (--timeout): stopped it. "
                             "Fix: a longer --timeout, or check the servers first: gptoss status")  # fmt: skip
    if state == "failed" or result != "success":
        raise BenchError(f"{target}: {UNIT} ended with {result}; see journalctl -u {UNIT} on the node")
    path = f"{cfg.results_dir}/{cfg.serving.bench.result_file}"
    keys = [k for k, _ in METRICS]
    script = f"import json; r = json.load(open({path!r})); print(json.dumps({{k: r.get(k) for k in {keys!r}}}))"
    status, out = run_command(ssm, iid, [f"python3 -c {shlex.quote(script)}"], sleep=sleep)
    if status != "Success":
        raise BenchError(f"{target}: could not read {path} ({status})")
    return json.loads(out)
