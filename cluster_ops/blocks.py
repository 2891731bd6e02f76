"""Capacity Blocks for ML that fit the planned fleet, their extensions, and their purchase.

EC2's own calls (DescribeCapacityBlockOfferings, PurchaseCapacityBlock,
DescribeCapacityBlockExtensionOfferings, PurchaseCapacityBlockExtension), one per role (the
roles' instances may come from different blocks: capacity.roles) or one for the whole fleet.
moto has none of these APIs: tests/cluster_ops/test_blocks.py drives them with botocore's Stubber, which
checks every call and answer against EC2's service model.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from clusterspec.config import ClusterConfig

PLATFORM = "Linux/UNIX"  # the DLAMI's


@dataclass(frozen=True)
class Need:
    """What one block must hold: a role (or "fleet"), its instance type and count."""

    role: str
    instance_type: str
    count: int


@dataclass(frozen=True)
class Offering:
    """One offering EC2 made, as the table shows it."""

    need: Need
    offering_id: str
    availability_zone: str
    start: dt.datetime
    end: dt.datetime
    hours: int
    upfront_fee: str
    currency: str

    def purchase_command(self, region: str) -> str:
        """The AWS CLI command that buys it (what `gptoss blocks --purchase` runs, for those who prefer the CLI)."""
        return (f"aws ec2 purchase-capacity-block --region {region} --capacity-block-offering-id {self.offering_id} "
                f"--instance-platform {PLATFORM}")  # fmt: skip


def needs(cfg: ClusterConfig, *, whole: bool = False) -> list[Need]:
    """The blocks the planned fleet needs: one per role (in the layout's order), or one for the whole fleet."""
    counts: dict[str, int] = {}
    for node in cfg.layout.nodes:
        counts[node.role] = counts.get(node.role, 0) + 1
    if whole:
        return [Need("fleet", cfg.instance_type, sum(counts.values()))]
    return [Need(role, cfg.instance_type, n) for role, n in counts.items()]


def offerings(
    ec2: Any, need: Need, *, hours: int, start_after: dt.datetime | None = None, end_before: dt.datetime | None = None
) -> list[Offering]:
    """Every offering EC2 has for `need` over `hours`, starting after / ending before the dates given, soonest first."""
    kwargs: dict[str, Any] = {"InstanceType": need.instance_type, "InstanceCount": need.count, "CapacityDurationHours": hours}
    if start_after:
        kwargs["StartDateRange"] = start_after
    if end_before:
        kwargs["EndDateRange"] = end_before
    out: list[Offering] = []
    while True:
        page = ec2.describe_capacity_block_offerings(**kwargs)
        for o in page.get("CapacityBlockOfferings", []):
            out.append(Offering(need, o["CapacityBlockOfferingId"], o.get("AvailabilityZone", "?"), o["StartDate"], o["EndDate"],
                                int(o.get("CapacityBlockDurationHours", hours)), o.get("UpfrontFee", "?"), o.get("CurrencyCode", "")))  # fmt: skip
        if not page.get("NextToken"):
            return sorted(out, key=lambda x: (x.start, x.offering_id))
        kwargs["NextToken"] = page["NextToken"]


@dataclass(frozen=True)
class Extension:
    """One extension EC2 offers for a block the cluster runs in."""

    reservation_id: str
    offering_id: str
    instance_type: str
    count: int
    new_end: dt.datetime
    hours: int
    upfront_fee: str
    currency: str

    def purchase_command(self, region: str) -> str:
        return (f"aws ec2 purchase-capacity-block-extension --region {region} --capacity-block-extension-offering-id "
                f"{self.offering_id} --capacity-reservation-id {self.reservation_id}")  # fmt: skip


def blocks_in_use(cfg: ClusterConfig) -> list[str]:
    """The Capacity Blocks (cr-...) the spec launches into, each once (the section's and the roles')."""
    ids = [cfg.capacity.target(role)[0] for role in sorted({n.role for n in cfg.layout.nodes})]
    return sorted({i for i in ids if i})


def extensions(ec2: Any, reservation_id: str, *, hours: int) -> list[Extension]:
    """The extensions EC2 offers for one block, over `hours`."""
    kwargs: dict[str, Any] = {"CapacityReservationId": reservation_id, "CapacityBlockExtensionDurationHours": hours}
    out: list[Extension] = []
    while True:
        page = ec2.describe_capacity_block_extension_offerings(**kwargs)
        for o in page.get("CapacityBlockExtensionOfferings", []):
            out.append(Extension(reservation_id, o["CapacityBlockExtensionOfferingId"], o.get("InstanceType", "?"), int(o.get("InstanceCount", 0)),
                                 o["CapacityBlockExtensionEndDate"], int(o.get("CapacityBlockExtensionDurationHours", hours)),
                                 o.get("UpfrontFee", "?"), o.get("CurrencyCode", "")))  # fmt: skip
        if not page.get("NextToken"):
            return sorted(out, key=lambda x: (x.new_end, x.offering_id))
        kwargs["NextToken"] = page["NextToken"]


def purchase(ec2: Any, offering_id: str, cluster: str) -> dict[str, Any]:
    """Buy one offering, tagged with the cluster; EC2's answer (the block and its reservation)."""
    answer: dict[str, Any] = ec2.purchase_capacity_block(
        CapacityBlockOfferingId=offering_id, InstancePlatform=PLATFORM,
        TagSpecifications=[{"ResourceType": "capacity-reservation", "Tags": [{"Key": "gptoss:cluster", "Value": cluster}]}],
    )  # fmt: skip
    return answer


def purchase_extension(ec2: Any, offering_id: str, reservation_id: str) -> dict[str, Any]:
    """Buy one extension of a block the cluster runs in; EC2's answer (its new end)."""
    answer: dict[str, Any] = ec2.purchase_capacity_block_extension(CapacityBlockExtensionOfferingId=offering_id, CapacityReservationId=reservation_id)
    return answer
