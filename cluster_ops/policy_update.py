"""A change of the rollout's policy goes in an update of its own, before the change it governs.

CloudFormation's UpdatePolicy attribute: "During stack update rollback operations, CloudFormation
uses the UpdatePolicy configuration specified in the template before the current stack update",
and AWS recommends changing an UpdatePolicy in an update of its own, separate from changes likely
to trigger a rolling update. So when a deploy changes a group's rollout policy (surge on or off:
its UpdatePolicy and MaxSize) and also what nodes launch from, `gptoss deploy` makes two updates:
first the deployed templates with only the groups' policies changed (no instance is replaced),
then the change itself, whose rollback then uses the policy it was rolled out with.

Also here: whether a deploy may surge at all. A surge replacement must serve within its group's
PauseTime (at most an hour); a rollback re-applies the same policy to the previous version. When
the last deploy's nodes took longer than that, or the image changes (its compile cache is cold),
`rollout.surge=auto` deploys without surge.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from cluster_ops.rollout import Templates, flatten_templates, node_launches
from clusterspec.config import ClusterConfig

GROUP = "AWS::AutoScaling::AutoScalingGroup"
# A replacement's time to serve must leave this much of its signal's PauseTime unused.
SURGE_MARGIN_S = 600
_ASSET_KEY = re.compile(r"/[0-9a-f]{64}\.json$")


def _policy(res: dict[str, Any]) -> Any:
    """What the rollout's policy is of a group: how its update replaces (UpdatePolicy) and its room for a second instance."""
    return {"UpdatePolicy": res.get("UpdatePolicy"), "MaxSize": res.get("Properties", {}).get("MaxSize")}


def policy_only(deployed: Templates, synthesized: Templates) -> Templates | None:
    """DEPLOYED with each group's rollout policy (UpdatePolicy, MaxSize) as SYNTHESIZED has it and
    nothing else changed; None when no group of both changes its policy."""
    out = copy.deepcopy(deployed)
    changed = False
    for scope, template in out.items():
        new = synthesized.get(scope, {}).get("Resources", {})
        for lid, res in template.get("Resources", {}).items():
            if res.get("Type") != GROUP or new.get(lid, {}).get("Type") != GROUP or _policy(res) == _policy(new[lid]):
                continue
            if new[lid].get("UpdatePolicy") is None:
                res.pop("UpdatePolicy", None)
            else:
                res["UpdatePolicy"] = copy.deepcopy(new[lid]["UpdatePolicy"])
            res.setdefault("Properties", {})["MaxSize"] = new[lid]["Properties"]["MaxSize"]
            changed = True
    return out if changed else None


def policy_nodes(deployed: Templates, synthesized: Templates) -> list[str]:
    """The nodes (their groups' gptoss:node tags) whose rollout policy differs between DEPLOYED and SYNTHESIZED."""
    out = []
    for scope, template in deployed.items():
        new = synthesized.get(scope, {}).get("Resources", {})
        for lid, res in template.get("Resources", {}).items():
            if res.get("Type") == GROUP and new.get(lid, {}).get("Type") == GROUP and _policy(res) != _policy(new[lid]):
                tags = {t.get("Key"): t.get("Value") for t in res.get("Properties", {}).get("Tags", []) if isinstance(t, dict)}
                out.append(str(tags.get("gptoss:node", lid)))
    return out


def updates(deployed: Templates, synthesized: Templates) -> list[tuple[str, Templates]]:
    """The stack updates a deploy from DEPLOYED to SYNTHESIZED makes, in order: ('policy', ...)
    first when it changes both a group's rollout policy and what a running node launches from,
    then ('change', SYNTHESIZED)."""
    policy = policy_only(deployed, synthesized)
    if policy is None:
        return [("change", synthesized)]
    old, new = node_launches(flatten_templates(deployed)), node_launches(flatten_templates(synthesized))
    if not any(node in new and new[node] != digest for node, digest in old.items()):
        return [("change", synthesized)]  # only the policy changes: one update is that
    return [("policy", policy), ("change", synthesized)]


