"""Find the cluster's instances by tag and run commands on them through SSM Run Command."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DONE = {"Success", "Failed", "Cancelled", "TimedOut", "Cancelling"}


@dataclass(frozen=True)
class NodeInstance:
    """A running instance of the cluster."""

    name: str
    role: str
    instance_id: str
    private_ip: str
    state: str


def find_nodes(ec2: Any, cluster: str) -> dict[str, NodeInstance]:
    """Instances tagged gptoss:cluster=CLUSTER that are pending or running, by node name."""
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": "tag:gptoss:cluster", "Values": [cluster]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
    )
    out = {}
    for page in pages:
        for res in page["Reservations"]:
            for i in res["Instances"]:
                tags = {t["Key"]: t["Value"] for t in i.get("Tags", [])}
                name = tags.get("gptoss:node", i["InstanceId"])
                out[name] = NodeInstance(name, tags.get("gptoss:role", "?"), i["InstanceId"], i.get("PrivateIpAddress", ""), i["State"]["Name"])
    return out


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
    cmd = ssm.send_command(
        InstanceIds=[instance_id],
        DocumentName="AWS-RunShellScript",
        Parameters={"commands": commands},
        TimeoutSeconds=max(30, int(timeout_s)),
    )["Command"]["CommandId"]
    waited = 0.0
    while True:
        try:
            inv = ssm.get_command_invocation(CommandId=cmd, InstanceId=instance_id)
        except ssm.exceptions.InvocationDoesNotExist:
            inv = {"Status": "Pending", "StandardOutputContent": ""}
        if inv["Status"] in DONE:
            return inv["Status"], inv.get("StandardOutputContent", "")
        if waited >= timeout_s:
            return "TimedOut", inv.get("StandardOutputContent", "")
        sleep(poll_s)
        waited += poll_s
