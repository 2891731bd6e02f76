"""What a deploy will do, decided once for `gptoss diff` and `gptoss deploy`: the synthesized change,
whether it surges, and the CloudFormation updates it takes (cluster_ops.policy_update)."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster_ops import common, in_place, policy_update, replacements, rollout, stack
from clusterspec.config import ClusterConfig
from clusterspec.names import node_order
from clusterspec.sections.rollout import FIRST_DEPLOY_CONTEXT


@dataclass
class DeployPlan:
    """A deploy decided: its config and context (rollout.surge=off added when the plan turns surge off),
    the assembly it deploys, what it does to the nodes, and its updates in order."""

    cfg: ClusterConfig
    context: list[str]
    assembly: Path
    change: rollout.Rollout | None  # what it does to each node; None: the stack does not exist (a first deploy)
    updates: list[tuple[str, rollout.Templates]] = field(default_factory=list)
    surge_off: str = ""  # why this deploy replaces without surge although the config would surge
    ready_min: float | None = None  # a node's time to serve at the last deploy
    policy_changed: list[str] = field(default_factory=list)  # the nodes whose group's rollout policy changes
    moves: list[str] = field(default_factory=list)  # a move onto other capacity: what it means, said before
    why: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # replaced node -> (machine|software, what changed)
    software: in_place.InPlace | None = None  # a new software version applied in place (rollout.software=in-place)
    keys_turn_on: bool = False  # the deployed cluster checks no API key and this deploy makes its gates check them


def make(cfg: ClusterConfig, context: list[str], workdir: Path) -> DeployPlan:
    """Synthesize into WORKDIR/change (what is then deployed, unchanged) and compare with what is deployed."""
    assembly = workdir / "change"
    first = not stack.exists(cfg)
    _synth(cfg, context + ([f"{FIRST_DEPLOY_CONTEXT}=true"] if first else []), assembly)
    if first:
        return DeployPlan(cfg, context, assembly, None)
    cfn = common.session(cfg).client("cloudformation")
    deployed = rollout.deployed_templates(cfn, cfg.stack_name)
    synthesized = rollout.assembly_templates(assembly, cfg.stack_name)
    r = rollout.compare(rollout.flatten_templates(deployed), rollout.flatten_templates(synthesized))
    ready = rollout.measured_ready_min(cfn, cfg.stack_name) if r.replaced else None
    why = ""
    if r.replaced:
        image = policy_update.image_changes(rollout.flatten_templates(deployed), rollout.flatten_templates(synthesized))
        why = policy_update.surge_off_because(cfg, ready_min=ready, image_changed=image)
    moves = policy_update.capacity_moves(rollout.flatten_templates(deployed), rollout.flatten_templates(synthesized)) if r.replaced else {}
    # A move onto another reservation or Capacity Block: the new one holds each replacement while the old
    # instance serves, so the move surges (rollout.surge=auto keeps a reservation's default, no surge, otherwise).
    surge_to = policy_update.surge_for(cfg, why, moves)
    if surge_to:
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"surge": surge_to})})
        context = [*context, f"rollout.surge={surge_to}"]
        shutil.rmtree(assembly, ignore_errors=True)
        _synth(cfg, context, assembly)
        synthesized = rollout.assembly_templates(assembly, cfg.stack_name)
        r = rollout.compare(rollout.flatten_templates(deployed), rollout.flatten_templates(synthesized))
    changed = sorted(policy_update.policy_nodes(deployed, synthesized), key=node_order)
    kinds = replacements.reasons(rollout.flatten_templates(deployed), rollout.flatten_templates(synthesized))
    return DeployPlan(cfg, context, assembly, r, policy_update.updates(deployed, synthesized), why, ready, changed, _move_lines(cfg, moves),
                      {n: kinds[n] for n in r.replaced if n in kinds}, _software(cfg, deployed, synthesized, assembly, r),
                      keys_turn_on(cfg, rollout.flatten_templates(deployed), rollout.flatten_templates(synthesized)))  # fmt: skip


def keys_turn_on(cfg: ClusterConfig, deployed: dict[str, Any], synthesized: dict[str, Any]) -> bool:
    """Whether this deploy makes a deployed cluster's gates take only API keys: the stack's secret of keys appears
    (it comes with the gate's key rules; an operator's own secret is the operator's deliberate choice), and auth is
    not 'optional' (which lets a request without a key pass)."""

    def secret(resources: dict[str, Any]) -> bool:
        return any(r.get("Type") == "AWS::SecretsManager::Secret" and lid.startswith("ApiKeys") for lid, r in resources.items())

    return cfg.serving.endpoint.auth != "optional" and secret(synthesized) and not secret(deployed)


def _software(cfg: ClusterConfig, deployed: rollout.Templates, synthesized: rollout.Templates, assembly: Path, r: rollout.Rollout) -> in_place.InPlace | None:
    """A new software version for the nodes that keep their instance, and what each of them restarts."""
    old = in_place.version_of(rollout.flatten_templates(deployed))
    new = in_place.version_of(rollout.flatten_templates(synthesized))
    if old is None or new is None or old == new or not r.kept:
        return None
    from node_render.paths import software_parameter

    session = common.session(cfg)
    data, unknown = in_place.deployed_software(session, software_parameter(cfg.cluster_name), old)
    change = in_place.compare(old, new, data, in_place.assembly_software(assembly, new), r.kept, unknown=unknown)
    change.measured = in_place.measured_restarts(session, cfg)
    return change


def _move_lines(cfg: ClusterConfig, moves: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]) -> list[str]:
    """The move's lines, with the reservations' dates from EC2 (without them, the move is said and the dates are not)."""
    if not moves:
        return []
    import datetime as dt

    ids = sorted({i for pair in moves.values() for side in pair for i in side if i.startswith("cr-")})
    try:
        found = common.session(cfg).client("ec2").describe_capacity_reservations(CapacityReservationIds=ids)["CapacityReservations"] if ids else []
    except Exception as e:  # the dates are advice: the deploy itself does not need them
        from cluster_ops.awserrors import explain

        return [*policy_update.move_lines(moves, {}, dt.datetime.now(dt.UTC)), f"  (EC2 did not give the reservations' dates: {explain(e, region=cfg.region) or type(e).__name__})"]
    return policy_update.move_lines(moves, {r["CapacityReservationId"]: r for r in found}, dt.datetime.now(dt.UTC))


def _synth(cfg: ClusterConfig, context: list[str], assembly: Path) -> None:
    code = stack.cdk("synth", cfg, context, ["--quiet", "--output", str(assembly)])
    if code != 0:
        raise common.CliError(f"cdk synth of {cfg.stack_name} failed (exit {code}): nothing was changed.", code)


KEYS_TURN_ON = (
    "API keys turn on with this deploy: each router node's gate then answers a /v1/ request without a valid key 401, so "
    "clients that send none stop being served. If this cluster's clients send no key yet: deploy with -c "
    "serving.endpoint.auth=optional, give each client a key (gptoss keys create NAME), and deploy without it once "
    "KeyRequests of 'anonymous' is 0 (docs/operations.md 'API keys')"
)


def lines(plan: DeployPlan) -> list[str]:
    """What the deploy does, before it does it."""
    keys = [KEYS_TURN_ON] if plan.keys_turn_on else []
    if plan.change is None:
        return [f"{plan.cfg.stack_name} is not deployed: a deploy launches all {len(plan.cfg.layout.nodes)} nodes at once", *keys]
    out = [*keys, *plan.moves]
    if plan.surge_off:
        out.append(f"this deploy replaces nodes without surge: {plan.surge_off} (rollout.surge=off for this deploy; "
                   "set rollout.surge=on to surge anyway)")  # fmt: skip
    out += rollout.describe(plan.cfg, plan.change, plan.ready_min)
    out += replacements.lines(plan.why)
    if plan.software is not None:
        out += in_place.lines(plan.cfg, plan.software)
    if [name for name, _ in plan.updates] == ["policy", "change"]:
        changed = plan.policy_changed
        out.append(f"  two CloudFormation updates: first the rollout policy of {len(changed)} node groups alone ({rollout.span(changed)}: "
                   "surge on or off; no instance replaced), then the change, whose rollback then keeps that policy (AWS: "
                   "an update policy changes in an update of its own)")  # fmt: skip
    return out


def say(plan: DeployPlan) -> None:
    """The plan's lines, on stderr."""
    for line in lines(plan):
        print(line, file=sys.stderr)


def execute(plan: DeployPlan, extra: list[str]) -> int:
    """Deploy the plan's updates in order with the pinned CDK CLI; the first that fails ends it."""
    for name, templates in plan.updates or [("change", {})]:
        app = plan.assembly
        if name == "policy":
            app = plan.assembly.parent / "policy"
            policy_update.write_assembly(plan.assembly, app, plan.cfg.stack_name, templates)
            print(f"update 1 of 2: the rollout policy alone ({plan.cfg.stack_name})", file=sys.stderr)
        elif len(plan.updates) > 1:
            print(f"update 2 of 2: the change ({plan.cfg.stack_name})", file=sys.stderr)
        code = stack.cdk("deploy", plan.cfg, plan.context, ["--app", str(app), *extra])
        if code != 0:
            return code
    return 0
