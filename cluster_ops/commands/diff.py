"""`gptoss diff`: cdk diff of the named stack, with the image a deploy would resolve now."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from cluster_ops import common, deploy_plan, stack
from cluster_ops.commands import deploy


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """`cdk diff` of the named stack (with the image a deploy would resolve now)."""
    cfg = common.load(args)
    common.announce(cfg)
    print(f"account {common.account(cfg)}", file=sys.stderr)
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and urlparse(endpoint).hostname in ("localhost", "127.0.0.1", "::1") and not any(a.startswith("--method") for a in extra):
        # moto makes no change set of a stack with nested stacks: the CDK says so only after a minute, then compares templates.
        print(f"the local AWS at {endpoint} makes no change sets: comparing the deployed templates with the synthesized ones "
              "(cdk diff --method=template)", file=sys.stderr)  # fmt: skip
        extra = [*extra, "--method=template"]
    context = common.context_args(args) + deploy.resolve_image(cfg, args, "diff")
    with tempfile.TemporaryDirectory(prefix="gptoss-assembly-") as workdir:
        # What a deploy would do: the same plan (its surge decision, its updates), and cdk's diff of the change.
        plan = deploy_plan.make(cfg, context, Path(workdir))
        code = stack.cdk("diff", plan.cfg, plan.context, ["--app", str(plan.assembly), *extra])
        deploy_plan.say(plan)
    return code


def register(sub: Any) -> None:
    """Add the command to the parser."""
    dif = sub.add_parser("diff", help="cdk diff of the named stack")
    common.add_target_arguments(dif)
    dif.set_defaults(func=run, passthrough=True)
