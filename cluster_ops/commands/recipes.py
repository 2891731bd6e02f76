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
    # The names a user copies (the recipe, its stack) never break: they have a column of their own
    # that does not wrap; the reference and what it deploys wrap beside them.
    t = common.table(title="recipes (-c recipe=NAME)", show_lines=True)
    t.add_column("recipe\nstack", no_wrap=True)
    t.add_column("reference\ndeploys", overflow="fold")
    for r in RECIPES.values():
        t.add_row(f"{r.name}\n{r.stack_name}" + ("\n(default)" if r.name == DEFAULT_RECIPE else ""), f"{r.reference}\n[dim]{r.deploys}[/]")
    common.console(args).print(t)
    return 0


def register(sub: Any) -> None:
    """Add the command to the parser."""
    rec = sub.add_parser("recipes", help="list the documented deployments (-c recipe=NAME)")
    rec.add_argument("--json", action="store_true", help="machine-readable list")
    common.add_width_arguments(rec)
    rec.set_defaults(func=run)
