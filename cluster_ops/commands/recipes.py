"""`gptoss recipes`: the documented deployments."""

from __future__ import annotations

import argparse
import json
from typing import Any

from cluster_ops import common


def run(args: argparse.Namespace) -> int:
    """List the documented deployments: name, reference, what each deploys, its stack."""
    from clusterspec.recipes import DEFAULT_RECIPE, RECIPES

    if args.json:
        print(json.dumps([{"name": r.name, "reference": r.reference, "deploys": r.deploys, "stack_name": r.stack_name,
                           "default": r.name == DEFAULT_RECIPE} for r in RECIPES.values()], indent=2))  # fmt: skip
        return 0
    t = common.table(title="recipes (-c recipe=NAME)", show_lines=True)
    for col in ("recipe", "reference", "deploys", "stack"):
        t.add_column(col, overflow="fold")
    for r in RECIPES.values():
        t.add_row(r.name + (" (default)" if r.name == DEFAULT_RECIPE else ""), r.reference, r.deploys, r.stack_name)
    common.console(args).print(t)
    return 0


def register(sub: Any) -> None:
    """Add the command to the parser."""
    rec = sub.add_parser("recipes", help="list the documented deployments (-c recipe=NAME)")
    rec.add_argument("--json", action="store_true", help="machine-readable list")
    common.add_width_arguments(rec)
    rec.set_defaults(func=run)
