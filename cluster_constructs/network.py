"""The nodes' network: a new VPC with one private subnet in one AZ, or an existing one."""

from __future__ import annotations

import json

from aws_cdk import Acknowledgment, Aws, CfnResource, RemovalPolicy, Stack, Tags, Validations
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct

from clusterspec.config import ClusterConfig

# The interface endpoints given a policy (services that take one); ssmmessages and ec2messages, the
# Session Manager and Run Command channels, keep the default (their support is not verified here).
ENDPOINT_POLICY_SERVICES = frozenset({"ssm", "ec2", "autoscaling", "logs", "monitoring", "cloudformation"})


def ssm_agent_buckets(region: str) -> list[str]:
    """AWS-owned buckets the SSM agent reads on Linux (docs: "SSM Agent communications with AWS managed S3 buckets")."""
    return [f"aws-ssm-{region}", f"amazon-ssm-{region}", f"amazon-ssm-packages-{region}", f"{region}-birdwatcher-prod",
            f"aws-ssm-distributor-file-{region}", f"aws-ssm-document-attachments-{region}", f"patch-baseline-snapshot-{region}"]  # fmt: skip


class ClusterNetwork(Construct):
    """VPC, private subnet, egress (NAT or none) and the S3 gateway endpoint.

    L1 resources on purpose: the L2 `Vpc` looks the AZs up when the stack has a region, and
    synthesis must never call AWS. The nodes' subnet is private: "public IPs cannot be
    associated with multiple network interfaces", and every node has one per network card.
    """

    vpc_id: str
    subnet_id: str
    # What a node's first boot needs in place before the instance starts: its subnet's route
    # table association, the default route (NAT), the S3 gateway endpoint (the scripts asset and
    # the gate's handle) and the interface endpoints. The instances depend on them all.
    path: list[CfnResource]

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig) -> None:
        super().__init__(scope, construct_id)
        net = config.network
        region = Stack.of(self).region
        self.route_table_id: str | None = net.route_table_id
        self.interface_endpoints: list[ec2.CfnVPCEndpoint] = []
        self.path = []
        if net.existing:
            assert net.vpc_id and net.subnet_id
            self.vpc_id, self.subnet_id = net.vpc_id, net.subnet_id
        else:
            self._new_vpc(config)
        self.s3_gateway: ec2.CfnVPCEndpoint | None = None
        if net.s3_gateway_endpoint and self.route_table_id:
            self.s3_gateway = s3_gateway = ec2.CfnVPCEndpoint(
                self,
                "S3Gateway",
                vpc_id=self.vpc_id,
                service_name=f"com.amazonaws.{region}.s3",
                vpc_endpoint_type="Gateway",
                route_table_ids=[self.route_table_id],
            )
            self.path.append(s3_gateway)
        self.vpc = ec2.Vpc.from_vpc_attributes(
            self,
            "Imported",
            vpc_id=self.vpc_id,
            availability_zones=[config.availability_zone],
            vpc_cidr_block=None if net.existing else net.vpc_cidr,
        )

    def _new_vpc(self, config: ClusterConfig) -> None:
        net = config.network
        vpc = ec2.CfnVPC(self, "Vpc", cidr_block=net.vpc_cidr, enable_dns_hostnames=True, enable_dns_support=True)
        Tags.of(vpc).add("Name", config.cluster_name)
        subnet = ec2.CfnSubnet(
            self,
            "NodeSubnet",
            vpc_id=vpc.ref,
            cidr_block=net.subnet_cidr,
            availability_zone=config.availability_zone,
            map_public_ip_on_launch=False,
        )
        Tags.of(subnet).add("Name", f"{config.cluster_name}-nodes")
        table = ec2.CfnRouteTable(self, "NodeRoutes", vpc_id=vpc.ref)
        self.path.append(ec2.CfnSubnetRouteTableAssociation(self, "NodeRoutesAssoc", subnet_id=subnet.ref, route_table_id=table.ref))
        self.vpc_id, self.subnet_id, self.route_table_id = vpc.ref, subnet.ref, table.ref
        Validations.of(self).acknowledge(
            Acknowledgment(
                id="CloudFormation-Validate::W3010",
                reason="EFA nodes must share one subnet in one named AZ; the AZ is the availability_zone parameter.",
            )
        )
        if net.egress == "nat":
            igw = ec2.CfnInternetGateway(self, "Igw")
            attach = ec2.CfnVPCGatewayAttachment(self, "IgwAttach", vpc_id=vpc.ref, internet_gateway_id=igw.ref)
            public = ec2.CfnSubnet(
                self,
                "NatSubnet",
                vpc_id=vpc.ref,
                cidr_block=net.public_subnet_cidr,
                availability_zone=config.availability_zone,
                map_public_ip_on_launch=False,
            )
            public_table = ec2.CfnRouteTable(self, "NatRoutes", vpc_id=vpc.ref)
            ec2.CfnSubnetRouteTableAssociation(self, "NatRoutesAssoc", subnet_id=public.ref, route_table_id=public_table.ref)
            to_igw = ec2.CfnRoute(
                self, "NatDefault", route_table_id=public_table.ref, destination_cidr_block="0.0.0.0/0", gateway_id=igw.ref
            )
            to_igw.node.add_dependency(attach)
            eip = ec2.CfnEIP(self, "NatEip", domain="vpc")
            nat = ec2.CfnNatGateway(self, "Nat", subnet_id=public.ref, allocation_id=eip.attr_allocation_id)
            nat.node.add_dependency(to_igw)
            self.path.append(
                ec2.CfnRoute(self, "NodeDefault", route_table_id=table.ref, destination_cidr_block="0.0.0.0/0", nat_gateway_id=nat.ref)
            )
        if net.flow_logs:
            # Removed with the stack: `cdk destroy` leaves nothing behind (30 days of history).
            group = logs.LogGroup(
                self, "FlowLogs", retention=logs.RetentionDays.ONE_MONTH, removal_policy=RemovalPolicy.DESTROY
            )
            role = iam.Role(self, "FlowLogsRole", assumed_by=iam.ServicePrincipal("vpc-flow-logs.amazonaws.com"))
            group.grant_write(role)
            ec2.CfnFlowLog(
                self,
                "FlowLog",
                resource_id=vpc.ref,
                resource_type="VPC",
                traffic_type=net.flow_logs_traffic,
                log_destination_type="cloud-watch-logs",
                log_group_name=group.log_group_name,
                deliver_logs_permission_arn=role.role_arn,
            )

    def restrict_endpoints(self, *, buckets: list[str]) -> None:
        """Endpoint policies for a network without a route out (egress 'none'), where the endpoints are the
        nodes' only way to AWS: nothing but this account's principals, and through S3 nothing but the
        cluster's buckets, the deploy gate's signal and the SSM agent's buckets (a node's credentials,
        or anyone's brought onto it, cannot move data to another account's bucket or service)."""
        region, partition = Stack.of(self).region, Aws.PARTITION
        if self.s3_gateway is not None:
            stack = Stack.of(self)
            unique = list({json.dumps(stack.resolve(b), sort_keys=True): b for b in buckets}.values())  # the asset bucket once
            ours = [arn for b in unique for arn in (f"arn:{partition}:s3:::{b}", f"arn:{partition}:s3:::{b}/*")]
            self.s3_gateway.policy_document = iam.PolicyDocument(statements=[
                iam.PolicyStatement(
                    sid="TheClustersBucketsWithThisAccountsCredentials", principals=[iam.AnyPrincipal()],
                    actions=["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"], resources=ours,
                    conditions={"StringEquals": {"aws:PrincipalAccount": Aws.ACCOUNT_ID}},
                ),
                # The deploy gate's handle: a URL CloudFormation presigned for its own bucket.
                iam.PolicyStatement(
                    sid="TheDeployGatesSignal", principals=[iam.AnyPrincipal()], actions=["s3:PutObject"],
                    resources=[f"arn:{partition}:s3:::cloudformation-waitcondition-{region}/*"],
                ),
                # AWS's buckets the SSM agent reads on Linux (its updates, documents, packages).
                iam.PolicyStatement(
                    sid="TheSsmAgentsBuckets", principals=[iam.AnyPrincipal()], actions=["s3:GetObject"],
                    resources=[f"arn:{partition}:s3:::{b}/*" for b in ssm_agent_buckets(region)],
                ),
            ])  # fmt: skip
        for endpoint in self.interface_endpoints:
            if (endpoint.service_name or "").rpartition(".")[2] in ENDPOINT_POLICY_SERVICES:
                endpoint.policy_document = iam.PolicyDocument(statements=[iam.PolicyStatement(
                    sid="ThisAccountsPrincipals", principals=[iam.AnyPrincipal()], actions=["*"], resources=["*"],
                    conditions={"StringEquals": {"aws:PrincipalAccount": Aws.ACCOUNT_ID}},
                )])  # fmt: skip

    def add_interface_endpoints(self, services: tuple[str, ...], *, security_group_id: str) -> None:
        """Interface endpoints (SSM; CloudWatch Logs and metrics) when the nodes have no route out (egress 'none')."""
        region = Stack.of(self).region
        for name in services:
            self.interface_endpoints.append(
                ec2.CfnVPCEndpoint(
                    self,
                    f"{name.capitalize()}Endpoint",
                    vpc_id=self.vpc_id,
                    service_name=f"com.amazonaws.{region}.{name}",
                    vpc_endpoint_type="Interface",
                    private_dns_enabled=True,
                    subnet_ids=[self.subnet_id],
                    security_group_ids=[security_group_id],
                )
            )
            self.path.append(self.interface_endpoints[-1])
