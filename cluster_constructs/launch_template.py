"""What a node's launch template and group say of its network cards and its capacity."""

from __future__ import annotations

from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2

from clusterspec.config import ClusterConfig
from clusterspec.instance_types import InstanceType


def network_interfaces(hw: InstanceType, *, group_id: str, efa: bool = True) -> list[ec2.CfnLaunchTemplate.NetworkInterfaceProperty]:
    """Card 0 carries the primary interface (EFA with ENA, the IP); every other card is efa-only.

    EFA interfaces exist only at launch, so they are defined here. An efa-only interface
    cannot be primary and has no IP address (EC2 user guide, EFA on multi-card instances).
    A single-instance server (efa=False) exchanges nothing with peers: one ENA interface.
    No subnet: the node's Auto Scaling group launches every interface into its own subnet.
    """
    if not efa:
        return [
            ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
                network_card_index=0, device_index=0, groups=[group_id], delete_on_termination=True,
                associate_public_ip_address=False, description="card 0: primary, ENA (single instance: no EFA traffic)",
            )
        ]  # fmt: skip
    nics = []
    for card in range(hw.network_cards):
        efa = card < hw.efa_interfaces
        nics.append(
            ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
                network_card_index=card,
                device_index=0,
                interface_type=("efa" if card == 0 else "efa-only") if efa else None,
                groups=[group_id],
                delete_on_termination=True,
                associate_public_ip_address=False if card == 0 else None,
                description=f"card {card}: " + ("primary, EFA with ENA" if card == 0 else "EFA only" if efa else "ENA"),
            )
        )
    return nics


def capacity_options(
    config: ClusterConfig, role: str
) -> tuple[ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty | None, ec2.CfnLaunchTemplate.InstanceMarketOptionsProperty | None]:
    """The launch template's part of the role's capacity (docs/design.md 'Capacity').

    on-demand: nothing (EC2's default). odcr open: preference open (any matching open
    reservation). odcr targeted: nothing here, the group targets the reservation. capacity-block:
    market type capacity-block (a block's launches must say it), the block targeted by the group.
    EC2 Auto Scaling's guide: "set a market type on your launch template alongside a Capacity
    Reservation target on the group".
    """
    cap = config.capacity
    if cap.type == "odcr" and cap.preference == "open":
        return ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty(capacity_reservation_preference="open"), None
    if cap.type == "capacity-block":
        return None, ec2.CfnLaunchTemplate.InstanceMarketOptionsProperty(market_type="capacity-block")
    return None, None


def group_capacity(config: ClusterConfig, role: str) -> autoscaling.CfnAutoScalingGroup.CapacityReservationSpecificationProperty | None:
    """The group's part of the role's capacity: the reservation, group of reservations or block it launches into, and only there.

    capacity-reservations-only: a replacement with no room in the reservation waits for room
    (the group retries, the NodeCannotBeReplaced alarm fires), never lands outside it.
    """
    cap = config.capacity
    if cap.type == "on-demand" or (cap.type == "odcr" and cap.preference == "open"):
        return None
    rid, group = cap.target(role)
    return autoscaling.CfnAutoScalingGroup.CapacityReservationSpecificationProperty(
        capacity_reservation_preference="capacity-reservations-only",
        capacity_reservation_target=autoscaling.CfnAutoScalingGroup.CapacityReservationTargetProperty(
            capacity_reservation_ids=[rid] if rid else None, capacity_reservation_resource_group_arns=[group] if group else None
        ),
    )
