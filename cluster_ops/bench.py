"""Run the benchmark unit on a proxy node and read back the measured leg's key metrics."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
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


SWEEP_UNIT = "gptoss-bench-sweep"


@dataclass(frozen=True)
class SweepLeg:
    """One run of a sweep: a closed loop at a concurrency, or an open loop at a request rate."""

    name: str
    argv: list[str]


def sweep_legs(cfg: ClusterConfig, *, image: str, concurrencies: list[int], rates: list[float], prompts_per: int) -> list[SweepLeg]:
    """The reference's benchmark (random prompts of the shape, --ignore-eos, p50 and p99 of every
    metric) at each concurrency and each rate, each saved under a name of its layout and image, with
    the layout in its --metadata (so runs of another layout or SDK are never mixed in silently)."""
    from node_render.command_lines import bench_argv

    layout = cfg.layout
    replicas, decode = len(layout.replicas), len(layout.decode_nodes)
    tag = f"{cfg.recipe}-{replicas}p{decode}d-{image}"
    metadata = ["--metadata", f"gptoss_recipe={cfg.recipe}", f"gptoss_instance_type={cfg.instance_type}", f"gptoss_image={image}",
                f"gptoss_prefill_replicas={replicas}", f"gptoss_decode_servers={decode}", "gptoss_leg=endpoint"]  # fmt: skip
    legs = []
    for c in concurrencies:
        name = f"{tag}-c{c}.json"
        argv = bench_argv(cfg, max(prompts_per * c, 10), name)
        argv[argv.index("--max-concurrency") + 1] = str(c)
        argv[argv.index("--result-dir") + 1] = f"{cfg.results_dir}/sweep"
        legs.append(SweepLeg(name, argv + metadata))
    for r in rates:
        name = f"{tag}-r{r:g}.json"
        argv = bench_argv(cfg, max(int(prompts_per * r * 60), 10), name)  # about prompts_per minutes of arrivals
        i = argv.index("--max-concurrency")
        del argv[i : i + 2]  # open loop: arrivals at the rate, however many are in flight
        argv[argv.index("--result-dir") + 1] = f"{cfg.results_dir}/sweep"
        legs.append(SweepLeg(name, [*argv[:3], "--request-rate", f"{r:g}", *argv[3:], *metadata]))
    return legs


def sweep(
    cfg: ClusterConfig,
    ec2: Any,
    ssm: Any,
    *,
    out: Any,
    concurrencies: list[int],
    rates: list[float],
    prompts_per: int = 10,
    node: str | None = None,
    timeout_s: float = 12 * 3600,
    poll_s: float = 60,
    on_poll: Callable[[str, float], None] = lambda state, t: None,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Any]:
    """Run every leg, one after the other, in one transient unit on a proxy node; copy each result
    JSON to `out` (a local directory). Returns the paths written."""
    from pathlib import Path

    from node_render.paths import BIN, ETC

    proxy_nodes = [p.node for p in cfg.layout.proxies] or [n.name for n in cfg.layout.nodes]
    target = node or proxy_nodes[0]
    if target not in proxy_nodes:
        raise BenchError(f"node={target!r}: the benchmark runs on a proxy node ({', '.join(proxy_nodes)})")
    nodes = find_nodes(ec2, cfg.cluster_name)
    if target not in nodes:
        raise BenchError(f"{target}: no running instance tagged gptoss:cluster={cfg.cluster_name}")
    iid = nodes[target].instance_id
    # The image the fleet runs, as the instance reports it: results of another SDK are named apart.
    (reservation,) = ec2.describe_instances(InstanceIds=[iid])["Reservations"]
    image = reservation["Instances"][0]["ImageId"]
    legs = sweep_legs(cfg, image=image, concurrencies=concurrencies, rates=rates, prompts_per=prompts_per)
    done = f"{cfg.results_dir}/sweep/{SWEEP_UNIT}.done"
    script = "set -e; rm -f " + shlex.quote(done) + "; " + "; ".join(shlex.join([f"{BIN}/gptoss-exec", "bench", *leg.argv]) for leg in legs)
    script += "; echo ok > " + shlex.quote(done)
    start = shlex.join(["systemd-run", f"--unit={SWEEP_UNIT}", "--property=User=root", f"--property=EnvironmentFile={ETC}/bench.env",
                        "--", "bash", "-c", script])  # fmt: skip
    # A sweep left running by an earlier command is stopped first: one sweep at a time on a node.
    status, said = run_command(ssm, iid, [f"systemctl stop {SWEEP_UNIT} 2>/dev/null; systemctl reset-failed {SWEEP_UNIT} 2>/dev/null; {start}"], sleep=sleep)
    if status != "Success":
        raise BenchError(f"{target}: could not start the sweep ({status}: {said.strip()[:200]})")
    waited = 0.0
    while True:
        sleep(poll_s)
        waited += poll_s
        _, said = run_command(ssm, iid, [f"systemctl show -p ActiveState --value {SWEEP_UNIT}; test -e {shlex.quote(done)} && echo done || echo running; "
                                         f"ls {shlex.quote(cfg.results_dir)}/sweep 2>/dev/null | grep -c '\\.json$' || true"], sleep=sleep)  # fmt: skip
        state, finished, count = [*said.split(), "unknown", "running", "0"][:3]
        on_poll(f"{state}, {count}/{len(legs)} runs saved", waited)
        if finished == "done":
            break
        if state in {"failed", "inactive"}:
            raise BenchError(f"{target}: the sweep ended ({state}) after {count} of {len(legs)} runs; see journalctl -u {SWEEP_UNIT} on the node")
        if waited >= timeout_s:
            run_command(ssm, iid, [f"systemctl stop {SWEEP_UNIT}"], sleep=sleep)
            raise BenchError(f"{target}: the sweep still runs after {timeout_s:.0f}s (--timeout): stopped it. Fix: fewer or shorter legs, or a longer --timeout")
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for leg in legs:
        path = f"{cfg.results_dir}/sweep/{leg.name}"
        status, text = run_command(ssm, iid, [f"cat {shlex.quote(path)}"], sleep=sleep)
        if status != "Success":
            raise BenchError(f"{target}: could not read {path} ({status})")
        json.loads(text)  # a result, not a truncated page
        (dest / leg.name).write_text(text)
        written.append(dest / leg.name)
    return written
