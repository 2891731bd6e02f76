"""Checks against the real account before a deploy: what the stack assumes, as AWS reports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from clusterspec.config import ClusterConfig
from clusterspec.names import holder_name


@dataclass(frozen=True)
class Check:
    """One preflight result."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False  # passes, with something the operator should know (a block ending soon)


def _quota_name(family: str) -> str:
    # EC2 groups vCPU quotas by letter family: trn1/trn2/trn3 share "Running On-Demand Trn instances".
    letters = "".join(c for c in family if c.isalpha())
    return f"Running On-Demand {letters.capitalize()} instances"


def check_offered(cfg: ClusterConfig, ec2: Any) -> Check:
    """The instance type is offered in the configured AZ."""
    offers = ec2.describe_instance_type_offerings(
        LocationType="availability-zone",
        Filters=[
            {"Name": "instance-type", "Values": [cfg.instance_type]},
            {"Name": "location", "Values": [cfg.availability_zone]},
        ],
    )["InstanceTypeOfferings"]
    if offers:
        return Check("instance type offered", True, f"{cfg.instance_type} in {cfg.availability_zone}")
    return Check(
        "instance type offered",
        False,
        f"{cfg.instance_type} is not offered in {cfg.availability_zone}",
        "set availability_zone (and region) to a zone that offers it: "
        f"aws ec2 describe-instance-type-offerings --location-type availability-zone --filters Name=instance-type,Values={cfg.instance_type}",
    )


def check_hardware(cfg: ClusterConfig, ec2: Any) -> list[Check]:
    """Network cards, EFA interfaces, instance storage and vCPUs match the stack's table."""
    try:
        (info,) = ec2.describe_instance_types(InstanceTypes=[cfg.instance_type])["InstanceTypes"]
    except ClientError as e:
        return [Check("hardware table", False, f"{cfg.instance_type}: {e.response['Error']['Message']}", "check instance_type")]
    hw = cfg.hardware
    net = info.get("NetworkInfo", {})
    disks = info.get("InstanceStorageInfo", {}).get("Disks", [{}])
    actual = {
        "network_cards": net.get("MaximumNetworkCards", 1),
        "efa_interfaces": net.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0),
        "nvme_disks": sum(d.get("Count", 0) for d in disks),
        "nvme_disk_gb": disks[0].get("SizeInGB", 0) if disks else 0,
        "vcpus": info["VCpuInfo"]["DefaultVCpus"],
    }
    checks = []
    for field, value in actual.items():
        expected = getattr(hw, field)
        source = "assumed, unpublished" if field in hw.unpublished else "stack table"
        if value == expected:
            checks.append(Check(f"{field}", True, f"{value} ({source}: {expected})"))
        else:
            checks.append(
                Check(
                    f"{field}",
                    False,
                    f"AWS reports {value}, the stack table says {expected}" + (" (an unpublished assumption)" if field in hw.unpublished else ""),
                    f"set instance_overrides.{field}={value} (-c 'instance_overrides={{\"{field}\": {value}}}')",
                )
            )
    return checks


def check_ami(cfg: ClusterConfig, ssm: Any, ec2: Any) -> Check:
    """The DLAMI SSM parameter (or the fixed AMI id) exists."""
    if cfg.ami_id:
        images = ec2.describe_images(ImageIds=[cfg.ami_id])["Images"]
        if images:
            return Check("Neuron DLAMI", True, f"{cfg.ami_id}: {images[0].get('Name', '')}")
        return Check("Neuron DLAMI", False, f"{cfg.ami_id} does not exist in {cfg.region}", "set ami_id to an AMI of this region")
    assert cfg.ami_ssm_parameter
    try:
        value = ssm.get_parameter(Name=cfg.ami_ssm_parameter)["Parameter"]["Value"]
    except ClientError as e:
        if e.response["Error"]["Code"] != "ParameterNotFound":
            raise
        return Check(
            "Neuron DLAMI",
            False,
            f"SSM parameter {cfg.ami_ssm_parameter} not found in {cfg.region}",
            "set ami_ssm_parameter to an existing DLAMI parameter "
            "(aws ssm get-parameters-by-path --path /aws/service/neuron/dlami --recursive) or set ami_id",
        )
    return Check("Neuron DLAMI", True, f"{cfg.ami_ssm_parameter} -> {value}")


def surge_room(cfg: ClusterConfig) -> dict[str, int]:
    """Per role, the instances a surge rollout runs beside the fleet at once (its replacements, and the
    old instances still draining when the next batch starts); empty without surge."""
    roles: dict[str, int] = {}
    for node in cfg.layout.nodes:
        roles[node.role] = roles.get(node.role, 0) + 1
    return {role: room for role, n in roles.items() if (room := cfg.rollout.surge_room(n, cfg.surge))}


