"""What a deploy does to the running nodes, said before it runs: which keep their instance, which
are replaced, which are launched or removed, and what that leaves serving.

A node's instance is replaced when what its group launches changes: its launch template's data
or the group's subnet or placement (CloudFormation then rolls the group, whose size is one). The
comparison is of the templates themselves, the synthesized ones against what CloudFormation has
(the stack and each cell), each flattened the way CloudFormation reads it (a cell's parameters
replaced by what the parent passes). Nothing is modelled apart from the templates.

Today every node's group updates with MinInstancesInService 0 and no group waits for another:
all replaced nodes go at the same time, and come back each after its deploy gate.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster_ops import common, stack
from clusterspec.config import ClusterConfig

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


def node_launches(resources: Mapping[str, Any]) -> dict[str, str]:
    """Each node (its group's gptoss:node tag) -> a digest of what its group launches."""
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
        launch = {"LaunchTemplateData": data, **{k: props.get(k) for k in GROUP_LAUNCH_PROPERTIES}}
        out[node] = hashlib.sha256(json.dumps(launch, sort_keys=True).encode()).hexdigest()
    return out


def synthesized(assembly: Path, stack_name: str) -> dict[str, Any]:
    """The flattened resources of a cloud assembly the CDK wrote (`cdk synth --output DIR`)."""
    parent = json.loads((assembly / f"{stack_name}.template.json").read_text())
    manifest = assembly / f"{stack_name}.assets.json"
    files = json.loads(manifest.read_text()).get("files", {}) if manifest.exists() else {}

    def nested(lid: str) -> Template | None:
        res = parent["Resources"][lid]
        path = res.get("Metadata", {}).get("aws:asset:path")
        if not path:
            # Without the CLI's metadata: the cell's template is the asset its TemplateURL names (<sha256>.json).
            url = json.dumps(res.get("Properties", {}).get("TemplateURL", ""))
            path = next((f["source"]["path"] for h, f in files.items() if f"/{h}.json" in url), None)
        return json.loads((assembly / path).read_text()) if path else None

    return flatten(parent, nested)


def _template_body(cfn: Any, stack: str) -> Template:
    body = cfn.get_template(StackName=stack, TemplateStage="Original")["TemplateBody"]
    return body if isinstance(body, dict) else json.loads(body)


def deployed(cfn: Any, stack_name: str) -> dict[str, Any]:
    """The flattened resources of the deployed stack and its cells, as CloudFormation holds them."""
    parent = _template_body(cfn, stack_name)
    cells = {}
    for page in cfn.get_paginator("list_stack_resources").paginate(StackName=stack_name):
        for r in page["StackResourceSummaries"]:
            if r["ResourceType"] == "AWS::CloudFormation::Stack" and r.get("PhysicalResourceId"):
                cells[r["LogicalResourceId"]] = r["PhysicalResourceId"]
    return flatten(parent, lambda lid: _template_body(cfn, cells[lid]) if lid in cells else None)


@dataclass
class Rollout:
    """The nodes of a deploy, by what happens to their instance."""

    kept: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    launched: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def _order(name: str) -> tuple[str, int]:
    role, _, index = name.rpartition("-")
    return (role, int(index)) if index.isdigit() else (name, 0)


def compare(before: Mapping[str, Any], after: Mapping[str, Any]) -> Rollout:
    """What a deploy from BEFORE's resources to AFTER's does to each node."""
    old, new = node_launches(before), node_launches(after)
    r = Rollout()
    for node in sorted(set(old) | set(new), key=_order):
        if node not in old:
            r.launched.append(node)
        elif node not in new:
            r.removed.append(node)
        elif old[node] == new[node]:
            r.kept.append(node)
        else:
            r.replaced.append(node)
    return r


def _span(names: list[str]) -> str:
    """Runs of one role as first..last: prefill-0..2, decode-0..7, decode-9."""
    runs: list[tuple[str, int, int]] = []
    for name in names:
        role, index = _order(name)
        if runs and runs[-1][0] == role and runs[-1][2] == index - 1:
            runs[-1] = (role, runs[-1][1], index)
        else:
            runs.append((role, index, index))
    return ", ".join(f"{role}-{a}" if a == b else f"{role}-{a}..{b}" for role, a, b in runs)


def role_lines(cfg: ClusterConfig, r: Rollout) -> list[str]:
    """One line per role a replacement touches, in the form `make bench-rollout` prints."""
    wait = f"up to {-(-cfg.gate_timeout_s // 60)} min (each replacement's deploy gate)" if cfg.wait_for_ready else "no deploy gate waits for them (wait_for_ready false)"
    lines = []
    for role, names in _by_role(cfg).items():
        running = [n for n in names if n not in r.launched]  # a launched node serves nothing yet
        out = [n for n in running if n in r.replaced]
        if not out:
            continue
        lines.append(
            f"{role}: 1 batch, at most {len(out)} of {len(running)} out, minimum serving {role} {len(running) - len(out)}/{len(running)}, {wait}"
        )
    return lines


def describe(cfg: ClusterConfig, r: Rollout) -> list[str]:
    """What the deploy does to the running nodes, in lines an operator reads before it runs."""
    total = len(r.kept) + len(r.replaced)
    lines = []
    if r.replaced:
        lines.append(
            f"this deploy replaces the instances of {len(r.replaced)} of the {total} running nodes, all at the same time "
            f"(each node's group terminates its instance, then launches the new one): {_span(r.replaced)}"
        )
        lines += [f"  {line}" for line in role_lines(cfg, r)]
        if any(all(n in r.replaced for n in names) for names in _by_role(cfg).values()):
            lines.append("  a role with every node replaced serves nothing: the endpoint is down until the replacements serve")
    else:
        lines.append(f"this deploy replaces no instance ({total} running node{'s keep their own' if total != 1 else ' keeps its own'})")
    if r.launched:
        lines.append(f"  launched: {_span(r.launched)}")
    if r.removed:
        lines.append(f"  removed (instance terminated): {_span(r.removed)}")
    if r.kept and r.replaced:
        lines.append(f"  kept: {_span(r.kept)}")
    return lines


def _by_role(cfg: ClusterConfig) -> dict[str, list[str]]:
    roles: dict[str, list[str]] = {}
    for node in cfg.layout.nodes:
        roles.setdefault(node.role, []).append(node.name)
    return roles


def preview(cfg: ClusterConfig, context: list[str], assembly: Path) -> Rollout | None:
    """Synthesize into ASSEMBLY (what the deploy then deploys, unchanged) and compare it with what is
    deployed; None when the stack is not deployed (a first deploy launches every node)."""
    code = stack.cdk("synth", cfg, context, ["--quiet", "--output", str(assembly)])
    if code != 0:
        raise common.CliError(f"cdk synth of {cfg.stack_name} failed (exit {code}): nothing was changed.", code)
    if not stack.exists(cfg):
        return None
    return compare(deployed(common.session(cfg).client("cloudformation"), cfg.stack_name), synthesized(assembly, cfg.stack_name))


def say(cfg: ClusterConfig, r: Rollout | None) -> None:
    """The preview, on stderr."""
    lines = describe(cfg, r) if r is not None else [f"{cfg.stack_name} is not deployed: a deploy launches all {len(cfg.layout.nodes)} nodes"]
    for line in lines:
        print(line, file=sys.stderr)


def confirm(cfg: ClusterConfig, r: Rollout, *, yes: bool) -> None:
    """Ask before a deploy that takes serving nodes' instances away (--yes: do not ask)."""
    gone = len(r.replaced) + len(r.removed)
    if not gone or yes:
        return
    what = f"{gone} serving node{'s' if gone != 1 else ''} of {cfg.stack_name} lose{'' if gone != 1 else 's'} their instance"
    if not sys.stdin.isatty():
        raise common.CliError(f"refusing to deploy without confirmation: {what}. Nothing was deployed. "
                              "Fix: gptoss diff shows the change; pass --yes if it is the change you mean.", 1)  # fmt: skip
    answer = input(f"{what}. Type the count ({gone}) to deploy: ").strip()
    if answer != str(gone):
        raise common.CliError(f"not confirmed ({answer!r} is not {gone}): nothing was deployed.", 1)