def surge_off_because(cfg: ClusterConfig, *, ready_min: float | None, image_changed: bool) -> str:
    """Why this deploy must replace nodes without surge although the config would surge ('' when it may surge).

    With rollout.surge=auto only: an operator's `on` is kept (and `gptoss diff` says the limit)."""
    if not cfg.surge or cfg.rollout.surge != "auto":
        return ""
    limit_min = (cfg.rollout.surge_timeout_s - SURGE_MARGIN_S) / 60
    if image_changed:
        return ("the image changes: its compile cache is cold, and a node that compiles cannot serve within the "
                f"{cfg.rollout.surge_timeout_s // 60} min a surge replacement has (CloudFormation's PauseTime)")  # fmt: skip
    if ready_min is not None and ready_min > limit_min:
        return (f"a node took {ready_min:.0f} min to serve at the last deploy, more than the {limit_min:.0f} min a surge "
                f"replacement may take ({cfg.rollout.surge_timeout_s // 60} min, CloudFormation's PauseTime, less "
                f"{SURGE_MARGIN_S // 60} min): a surge, and the rollback of one, would time out")  # fmt: skip
    return ""


def image_changes(deployed: dict[str, Any], synthesized: dict[str, Any]) -> bool:
    """Whether any node kept in both launches another image (flattened resources)."""

    def images(resources: dict[str, Any]) -> set[str]:
        return {json.dumps(r["Properties"]["LaunchTemplateData"].get("ImageId"), sort_keys=True)
                for r in resources.values() if r.get("Type") == "AWS::EC2::LaunchTemplate"}  # fmt: skip

    before, after = images(deployed), images(synthesized)
    return bool(before) and bool(after) and before != after


