"""What a deploy does to the running nodes, said before it runs: which keep their instance, which
are replaced, which are launched or removed, and what that leaves serving.

A node's instance is replaced when what its group launches changes: its launch template's data
or the group's subnet or placement (CloudFormation then rolls the group, whose size is one). The
comparison is of the templates themselves, the synthesized ones against what CloudFormation has
(the stack and each cell), each flattened the way CloudFormation reads it (a cell's parameters
replaced by what the parent passes). Nothing is modelled apart from the templates.

The order is read from the same synthesized template: a replaced node's group waits for what it
depends on (DependsOn: the deploy gates of the earlier nodes of its lane, a role's previous cell),
so its batch is one more than the latest batch of a replaced node it waits for. With surge, the
group's own rolling update launches the replacement first (MinInstancesInService 1): nothing of a
role is out; without it, a batch's nodes are out until they serve.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster_ops import common
from clusterspec.config import ClusterConfig
from clusterspec.names import node_order

Template = dict[str, Any]
# What CloudFormation rolls a group for (AutoScalingRollingUpdate), beside its launch template.
GROUP_LAUNCH_PROPERTIES = ("VPCZoneIdentifier", "PlacementGroup", "MixedInstancesPolicy", "LaunchConfigurationName")


def substitute(value: Any, params: Mapping[str, Any]) -> Any:
    """VALUE with every {"Ref": P} of a parameter P in PARAMS replaced by its value (a cell as its parent passes it)."""
    if isinstance(value, dict):
        if set(value) == {"Ref"} and value["Ref"] in params:
            return params[value["Ref"]]
        return {k: substitute(v, params) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, params) for v in value]
    return value


def flatten(parent: Template, nested: Callable[[str], Template | None]) -> dict[str, Any]:
    """Every resource of the stack and of its cells, a cell's parameters replaced by the parent's values."""
    out = dict(parent.get("Resources", {}))
    for lid, res in parent.get("Resources", {}).items():
        if res.get("Type") != "AWS::CloudFormation::Stack":
            continue
        child = nested(lid)
        if child is None:
            continue
        params = res.get("Properties", {}).get("Parameters", {})
        for clid, cres in child.get("Resources", {}).items():
            out[f"{lid}/{clid}"] = substitute(cres, params)
    return out


def launch_settings(resources: Mapping[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Each node (its group's gptoss:node tag) -> (its launch template's data, its group's launch properties)."""
    out = {}
    for lid, res in resources.items():
        if res.get("Type") != "AWS::AutoScaling::AutoScalingGroup":
            continue
        props = res.get("Properties", {})
        tags = {t.get("Key"): t.get("Value") for t in props.get("Tags", []) if isinstance(t, dict)}
        node = tags.get("gptoss:node")
        if not isinstance(node, str):
            continue
        scope = lid.rsplit("/", 1)[0] + "/" if "/" in lid else ""
        template_ref = (props.get("LaunchTemplate") or {}).get("LaunchTemplateId") or {}
        template_lid = template_ref.get("Ref") if isinstance(template_ref, dict) else None
        data = resources.get(f"{scope}{template_lid}", {}).get("Properties", {}).get("LaunchTemplateData") if template_lid else None
        out[node] = (data or {}, {k: props.get(k) for k in GROUP_LAUNCH_PROPERTIES})
    return out


def node_launches(resources: Mapping[str, Any]) -> dict[str, str]:
    """Each node -> a digest of what its group launches."""
    return {
        node: hashlib.sha256(json.dumps({"LaunchTemplateData": data or None, **group}, sort_keys=True).encode()).hexdigest()
        for node, (data, group) in launch_settings(resources).items()
    }


Templates = dict[str, Template]  # '' -> the stack's template, a cell's nested stack logical id -> its template


