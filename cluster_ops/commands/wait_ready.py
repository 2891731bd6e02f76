"""`gptoss wait-ready`: wait until every server answers its health route."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cluster_ops import common, stack
from cluster_ops.commands.status import status_table
from cluster_ops.remote import find_nodes


def run(args: argparse.Namespace) -> int:
    """Wait until every server answers; on timeout exit 1 naming the failing units."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from cluster_ops.status import wait_ready

    cfg = common.load(args)
    common.announce(cfg)
    session = common.session(cfg)
    common.account(cfg)  # no credentials: one line before anything is shown
    if not find_nodes(session.client("ec2"), cfg.cluster_name) and stack.deployed_status(cfg) is None:
        raise stack.not_deployed(cfg)  # nothing will come: no wait of hours for it
    console = common.console(args)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                  TimeElapsedColumn(), console=console, disable=not console.is_terminal) as progress:  # fmt: skip
        task = progress.add_task("waiting for the cluster: asking every node", total=None, count="")

        def on_poll(status: Any, elapsed: float) -> None:
            ready = sum(u.ready for u in status.units)
            total = len(status.units) + len(status.missing_nodes) + len(status.pending_nodes)
            waiting = list(status.failing)[:2]
            progress.update(task, total=total, completed=ready, count=f"{ready}/{total} units ready",
                            description=("waiting: " + "; ".join(waiting) if waiting else "all ready")[:60])  # fmt: skip

        status = wait_ready(cfg, session.client("ec2"), session.client("ssm"), timeout_s=args.timeout, interval_s=args.interval,
                            on_poll=on_poll)  # fmt: skip
    if status.ready:
        console.print(f"[green]ready[/]: {len(status.units)} units on {len(cfg.layout.nodes)} nodes")
        return 0
    console.print(status_table(cfg, status))
    print(f"not ready after {args.timeout:.0f}s:\n" + "\n".join(f"  - {f}" for f in status.failing), file=sys.stderr)
    return 1


def register(sub: Any) -> None:
    """Add the command to the parser."""
    wr = sub.add_parser("wait-ready", help="wait until every server answers its health route")
    common.add_target_arguments(wr)
    common.add_width_arguments(wr)
    wr.add_argument("--timeout", type=float, default=6 * 3600, help="seconds (first compiles take hours)")
    wr.add_argument("--interval", type=float, default=60, help="seconds between polls")
    wr.set_defaults(func=run)
