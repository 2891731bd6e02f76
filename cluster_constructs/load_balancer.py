"""One client endpoint for a fleet with several proxies: an internal Network Load Balancer."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Annotations, Duration, Validations
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from constructs import Construct

from clusterspec.config import ClusterConfig

# The idle timeout of a Network Load Balancer's TLS listener, which cannot be changed (a TCP listener's can).
TLS_IDLE_TIMEOUT_S = 350


class ProxyLoadBalancer(Construct):
    """Internal NLB over every proxy or router, checking that each can serve.

    A router is checked on its readiness route (ready while one prefill and one decode server
    answer). The example proxy answers /healthcheck as long as its process runs, even when the servers
    behind it are dead. The target group checks the project's group health route instead
    (gptoss-group-health: ready only when the proxy, its decode server and its prefill
    replicas answer), so a broken group leaves the rotation and returns when it heals.
    Client IP preservation is off: with it on, an NLB drops a connection a target opens to the
    NLB that is routed back to that same target, which is what the SSM port forward through a
    proxy node does one time in N.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        vpc: ec2.IVpc,
        subnet_id: str,
        route_table_id: str | None,
        cluster_group: ec2.SecurityGroup,
    ) -> None:
        super().__init__(scope, construct_id)
        port = config.serving.proxy.port
        subnet = ec2.Subnet.from_subnet_attributes(
            self, "Subnet", subnet_id=subnet_id, availability_zone=config.availability_zone, route_table_id=route_table_id
        )
        self.group = ec2.SecurityGroup(
            self, "Group", vpc=vpc, description=f"{config.cluster_name}: proxy load balancer", allow_all_outbound=False
        )
        self.group.add_egress_rule(cluster_group, ec2.Port.tcp(port), "to the proxies")
        cluster_group.add_ingress_rule(self.group, ec2.Port.tcp(port), "proxy, from the load balancer")
        # The toy proxy's /healthcheck answers while its servers are dead: the NLB checks the
        # project's group route. The router's own readiness already says whether it can serve.
        routed = config.proxy_kind == "vllm-router"
        health_port, health_path = config.endpoint_health_check
        if not routed:
            cluster_group.add_ingress_rule(self.group, ec2.Port.tcp(health_port), "group health check, from the load balancer")
            self.group.add_egress_rule(cluster_group, ec2.Port.tcp(health_port), "health checks of the proxies' groups")
        # A node's SSM port forward (and bench) opens connections to the NLB: in at the NLB, out of the cluster.
        self.group.add_ingress_rule(cluster_group, ec2.Port.tcp(port), "proxy endpoint, from the cluster (SSM forward, bench)")
        cluster_group.add_egress_rule(self.group, ec2.Port.tcp(port), "to the proxy endpoint (SSM forward, bench)")
        endpoint = config.serving.endpoint
        # With a certificate, the operator's network reaches the TLS port alone; the plain one stays for the cluster's own
        # nodes (the SSM port forward), or is gone.
        client_port = endpoint.tls_port if endpoint.certificate_arn else port
        if endpoint.certificate_arn:
            self.group.add_ingress_rule(cluster_group, ec2.Port.tcp(client_port), "TLS endpoint, from the cluster (SSM forward)")
            cluster_group.add_egress_rule(self.group, ec2.Port.tcp(client_port), "to the TLS endpoint (SSM forward)")
        if config.proxy_ingress_cidr:
            self.group.add_ingress_rule(ec2.Peer.ipv4(config.proxy_ingress_cidr), ec2.Port.tcp(client_port), "from the operator network")
        if config.proxy_ingress_prefix_list_id:
            self.group.add_ingress_rule(
                ec2.Peer.prefix_list(config.proxy_ingress_prefix_list_id), ec2.Port.tcp(client_port), "from the operator prefix list"
            )
        self.nlb = elbv2.NetworkLoadBalancer(
            self,
            "Nlb",
            vpc=vpc,
            internet_facing=False,
            vpc_subnets=ec2.SubnetSelection(subnets=[subnet]),
            security_groups=[self.group],
            cross_zone_enabled=False,
            # PrivateLink: a consumer's interface endpoint connects from addresses of the consumer's VPC, which no rule
            # here can name; who may connect is the endpoint service's allowed principals (and each key at the gate).
            enforce_security_group_inbound_rules_on_private_link_traffic=False if endpoint.allowed_principals else None,
        )
        # A TCP flow the NLB sees idle for its idle timeout (350 s by default) is cut; a request may run
        # for the router's request timeout (1,800 s by default) before its first byte: the listener waits
        # that long and 30 s more (at most the NLB's 6,000 s).
        idle_s = min(6000, max(350, config.serving.proxy.router.request_timeout_s + 30))
        listeners: list[elbv2.NetworkListener] = []
        if endpoint.plain_port:
            listeners.append(self.nlb.add_listener("Proxy", port=port, protocol=elbv2.Protocol.TCP))
        if endpoint.certificate_arn:
            # TLS ends here (the operator's ACM certificate, TLS 1.3/1.2 only); the nodes are reached in the VPC as before.
            tls = self.nlb.add_listener(
                "Tls", port=endpoint.tls_port, protocol=elbv2.Protocol.TLS,
                certificates=[elbv2.ListenerCertificate.from_arn(endpoint.certificate_arn)],
            )  # fmt: skip
            cfn_tls = tls.node.default_child
            assert isinstance(cfn_tls, elbv2.CfnListener)
            cfn_tls.add_property_override("SslPolicy", endpoint.tls_policy)
            listeners.append(tls)
        # The TLS listener's idle timeout is 350 s and cannot be changed (ELB: "Update the TCP idle timeout"): the synth
        # says so when a request may be silent longer (gptoss:tls-idle-timeout).
        for listener in listeners[:1] if endpoint.plain_port else []:
            cfn_listener = listener.node.default_child
            assert isinstance(cfn_listener, elbv2.CfnListener)
            cfn_listener.add_property_override("ListenerAttributes", [{"Key": "tcp.idle_timeout.seconds", "Value": str(idle_s)}])
        if endpoint.certificate_arn and config.serving.proxy.router.request_timeout_s > TLS_IDLE_TIMEOUT_S:
            Annotations.of(self).add_warning_v2(
                "gptoss:tls-idle-timeout",
                f"the load balancer's TLS listener cuts a connection silent for {TLS_IDLE_TIMEOUT_S} s (fixed by AWS), and a request "
                f"may run {config.serving.proxy.router.request_timeout_s} s (serving.proxy.router.request_timeout_s): a client over TLS "
                f"streams (stream=true sends each token as it comes), or its non-streamed requests end within {TLS_IDLE_TIMEOUT_S} s.",
            )
        if not endpoint.certificate_arn:
            Annotations.of(self).add_warning_v2(
                "gptoss:plain-endpoint",
                "the endpoint is plain HTTP inside the VPC: prompts, answers and API keys cross the network in clear text. "
                "For TLS give an ACM certificate: -c serving.endpoint.certificate_arn=arn:aws:acm:...",
            )
        drain_s = min(3600, config.serving.proxy.router.request_timeout_s)  # the deregistration delay's maximum
        # No fixed targets: each proxy node's Auto Scaling group registers whichever instance holds the
        # node now (a replacement joins, the instance it replaces leaves).
        self.target_group = elbv2.NetworkTargetGroup(
            self,
            "Proxies",
            vpc=vpc,
            port=port,
            protocol=elbv2.Protocol.TCP,
            target_type=elbv2.TargetType.INSTANCE,
            health_check=elbv2.HealthCheck(
                protocol=elbv2.Protocol.HTTP,
                port=str(health_port),
                path=health_path,
                interval=Duration.seconds(10),
                healthy_threshold_count=2,
                unhealthy_threshold_count=2,
            ),
            # A target that leaves (deregistered, or unhealthy: a router going lame-duck before its restart)
            # keeps its connections until its requests end, within the router's request timeout.
            deregistration_delay=Duration.seconds(drain_s),
            preserve_client_ip=False,
        )
        # An unhealthy target's connections are not reset (the default resets every one): they drain
        # for the request timeout (target_health_state.unhealthy.*, FACTS: 0-360,000 s).
        self.target_group.set_attribute("target_health_state.unhealthy.connection_termination.enabled", "false")
        self.target_group.set_attribute(
            "target_health_state.unhealthy.draining_interval_seconds", str(config.serving.proxy.router.request_timeout_s)
        )
        for listener in listeners:
            listener.add_target_groups("Proxies", self.target_group)
        self.dns_name = self.nlb.load_balancer_dns_name
        self.service: ec2.VpcEndpointService | None = None
        if endpoint.allowed_principals:
            # PrivateLink: clients in other VPCs and accounts create an interface endpoint to this service.
            self.service = ec2.VpcEndpointService(
                self, "Service", vpc_endpoint_service_load_balancers=[self.nlb], acceptance_required=endpoint.acceptance_required,
                allowed_principals=[iam.ArnPrincipal(p) for p in endpoint.allowed_principals],
            )  # fmt: skip
        Validations.of(self).acknowledge(
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-ELB2",
                reason="The internal NLB only spreads TCP connections over the proxies, which log every request "
                "to journald and the results directory; add an access-log bucket if policy requires it.",
            )
        )
