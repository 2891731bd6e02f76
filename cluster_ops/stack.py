"""The cluster's CloudFormation stack: the pinned CDK CLI run on exactly it, whether it exists, and
why its last operation failed (from its events and its cells')."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from cluster_ops import common
from clusterspec.config import ClusterConfig


def cdk(verb: str, cfg: ClusterConfig, context: list[str], extra: list[str]) -> int:
    """Run the pinned CDK CLI on exactly this stack, with these parameters."""
    if not common.CDK.exists():
        raise common.CliError(f"the CDK CLI is not installed ({common.CDK}). Fix: make setup")
    cmd = [str(common.CDK), verb, cfg.stack_name, "--no-notices", *(a for c in context for a in ("-c", c)), *extra]
    print("$ " + shlex.join(["cdk", *cmd[1:]]), file=sys.stderr, flush=True)
    env = {**os.environ, "PATH": f"{common.ROOT / 'node_modules' / '.bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.setdefault("AWS_REGION", cfg.region)
    env.setdefault("CDK_DISABLE_CLI_TELEMETRY", "true")
    if verb != "synth":
        return subprocess.run(cmd, cwd=common.checkout(), env=env).returncode
    # The diff or deploy that reads this assembly prints its warnings (the CLI validates every assembly it
    # reads): a synth's own output is shown only when it fails, so that each warning is printed once.
    r = subprocess.run(cmd, cwd=common.checkout(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout, end="", file=sys.stderr)
    return r.returncode


def operation_events(cfn: Any, stack: str) -> list[dict[str, Any]]:
    """Every event of a stack's latest operation (all pages), newest first, up to its 'User Initiated' start."""
    out = []
    for page in cfn.get_paginator("describe_stack_events").paginate(StackName=stack):
        for e in page["StackEvents"]:
            out.append(e)
            if e.get("ResourceType") == "AWS::CloudFormation::Stack" and e.get("PhysicalResourceId") == e.get("StackId") \
                    and e.get("ResourceStatusReason") == "User Initiated":  # fmt: skip
                return out
    return out


def failure_line(cfg: ClusterConfig) -> str | None:
    """Why the stack's last operation failed, from its events and its cells' (capacity first), or None."""
    from cluster_ops.capacity import explain_launch_failure

    try:
        cfn = common.session(cfg).client("cloudformation")
        events = operation_events(cfn, cfg.stack_name)
        # A cell (nested stack) that failed says only "Embedded stack ... was not successfully created":
        # its own events hold the reason (a node's gate, a group that could not launch).
        for e in list(events):
            if e.get("ResourceType") == "AWS::CloudFormation::Stack" and e.get("ResourceStatus", "").endswith("FAILED") \
                    and e.get("PhysicalResourceId") not in ("", e.get("StackId")):  # fmt: skip
                events = operation_events(cfn, e["PhysicalResourceId"]) + events
    except Exception:  # the deploy's own error stands; this is a best effort
        return None
    line = explain_launch_failure(cfg, events)
    if line:
        return line
    generic = ("cancelled", "Embedded stack", "The following resource(s) failed")
    failed = [e for e in events if e.get("ResourceStatus", "").endswith("FAILED") and not any(g in (e.get("ResourceStatusReason") or "") for g in generic)]
    if failed:
        e = failed[-1]  # the earliest: what failed first
        return f"{e['LogicalResourceId']}: {e['ResourceStatus']}: {(e.get('ResourceStatusReason') or '').strip()[:300]}"
    return None


def exists(cfg: ClusterConfig) -> bool:
    try:
        stacks = common.session(cfg).client("cloudformation").describe_stacks(StackName=cfg.stack_name)["Stacks"]
    except Exception:  # does not exist, or cannot be asked: nothing to record either way
        return False
    return any(s["StackStatus"] != "DELETE_COMPLETE" for s in stacks)


def deployed_status(cfg: ClusterConfig) -> str | None:
    """The stack's status in its region, or None when CloudFormation has no such stack. Any other
    error (credentials, access) propagates: "not deployed" is said only when it is so."""
    from botocore.exceptions import ClientError

    try:
        stacks = common.session(cfg).client("cloudformation").describe_stacks(StackName=cfg.stack_name)["Stacks"]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "ValidationError" and "does not exist" in e.response["Error"].get("Message", ""):
            return None
        raise
    live = [s["StackStatus"] for s in stacks if s["StackStatus"] != "DELETE_COMPLETE"]
    return live[0] if live else None


def others_deployed(cfg: ClusterConfig) -> str:
    """The other stacks this checkout deployed, as the --stack arguments that name them."""
    others = sorted(k for k in common.deployed() if k != cfg.stack_name)
    return ", ".join(f"--stack {k}" for k in others) or "none"


def not_deployed(cfg: ClusterConfig) -> common.CliError:
    """The one line a command that needs a deployed cluster says when this one is not."""
    return common.CliError(
        f"{cfg.stack_name} is not deployed in {cfg.region}: there is no such stack. Fix: name the cluster that is deployed "
        f"(from this checkout: {others_deployed(cfg)}; or -c config=FILE with its parameters), or check the region (-c region=...)."
    )
