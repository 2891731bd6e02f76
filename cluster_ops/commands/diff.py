"""`gptoss diff`: cdk diff of the named stack, with the image a deploy would resolve now."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cluster_ops import common, stack
from cluster_ops.commands import deploy


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """`cdk diff` of the named stack (with the image a deploy would resolve now)."""
    cfg = common.load(args)
    common.announce(cfg)
    print(f"account {common.account(cfg)}", file=sys.stderr)
    return stack.cdk("diff", cfg, common.context_args(args) + deploy.resolve_image(cfg, args, "diff"), extra)


def register(sub: Any) -> None:
    """Add the command to the parser."""
    dif = sub.add_parser("diff", help="cdk diff of the named stack")
    common.add_target_arguments(dif)
    dif.set_defaults(func=run, passthrough=True)