def assembly_templates(assembly: Path, stack_name: str) -> Templates:
    """The stack's template and each cell's, from a cloud assembly the CDK wrote (`cdk synth --output DIR`)."""
    parent = json.loads((assembly / f"{stack_name}.template.json").read_text())
    manifest = assembly / f"{stack_name}.assets.json"
    files = json.loads(manifest.read_text()).get("files", {}) if manifest.exists() else {}
    out: Templates = {"": parent}
    for lid, res in parent.get("Resources", {}).items():
        if res.get("Type") != "AWS::CloudFormation::Stack":
            continue
        path = res.get("Metadata", {}).get("aws:asset:path")
        if not path:
            # Without the CLI's metadata: the cell's template is the asset its TemplateURL names (<sha256>.json).
            url = json.dumps(res.get("Properties", {}).get("TemplateURL", ""))
            path = next((f["source"]["path"] for h, f in files.items() if f"/{h}.json" in url), None)
        if path:
            out[lid] = json.loads((assembly / path).read_text())
    return out


def flatten_templates(templates: Templates) -> dict[str, Any]:
    """Every resource of the stack and of its cells (see flatten)."""
    return flatten(templates[""], templates.get)


def synthesized(assembly: Path, stack_name: str) -> dict[str, Any]:
    """The flattened resources of a cloud assembly the CDK wrote (`cdk synth --output DIR`)."""
    return flatten_templates(assembly_templates(assembly, stack_name))


def _template_body(cfn: Any, stack: str) -> Template:
    body = cfn.get_template(StackName=stack, TemplateStage="Original")["TemplateBody"]
    return body if isinstance(body, dict) else json.loads(body)


def deployed_templates(cfn: Any, stack_name: str) -> Templates:
    """The deployed stack's template and each cell's, as CloudFormation holds them."""
    out: Templates = {"": _template_body(cfn, stack_name)}
    for page in cfn.get_paginator("list_stack_resources").paginate(StackName=stack_name):
        for r in page["StackResourceSummaries"]:
            if r["ResourceType"] == "AWS::CloudFormation::Stack" and r.get("PhysicalResourceId"):
                out[r["LogicalResourceId"]] = _template_body(cfn, r["PhysicalResourceId"])
    return out


def deployed(cfn: Any, stack_name: str) -> dict[str, Any]:
    """The flattened resources of the deployed stack and its cells, as CloudFormation holds them."""
    return flatten_templates(deployed_templates(cfn, stack_name))


@dataclass
class Rollout:
    """The nodes of a deploy, by what happens to their instance, and the batch of each replaced node."""

    kept: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    launched: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    batch: dict[str, int] = field(default_factory=dict)  # replaced node -> 1, 2, ...: when its replacement starts
    surge: dict[str, bool] = field(default_factory=dict)  # replaced node -> its replacement comes before the old goes


def _node_of(resources: Mapping[str, Any]) -> dict[str, str]:
    """Each group's, deploy gate's and cell's logical id (flattened) -> the node(s) it stands for.
    A cell stands for every node in it: 'cell:<lid>' entries map to a space-separated list."""
    out: dict[str, str] = {}
    for lid, res in resources.items():
        if res.get("Type") == "AWS::AutoScaling::AutoScalingGroup":
            tags = {t.get("Key"): t.get("Value") for t in res.get("Properties", {}).get("Tags", []) if isinstance(t, dict)}
            node = tags.get("gptoss:node")
            if isinstance(node, str):
                out[lid] = node
    for lid, res in resources.items():
        if res.get("Type") == "AWS::CloudFormation::WaitCondition":
            scope = lid.rsplit("/", 1)[0] + "/" if "/" in lid else ""
            groups = [g for g in (out.get(f"{scope}{d}") for d in _depends(res)) if g]
            if groups:
                out[lid] = groups[0]
    cells: dict[str, list[str]] = {}
    for lid, node in list(out.items()):
        if "/" in lid and resources[lid].get("Type") == "AWS::AutoScaling::AutoScalingGroup":
            cells.setdefault(lid.split("/", 1)[0], []).append(node)
    for cell, nodes in cells.items():
        out[f"cell:{cell}"] = " ".join(nodes)
    return out


def _depends(res: Mapping[str, Any]) -> list[str]:
    d = res.get("DependsOn", [])
    return [d] if isinstance(d, str) else list(d)


def _handle_of(resources: Mapping[str, Any], group: str) -> Mapping[str, Any]:
    """The deploy gate's handle whose URL a group's launch template carries ({} when none)."""
    scope, _, _ = group.rpartition("/")
    ref = (resources[group].get("Properties", {}).get("LaunchTemplate") or {}).get("LaunchTemplateId") or {}
    template = resources.get(f"{scope}/{ref['Ref']}" if scope else ref["Ref"], {}) if isinstance(ref, dict) and "Ref" in ref else {}
    for name in _refs(template.get("Properties", {})):
        res = resources.get(f"{scope}/{name}" if scope else name, {})
        if res.get("Type") == "AWS::CloudFormation::WaitConditionHandle":
            return res
    return {}


