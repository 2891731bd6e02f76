"""The cluster security group: EFA to itself, and each serving port the spec opens."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import aws_ec2 as ec2
from constructs import Construct

from clusterspec.config import ClusterConfig
from clusterspec.layout import Layout
from node_render.command_lines import endpoint_port


@dataclass(frozen=True)
class PortRule:
    """One TCP range opened from the group itself."""

    description: str
    first: int
    last: int


def serving_rules(config: ClusterConfig, layout: Layout) -> list[PortRule]:
    """Every listener of the fleet, as the spec and the layout place them."""
    s = config.serving
    if not s.disaggregated:
        return [PortRule("server", s.server.port, s.server.port)]
    n = layout.max_replicas_per_node
    rules = [
        PortRule("proxy", s.proxy.port, s.proxy.port),
        PortRule(f"prefill HTTP, replicas 0-{n - 1}", s.prefill.http_port(0), s.prefill.http_port(n - 1)),
        PortRule("decode HTTP", s.decode.http_port, s.decode.http_port),
    ]
    rules += [PortRule(f"NIXL side channel, prefill replica {i}", *s.prefill.side_channel_range(i)) for i in range(n)]
    rules.append(PortRule("NIXL side channel, decode (every DP and TP rank)", *s.decode.side_channel_ports))
    return rules


class ClusterSecurityGroup(Construct):
    """Self-referencing all-traffic ingress and egress for EFA, plus the serving ports.

    EFA needs all traffic in *and* out to the group itself; a missing self egress rule makes
    the EFA handshake hang silently. The serving ports are also opened one by one from the
    group, so the rules say what listens where even though the EFA rule covers them.
    """

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig, layout: Layout, vpc: ec2.IVpc) -> None:
        super().__init__(scope, construct_id)
        self.group = ec2.SecurityGroup(
            self,
            "Group",
            vpc=vpc,
            description=f"{config.cluster_name}: EFA and serving traffic between the nodes",
            allow_all_outbound=False,
        )
        sg = self.group
        sg.add_ingress_rule(sg, ec2.Port.all_traffic(), "EFA: all traffic from the cluster itself")
        sg.add_egress_rule(sg, ec2.Port.all_traffic(), "EFA: all traffic to the cluster itself")
        # Staging (S3, Hugging Face, git) and the SSM agent speak HTTPS only. Without a route out
        # (egress none) the interface endpoints are in this group (the rule above), so HTTPS needs
        # to reach S3 alone: its prefix list when the operator names it (preflight finds it).
        if config.network.s3_prefix_list_id:
            sg.add_egress_rule(ec2.Peer.prefix_list(config.network.s3_prefix_list_id), ec2.Port.tcp(443), "HTTPS: S3 (gateway endpoint) only")
        else:
            sg.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(443), "HTTPS: S3, SSM, model and examples downloads")
        for rule in serving_rules(config, layout):
            port = ec2.Port.tcp(rule.first) if rule.first == rule.last else ec2.Port.tcp_range(rule.first, rule.last)
            sg.add_ingress_rule(sg, port, rule.description)
        proxy = ec2.Port.tcp(endpoint_port(config))
        if config.load_balanced:
            # Behind the NLB the operator network reaches the NLB only (its own group): a node's
            # proxy port opened to it as well would be a way around the NLB to any one router.
            return
        if config.proxy_ingress_cidr:
            sg.add_ingress_rule(ec2.Peer.ipv4(config.proxy_ingress_cidr), proxy, "proxy, from the operator network")
        if config.proxy_ingress_prefix_list_id:
            sg.add_ingress_rule(
                ec2.Peer.prefix_list(config.proxy_ingress_prefix_list_id), proxy, "proxy, from the operator prefix list"
            )

