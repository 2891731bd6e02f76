"""`gptoss local up|down|env`: the whole lifecycle on this machine against moto (cluster_ops/local.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cluster_ops import common


def run(args: argparse.Namespace) -> int:
    """`gptoss local up|down|env` (cluster_ops/local.py)."""
    from cluster_ops import local

    gptoss = str(Path(sys.executable).parent / "gptoss")
    if args.unset and args.action != "env":
        raise common.CliError("--unset goes with env: gptoss local env --unset")
    return {"up": lambda: local.up(gptoss), "down": lambda: local.down(gptoss), "env": lambda: local.env(args.unset)}[args.action]()


def register(sub: Any) -> None:
    """Add the command to the parser."""
    lo = sub.add_parser("local", help="the whole lifecycle on this machine against moto on localhost (no AWS account): up, down, env",
                        description="up: start moto on localhost:5005 (GPTOSS_LOCAL_PORT; or use GPTOSS_LOCAL_ENDPOINT), seed it, "
                                    "bootstrap the CDK, deploy examples/local.yaml and show its status. down: destroy it, remove "
                                    "everything up made, list what is left, stop the server. env: the exports that point this "
                                    "shell's AWS clients at it (env --unset: give back what the shell had before).")  # fmt: skip
    lo.add_argument("action", choices=["up", "down", "env"], help="up, down or env")
    lo.add_argument("--unset", action="store_true", help="env: print what gives this shell back the AWS settings it had before `local env`")
    lo.set_defaults(func=run)
