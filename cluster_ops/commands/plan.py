"""`gptoss plan`: what runs where, the summary, every unit's detail, the JSON document, the diagram."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cluster_ops import common, cost, plan_view
from clusterspec.errors import SpecError
from node_render.render import render_cluster


def run(args: argparse.Namespace) -> int:
    """What runs where: a summary; with --details or --node, each unit's environment and command line."""
    cfg = common.load(args)
    common.announce(cfg)
    renders = render_cluster(cfg)
    if args.node:
        chosen = [r for r in renders if r.node.name == args.node]
        if not chosen:
            raise SpecError([f"--node {args.node}: no such node in {cfg.stack_name}. Fix: one of {', '.join(r.node.name for r in renders)}."])
        renders_shown = chosen
    else:
        renders_shown = renders
    if args.json:
        doc = plan_view.plan_document(cfg, renders)
        if args.node:
            doc["nodes"] = [n for n in doc["nodes"] if n["name"] == args.node]
        if args.cost:
            doc["cost"] = cost.price_rows(cfg, common.pricing(cfg))
        print(json.dumps(doc, indent=2))
        return 0
    if args.details or args.node:
        console = common.console(args)
        if args.wide or args.width:
            plan_view.detail_tables(console, renders_shown)
        else:
            plan_view.detail_lists(renders_shown, console.width)
    else:
        print(plan_view.summary(cfg, renders))
        if args.explain:
            print("\n" + plan_view.legend())
    if args.cost:
        plan_view.print_cost(cfg, cost.price_rows(cfg, common.pricing(cfg)), common.console(args))
    if args.diagram:
        from clusterspec.diagram import draw

        print(f"diagram written to {draw(cfg, Path(args.diagram))}")
    return 0


def register(sub: Any) -> None:
    """Add the command to the parser."""
    plan = sub.add_parser("plan", help="what runs where (80-column summary; --details for every unit)")
    common.add_target_arguments(plan)
    plan.add_argument("--details", action="store_true", help="every unit's environment and command line")
    plan.add_argument("--node", help="the detail of one node")
    plan.add_argument("--json", action="store_true", help="machine-readable plan (everything the tables show)")
    plan.add_argument("--cost", action="store_true", help="prices per hour from the AWS Price List API (needs credentials)")
    plan.add_argument("--explain", action="store_true", help="after the summary, what each of its terms means")
    plan.add_argument("--diagram", metavar="FILE", help="also draw the layout (PNG or SVG by extension)")
    common.add_width_arguments(plan)
    plan.set_defaults(func=run)
