"""Why a deploy replaces each node: what in its launch changed, read from the deployed and the synthesized
template, and which kind of change that is.

A node's instance is replaced when its group's launch changes. Two kinds: the *machine* (image,
instance type, network interfaces and EFA, root volume, the capacity it launches into, its group's
subnet, the boot files its user data carries) and the *software* when the launch template carries it
(rollout.software=replace: the digest of the node's own software; the router wheel). With the default,
rollout.software=in-place, the software is not in the launch template: a change of it replaces no
instance (cluster_ops.in_place says which units it restarts). Said per node before the deploy, so
that a one-line change is seen for what it costs.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from cluster_ops.rollout import launch_settings, span
from clusterspec.names import node_order
from node_render.userdata import parse_user_data

# The launch template's settings that are the machine, as an operator names them.
MACHINE = {
    "ImageId": "the image",
    "InstanceType": "the instance type",
    "NetworkInterfaces": "the network interfaces (EFA)",
    "BlockDeviceMappings": "the root volume",
    "Monitoring": "the monitoring",
    "CapacityReservationSpecification": "the capacity it launches into",
    "InstanceMarketOptions": "the capacity it launches into",
    "Placement": "the placement group",
    "MetadataOptions": "the instance metadata settings",
    "IamInstanceProfile": "the instance profile",
}
# deploy.env values that are software: its own software's digest (rollout.software=replace).
SOFTWARE_VALUES = {"GPTOSS_SOFTWARE_DIGEST": "its software",
                   "GPTOSS_COMPILE_CACHE_URI": "the compile cache location", "GPTOSS_SOFTWARE_PARAMETER": "where it reads its software version"}
# What changes with the deploy gate itself (a consequence of a replacement, never its cause).
GATE_VALUES = {"GPTOSS_SIGNAL_URL", "GPTOSS_GATE"}


def _token(value: Any) -> str:
    """A stable stand-in for a CloudFormation token inside the user data (a bucket, a handle's URL)."""
    return "TOKEN" + hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def user_data_text(value: Any) -> str | None:
    """The user data as the instance receives it, with each token replaced by a stand-in, or None."""
    if isinstance(value, dict) and "Fn::Base64" in value:
        inner = value["Fn::Base64"]
        if isinstance(inner, str):
            return inner
        if isinstance(inner, dict) and "Fn::Join" in inner:
            sep, parts = inner["Fn::Join"]
            return str(sep).join(p if isinstance(p, str) else _token(p) for p in parts)
        return None
    if isinstance(value, str):
        try:
            return base64.b64decode(value).decode()
        except ValueError:
            return None
    return None


def _user_data_changes(before: Any, after: Any) -> tuple[list[str], list[str]]:
    """What a node's user data says changed: (machine: its boot files by path; software: the pinned version, the router)."""
    old, new = user_data_text(before), user_data_text(after)
    if old is None or new is None:
        return ["its user data"], []
    try:
        old_files, old_values, _ = parse_user_data(old)
        new_files, new_values, _ = parse_user_data(new)
    except (AssertionError, ValueError, KeyError, TypeError):
        return ["its user data"], []
    machine: list[str] = []
    software: list[str] = []
    files = sorted(p for p in set(old_files) | set(new_files) if old_files.get(p) != new_files.get(p))
    if files:
        machine.append(f"its boot files {', '.join(files)}")
    for key in sorted(set(old_values) | set(new_values)):
        if key in GATE_VALUES or old_values.get(key) == new_values.get(key):
            continue
        (software if key in SOFTWARE_VALUES else machine).append(SOFTWARE_VALUES.get(key, f"its deploy value {key}"))
    return list(dict.fromkeys(machine)), list(dict.fromkeys(software))


def reasons(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, tuple[str, list[str]]]:
    """Each node whose launch changes -> (kind: 'machine' or 'software', what changed), from two flattened templates."""
    old, new = launch_settings(before), launch_settings(after)
    out = {}
    for node in sorted(set(old) & set(new), key=node_order):
        (old_data, old_group), (new_data, new_group) = old[node], new[node]
        machine = list(dict.fromkeys(label for key, label in MACHINE.items() if old_data.get(key) != new_data.get(key)))
        if old_group != new_group:
            machine.append("its group's subnet or launch settings")
        known = set(MACHINE) | {"UserData"}
        if any(old_data.get(k) != new_data.get(k) for k in set(old_data) | set(new_data) if k not in known):
            machine.append("its launch template")
        software: list[str] = []
        if old_data.get("UserData") != new_data.get("UserData"):
            booted, software = _user_data_changes(old_data.get("UserData"), new_data.get("UserData"))
            machine += booted
        if machine or software:
            out[node] = ("machine" if machine else "software", machine + software)
    return out


def lines(why: Mapping[str, tuple[str, list[str]]]) -> list[str]:
    """One line per set of nodes replaced for the same reasons: the kind, what changed, what it costs."""
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for node, (kind, what) in why.items():
        groups.setdefault((kind, tuple(what)), []).append(node)
    out = []
    for (kind, said), nodes in sorted(groups.items(), key=lambda g: node_order(g[1][0])):
        cost = ("a new machine" if kind == "machine" else
                "a software change, applied with a new instance (rollout.software=replace): it boots, stages the model and loads "
                "again; rollout.software=in-place restarts the changed units instead")  # fmt: skip
        out.append(f"  why {span(nodes)}: {'; '.join(said)} ({cost})")
    return out