def check_quota(cfg: ClusterConfig, quotas: Any) -> Check:
    """The On-Demand vCPU quota of the family covers the whole fleet, and what a surge rollout runs beside it."""
    nodes = len(cfg.layout.nodes)
    room = surge_room(cfg)
    extra = sum(room.values())
    need = (nodes + extra) * cfg.hardware.vcpus
    name = _quota_name(cfg.hardware.vcpu_family)
    pages = quotas.get_paginator("list_service_quotas").paginate(ServiceCode="ec2")
    found = [q for page in pages for q in page["Quotas"] if q["QuotaName"] == name]
    if not found:
        return Check("vCPU quota", False, f"no EC2 quota named {name!r}", "request it in the Service Quotas console")
    have = int(found[0]["Value"])
    what = f"{nodes} x {cfg.instance_type}" + (
        f" and {extra} more while a change surges ({', '.join(f'{n} {r}' for r, n in sorted(room.items()))}: each batch's "
        "replacements and the old instances still draining)" if extra else "")  # fmt: skip
    if have >= need:
        return Check("vCPU quota", True, f"{name}: {have} vCPUs >= {need} for {what}")
    fix = f"request {need} vCPUs (quota code {found[0]['QuotaCode']}) or lower decode_instances"
    if extra and have >= nodes * cfg.hardware.vcpus:
        fix += " (or deploy changes with rollout.surge=off, which needs no instance beyond the fleet)"
    return Check("vCPU quota", False, f"{name}: {have} vCPUs < {need} for {what}", fix)


def check_groups(cfg: ClusterConfig, autoscaling: Any) -> Check:
    """The region's Auto Scaling group quota (500 by default) holds the fleet's groups, one per node, beside the others."""
    limits = autoscaling.describe_account_limits()
    most, used = int(limits["MaxNumberOfAutoScalingGroups"]), int(limits["NumberOfAutoScalingGroups"])
    names = [holder_name(cfg.cluster_name, n.name) for n in cfg.layout.nodes]
    existing = 0
    for i in range(0, len(names), 50):
        existing += len(autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=names[i : i + 50], MaxRecords=50)["AutoScalingGroups"])
    new = len(names) - existing
    detail = f"{used} of {most} Auto Scaling groups in {cfg.region} used; the fleet adds {new} (one per node, {existing} exist)"
    if used + new <= most:
        return Check("Auto Scaling groups", True, detail)
    return Check("Auto Scaling groups", False, detail,
                 f"request a quota of at least {used + new} Auto Scaling groups per region (Service Quotas, Amazon EC2 Auto Scaling), "
                 "or lower decode_instances")  # fmt: skip


def check_s3_prefix_list(cfg: ClusterConfig, ec2: Any) -> Check:
    """egress=none: the nodes' HTTPS reaches S3 alone when network.s3_prefix_list_id is the region's S3 prefix list."""
    name = f"com.amazonaws.{cfg.region}.s3"
    found = ec2.describe_managed_prefix_lists(Filters=[{"Name": "prefix-list-name", "Values": [name]}])["PrefixLists"]
    if not found:
        return Check("S3 prefix list", False, f"no managed prefix list {name} in {cfg.region}", "check the region")
    pl = found[0]["PrefixListId"]
    given = cfg.network.s3_prefix_list_id
    if given == pl:
        return Check("S3 prefix list", True, f"HTTPS egress reaches {name} ({pl}) alone")
    if given:
        return Check("S3 prefix list", False, f"network.s3_prefix_list_id is {given}, but {name} is {pl}", f"set network.s3_prefix_list_id={pl}")
    return Check("S3 prefix list", True, f"HTTPS egress is open to any address (no route leads out but to S3 and the endpoints); {name} is {pl}",
                 f"set network.s3_prefix_list_id={pl} to narrow it to S3", warn=True)  # fmt: skip


def run(cfg: ClusterConfig, session: Any) -> list[Check]:
    """Every preflight check for this config."""
    ec2 = session.client("ec2", region_name=cfg.region)
    checks = [check_offered(cfg, ec2), *check_hardware(cfg, ec2)]
    checks.append(check_ami(cfg, session.client("ssm", region_name=cfg.region), ec2))
    checks.append(check_quota(cfg, session.client("service-quotas", region_name=cfg.region)))
    checks.append(check_groups(cfg, session.client("autoscaling", region_name=cfg.region)))
    if cfg.network.egress == "none":
        checks.append(check_s3_prefix_list(cfg, ec2))
    groups = cfg.capacity.reservation_group_arn or any(r.reservation_group_arn for r in cfg.capacity.roles.values())
    checks += check_capacity(cfg, ec2, session.client("resource-groups", region_name=cfg.region) if groups else None)
    return checks


def check_capacity(cfg: ClusterConfig, ec2: Any, rg: Any, *, now: Any = None) -> list[Check]:
    """One check per reservation the fleet launches into (cluster_ops.capacity)."""
    from cluster_ops import capacity

    return [
        Check(f"capacity {r.reservation} ({r.roles})", r.verdict != "FAIL", r.detail, r.fix, warn=r.verdict == "warn")
        for r in capacity.check(cfg, ec2, rg, now=now)
    ]
