"""Stack outputs: where the nodes are and how to reach the proxy from a laptop."""

from __future__ import annotations

from aws_cdk import CfnOutput, Fn
from constructs import Construct

from cluster_constructs.node import ClusterNode
from clusterspec.commands import endpoint_port
from clusterspec.config import ClusterConfig


def port_forward_command(*, region: str, target: str, port: int, remote_host: str | None = None) -> str:
    """The SSM command that forwards localhost:PORT to the proxy (or to a host behind a node)."""
    if remote_host is None:
        doc, params = "AWS-StartPortForwardingSession", f"portNumber={port},localPortNumber={port}"
    else:
        doc, params = "AWS-StartPortForwardingSessionToRemoteHost", f"host={remote_host},portNumber={port},localPortNumber={port}"
    return f"aws ssm start-session --region {region} --target {target} --document-name {doc} --parameters {params}"


class ClusterOutputs(Construct):
    """Instance ids, private IPs, the proxy URL and the SSM port-forward command."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        nodes: list[ClusterNode],
        proxy_nodes: list[ClusterNode],
        endpoint_dns: str | None,
    ) -> None:
        super().__init__(scope, construct_id)
        port = endpoint_port(config)
        # Clients talk to the proxies of a DI recipe, or straight to the server of a single-instance one.
        kind = "Proxy" if config.serving.disaggregated else "Server"
        for node in nodes:
            lid = node.render.node.logical_id
            CfnOutput(scope, f"{lid}InstanceId", value=node.instance.ref, description=f"{node.render.node.name} instance id")
            CfnOutput(scope, f"{lid}PrivateIp", value=node.private_ip, description=f"{node.render.node.name} private IP")
        proxy_node = proxy_nodes[0]
        if len(proxy_nodes) > 1 and endpoint_dns is None:
            CfnOutput(
                scope,
                "ProxyUrls",
                value=Fn.join(" ", [Fn.join("", ["http://", n.private_ip, f":{port}"]) for n in proxy_nodes]),
                description="One proxy per decode server (no load balancer): spread clients over these",
            )
        host = endpoint_dns or proxy_node.private_ip
        CfnOutput(scope, f"{kind}Url", value=Fn.join("", ["http://", host, f":{port}"]), description="The client endpoint (in the VPC)")
        CfnOutput(
            scope,
            f"{kind}PortForward",
            value=port_forward_command(
                region=config.region, target=proxy_node.instance.ref, port=port, remote_host=endpoint_dns
            ),
            description=f"Run on a laptop with the Session Manager plugin, then use http://localhost:{port}",
        )
