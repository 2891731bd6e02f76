"""One cluster node: an instance from its role's launch template, with its own user data."""

from __future__ import annotations

from collections.abc import Mapping

from aws_cdk import Fn
from aws_cdk import aws_ec2 as ec2
from constructs import Construct

from clusterspec.config import ClusterConfig
from clusterspec.render import NodeRender
from clusterspec.userdata import user_data


class ClusterNode(Construct):
    """An EFA instance of the fleet."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        render: NodeRender,
        template: ec2.CfnLaunchTemplate,
        image_id: str,
        peer_ips: Mapping[str, str],
        scripts_uri: str,
        scripts_sha256: str,
        signal_url: str | None = None,
        router_uri: str | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        node = render.node
        self.render = render
        self.instance = ec2.CfnInstance(
            self,
            "Instance",
            launch_template=ec2.CfnInstance.LaunchTemplateSpecificationProperty(
                launch_template_id=template.ref, version=template.attr_latest_version_number
            ),
            # Also in the launch template; repeated because some tools (moto) read it only here.
            image_id=image_id,
            monitoring=config.detailed_monitoring,
            disable_api_termination=config.termination_protection,
            user_data=Fn.base64(
                user_data(
                    render, peer_ips, scripts_uri=scripts_uri, scripts_sha256=scripts_sha256, signal_url=signal_url, router_uri=router_uri
                )
            ),
            tags=[
                {"key": "Name", "value": f"{config.cluster_name}-{node.name}"},
                {"key": "gptoss:cluster", "value": config.cluster_name},
                {"key": "gptoss:role", "value": node.role},
                {"key": "gptoss:node", "value": node.name},
            ],
        )
        self.private_ip = self.instance.attr_private_ip
