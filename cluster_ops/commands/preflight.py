"""`gptoss preflight`: the account against what the stack assumes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cluster_ops import common, cost, plan_view


def run(args: argparse.Namespace) -> int:
    """Check the account against what the stack assumes; non-zero when any check fails."""
    from cluster_ops import preflight

    cfg = common.load(args)
    common.announce(cfg)
    checks = preflight.run(cfg, common.session(cfg))
    t = common.table(title=f"preflight: {cfg.stack_name} ({len(cfg.layout.nodes)} x {cfg.instance_type} in {cfg.availability_zone})")
    for col in ("check", "result", "detail", "fix"):
        t.add_column(col, overflow="fold")
    for c in checks:
        t.add_row(c.name, "[red]FAIL[/]" if not c.ok else "[yellow]warn[/]" if c.warn else "[green]pass[/]", c.detail, c.fix)
    common.console(args).print(t)
    if not cfg.ami_id:
        print(f"note: the image resolves from {cfg.ami_ssm_parameter} at every deploy; pin it: gptoss pin-ami", file=sys.stderr)
    if args.cost:
        plan_view.print_cost(cfg, cost.price_rows(cfg, common.pricing(cfg)), common.console(args))
    return 0 if all(c.ok for c in checks) else 1


def register(sub: Any) -> None:
    """Add the command to the parser."""
    pre = sub.add_parser("preflight", help="check the account: type offered, hardware, DLAMI, quota, capacity")
    common.add_target_arguments(pre)
    pre.add_argument("--cost", action="store_true", help="also the prices per hour (AWS Price List API)")
    common.add_width_arguments(pre)
    pre.set_defaults(func=run)
