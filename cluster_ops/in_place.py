"""What a deploy changes in place (rollout.software=in-place): per node, the units gptoss-apply restarts.

The fleet's software is one asset whose sha256 is its version (node_render.userdata.software_asset);
the stack's SSM parameter names the current one, and a State Manager association per role runs
gptoss-apply on each node with a new one, at most rollout.max_unavailable nodes of the role at a time.
On a node, gptoss-apply compares the version it runs with the new one file by file and restarts the
units whose files changed, as the new version's restarts file lists them (node_render.render.
restarts_file). The same comparison is made here, from the deployed asset and the synthesized one, so
that `gptoss diff`/`deploy` say before the change which node restarts which units.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterspec.config import ClusterConfig
from clusterspec.names import node_order
from node_render.paths import MANIFEST, RESTARTS_FILE
from node_render.userdata import node_files_in, unbundle

Tree = dict[str, tuple[str, int]]
# How far back `gptoss diff` looks for the measured restart times (CloudWatch keeps hourly points 455 days).
MEASURED_DAYS = 30
# Units a node serves without: their restart leaves its servers, router and proxy running.
NOT_SERVING = frozenset({"gptoss-telemetry.service", "gptoss-signal.service", "gptoss-cache-save.service", "gptoss-group-health.service"})


def version_of(resources: Mapping[str, Any]) -> str | None:
    """The software version a template names: its software parameter's sha256, or None (rollout.software=replace)."""
    for res in resources.values():
        if res.get("Type") == "AWS::SSM::Parameter" and str(res.get("Properties", {}).get("Name", "")).endswith("/software"):
            value = res["Properties"]["Value"]
            return str(value["Fn::Join"][1][-1]) if isinstance(value, dict) else str(value).rsplit(" ", 1)[-1]
    return None


def assembly_software(assembly: Path, version: str) -> bytes:
    """The software asset a synthesized assembly staged for VERSION (the CLI names it asset.<hash>.xz)."""
    for path in assembly.glob("asset.*.xz"):
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() == version:
            return data
    raise FileNotFoundError(f"no software asset {version[:12]} in {assembly}")


def node_tree(asset: bytes, node: str) -> Tree:
    """A node's files as gptoss-fetch-scripts stages them: its own files, then the shared scripts its manifest lists."""
    files = unbundle(asset)
    own = node_files_in(asset, node)
    if MANIFEST not in own:
        return {}
    listed = [line for line in own[MANIFEST][0].splitlines() if line]
    return own | {p: files[p] for p in listed if p in files and p not in own}


def restarted_units(old: Tree, new: Tree) -> list[str] | None:
    """The units gptoss-apply restarts going from OLD to NEW (the same rule), or None: the node's files are the same."""
    changed = {p for p in set(old) | set(new) if old.get(p) != new.get(p)}
    if not changed:
        return None
    units = []
    for line in new.get(RESTARTS_FILE, ("", 0))[0].splitlines():
        unit, *paths = line.split()
        if changed & set(paths):
            units.append(unit)
    return units


@dataclass
class InPlace:
    """A software change: the versions, and what each running node does with it."""

    old: str
    new: str
    restarts: dict[str, list[str]] = field(default_factory=dict)  # node -> the units it restarts ([] : files only)
    same: list[str] = field(default_factory=list)  # nodes whose software is the same: nothing happens on them
    unknown: str = ""  # why the deployed version could not be read (then each node's restarts are not known)
    measured: dict[str, float] = field(default_factory=dict)  # role -> the longest restart in place measured lately, seconds


def compare(old_version: str, new_version: str, old_asset: bytes | None, new_asset: bytes, nodes: list[str], *, unknown: str = "") -> InPlace:
    """What changing the fleet's software from OLD to NEW does to each of NODES (those running before and after)."""
    change = InPlace(old_version, new_version, unknown=unknown)
    for node in sorted(nodes, key=node_order):
        if old_asset is None:
            change.restarts[node] = []
            continue
        units = restarted_units(node_tree(old_asset, node), node_tree(new_asset, node))
        if units is None:
            change.same.append(node)
        else:
            change.restarts[node] = units
    return change