def write_assembly(source: Path, dest: Path, stack_name: str, templates: Templates) -> None:
    """A cloud assembly in DEST that deploys TEMPLATES with the CDK CLI (`cdk deploy --app DEST`):
    SOURCE's (the synthesized change, for its manifest and bootstrap settings) with the stack's
    template replaced and each cell's template a new asset, keyed by its own sha256 and named by
    the stack's TemplateURL. Nothing else is published: the other assets the templates name are
    the deployed ones, already in the bucket."""
    shutil.copytree(source, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    artifact = manifest["artifacts"][stack_name]
    template_file = artifact["properties"]["templateFile"]
    assets_path = dest / f"{stack_name}.assets.json"
    assets = json.loads(assets_path.read_text())
    files: dict[str, Any] = assets["files"]
    nested = next(f for f in files.values() if f["source"]["path"].endswith(".nested.template.json"))
    own = next(h for h, f in files.items() if f["source"]["path"] == template_file)

    def publish(body: str, path: str) -> str:
        digest = hashlib.sha256(body.encode()).hexdigest()
        (dest / path.format(digest)).write_text(body)
        destinations = {k: v | {"objectKey": f"{digest}.json"} for k, v in nested["destinations"].items()}
        files[digest] = {"displayName": path.format(digest), "source": {"path": path.format(digest), "packaging": "file"},
                         "destinations": destinations}  # fmt: skip
        return digest

    parent = copy.deepcopy(templates[""])
    for lid, template in templates.items():
        if not lid:
            continue
        digest = publish(json.dumps(template, indent=1), "policy-{}.nested.template.json")
        res = parent["Resources"][lid]
        res["Properties"]["TemplateURL"] = _rekey(res["Properties"]["TemplateURL"], digest)
        res.setdefault("Metadata", {})["aws:asset:path"] = f"policy-{digest}.nested.template.json"
    body = json.dumps(parent, indent=1)
    (dest / template_file).write_text(body)
    digest = hashlib.sha256(body.encode()).hexdigest()
    entry = files.pop(own)
    entry["destinations"] = {k: v | {"objectKey": f"{digest}.json"} for k, v in entry["destinations"].items()}
    files[digest] = entry
    url = artifact["properties"]["stackTemplateAssetObjectUrl"]
    artifact["properties"]["stackTemplateAssetObjectUrl"] = url.rsplit("/", 1)[0] + f"/{digest}.json"
    assets_path.write_text(json.dumps(assets, indent=1))
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _rekey(url: Any, digest: str) -> Any:
    """A TemplateURL (a string or an Fn::Join of parts) naming the asset DIGEST instead of the one it named."""
    if isinstance(url, str):
        return _ASSET_KEY.sub(f"/{digest}.json", url)
    if isinstance(url, dict):
        return {k: _rekey(v, digest) for k, v in url.items()}
    if isinstance(url, list):
        return [_rekey(v, digest) for v in url]
    return url


def capacity_moves(deployed: dict[str, Any], synthesized: dict[str, Any]) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The groups (flattened resources, by logical id) whose reservation target changes: {group: (before, after)},
    each a tuple of reservation ids or resource-group ARNs. A move from one reservation or Capacity Block to another."""

    def target(res: dict[str, Any]) -> tuple[str, ...]:
        t = (res.get("Properties", {}).get("CapacityReservationSpecification") or {}).get("CapacityReservationTarget") or {}
        return tuple(sorted([*t.get("CapacityReservationIds", []), *t.get("CapacityReservationResourceGroupArns", [])]))

    out = {}
    for lid, res in synthesized.items():
        if res.get("Type") != "AWS::AutoScaling::AutoScalingGroup" or lid not in deployed:
            continue
        before, after = target(deployed[lid]), target(res)
        if before and after and before != after:
            out[lid] = (before, after)
    return out


def move_lines(moves: dict[str, tuple[tuple[str, ...], tuple[str, ...]]], reservations: dict[str, dict[str, Any]], now: Any) -> list[str]:
    """What a move onto other capacity means, before it runs: each pair of reservations once, and when the new one
    starts later, or after the old one's instances are reclaimed (a Capacity Block: 30 min before its end), the gap.
    RESERVATIONS: describe-capacity-reservations entries by id (those EC2 gave)."""
    import datetime as dt

    out = []
    for before, after in sorted(set(moves.values())):
        n = sum(1 for m in moves.values() if m == (before, after))
        line = f"moving {n} node(s) from {', '.join(before)} to {', '.join(after)}: with surge, each replacement launched in the new capacity while its old instance serves"
        old = [reservations[i] for i in before if i in reservations]
        new = [reservations[i] for i in after if i in reservations]
        starts = [r["StartDate"] for r in new if r.get("StartDate")]
        ends = [r["EndDate"] - (dt.timedelta(minutes=30) if r.get("ReservationType") == "capacity-block" else dt.timedelta(0))
                for r in old if r.get("EndDate")]  # fmt: skip
        if starts and max(starts) > now:
            line += f"; the new capacity starts {max(starts):%Y-%m-%d %H:%M} UTC: no replacement can launch before then (each group waits and retries), deploy then"
        if starts and ends and max(starts) > min(ends):
            gap = max(starts) - min(ends)
            line += (f"; THE TWO DO NOT OVERLAP: from {min(ends):%Y-%m-%d %H:%M} UTC (the old capacity reclaimed) to {max(starts):%Y-%m-%d %H:%M} UTC "
                     f"these nodes have no instance ({gap.total_seconds() / 3600:.1f} h without them)")  # fmt: skip
        elif not new:
            line += "; EC2 gave no dates for the new capacity (gptoss preflight checks it)"
        out.append(line)
    return out


def surge_for(cfg: ClusterConfig, why_off: str, moves: dict[str, Any]) -> str:
    """The rollout.surge this deploy is synthesized with, when it differs from the config's ('' when it does not):
    off when a surge would time out (WHY_OFF), on for a move onto other capacity (the new reservation or block
    holds each replacement while its old instance serves; a reservation's default is no surge)."""
    if why_off:
        return "off"
    if moves and cfg.rollout.surge == "auto" and not cfg.surge and cfg.wait_for_ready:
        return "on"
    return ""
