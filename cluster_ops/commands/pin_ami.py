"""`gptoss pin-ami`: resolve the DLAMI parameter once and record the image in cdk.context.json."""

from __future__ import annotations

import argparse
from typing import Any

from cluster_ops import common
from clusterspec.loading import load_config


def run(args: argparse.Namespace) -> int:
    """Resolve the DLAMI parameter once and record the image in cdk.context.json."""
    from cluster_ops import ami
    from clusterspec.loading import pin_key

    ctx = common.context(common.context_args(args))
    current = load_config(ctx)
    common.announce(current)
    ctx.pop(pin_key(current.region), None)
    cfg = load_config(ctx)
    if cfg.ami_id:
        print(f"ami_id is given in the parameters ({cfg.ami_id}): it is pinned already")
        return 0
    if current.ami_id and not args.upgrade:
        print(f"already pinned: {current.ami_id}. To move to the image {cfg.ami_ssm_parameter} names today: "
              "gptoss pin-ami --upgrade, review, commit cdk.context.json, deploy")  # fmt: skip
        return 0
    session = common.session(cfg)
    pin = ami.resolve(cfg, session.client("ssm"), session.client("ec2"))
    path = common.checkout() / "cdk.context.json"
    previous = ami.write(path, cfg.region, pin)
    print(f"pinned {pin['ami_id']} ({pin['name']}, created {pin['created']}) from {pin['parameter']} in {path.name}")
    if previous and previous.get("ami_id") != pin["ami_id"]:
        print(f"was {previous.get('ami_id')} ({previous.get('name')}): the next deploy replaces every instance "
              "(instance store and compiled graphs lost; save-cache first)")  # fmt: skip
    return 0


def register(sub: Any) -> None:
    """Add the command to the parser."""
    pin = sub.add_parser("pin-ami", help="resolve the DLAMI parameter once and record the image (cdk.context.json)")
    common.add_target_arguments(pin)
    pin.add_argument("--upgrade", action="store_true", help="re-resolve a pinned image (a deliberate upgrade)")
    pin.set_defaults(func=run)
