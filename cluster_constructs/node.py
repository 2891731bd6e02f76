"""One node identity: an Auto Scaling group that holds its one instance, launched from the node's own template.

A node keeps its identity (name, role, the replicas and ports it serves, its user data, its
role) but not its instance: when EC2's status checks fail, or the node marks itself unhealthy
(gptoss-health-watch), the group launches an instance of the same identity, in the same subnet,
placement group and capacity, without anyone acting and without touching another node. A
redeploy that changes what a node runs or is launched from makes a new version of its template,
which the group's rolling update applies by replacing exactly that node's instance.
"""

from __future__ import annotations

from aws_cdk import CfnAutoScalingRollingUpdate, CfnUpdatePolicy, Fn
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2
from constructs import Construct

from cluster_constructs.launch_template import capacity_options, group_capacity, network_interfaces
from clusterspec.config import ClusterConfig
from clusterspec.names import holder_name
from clusterspec.sections.rollout import PAUSE_MAX_S
from node_render.node_files import NodeRender

# Every process of a group a rolling update must not trip over: the update replaces the instance
# itself, and a health check or a replacement in the middle would fight it.
ROLLING_UPDATE_SUSPENDS = ["HealthCheck", "ReplaceUnhealthy", "AZRebalance", "AlarmNotification", "ScheduledActions"]
GROUP_NOTIFICATIONS = [
    "autoscaling:EC2_INSTANCE_LAUNCH",
    "autoscaling:EC2_INSTANCE_LAUNCH_ERROR",
    "autoscaling:EC2_INSTANCE_TERMINATE",
    "autoscaling:EC2_INSTANCE_TERMINATE_ERROR",
]
# The termination hook that keeps a leaving instance running for rollout.drain_s.
DRAIN_HOOK = "gptoss-drain"
# The group's own metrics (one-minute, no charge): in service and pending, graphed per identity.
GROUP_METRICS = ["GroupInServiceInstances", "GroupPendingInstances", "GroupTerminatingInstances", "GroupDesiredCapacity"]


class ClusterNode(Construct):
    """A node identity: its launch template (its user data, profile, NICs, capacity) and its group of one."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        render: NodeRender,
        image_id: str,
        subnet_id: str,
        security_group_id: str,
        instance_profile_arn: str,
        placement_group: str | None,
        user_data: str,
        alarm_topic_arn: str,
        target_group_arns: list[str] | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        node = render.node
        self.render = render
        self.group_name = holder_name(config.cluster_name, node.name)
        reservation, market = capacity_options(config, node.role)
        identity = [
            {"key": "gptoss:cluster", "value": config.cluster_name},
            {"key": "gptoss:role", "value": node.role},
            {"key": "gptoss:node", "value": node.name},
        ]
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
                # The subnet is the group's (VPCZoneIdentifier): a group fills in every interface's subnet.
                network_interfaces=network_interfaces(config.hardware, group_id=security_group_id, efa=node.role != "server"),
                placement=ec2.CfnLaunchTemplate.PlacementProperty(group_name=placement_group) if placement_group else None,
                monitoring=ec2.CfnLaunchTemplate.MonitoringProperty(enabled=config.detailed_monitoring),
                disable_api_termination=config.termination_protection,
                capacity_reservation_specification=reservation,
                instance_market_options=market,
                tag_specifications=[
                    ec2.CfnLaunchTemplate.TagSpecificationProperty(resource_type=kind, tags=identity)
                    for kind in ("volume", "network-interface")
                ],
                user_data=Fn.base64(user_data),
            ),
        )
        self.group = autoscaling.CfnAutoScalingGroup(
            self,
            "Group",
            auto_scaling_group_name=self.group_name,
            min_size="1",
            max_size="1",
            desired_capacity="1",
            launch_template=autoscaling.CfnAutoScalingGroup.LaunchTemplateSpecificationProperty(
                launch_template_id=self.template.ref, version=self.template.attr_latest_version_number
            ),
            vpc_zone_identifier=[subnet_id],
            # EC2's status checks (an impaired or stopped instance is replaced), plus the node's own report.
            health_check_type="EC2",
            health_check_grace_period=config.healing.grace_s,
            capacity_reservation_specification=group_capacity(config, node.role),
            target_group_arns=target_group_arns or None,
            metrics_collection=[autoscaling.CfnAutoScalingGroup.MetricsCollectionProperty(granularity="1Minute", metrics=GROUP_METRICS)],
            # Every launch and termination of the node's instance, and a launch that failed, to the alarm topic.
            notification_configurations=[
                autoscaling.CfnAutoScalingGroup.NotificationConfigurationProperty(topic_arn=alarm_topic_arn, notification_types=GROUP_NOTIFICATIONS)
            ],
            # An instance being terminated (replaced, rolled, scaled in) runs drain_s more: its requests
            # finish, and every router reads the members again and follows its name to the replacement.
            lifecycle_hook_specification_list=[
                autoscaling.CfnAutoScalingGroup.LifecycleHookSpecificationProperty(
                    lifecycle_hook_name=DRAIN_HOOK,
                    lifecycle_transition="autoscaling:EC2_INSTANCE_TERMINATING",
                    heartbeat_timeout=config.rollout.drain_s,
                    default_result="CONTINUE",
                )
            ],
            tags=[
                autoscaling.CfnAutoScalingGroup.TagPropertyProperty(key="Name", value=f"{config.cluster_name}-{node.name}", propagate_at_launch=True),
                *(autoscaling.CfnAutoScalingGroup.TagPropertyProperty(key=t["key"], value=t["value"], propagate_at_launch=True) for t in identity),
            ],
        )
        # A new template version (the node's user data or launch inputs changed) replaces this node's
        # instance, and only this node's (docs/design.md 'Changes'). With surge, the group grows to two:
        # the replacement launches, and the update waits for its signal (gptoss-signal, once it serves)
        # before it terminates the old instance; a failure signal or no signal within surge_timeout_s
        # terminates the replacement instead and rolls the stack back. Without surge (capacity sized to
        # the fleet): terminate, then launch, and wait up to an hour for the replacement's signal
        # without requiring it (MinSuccessfulInstancesPercent 0: a timeout or a FAILURE counts, and the
        # update goes on; the node's deploy gate, up to 12 hours, judges it and holds the lane). That
        # wait is what paces a rollback, which re-applies this policy to the previous version: the
        # previous gates are long done, so without it every node the change reached would be
        # relaunched at once. No gate, no signal: nothing to wait for.
        surge = config.surge
        self.surge = surge
        self.group.max_size = "2" if surge else "1"
        self.group.cfn_options.update_policy = CfnUpdatePolicy(
            auto_scaling_rolling_update=CfnAutoScalingRollingUpdate(
                min_instances_in_service=1 if surge else 0,
                max_batch_size=1,
                wait_on_resource_signals=config.wait_for_ready,
                pause_time=f"PT{config.rollout.surge_timeout_s if surge else PAUSE_MAX_S}S" if config.wait_for_ready else "PT0S",
                min_successful_instances_percent=None if surge or not config.wait_for_ready else 0,
                suspend_processes=ROLLING_UPDATE_SUSPENDS,
            )
        )