def lines(cfg: ClusterConfig, change: InPlace) -> list[str]:
    """What an in-place change does, per node, in lines an operator reads before it runs."""
    from cluster_ops.rollout import span

    out = [f"software {change.old[:12]} -> {change.new[:12]}, in place (no instance replaced): State Manager runs it on each role's "
           f"nodes, at most rollout.max_unavailable of a role at a time; a node that does not serve again within "
           f"{cfg.rollout.apply_timeout_s // 60} min goes back to {change.old[:12]} and the deploy fails there"]  # fmt: skip
    if change.unknown:
        out.append(f"  the deployed version could not be read ({change.unknown}): each node restarts the units whose files changed")
    groups: dict[tuple[str, ...], list[str]] = {}
    for node, units in change.restarts.items():
        groups.setdefault(tuple(units), []).append(node)
    roles = {n.name: n.role for n in cfg.layout.nodes}
    for restarted, nodes in sorted(groups.items(), key=lambda g: node_order(g[1][0])):
        if change.unknown:
            continue
        said = f"restart {', '.join(restarted)}" if restarted else "take new files and restart no unit"
        out.append(f"  {span(nodes)}: {said}")
    for role in dict.fromkeys(roles.values()):
        names = [n for n in change.restarts if roles.get(n) == role]
        if not names:
            continue
        total = sum(1 for r in roles.values() if r == role)
        lanes = cfg.rollout.lanes(total, False)
        batches = -(-len(names) // lanes)
        servers = any(u not in NOT_SERVING for n in names for u in change.restarts[n])
        took = change.measured.get(role)
        each = (f"{took / 60:.0f} min, the longest restart of a {role} node in place in the last {MEASURED_DAYS} days"
                if took is not None else f"not measured yet; each at most {cfg.rollout.apply_timeout_s // 60} min")  # fmt: skip
        about = f"about {batches * took / 60:.0f} min: " if took is not None else "about "
        out.append(f"  {role}: {batches} batch{'es' if batches != 1 else ''} of at most {lanes}, minimum serving {role} "
                   f"{total - (lanes if servers else 0)}/{total}, {about}{batches} x a node's restart ({each})")  # fmt: skip
    if change.same:
        out.append(f"  same software, nothing restarted: {span(change.same)}")
    return out


def measured_restarts(session: Any, cfg: ClusterConfig, now: dt.datetime | None = None) -> dict[str, float]:
    """Per role, the longest time a node took to serve again after an in-place change (gptoss-apply's
    RESTART_METRIC) in the last MEASURED_DAYS days, in seconds; {} when CloudWatch has none or cannot say
    (the estimate is advice: the deploy does not need it)."""
    from node_render.telemetry import RESTART_METRIC, namespace

    now = now or dt.datetime.now(dt.UTC)
    out: dict[str, float] = {}
    try:
        cloudwatch = session.client("cloudwatch")
        for role in dict.fromkeys(n.role for n in cfg.layout.nodes):
            points = cloudwatch.get_metric_statistics(
                Namespace=namespace(cfg), MetricName=RESTART_METRIC, StartTime=now - dt.timedelta(days=MEASURED_DAYS), EndTime=now,
                Dimensions=[{"Name": "Cluster", "Value": cfg.cluster_name}, {"Name": "Role", "Value": role}],
                Period=MEASURED_DAYS * 86400, Statistics=["Maximum"],
            )["Datapoints"]  # fmt: skip
            if points:
                out[role] = max(float(p["Maximum"]) for p in points)
    except Exception:  # advice before the deploy, like the deployed version's files
        return {}
    return out


def deployed_software(session: Any, parameter: str, version: str) -> tuple[bytes | None, str]:
    """The deployed version's asset, from where the stack's parameter says it is (checked against its sha256),
    or (None, why not)."""
    from cluster_ops.awserrors import explain

    try:
        value = session.client("ssm").get_parameter(Name=parameter)["Parameter"]["Value"]
        uri, sha = value.split()
        if sha != version:
            return None, f"{parameter} names {sha[:12]}, the deployed template {version[:12]}"
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        data = session.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as e:  # advice before the deploy: the deploy itself does not need it
        return None, explain(e, region=session.region_name or "") or f"{type(e).__name__}: {e}"
    if hashlib.sha256(data).hexdigest() != version:
        return None, f"the object at {uri} is not version {version[:12]}"
    return data, ""


def serving_restarts(change: InPlace | None) -> list[str]:
    """The nodes whose servers, router or proxy restart (all the nodes the change reaches when the deployed
    version could not be read): what `gptoss deploy` asks about."""
    if change is None:
        return []
    return [n for n, units in change.restarts.items() if change.unknown or any(u not in NOT_SERVING for u in units)]
