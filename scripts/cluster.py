#!/usr/bin/env python3
"""Operator commands for the Trn3 gpt-oss-120b cluster: plan, preflight, status, wait-ready, bench, save-cache."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from clusterspec.config import ClusterConfig, load_config
from clusterspec.errors import SpecError
from clusterspec.render import NodeRender, plan_json, render_cluster


def _context(args: argparse.Namespace) -> dict[str, Any]:
    ctx: dict[str, Any] = {}
    for item in args.context or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError([f"-c {item!r}: context must be KEY=VALUE. Fix: e.g. -c decode_instances=8."])
        ctx[key] = value
    if args.config:
        ctx["config"] = args.config
    for name in ("decode_instances", "prefill_per_decode", "replicas_per_prefill_instance", "instance_type"):
        value = getattr(args, name, None)
        if value is not None:
            ctx[name] = str(value)
    return ctx


def load(args: argparse.Namespace) -> ClusterConfig:
    """Validate the same parameters `cdk synth` takes, and the limits of one stack."""
    from clusterspec import limits

    cfg = load_config(_context(args))
    limits.check(cfg)
    return cfg


def _summary(cfg: ClusterConfig, renders: list[NodeRender]) -> Table:
    layout = cfg.layout
    t = Table(title=f"{cfg.stack_name} (recipe {cfg.recipe}): {len(layout.prefill_nodes)} prefill + {len(layout.decode_nodes)} decode = "
              f"{len(layout.nodes)} x {cfg.instance_type}, {len(layout.replicas)} prefill replicas, "
              f"{len(layout.proxies)} prox{'y' if len(layout.proxies) == 1 else 'ies'}"
              + (" behind an internal NLB" if cfg.load_balanced else "")
              + f", {sum(n.idle_cores for n in layout.nodes)} idle cores")
    for col in ("node", "role", "replicas", "cores", "idle cores", "feeds decode", "units"):
        t.add_column(col, overflow="fold")
    for r in renders:
        n = r.node
        feeds = sorted({rep.decode_server for rep in n.replicas})
        t.add_row(
            n.name, n.role, str(len(n.replicas)), f"{n.used_cores}/{n.cores}", str(n.idle_cores),
            ",".join(f"decode-{d}" for d in feeds) or "-",
            ", ".join(dict.fromkeys(s.unit for s in r.services)),
        )  # fmt: skip
    return t


def cmd_plan(args: argparse.Namespace) -> int:
    """Print what runs where: per node, each unit with its environment and command line."""
    cfg = load(args)
    renders = render_cluster(cfg)
    if args.json:
        print(plan_json(renders))
        return 0
    console = Console(width=args.width or max(Console().width, 160))
    console.print(_summary(cfg, renders))
    for r in renders:
        t = Table(title=f"{r.node.name} ({r.node.role}, {r.instance_type})", show_lines=True, expand=True)
        t.add_column("unit", overflow="fold")
        t.add_column("environment", overflow="fold")
        t.add_column("command line", overflow="fold")
        for s in r.services:
            env = "\n".join(f"{k}={v}" for k, v in s.environment.items())
            unit = s.unit + (f"\n({s.step} leg)" if s.step else "")
            t.add_row(unit, env, shlex.join(s.argv))
        console.print(t)
    if args.diagram:
        from clusterspec.diagram import draw

        out = draw(cfg, Path(args.diagram))
        console.print(f"diagram written to {out}")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    """List the documented deployments: name, reference, what each deploys, its stack."""
    from clusterspec.recipes import DEFAULT_RECIPE, RECIPES

    if args.json:
        import json

        print(json.dumps([{"name": r.name, "reference": r.reference, "deploys": r.deploys, "stack_name": r.stack_name,
                           "default": r.name == DEFAULT_RECIPE} for r in RECIPES.values()], indent=2))  # fmt: skip
        return 0
    t = Table(title="recipes (-c recipe=NAME)", show_lines=True)
    for col in ("recipe", "reference", "deploys", "stack"):
        t.add_column(col, overflow="fold")
    for r in RECIPES.values():
        t.add_row(r.name + (" (default)" if r.name == DEFAULT_RECIPE else ""), r.reference, r.deploys, r.stack_name)
    Console(width=args.width or max(Console().width, 120)).print(t)
    return 0


def _session(cfg: ClusterConfig) -> Any:
    import boto3

    return boto3.Session(region_name=cfg.region)


def cmd_preflight(args: argparse.Namespace) -> int:
    """Check the account against what the stack assumes; non-zero when any check fails."""
    from cluster_ops import preflight

    cfg = load(args)
    checks = preflight.run(cfg, _session(cfg))
    t = Table(title=f"preflight: {cfg.stack_name} ({len(cfg.layout.nodes)} x {cfg.instance_type} in {cfg.availability_zone})")
    for col in ("check", "result", "detail", "fix"):
        t.add_column(col, overflow="fold")
    for c in checks:
        t.add_row(c.name, "[red]FAIL[/]" if not c.ok else "[yellow]warn[/]" if c.warn else "[green]pass[/]", c.detail, c.fix)
    Console(width=args.width or max(Console().width, 160)).print(t)
    return 0 if all(c.ok for c in checks) else 1


def _status_table(status: Any) -> Table:
    t = Table(title="cluster status")
    for col in ("node", "unit", "state", "health"):
        t.add_column(col)
    for u in status.units:
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


def cmd_status(args: argparse.Namespace) -> int:
    """Report every unit's state and health on every node; 0 when all are ready."""
    from rich.progress import BarColumn, Progress, TextColumn

    from cluster_ops.status import collect

    cfg = load(args)
    session = _session(cfg)
    console = Console()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} nodes"),
                  console=console, transient=True) as progress:  # fmt: skip
        task = progress.add_task("asking every node (SSM Run Command)", total=len(cfg.layout.nodes))
        status = collect(cfg, session.client("ec2"), session.client("ssm"),
                         on_node=lambda node, st: progress.update(task, advance=1, description=f"{node}: {st}"))  # fmt: skip
    console.print(_status_table(status))
    return 0 if status.ready else 1


