"""EFA launch template of one role: a network interface on every network card."""

from __future__ import annotations

from aws_cdk import Tags
from aws_cdk import aws_ec2 as ec2
from constructs import Construct

from clusterspec.config import ClusterConfig
from clusterspec.instance_types import InstanceType


def network_interfaces(
    hw: InstanceType, *, subnet_id: str, group_id: str, efa: bool = True
) -> list[ec2.CfnLaunchTemplate.NetworkInterfaceProperty]:
    """Card 0 carries the primary interface (EFA with ENA, the IP); every other card is efa-only.

    EFA interfaces exist only at launch, so they are defined here. An efa-only interface
    cannot be primary and has no IP address (EC2 user guide, EFA on multi-card instances).
    A single-instance server (efa=False) exchanges nothing with peers: one ENA interface.
    """
    if not efa:
        return [
            ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
                network_card_index=0, device_index=0, subnet_id=subnet_id, groups=[group_id], delete_on_termination=True,
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
                subnet_id=subnet_id,
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
    """The role's reservation targeting and market (capacity section; README 'Capacity').

    on-demand: neither (EC2's default, preference open). odcr targeted: the reservation or
    group as target; odcr open: preference open. capacity-block: the block as target and market
    type capacity-block (a block's launches must say both).
    """
    cap = config.capacity
    if cap.type == "on-demand":
        return None, None
    if cap.type == "odcr" and cap.preference == "open":
        return ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty(capacity_reservation_preference="open"), None
    rid, group = cap.target(role)
    spec = ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty(
        capacity_reservation_target=ec2.CfnLaunchTemplate.CapacityReservationTargetProperty(
            capacity_reservation_id=rid, capacity_reservation_resource_group_arn=group
        )
    )
    market = ec2.CfnLaunchTemplate.InstanceMarketOptionsProperty(market_type="capacity-block") if cap.type == "capacity-block" else None
    return spec, market


class EfaLaunchTemplate(Construct):
    """Launch template shared by every node of one role."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        role: str,
        image_id: str,
        subnet_id: str,
        security_group_id: str,
        instance_profile_arn: str,
        placement_group: str | None,
    ) -> None:
        super().__init__(scope, construct_id)
        hw = config.hardware
        tags = [
            ec2.CfnLaunchTemplate.TagSpecificationProperty(
                resource_type=kind,
                tags=[
                    {"key": "gptoss:cluster", "value": config.cluster_name},
                    {"key": "gptoss:role", "value": role},
                ],
            )
            for kind in ("volume", "network-interface")
        ]
        reservation, market = capacity_options(config, role)
        self.template = ec2.CfnLaunchTemplate(
            self,
            "Template",
            launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(
                image_id=image_id,
                instance_type=config.instance_type,
                iam_instance_profile=ec2.CfnLaunchTemplate.IamInstanceProfileProperty(arn=instance_profile_arn),
                metadata_options=ec2.CfnLaunchTemplate.MetadataOptionsProperty(
                    http_tokens="required", http_endpoint="enabled", http_put_response_hop_limit=1
                ),
                block_device_mappings=[
                    ec2.CfnLaunchTemplate.BlockDeviceMappingProperty(
                        device_name="/dev/sda1",
                        ebs=ec2.CfnLaunchTemplate.EbsProperty(
                            volume_type="gp3", volume_size=config.root_volume_gb, encrypted=True, delete_on_termination=True
                        ),
                    )
                ],
                network_interfaces=network_interfaces(hw, subnet_id=subnet_id, group_id=security_group_id, efa=role != "server"),
                placement=ec2.CfnLaunchTemplate.PlacementProperty(group_name=placement_group) if placement_group else None,
                monitoring=ec2.CfnLaunchTemplate.MonitoringProperty(enabled=config.detailed_monitoring),
                disable_api_termination=config.termination_protection,
                capacity_reservation_specification=reservation,
                instance_market_options=market,
                tag_specifications=tags,
            ),
        )
        Tags.of(self.template).add("gptoss:cluster", config.cluster_name)
        Tags.of(self.template).add("gptoss:role", role)
