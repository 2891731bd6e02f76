#!/usr/bin/env python3
"""Operator commands for the Trn3 gpt-oss-120b cluster: plan, preflight, status, wait-ready, bench."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from clusterspec.config import ClusterConfig, load_config  # noqa: E402
from clusterspec.errors import SpecError  # noqa: E402
from clusterspec.render import NodeRender, plan_json, render_cluster  # noqa: E402


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
    """Validate the same parameters `cdk synth` takes."""
    return load_config(_context(args))


def _summary(cfg: ClusterConfig, renders: list[NodeRender]) -> Table:
    layout = cfg.layout
    t = Table(title=f"{cfg.stack_name}: {len(layout.prefill_nodes)} prefill + {len(layout.decode_nodes)} decode = "
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


if __name__ == "__main__":
    sys.exit(main())
