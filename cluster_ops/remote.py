"""Find the cluster's instances by tag and run commands on them through SSM Run Command."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DONE = {"Success", "Failed", "Cancelled", "TimedOut", "Cancelling"}
SSM_MAX_TARGETS = 50  # instance ids one SendCommand accepts


@dataclass(frozen=True)
class NodeInstance:
    """A running instance of the cluster."""

    name: str
    role: str
    instance_id: str
    private_ip: str
    state: str
    state_reason: str = ""  # EC2's StateReason message (why a node is still pending)
    reservation_id: str = ""  # the capacity reservation or block it runs in
    newer: tuple[str, ...] = ()  # the node's other instances, launched after this one (a surge's replacement)


def find_nodes(ec2: Any, cluster: str) -> dict[str, NodeInstance]:
    """Instances tagged gptoss:cluster=CLUSTER that are pending or running, by node name.

    A node with two (a surge: the replacement launched beside the old one) is its oldest, which
    serves and holds the node's name until its group lets it go (as gptoss-members and the port
    forward's lookup choose); the others are listed as newer. EC2 lists in no promised order."""
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": "tag:gptoss:cluster", "Values": [cluster]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
    )
    by_node: dict[str, list[dict[str, Any]]] = {}
    for page in pages:
        for res in page["Reservations"]:
            for i in res["Instances"]:
                tags = {t["Key"]: t["Value"] for t in i.get("Tags", [])}
                by_node.setdefault(tags.get("gptoss:node", i["InstanceId"]), []).append(i | {"Tags": tags})
    out = {}
    for name, found in by_node.items():
        i, *newer = sorted(found, key=lambda i: (str(i.get("LaunchTime", "")), i["InstanceId"]))
        out[name] = NodeInstance(
            name, i["Tags"].get("gptoss:role", "?"), i["InstanceId"], i.get("PrivateIpAddress", ""), i["State"]["Name"],
            state_reason=i.get("StateReason", {}).get("Message", ""), reservation_id=i.get("CapacityReservationId", ""),
            newer=tuple(n["InstanceId"] for n in newer),
        )  # fmt: skip
    return out


def run_on_all(
    ssm: Any,
    instance_ids: list[str],
    commands: list[str],
    *,
    timeout_s: float = 120,
    poll_s: float = 2,
    on_done: Callable[[str, str], None] = lambda iid, status: None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, tuple[str, str]]:
    """Run shell commands on many instances at once (one SendCommand per 50); id -> (status, stdout)."""
    pending: dict[str, str] = {}
    for i in range(0, len(instance_ids), SSM_MAX_TARGETS):
        batch = instance_ids[i : i + SSM_MAX_TARGETS]
        cmd = ssm.send_command(
            InstanceIds=batch,
            DocumentName="AWS-RunShellScript",
            Parameters={"commands": commands},
            TimeoutSeconds=max(30, int(timeout_s)),
        )["Command"]["CommandId"]
        pending |= {iid: cmd for iid in batch}
    results: dict[str, tuple[str, str]] = {}
    waited = 0.0
    while pending:
        for iid, cmd in list(pending.items()):
            try:
                inv = ssm.get_command_invocation(CommandId=cmd, InstanceId=iid)
            except ssm.exceptions.InvocationDoesNotExist:
                inv = {"Status": "Pending", "StandardOutputContent": ""}
            if inv["Status"] in DONE or waited >= timeout_s:
                status = inv["Status"] if inv["Status"] in DONE else "TimedOut"
                results[iid] = (status, inv.get("StandardOutputContent", ""))
                del pending[iid]
                on_done(iid, status)
        if pending:
            sleep(poll_s)
            waited += poll_s
    return results


def run_command(
    ssm: Any,
    instance_id: str,
    commands: list[str],
    *,
    timeout_s: float = 120,
    poll_s: float = 2,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[str, str]:
    """Run shell commands on one instance; return (status, stdout)."""
    return run_on_all(ssm, [instance_id], commands, timeout_s=timeout_s, poll_s=poll_s, sleep=sleep)[instance_id]