def cmd_wait_ready(args: argparse.Namespace) -> int:
    """Wait until every server answers; on timeout exit 1 naming the failing units."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from cluster_ops.status import wait_ready

    cfg = load(args)
    session = _session(cfg)
    console = Console()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} units ready"),
                  TimeElapsedColumn(), console=console) as progress:  # fmt: skip
        task = progress.add_task("waiting for the cluster", total=None)

        def on_poll(status: Any, elapsed: float) -> None:
            ready = sum(u.ready for u in status.units)
            waiting = [f for f in status.failing][:3]
            progress.update(task, total=len(status.units) + len(status.missing_nodes), completed=ready,
                            description="waiting: " + ("; ".join(waiting) if waiting else "all ready"))  # fmt: skip

        status = wait_ready(cfg, session.client("ec2"), session.client("ssm"), timeout_s=args.timeout, interval_s=args.interval,
                            on_poll=on_poll)  # fmt: skip
    if status.ready:
        console.print(f"[green]ready[/]: {len(status.units)} units on {len(cfg.layout.nodes)} nodes")
        return 0
    console.print(_status_table(status))
    print(f"not ready after {args.timeout:.0f}s:\n" + "\n".join(f"  - {f}" for f in status.failing), file=sys.stderr)
    return 1


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the reference's benchmark on a proxy node and print its key metrics."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from cluster_ops import bench

    cfg = load(args)
    session = _session(cfg)
    console = Console()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("gptoss-bench.service: starting", total=None)
        try:
            metrics = bench.run(cfg, session.client("ec2"), session.client("ssm"), node=args.node, poll_s=args.interval,
                                on_poll=lambda state, t: progress.update(task, description=f"gptoss-bench.service: {state}"))  # fmt: skip
        except bench.BenchError as e:
            print(f"bench failed: {e}", file=sys.stderr)
            return 1
    t = Table(title=f"{cfg.serving.bench.result_file} (measured leg, {cfg.serving.bench.measured_prompts} prompts)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key, label in bench.METRICS:
        value = metrics.get(key)
        t.add_row(label, "-" if value is None else f"{value:,.2f}")
    console.print(t)
    return 0


def cmd_save_cache(args: argparse.Namespace) -> int:
    """Copy the compile caches of one prefill and one decode node to compile_cache_s3_uri."""
    from cluster_ops import cache

    cfg = load(args)
    session = _session(cfg)
    try:
        done = cache.save(cfg, session.client("ec2"), session.client("ssm"))
    except cache.CacheError as e:
        print(f"save-cache failed: {e}", file=sys.stderr)
        return 1
    print(f"saved to {cfg.compile_cache_s3_uri} from {', '.join(sorted(done))}; new nodes restore it before compiling")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(prog="cluster.py", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("-c", "--context", action="append", metavar="KEY=VALUE", help="the same keys as `cdk -c`")
        sp.add_argument("--config", help="YAML or JSON config file (as `cdk -c config=FILE`)")
        sp.add_argument("--decode-instances", type=int, help="decode instances (default 1: the tested 6P1D)")
        sp.add_argument("--prefill-per-decode", type=int, help="prefill replicas per decode server (default 6)")
        sp.add_argument("--replicas-per-prefill-instance", type=int, help="default: fill each prefill instance")
        sp.add_argument("--instance-type", help="default trn3.48xlarge")

    plan = sub.add_parser("plan", help="print each node's units, environment and command lines")
    common(plan)
    plan.add_argument("--json", action="store_true", help="machine-readable plan")
    plan.add_argument("--diagram", metavar="FILE", help="also draw the layout (PNG or SVG by extension)")
    plan.add_argument("--width", type=int, default=None, help="console width")
    plan.set_defaults(func=cmd_plan)

    rec = sub.add_parser("recipes", help="list the documented deployments (-c recipe=NAME)")
    rec.add_argument("--json", action="store_true")
    rec.add_argument("--width", type=int, default=None)
    rec.set_defaults(func=cmd_recipes)

    pre = sub.add_parser("preflight", help="check the account (type offered, hardware, DLAMI, quota, reservation)")
    common(pre)
    pre.add_argument("--width", type=int, default=None)
    pre.set_defaults(func=cmd_preflight)

    st = sub.add_parser("status", help="every unit's state and health on every node (SSM)")
    common(st)
    st.set_defaults(func=cmd_status)

    wr = sub.add_parser("wait-ready", help="wait until every server answers its health route")
    common(wr)
    wr.add_argument("--timeout", type=float, default=6 * 3600, help="seconds (first compiles take hours)")
    wr.add_argument("--interval", type=float, default=60, help="seconds between polls")
    wr.set_defaults(func=cmd_wait_ready)

    be = sub.add_parser("bench", help="run the 8K/1K benchmark on a proxy node and print its metrics")
    common(be)
    be.add_argument("--node", help="proxy node to run it on (default: the first)")
    be.add_argument("--interval", type=float, default=60, help="seconds between polls")
    be.set_defaults(func=cmd_bench)

    sc = sub.add_parser("save-cache", help="upload the compile caches to compile_cache_s3_uri (after the first compile)")
    common(sc)
    sc.set_defaults(func=cmd_save_cache)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; invalid parameters exit 2 with the field, value, rule and fix."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except SpecError as e:
        print(f"invalid deployment parameters:\n{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug, not a bad value: one line unless asked for the traceback
        if os.environ.get("GPTOSS_DEBUG"):
            raise
        print(f"internal error: {type(e).__name__}: {e} (set GPTOSS_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
