"""`gptoss destroy`: delete the named stack after saying what goes and asking."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cluster_ops import common, stack
from clusterspec.config import ClusterConfig


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """Delete the named stack after confirmation (or --yes); never the default one by omission."""
    if not (args.context or args.config or args.stack):
        recorded = ", ".join(f"--stack {k}" for k in sorted(common.deployed())) or "none"
        raise common.CliError("destroy deletes a cluster: name it (-c config=FILE, -c KEY=VALUE or --stack NAME; "
                              f"deployed from this checkout: {recorded}). Nothing was deleted.")  # fmt: skip
    cfg = common.load(args)
    common.announce(cfg)
    account = common.account(cfg)
    print(f"account {account}", file=sys.stderr)
    if stack.deployed_status(cfg) is None:
        if cfg.stack_name in common.deployed():
            common.record(cfg, [], remove=True)  # the record outlived its stack (deleted elsewhere)
        print(f"nothing to destroy: there is no stack {cfg.stack_name} in {cfg.region} (account {account}). If you meant another "
              f"cluster, name it (deployed from this checkout: {stack.others_deployed(cfg)}).", file=sys.stderr)  # fmt: skip
        return 0
    goes = what_goes(cfg)
    print(f"destroy {cfg.stack_name} in {cfg.region} deletes: {goes}", file=sys.stderr)
    if not args.yes:
        if not sys.stdin.isatty():
            raise common.CliError(f"refusing to destroy {cfg.stack_name} without confirmation (no terminal). "
                                  "Fix: run it in a terminal, or pass --yes (make destroy YES=1).", 1)  # fmt: skip
        answer = input(f"type the stack name ({cfg.stack_name}) to delete it: ").strip()
        if answer != cfg.stack_name:
            raise common.CliError(f"not confirmed ({answer!r} is not {cfg.stack_name}): nothing was deleted.", 1)
    context = common.context_args(args)
    empty_cache_bucket(cfg)
    code = stack.cdk("destroy", cfg, context, ["--force", *extra])
    if code == 0:
        common.record(cfg, context, remove=True)
    return code


def what_goes(cfg: ClusterConfig) -> str:
    """What a destroy deletes: the plan's instances, and the live ones when AWS can be asked."""
    from cluster_ops.awserrors import explain
    from cluster_ops.remote import find_nodes

    layout = cfg.layout
    roles: dict[str, int] = {}
    for n in layout.nodes:
        roles[n.role] = roles.get(n.role, 0) + 1
    text = (f"{len(layout.nodes)} x {cfg.instance_type} ({', '.join(f'{c} {r}' for r, c in roles.items())})"
            + (", the internal NLB" if cfg.load_balanced else "")
            + (", the VPC and its NAT gateway" if cfg.network.vpc_id is None and cfg.network.egress == "nat" else
               ", the VPC" if cfg.network.vpc_id is None else "")
            + f", the log group /gptoss/{cfg.cluster_name}" * cfg.observability.enabled
            + (", the compile cache bucket and the caches in it" if not cfg.compile_cache_s3_uri and cfg.compile_cache_bucket else ""))  # fmt: skip
    try:
        live = find_nodes(common.session(cfg).client("ec2"), cfg.cluster_name)
        count = sum(1 + len(n.newer) for n in live.values())  # a surge's replacement is an instance too
        text += f"; running now: {count} instance{'s' if count != 1 else ''} tagged gptoss:cluster={cfg.cluster_name}"
    except Exception as e:
        reason = explain(e, region=cfg.region) or f"{type(e).__name__}"
        text += f"; could not list the running instances ({reason.split('. Fix')[0]})"
    return text


def cache_bucket(cfg: ClusterConfig) -> str | None:
    """The stack's own compile cache bucket, when the stack made one and it exists."""
    from cluster_ops import cache

    if cfg.compile_cache_s3_uri or not cfg.compile_cache_bucket:
        return None
    try:
        return cache.location(cfg, common.session(cfg).client("cloudformation")).removeprefix("s3://")
    except Exception:  # no such stack (never deployed, or already gone): nothing to empty
        return None


def empty_cache_bucket(cfg: ClusterConfig) -> None:
    """CloudFormation deletes only an empty bucket: the compile caches in the stack's own bucket go first."""
    bucket = cache_bucket(cfg)
    if bucket is None:
        return
    s3 = common.session(cfg).client("s3")
    deleted = 0
    # The bucket is versioned: every version and delete marker goes, or the bucket is not empty.
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"], "VersionId": o["VersionId"]} for o in page.get("Versions", []) + page.get("DeleteMarkers", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            deleted += len(keys)
    print(f"emptied the compile cache bucket {bucket} ({deleted} object versions) so that CloudFormation can delete it", file=sys.stderr)


def register(sub: Any) -> None:
    """Add the command to the parser."""
    des = sub.add_parser("destroy", help="cdk destroy of the named stack, after confirmation")
    common.add_target_arguments(des)
    des.add_argument("--yes", action="store_true", help="delete without asking (CI)")
    des.set_defaults(func=run, passthrough=True)
