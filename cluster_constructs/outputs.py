"""Stack outputs: the client endpoint and how to reach it from a laptop.

No output names an instance id or a private IP: a node's instance can be replaced at any time
(its group keeps the identity, not the instance). The commands below find the current instance
by its identity tags when they run; `gptoss status` shows each identity's instance and address.
"""

from __future__ import annotations

from aws_cdk import CfnOutput, Fn
from constructs import Construct

from clusterspec.config import ClusterConfig
from clusterspec.sections.endpoint import keys_secret_name
from node_render.command_lines import endpoint_port


def instance_lookup(*, region: str, cluster: str, node: str | None) -> str:
    """A shell command that prints the id of the instance running now for a node (or any node of the cluster).

    The oldest running one: during a surge a node has two, and the old one serves (and holds the
    node's name) until its group lets it go, while the new one may not serve yet."""
    filters = f"Name=tag:gptoss:cluster,Values={cluster} Name=instance-state-name,Values=running"
    if node:
        filters += f" Name=tag:gptoss:node,Values={node}"
    oldest = "sort_by(Reservations[].Instances[], &LaunchTime)[0].InstanceId"
    return f"aws ec2 describe-instances --region {region} --filters {filters} --query '{oldest}' --output text"


def port_forward_command(*, region: str, target: str, port: int, remote_host: str | None = None) -> str:
    """The SSM command that forwards localhost:PORT to the proxy (or to a host behind a node)."""
    if remote_host is None:
        doc, params = "AWS-StartPortForwardingSession", f"portNumber={port},localPortNumber={port}"
    else:
        doc, params = "AWS-StartPortForwardingSessionToRemoteHost", f"host={remote_host},portNumber={port},localPortNumber={port}"
    return f"aws ssm start-session --region {region} --target {target} --document-name {doc} --parameters {params}"


class ClusterOutputs(Construct):
    """The endpoint (the NLB's name, or the node that serves clients) and the SSM port-forward command."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        proxy_nodes: list[str],
        endpoint_dns: str | None,
        own_alarm_topic: str | None = None,
        endpoint_service: str | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        port = endpoint_port(config)
        # Clients talk to the proxies of a DI recipe, or straight to the server of a single-instance one.
        kind = "Proxy" if config.serving.disaggregated else "Server"
        cluster, region = config.cluster_name, config.region
        e = config.serving.endpoint
        if endpoint_dns is not None:
            if e.plain_port:
                CfnOutput(scope, f"{kind}Url", value=Fn.join("", ["http://", endpoint_dns, f":{port}"]),
                          description="The client endpoint (in the VPC)" + (": plain HTTP, for the cluster's own nodes and the port forward" if e.certificate_arn else ""))  # fmt: skip
            if e.certificate_arn:
                CfnOutput(scope, f"{kind}HttpsUrl", value=Fn.join("", ["https://", endpoint_dns, f":{e.tls_port}"]),
                          description="The client endpoint over TLS (the certificate's own name resolves to it where your DNS says so)")  # fmt: skip
            target = f"$({instance_lookup(region=region, cluster=cluster, node=None)})"
            forward = port_forward_command(region=region, target=target, port=port if e.plain_port else e.tls_port, remote_host=endpoint_dns)
        else:
            CfnOutput(
                scope,
                f"{kind}Nodes",
                value=" ".join(proxy_nodes),
                description=f"The nodes that serve clients on port {port} (no load balancer); gptoss status shows their addresses",
            )
            target = f"$({instance_lookup(region=region, cluster=cluster, node=proxy_nodes[0])})"
            forward = port_forward_command(region=region, target=target, port=port)
        CfnOutput(
            scope,
            f"{kind}PortForward",
            value=forward,
            description=f"Run on a laptop with the Session Manager plugin, then use http://localhost:{port}",
        )
        if config.endpoint_auth == "keys":
            secret = e.keys_secret_arn or keys_secret_name(cluster)
            CfnOutput(scope, "ApiKeysSecret", value=secret,
                      description="The API keys (gptoss keys list|create|rotate|revoke); every /v1/ request sends Authorization: Bearer <key>")  # fmt: skip
            CfnOutput(scope, "ApiKeyInitial", value=f"aws secretsmanager get-secret-value --region {region} --secret-id {secret} --query SecretString --output text | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"initial\"])'",
                      description="Prints the key the stack generated ('initial'); gptoss keys create gives each client its own")  # fmt: skip
        if endpoint_service is not None:
            CfnOutput(scope, "EndpointServiceName", value=endpoint_service, description="PrivateLink: the VPC endpoint service over the load balancer")
            CfnOutput(
                scope, "EndpointConsumerCommand",
                value=Fn.join("", [f"aws ec2 create-vpc-endpoint --region {region} --vpc-endpoint-type Interface --service-name ", endpoint_service,
                                   " --vpc-id <YOUR-VPC> --subnet-ids <YOUR-SUBNET-IN-" + config.availability_zone + "> --security-group-ids <YOUR-SG>"]),
                description="Run in the consumer's account (one of serving.endpoint.allowed_principals)"
                + ("; the operator then accepts it: aws ec2 accept-vpc-endpoint-connections" if e.acceptance_required else ""),
            )  # fmt: skip
        if own_alarm_topic is not None:
            CfnOutput(scope, "AlarmTopic", value=own_alarm_topic, description="The stack's topic: every alarm and every node replacement")
            CfnOutput(
                scope,
                "AlarmSubscribe",
                value=Fn.join("", [f"aws sns subscribe --region {region} --topic-arn ", own_alarm_topic,
                                   " --protocol email --notification-endpoint YOU@EXAMPLE.COM"]),
                description="Subscribe an address to the alarms (it confirms by mail); or deploy with observability.alarm_emails",
            )  # fmt: skip
