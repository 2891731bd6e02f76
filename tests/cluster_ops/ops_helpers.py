"""What the tests of preflight, status, wait-ready, bench and save-cache share: a session of moto's clients
and Stubbers (Service Quotas, Auto Scaling), a fleet launched into moto, a node's report."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import boto3
from botocore.stub import ANY, Stubber

from cluster_ops import preflight
from clusterspec.config import ClusterConfig
from node_render.node_health import health_file
from node_render.paths import USERDATA_DIR
from node_render.render import render_cluster

REGION = "us-east-2"
TRN2 = {"instance_type": "trn2.48xlarge", "serving": {"shape": {"quantization": "bf16"}}, "ami_ssm_parameter": "/test/dlami"}


class Session:
    """A boto3 session stand-in that hands out the given clients (moto-backed or stubbed)."""

    def __init__(self, **clients: Any) -> None:
        self.clients = clients

    def client(self, name: str, region_name: str | None = None) -> Any:
        return self.clients[name] if name in self.clients else boto3.client(name, region_name=region_name or REGION)


def quotas(value: float, name: str = "Running On-Demand Trn instances") -> Any:
    client = boto3.client("service-quotas", region_name=REGION)
    stub = Stubber(client)
    stub.add_response(
        "list_service_quotas",
        {"Quotas": [{"QuotaName": name, "QuotaCode": "L-2C3B7624", "Value": value, "ServiceCode": "ec2"}]},
        {"ServiceCode": "ec2"},
    )
    stub.activate()
    return client


def groups(used: int = 12, most: int = 500, existing: list[str] | None = None, names: list[str] | None = None) -> Any:
    """Auto Scaling's account limits and the fleet's existing groups (Stubber: moto has no DescribeAccountLimits)."""
    client = boto3.client("autoscaling", region_name=REGION)
    stub = Stubber(client)
    stub.add_response("describe_account_limits", {"MaxNumberOfAutoScalingGroups": most, "NumberOfAutoScalingGroups": used,
                                                  "MaxNumberOfLaunchConfigurations": 200, "NumberOfLaunchConfigurations": 0})  # fmt: skip
    names = names or ["gptoss-8k1k-prefill-0", "gptoss-8k1k-decode-0"]
    for i in range(0, len(names), 50):
        chunk = names[i : i + 50]
        found = [{"AutoScalingGroupName": n, "MinSize": 1, "MaxSize": 2, "DesiredCapacity": 1, "DefaultCooldown": 300, "AvailabilityZones": ["us-east-2a"],
                  "HealthCheckType": "EC2", "CreatedTime": dt.datetime(2026, 12, 1, tzinfo=dt.UTC)} for n in chunk if n in (existing or [])]  # fmt: skip
        stub.add_response("describe_auto_scaling_groups", {"AutoScalingGroups": found}, {"AutoScalingGroupNames": chunk, "MaxRecords": 50})
    stub.activate()
    return client


def _session(quota: float = 768, **extra: Any) -> Session:
    ec2 = extra.pop("ec2", boto3.client("ec2", region_name=REGION))
    autoscaling = extra.pop("autoscaling", groups())
    return Session(ec2=ec2, ssm=boto3.client("ssm", region_name=REGION), autoscaling=autoscaling, **{"service-quotas": quotas(quota)}, **extra)


def by_name(checks: list[preflight.Check]) -> dict[str, preflight.Check]:
    return {c.name: c for c in checks}


# ---- status and wait-ready ---------------------------------------------------------------


def launch(cfg: ClusterConfig, names: list[str] | None = None) -> dict[str, str]:
    """Run moto instances tagged as the stack tags them; node name -> instance id."""
    ec2 = boto3.client("ec2", region_name=REGION)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    out = {}
    for node in cfg.layout.nodes:
        if names is not None and node.name not in names:
            continue
        tags = [{"Key": "gptoss:cluster", "Value": cfg.cluster_name}, {"Key": "gptoss:role", "Value": node.role},
                {"Key": "gptoss:node", "Value": node.name}]  # fmt: skip
        inst = ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])
        out[node.name] = inst["Instances"][0]["InstanceId"]
    return out


def node_report(cfg: ClusterConfig, node: str, tmp_path: Path, server: str, down: frozenset[str] | set[str] = frozenset(),
                software: str = "", applying: bool = False) -> str:  # fmt: skip
    """What gptoss-status prints on a node: the real script, a fake systemctl, local health routes; the software
    version it runs (what its fetch or gptoss-apply recorded) and whether gptoss-apply runs now."""
    r = next(r for r in render_cluster(cfg) if r.node.name == node)
    lines = []
    for line in health_file(cfg, r).splitlines():
        unit, url, phase = line.split()
        if url != "-":
            # A unit that is down gets a port nothing listens on.
            url = f"{server if unit not in down else 'http://127.0.0.1:1'}/{url.rsplit('/', 1)[1]}"
        lines.append(f"{unit} {url} {phase}")
    state = tmp_path / f"{node}-state"
    (state / "run").mkdir(parents=True, exist_ok=True)
    if software:
        (state / "software").write_text(f"s3://assets/{software}.xz {software}\n")
    if applying:
        (state / "run" / "applying").touch()
    hf = tmp_path / f"{node}.health"
    hf.write_text("\n".join(lines) + "\n")
    env_file = tmp_path / "cluster.env"
    env_file.write_text(f"GPTOSS_NODE={node}\n")
    systemctl = tmp_path / "systemctl"
    systemctl.write_text(
        '#!/usr/bin/env bash\nfor a; do unit=$a; done\n'
        'case " $DOWN " in *" $unit "*) echo ActiveState=activating; echo SubState=auto-restart; echo NRestarts=2;; '
        '*) echo ActiveState=active; echo SubState=running; echo NRestarts=0;; esac\n'
    )
    systemctl.chmod(0o755)
    journalctl = tmp_path / "journalctl"
    journalctl.write_text('#!/usr/bin/env bash\nu=${*: -1}; echo "last line of ${u#_SYSTEMD_UNIT=}"\n')
    journalctl.chmod(0o755)
    res = subprocess.run(
        [str(USERDATA_DIR / "bin" / "gptoss-status")],
        env={
            **os.environ,
            "GPTOSS_HEALTH_FILE": str(hf),
            "GPTOSS_CLUSTER_ENV": str(env_file),
            "GPTOSS_SYSTEMCTL": str(systemctl),
            "GPTOSS_JOURNALCTL": str(journalctl),
            "GPTOSS_RUN_DIR": str(state / "run"),
            "GPTOSS_STATE_DIR": str(state),
            "DOWN": " ".join(down),
        },
        capture_output=True,
        text=True,
        check=True,
    )
    json.loads(res.stdout)  # the script prints valid JSON
    return res.stdout


def stub_ssm(outputs: list[tuple[str, str]]) -> tuple[Any, Stubber]:
    """An SSM client answering one send_command/get_command_invocation pair per (instance, stdout)."""
    ssm = boto3.client("ssm", region_name=REGION)
    stub = Stubber(ssm)
    for i, (iid, out) in enumerate(outputs):
        stub.add_response("send_command", {"Command": {"CommandId": str(uuid.UUID(int=i))}},
                          {"InstanceIds": [iid], "DocumentName": "AWS-RunShellScript", "Parameters": ANY, "TimeoutSeconds": ANY})  # fmt: skip
        stub.add_response("get_command_invocation", {"Status": "Success", "StandardOutputContent": out},
                          {"CommandId": str(uuid.UUID(int=i)), "InstanceId": iid})  # fmt: skip
    stub.activate()
    return ssm, stub


def stub_fleet(
    polls: list[list[tuple[str, str] | tuple[str, str, str]]], command: str = "/opt/gptoss/bin/gptoss-status"
) -> tuple[Any, Stubber]:
    """An SSM client answering, per poll, one send_command to all instances and one invocation each.

    A poll entry is (instance id, stdout) or (instance id, stdout, status); status defaults to Success.
    """
    ssm = boto3.client("ssm", region_name=REGION)
    stub = Stubber(ssm)
    for n, poll in enumerate(polls):
        cmd = str(uuid.UUID(int=1000 + n))
        stub.add_response("send_command", {"Command": {"CommandId": cmd}},
                          {"InstanceIds": [entry[0] for entry in poll], "DocumentName": "AWS-RunShellScript",
                           "Parameters": {"commands": [command]}, "TimeoutSeconds": ANY})  # fmt: skip
        for iid, out, *status in poll:
            stub.add_response("get_command_invocation", {"Status": status[0] if status else "Success", "StandardOutputContent": out},
                              {"CommandId": cmd, "InstanceId": iid})  # fmt: skip
    stub.activate()
    return ssm, stub


def _load_cli() -> Any:
    from cluster_ops import cli

    return cli


def _common() -> Any:
    from cluster_ops import common

    return common