def _refs(value: Any) -> set[str]:
    if isinstance(value, dict):
        if set(value) == {"Ref"} and isinstance(value["Ref"], str):
            return {value["Ref"]}
        return set().union(*(_refs(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(_refs(v) for v in value)) if value else set()
    return set()


def waits_for(resources: Mapping[str, Any]) -> dict[str, set[str]]:
    """Each node -> the nodes whose update its own waits for, read from the template: what its group
    and its gate's handle depend on (the earlier groups and gates of its lane in its cell), and every
    node of a cell its cell waits for."""
    names = _node_of(resources)
    out: dict[str, set[str]] = {}
    for lid, res in resources.items():
        if res.get("Type") != "AWS::AutoScaling::AutoScalingGroup" or lid not in names:
            continue
        scope, _, _ = lid.rpartition("/")
        depends = _depends(res) + _depends(_handle_of(resources, lid))
        deps = {names[f"{scope}/{d}" if scope else d] for d in depends if (f"{scope}/{d}" if scope else d) in names}
        if scope:
            for cell in _depends(resources.get(scope, {})):
                deps |= set(names.get(f"cell:{cell}", "").split())
        out[names[lid]] = deps - {""}
    return out


def batches(replaced: list[str], graph: Mapping[str, set[str]]) -> dict[str, int]:
    """Each replaced node's batch: 1 + the latest batch of a replaced node it waits for (1 if none)."""
    todo = set(replaced)
    done: dict[str, int] = {}

    def batch(node: str, seen: frozenset[str] = frozenset()) -> int:
        if node not in done:
            before = [batch(d, seen | {node}) for d in graph.get(node, ()) if d in todo and d not in seen]
            done[node] = 1 + max(before, default=0)
        return done[node]

    return {n: batch(n) for n in replaced}


def group_surges(resources: Mapping[str, Any]) -> dict[str, bool]:
    """Each node -> whether its group's rolling update launches the replacement first (MinInstancesInService 1)."""
    names = _node_of(resources)
    out = {}
    for lid, res in resources.items():
        if res.get("Type") == "AWS::AutoScaling::AutoScalingGroup" and lid in names:
            policy = (res.get("UpdatePolicy") or {}).get("AutoScalingRollingUpdate") or {}
            out[names[lid]] = int(policy.get("MinInstancesInService", 0)) >= 1
    return out


def compare(before: Mapping[str, Any], after: Mapping[str, Any]) -> Rollout:
    """What a deploy from BEFORE's resources to AFTER's does to each node."""
    old, new = node_launches(before), node_launches(after)
    r = Rollout(surge=group_surges(after))
    for node in sorted(set(old) | set(new), key=node_order):
        if node not in old:
            r.launched.append(node)
        elif node not in new:
            r.removed.append(node)
        elif old[node] == new[node]:
            r.kept.append(node)
        else:
            r.replaced.append(node)
    r.batch = batches(r.replaced, waits_for(after))
    r.surge = {n: r.surge.get(n, False) for n in r.replaced}
    return r


def span(names: list[str]) -> str:
    """Runs of one role as first..last: prefill-0..2, decode-0..7, decode-9."""
    runs: list[tuple[str, int, int]] = []
    for name in names:
        role, index = node_order(name)
        if runs and runs[-1][0] == role and runs[-1][2] == index - 1:
            runs[-1] = (role, runs[-1][1], index)
        else:
            runs.append((role, index, index))
    return ", ".join(f"{role}-{a}" if a == b else f"{role}-{a}..{b}" for role, a, b in runs)


def role_lines(cfg: ClusterConfig, r: Rollout, ready_min: float | None = None) -> list[str]:
    """One line per role a replacement touches, in the form `make bench-rollout` prints:

        <role> <B> batches, at most <K> of <N> out, minimum serving <role> <X>/<N>, about <T>

    B is the role's last batch; K the most of its nodes in one batch that are out (none with
    surge: the replacement serves before the old instance goes); T is B x READY_MIN, the time a
    node takes to serve (measured from the last deploy's gates, when known)."""
    lines = []
    for role, names in _by_role(cfg).items():
        running = [n for n in names if n not in r.launched]  # a launched node serves nothing yet
        out = [n for n in running if n in r.replaced]
        if not out:
            continue
        n_batches = max(r.batch.get(n, 1) for n in out)
        per_batch = [sum(1 for n in out if r.batch.get(n, 1) == b) for b in range(1, n_batches + 1)]
        surged = all(r.surge.get(n, False) for n in out)
        k = 0 if surged else max(per_batch)
        if ready_min is not None:
            took = f"about {n_batches * ready_min:.0f} min ({n_batches} x {ready_min:.0f} min, a node's time to serve at the last deploy)"
        elif cfg.wait_for_ready and surged:
            took = (f"about {n_batches} x a node's time to serve (each batch up to {cfg.rollout.surge_timeout_s // 60} min from its turn: "
                    "a surge replacement's signal)")  # fmt: skip
        elif cfg.wait_for_ready:
            took = f"about {n_batches} x a node's time to serve (each batch waits for its deploy gates, up to {-(-cfg.gate_timeout_s // 60)} min from its turn)"
        else:
            took = f"about {n_batches} x a node's time to launch (no deploy gate: wait_for_ready false)"
        lines.append(
            f"{role}: {n_batches} batch{'es' if n_batches != 1 else ''}, at most {k} of {len(running)} out"
            f"{' (surge: each replacement serves before its old instance goes)' if surged else ''}, "
            f"minimum serving {role} {len(running) - k}/{len(running)}, {took}"
        )
    return lines


def describe(cfg: ClusterConfig, r: Rollout, ready_min: float | None = None) -> list[str]:
    """What the deploy does to the running nodes, in lines an operator reads before it runs."""
    total = len(r.kept) + len(r.replaced)
    lines = []
    if r.replaced:
        in_batches = "; ".join(f"batch {b}: {span([n for n in r.replaced if r.batch.get(n, 1) == b])}" for b in sorted(set(r.batch.values())))
        how = ("each replacement launched and serving before its old instance is terminated (surge)"
               if all(r.surge.get(n) for n in r.replaced) else "each node's group terminates its instance, then launches the new one")  # fmt: skip
        lines.append(f"this deploy replaces the instances of {len(r.replaced)} of the {total} running nodes, in batches ({how}): {in_batches}")
        lines += [f"  {line}" for line in role_lines(cfg, r, ready_min)]
        if any(all(n in r.replaced and not r.surge.get(n) and r.batch.get(n) == 1 for n in names) for names in _by_role(cfg).values()):
            lines.append("  a role with every node in one batch and no surge serves nothing: the endpoint is down until the replacements serve")
        moved = [n for n in cfg.layout.endpoint_nodes if n in r.replaced]
        if moved and not cfg.load_balanced:
            # The endpoint is the node's instance itself: a port forward is a session to that instance.
            kind, lb = ("Proxy", ", or set proxy_load_balancer=true for one address through replacements") if cfg.serving.disaggregated else ("Server", "")
            lines.append(f"  {span(moved)} {'serves' if len(moved) == 1 else 'serve'} the endpoint with no load balancer: a client's "
                         f"port forward (stack output {kind}PortForward) or address ends with the old instance; connect again once "
                         f"it is gone (gptoss status shows the new address){lb}")  # fmt: skip
        if any(r.surge.get(n) for n in r.replaced):
            lines.append(f"  with surge a replacement must serve within {cfg.rollout.surge_timeout_s // 60} min (CloudFormation's limit), "
                         "or it is terminated and the deploy rolls back: a change whose nodes compile longer (a new image, a cold "
                         "compile cache) deploys with rollout.surge=off")  # fmt: skip
    else:
        lines.append(f"this deploy replaces no instance ({total} running node{'s keep their own' if total != 1 else ' keeps its own'})")
    if r.launched:
        lines.append(f"  launched: {span(r.launched)}")
    if r.removed:
        lines.append(f"  removed (instance terminated): {span(r.removed)}")
    if r.kept and r.replaced:
        lines.append(f"  kept: {span(r.kept)}")
    return lines


def _by_role(cfg: ClusterConfig) -> dict[str, list[str]]:
    roles: dict[str, list[str]] = {}
    for node in cfg.layout.nodes:
        roles.setdefault(node.role, []).append(node.name)
    return roles


def surge_found_no_capacity(cfg: ClusterConfig, autoscaling: Any, nodes: list[str], since: Any) -> str:
    """'node: EC2's words' for the first replaced node whose group failed to launch a surge replacement
    for lack of capacity since SINCE (its own scaling activities), or ''."""
    from cluster_ops.capacity import CAPACITY_CODES
    from clusterspec.names import holder_name

    for node in nodes:
        pages = autoscaling.get_paginator("describe_scaling_activities").paginate(AutoScalingGroupName=holder_name(cfg.cluster_name, node))
        for page in pages:
            for a in page.get("Activities", []):
                said = a.get("StatusMessage") or ""
                if a.get("StartTime") and a["StartTime"] >= since and a.get("StatusCode") in ("Failed", "Cancelled") and any(c in said for c in CAPACITY_CODES):
                    return f"{node}: {said.strip()[:200]}"
    return ""


def confirm(cfg: ClusterConfig, r: Rollout, *, yes: bool, restarting: list[str] | None = None) -> None:
    """Ask before a deploy that takes serving nodes' instances away, or restarts their servers in place
    (RESTARTING: rollout.software=in-place), counting both (--yes: do not ask)."""
    lost = len(r.replaced) + len(r.removed)
    restarted = len(restarting or [])
    gone = lost + restarted
    if not gone or yes:
        return
    said = []
    if lost:
        said.append(f"{lost} serving node{'s' if lost != 1 else ''} of {cfg.stack_name} lose{'' if lost != 1 else 's'} their instance")
    if restarted:
        said.append(f"{restarted} serving node{'s' if restarted != 1 else ''} of {cfg.stack_name} restart{'' if restarted != 1 else 's'} "
                    "their servers in place")  # fmt: skip
    what = " and ".join(said)
    if not sys.stdin.isatty():
        raise common.CliError(f"refusing to deploy without confirmation: {what}. Nothing was deployed. "
                              "Fix: gptoss diff shows the change; pass --yes if it is the change you mean.", 1)  # fmt: skip
    answer = input(f"{what}. Type the count ({gone}) to deploy: ").strip()
    if answer != str(gone):
        raise common.CliError(f"not confirmed ({answer!r} is not {gone}): nothing was deployed.", 1)


# ---- a rollout in progress (gptoss status) --------------------------------------------------------


@dataclass(frozen=True)
class NodeProgress:
    """One node during a rollout: the versions of its group's launch template its instances run."""

    node: str
    group_version: str  # the version the group launches now
    instances: tuple[tuple[str, str, str], ...]  # (instance id, its launch template version, its lifecycle state)

    @property
    def phase(self) -> str:
        """new (every instance on the group's version), old, surging (old and new at once) or replacing (nothing in service yet)."""
        new = [i for i in self.instances if i[1] == self.group_version]
        old = [i for i in self.instances if i[1] != self.group_version]
        if new and old:
            return "surging"
        if new:
            return "new" if any(state == "InService" for _, _, state in new) else "replacing"
        return "old" if old else "replacing"


def progress(cfg: ClusterConfig, cfn: Any, autoscaling: Any) -> list[str]:
    """Lines for `gptoss status` while the stack is being updated or rolled back: each node old/new
    (its instances' launch template versions against its group's), the batches left (from the
    template's lanes), and what CloudFormation waits for; [] when no operation is in progress."""
    from clusterspec.names import holder_name

    (st,) = cfn.describe_stacks(StackName=cfg.stack_name)["Stacks"]
    status = st["StackStatus"]
    if not status.endswith("_IN_PROGRESS") or status in ("CREATE_IN_PROGRESS", "DELETE_IN_PROGRESS"):
        return []
    names = {holder_name(cfg.cluster_name, n.name): n.name for n in cfg.layout.nodes}
    nodes: dict[str, NodeProgress] = {}
    listed = list(names)
    for i in range(0, len(listed), 50):
        for page in autoscaling.get_paginator("describe_auto_scaling_groups").paginate(AutoScalingGroupNames=listed[i : i + 50]):
            for g in page["AutoScalingGroups"]:
                version = str((g.get("LaunchTemplate") or {}).get("Version", ""))
                inst = tuple((x["InstanceId"], str((x.get("LaunchTemplate") or {}).get("Version", "")), x.get("LifecycleState", ""))
                             for x in g.get("Instances", []))  # fmt: skip
                nodes[names[g["AutoScalingGroupName"]]] = NodeProgress(names[g["AutoScalingGroupName"]], version, inst)
    waiting = _in_progress(cfn, cfg.stack_name)
    pending = [n for n in sorted(nodes, key=node_order) if nodes[n].phase != "new"]
    lines = [f"rollout in progress ({status}): {len(nodes) - len(pending)} of {len(nodes)} nodes on their group's current version"]
    resources = deployed(cfn, cfg.stack_name)
    left = batches(pending, waits_for(resources))
    for n in sorted(nodes, key=node_order):
        p = nodes[n]
        runs = ", ".join(f"{iid} v{v or '?'} {state}" for iid, v, state in p.instances) or "no instance"
        batch = f", batch {left[n]} of those left" if n in left else ""
        lines.append(f"  {n}: {p.phase} (group launches v{p.group_version or '?'}; runs {runs}){batch}")
    lines.append("  waits for: " + ("; ".join(waiting) if waiting else "nothing in progress (CloudFormation is between steps)"))
    return lines


def measured_ready_min(cfn: Any, stack_name: str) -> float | None:
    """A node's time to serve at the last deploy: the longest wait of a deploy gate (a WaitCondition,
    from its CREATE_IN_PROGRESS to its CREATE_COMPLETE: the node's launch, boot, staging, load and
    first completion), from the events of the stack and its cells, in minutes; None when none
    completed (a first deploy without gates, wait_for_ready false) or CloudFormation does not say."""
    from botocore.exceptions import BotoCoreError, ClientError

    longest = None
    stacks = [stack_name]
    try:
        while stacks:
            name = stacks.pop(0)
            for page in cfn.get_paginator("list_stack_resources").paginate(StackName=name):
                stacks += [r["PhysicalResourceId"] for r in page["StackResourceSummaries"]
                           if r["ResourceType"] == "AWS::CloudFormation::Stack" and r.get("PhysicalResourceId")]  # fmt: skip
            done: dict[str, Any] = {}
            # Newest first: each gate's last completion, then the start that came before it.
            for page in cfn.get_paginator("describe_stack_events").paginate(StackName=name):
                for e in page["StackEvents"]:
                    if e.get("ResourceType") != "AWS::CloudFormation::WaitCondition":
                        continue
                    lid, state = e["LogicalResourceId"], e.get("ResourceStatus")
                    if state == "CREATE_COMPLETE" and lid not in done:
                        done[lid] = e["Timestamp"]
                    elif state == "CREATE_IN_PROGRESS" and isinstance(done.get(lid), dt.datetime):
                        took = (done[lid] - e["Timestamp"]).total_seconds() / 60
                        longest = took if longest is None else max(longest, took)
                        done[lid] = "measured"
    except (BotoCoreError, ClientError):
        return None
    return longest


def _in_progress(cfn: Any, stack_name: str) -> list[str]:
    """What CloudFormation is doing now, in the stack and its cells: a group's rolling update (its
    replacement's signal, with surge) or a deploy gate (a replacement's first serve)."""
    out = []
    stacks = [stack_name]
    while stacks:
        name = stacks.pop(0)
        for page in cfn.get_paginator("list_stack_resources").paginate(StackName=name):
            for r in page["StackResourceSummaries"]:
                kind, state, lid = r["ResourceType"], r.get("ResourceStatus", ""), r["LogicalResourceId"]
                if kind == "AWS::CloudFormation::Stack" and r.get("PhysicalResourceId"):
                    stacks.append(r["PhysicalResourceId"])
                elif state.endswith("_IN_PROGRESS") and kind == "AWS::AutoScaling::AutoScalingGroup":
                    out.append(f"{lid}: its rolling update (a replacement launched; with surge, its signal once it serves)")
                elif state.endswith("_IN_PROGRESS") and kind == "AWS::CloudFormation::WaitCondition":
                    out.append(f"{lid}: a deploy gate (the replacement serving)")
    return out
