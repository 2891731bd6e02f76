"""`gptoss status`: every unit's state and health on every node, each node identity's instance and replacements."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from cluster_ops import common, stack
from cluster_ops.remote import find_nodes
from clusterspec.config import ClusterConfig

if TYPE_CHECKING:
    from rich.table import Table


def run(args: argparse.Namespace) -> int:
    """Report every unit's state and health on every node; 0 when all are ready."""
    from rich.progress import BarColumn, Progress, TextColumn

    from cluster_ops.status import collect

    cfg = common.load(args)
    common.announce(cfg)
    session = common.session(cfg)
    if not find_nodes(session.client("ec2"), cfg.cluster_name) and stack.deployed_status(cfg) is None:
        raise stack.not_deployed(cfg)
    console = common.console(args)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} nodes"),
                  console=console, transient=True, disable=not console.is_terminal) as progress:  # fmt: skip
        task = progress.add_task("asking every node (SSM Run Command)", total=len(cfg.layout.nodes))
        status = collect(cfg, session.client("ec2"), session.client("ssm"), autoscaling=session.client("autoscaling"),
                         logs=session.client("logs") if cfg.observability.enabled else None,
                         on_node=lambda node, st: progress.update(task, advance=1, description=f"{node}: {st}"))  # fmt: skip
    if stack.deployed_status(cfg) is not None:
        from cluster_ops import rollout

        for line in rollout.progress(cfg, session.client("cloudformation"), session.client("autoscaling")):
            console.print(line, highlight=False, soft_wrap=True)
    console.print(identity_table(cfg, status))
    from cluster_ops.status import software_lines

    for line in software_lines(status):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(status_table(cfg, status))
    if not no_instances_hint(cfg, status):
        from cluster_ops.status import summary

        for line in summary(status, os.environ.get("AWS_ENDPOINT_URL")):
            console.print(line, highlight=False, soft_wrap=True)
    return 0 if status.ready else 1


def status_table(cfg: ClusterConfig, status: Any) -> Table:
    t = common.table(title=f"{cfg.stack_name}: cluster status")
    for col in ("node", "unit", "state", "health"):
        t.add_column(col)
    silent = getattr(status, "no_report", {})
    for node, why in silent.items():
        count = sum(u.node == node for u in status.units)
        t.add_row(node, f"all {count} units", "[red]no report[/]", why)
    for u in status.units:
        if u.node in silent:
            continue
        health = "-" if not u.needs_health else ("[green]ok[/]" if u.healthy else "[red]no answer[/]")
        state = f"[green]{u.state}[/]" if u.state == "active" else f"[yellow]{u.state}[/]"
        t.add_row(u.node, u.unit, state, health)
    for n in status.missing_nodes:
        t.add_row(n, "-", "[red]no running instance[/]", "-")
    for n, why in status.pending_nodes.items():
        t.add_row(n, "-", f"[yellow]instance pending[/] {why}", "-")
    if status.notes:
        t.caption = "\n".join(status.notes)
    return t


def identity_table(cfg: ClusterConfig, status: Any) -> Table:
    """Each node identity: the instance that holds it now, and its replacements (its group's count and cause)."""
    t = common.table(title=f"{cfg.stack_name}: nodes (each an Auto Scaling group of one)")
    for col in ("node", "instance", "replaced", "latest replacement or failed launch"):
        t.add_column(col, overflow="fold")
    for i in status.identities:
        instance = f"{i.instance_id} ({', '.join(filter(None, [i.state, i.private_ip]))})" if i.instance_id else "[red]none running[/]"
        if i.newer:
            instance += f"; its replacement beside it: {', '.join(i.newer)}"
        why = " ".join(filter(None, [i.last_at, i.last_cause, f"- the node said: {i.reported}" if i.reported else ""])) or "-"
        t.add_row(i.node, instance, str(i.replaced), why)
    return t


def no_instances_hint(cfg: ClusterConfig, status: Any) -> bool:
    """When nothing of this cluster runs, say so and which stacks this checkout did deploy."""
    if status.units or status.pending_nodes:
        return False
    others = {k: v for k, v in common.deployed().items() if k != cfg.stack_name}
    hint = "; ".join(f"{k} (gptoss status --stack {k})" for k in sorted(others))
    print(f"no instance tagged gptoss:cluster={cfg.cluster_name} runs in {cfg.region}"
          + (f". Deployed from this checkout: {hint}" if hint else ""), file=sys.stderr)  # fmt: skip
    return True


def register(sub: Any) -> None:
    """Add the command to the parser."""
    st = sub.add_parser("status", help="every unit's state and health on every node (SSM)")
    common.add_target_arguments(st)
    common.add_width_arguments(st)
    st.set_defaults(func=run)
