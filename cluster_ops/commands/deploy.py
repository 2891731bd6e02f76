"""`gptoss deploy`: cdk deploy of the named stack, the size and the image asked first, a failure in one line."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from cluster_ops import common, deploy_plan, in_place, rollout, stack
from cluster_ops.growth import fleet_growth
from clusterspec.config import ClusterConfig


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """`cdk deploy` of the named stack (CDK's approval prompt kept); a failure explained in one line."""
    from cluster_ops import cost

    cfg = common.load(args)
    common.announce(cfg)
    account = common.account(cfg)
    print(f"account {account}", file=sys.stderr)
    billable = ", ".join(f"{i.count:g} x {i.name}" if i.unit == "hour" else i.name for i in cost.items(cfg))
    print(f"billed by the hour once deployed: {billable} (prices: gptoss plan --cost)", file=sys.stderr)
    growth = fleet_growth(cfg)
    if growth and not args.yes:
        nodes = len(cfg.layout.nodes)
        if not sys.stdin.isatty():
            raise common.CliError(f"refusing to deploy without confirmation: {growth}. Nothing was deployed. "
                                  "Fix: check decode_instances, prefill_per_decode and replicas_per_prefill_instance, "
                                  "or pass --yes if this is the fleet you mean.", 1)  # fmt: skip
        print(f"check the size: {growth}", file=sys.stderr)
        answer = input(f"type the instance count ({nodes}) to deploy them: ").strip()
        if answer != str(nodes):
            raise common.CliError(f"not confirmed ({answer!r} is not {nodes}): nothing was deployed.", 1)
    context = common.context_args(args)
    if "--no-rollback" in extra and cfg.healing.report_unhealthy:
        # Kept for inspection (docs/node.md): a node that failed must stay as it failed, not ask its
        # group for a new instance (which would boot and fail again, and take the evidence with it).
        print("--no-rollback: a node that fails is kept as it failed for inspection; no node asks its group to replace it "
              "(healing.report_unhealthy=false for this deploy; a later deploy without it replaces every node to turn it back on)",
              file=sys.stderr)  # fmt: skip
        context = [*context, "healing.report_unhealthy=false"]
        cfg = cfg.model_copy(update={"healing": cfg.healing.model_copy(update={"report_unhealthy": False})})
    image = resolve_image(cfg, args, "deploy")
    code, plan, started = _deploy(cfg, args, context + image, extra)
    if code != 0 and plan is not None and plan.change is not None and any(plan.change.surge.values()):
        # A surge that found no capacity (or quota) for a replacement (common for large Trainium types) rolled back:
        # the same change again without surge, within max_unavailable, said first (and asked, as any deploy). Its
        # plan makes the policy change an update of its own before the change.
        short = rollout.surge_found_no_capacity(cfg, common.session(cfg).client("autoscaling"), plan.change.replaced, started)
        if short and stack.deployed_status(cfg) == "UPDATE_ROLLBACK_COMPLETE":
            print(f"the surge found no capacity for a replacement ({short}); the stack rolled back and every node kept its "
                  "instance. Deploying the same change again without surge (rollout.surge=off): each node's instance goes "
                  f"before its replacement launches, at most {cfg.rollout.max_unavailable} per role at a time", file=sys.stderr)  # fmt: skip
            cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"surge": "off"})})
            code, plan, _ = _deploy(cfg, args, [*context, *image, "rollout.surge=off"], extra)
    # Recorded once the stack exists: a deploy refused before anything was made leaves no record.
    if code == 0 or stack.exists(cfg):
        common.record(cfg, context, image=image[0].split("=", 1)[1] if image else cfg.ami_id)
    if code != 0:
        line = stack.failure_line(cfg)
        if line:
            print(f"deploy failed: {line}", file=sys.stderr)
    return code


def _deploy(cfg: ClusterConfig, args: argparse.Namespace, context: list[str], extra: list[str]) -> tuple[int, deploy_plan.DeployPlan, Any]:
    """Synthesize once, say what the deploy does (and ask), deploy that assembly, its policy first when it
    changes: (exit code, the plan, when it started)."""
    import datetime as dt

    with tempfile.TemporaryDirectory(prefix="gptoss-assembly-") as workdir:
        # Synthesized once: what the rollout is computed from is what is deployed (cdk deploy --app DIR).
        plan = deploy_plan.make(cfg, context, Path(workdir))
        deploy_plan.say(plan)
        if plan.keys_turn_on and not args.yes:
            if not sys.stdin.isatty():
                raise common.CliError("refusing to turn on API keys without confirmation (no terminal): clients without a key would "
                                      "be refused. Fix: -c serving.endpoint.auth=optional first, or pass --yes. Nothing was deployed.", 1)  # fmt: skip
            if input("type 'keys' to turn on API keys for this cluster: ").strip() != "keys":
                raise common.CliError("not confirmed: nothing was deployed.", 1)
        if plan.change is not None:
            rollout.confirm(plan.cfg, plan.change, yes=args.yes, restarting=in_place.serving_restarts(plan.software))
        started = dt.datetime.now(dt.UTC)
        return deploy_plan.execute(plan, extra), plan, started


def resolve_image(cfg: ClusterConfig, args: argparse.Namespace, verb: str) -> list[str]:
    """For a stack whose image is not pinned: the image the DLAMI parameter names now, passed to the
    synth as ami_id, so the deploy gate of every node sees a new image as the change it is (a
    parameter CloudFormation resolves would replace the instances behind the gate's back). A new
    image since this checkout's last deploy replaces every instance: it is said, and a deploy asks."""
    from cluster_ops import ami

    if cfg.ami_id:
        return []
    session = common.session(cfg)
    image = ami.resolve(cfg, session.client("ssm"), session.client("ec2"))
    print(f"image {image['ami_id']} ({image['name'] or 'no name'}, created {image['created'] or '?'}) from {cfg.ami_ssm_parameter}, "
          "for this deploy; pin it to keep it: gptoss pin-ami", file=sys.stderr)  # fmt: skip
    before = common.deployed().get(cfg.stack_name, {}).get("image")
    if verb == "deploy" and before and before != image["ami_id"] and not args.yes:
        what = f"{before} was deployed before: the new image replaces every instance of {cfg.stack_name} (instance store and compiled graphs with them)"
        if not sys.stdin.isatty():
            raise common.CliError(f"refusing to move to a new image without confirmation: {what}. Nothing was deployed. "
                                  "Fix: gptoss pin-ami to keep the image you have, or pass --yes to move.", 1)  # fmt: skip
        answer = input(f"{what}. Type the new image id to deploy it: ").strip()
        if answer != image["ami_id"]:
            raise common.CliError(f"not confirmed ({answer!r} is not {image['ami_id']}): nothing was deployed.", 1)
    return [f"ami_id={image['ami_id']}", "ami_ssm_parameter=null"]


def register(sub: Any) -> None:
    """Add the command to the parser."""
    dep = sub.add_parser("deploy", help="cdk deploy of the named stack (extra arguments go to cdk)")
    common.add_target_arguments(dep)
    dep.add_argument("--yes", action="store_true", help="deploy without asking: a fleet 4x or more the expected size, or a new image")
    dep.set_defaults(func=run, passthrough=True)
