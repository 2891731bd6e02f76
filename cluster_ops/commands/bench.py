"""`gptoss bench`: the reference's benchmark on a proxy node, its key metrics printed."""

from __future__ import annotations

import argparse
from typing import Any

from cluster_ops import common


def run(args: argparse.Namespace) -> int:
    """Run the reference's benchmark on a proxy node and print its key metrics."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from cluster_ops import bench

    cfg = common.load(args)
    common.announce(cfg)
    session = common.session(cfg)
    common.account(cfg)  # no credentials: one line before anything is shown
    console = common.console(args)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task("gptoss-bench.service: starting", total=None)
        try:
            metrics = bench.run(cfg, session.client("ec2"), session.client("ssm"), node=args.node, poll_s=args.interval,
                                timeout_s=args.timeout,
                                on_poll=lambda state, t: progress.update(task, description=f"gptoss-bench.service: {state}"[:100]))  # fmt: skip
        except bench.BenchError as e:
            raise common.CliError(f"bench failed: {e}", 1) from None
    t = common.table(title=f"{cfg.serving.bench.result_file} (measured leg, {cfg.serving.bench.measured_prompts} prompts)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key, label in bench.METRICS:
        value = metrics.get(key)
        t.add_row(label, "-" if value is None else f"{value:,.2f}")
    console.print(t)
    return 0


def register(sub: Any) -> None:
    """Add the command to the parser."""
    be = sub.add_parser("bench", help="run the benchmark on a proxy node and print its metrics")
    common.add_target_arguments(be)
    common.add_width_arguments(be)
    be.add_argument("--node", help="proxy node to run it on (default: the first)")
    be.add_argument("--interval", type=float, default=60, help="seconds between polls")
    be.add_argument("--timeout", type=float, default=6 * 3600,
                    help="seconds before the benchmark is stopped and the command fails (default 6 h)")  # fmt: skip
    be.set_defaults(func=run)
