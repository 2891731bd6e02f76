"""The nodes' permissions: exactly what a node does, each statement with its reason (docs/design.md 'Security defaults').

What every node does is one policy, attached to every node's role (NodePolicy). What only one
node may do is in that node's own role (NodeIdentityRole): writing its own area of the compile
cache, and marking its own instance unhealthy, which names its own Auto Scaling group and no
other. A node identity's role outlives its instances: a replacement has the same permissions.

No managed policy: AmazonSSMManagedInstanceCore would also grant ssm:GetParameter(s) on every
parameter of the account (SecureStrings under the default key included) to processes that run
vLLM as root; a router node reads one parameter, the fleet's router settings, and no other node
reads Parameter Store (the image id is resolved by CloudFormation).
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Acknowledgment, ArnFormat, Aws, Stack, Validations
from aws_cdk import aws_iam as iam
from constructs import Construct

from cluster_constructs.api_keys import keys_secret_resources
from clusterspec.config import ClusterConfig
from clusterspec.names import holder_name
from node_render import telemetry


def _bucket_prefix(uri: str) -> tuple[str, str]:
    """(bucket, prefix) of an s3:// location; the bucket may be a token (the stack's own bucket)."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


# The SSM agent's own calls for Session Manager and Run Command (`gptoss status`, `wait-ready`,
# `bench`, `save-cache`, the port forward): registering the instance, and its message channels.
# None reads data; none supports a narrower resource than "*" (ssmmessages, ec2messages) or the
# instance itself. Inventory and patching are not used.
SSM_AGENT_ACTIONS = (  # sorted, as the CDK CLI's policy minimization writes them
    "ec2messages:AcknowledgeMessage",
    "ec2messages:DeleteMessage",
    "ec2messages:FailMessage",
    "ec2messages:GetEndpoint",
    "ec2messages:GetMessages",
    "ec2messages:SendReply",
    "ssm:UpdateInstanceInformation",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
)


# The SSM agent's calls for State Manager associations (rollout.software=in-place): the associations
# of its own instance, their status and compliance. AmazonSSMManagedInstanceCore grants these with
# every parameter of the account; these alone are granted here.
STATE_MANAGER_AGENT_ACTIONS = (
    "ssm:DescribeAssociation",
    "ssm:ListInstanceAssociations",
    "ssm:PutComplianceItems",
    "ssm:UpdateInstanceAssociationStatus",
)


def secret_resources(arn: str) -> list[str]:
    """The IAM resources of a secret given by its full ARN or by the partial one (no -XXXXXX suffix).

    IAM matches the secret's full ARN, which ends in '-' and six random characters; a partial
    ARN alone would match nothing, so its '-??????' form is granted too.
    """
    return [arn, f"{arn}-??????"]


def in_account(statement: iam.PolicyStatement) -> iam.PolicyStatement:
    """`statement`, holding only while the bucket belongs to this account (s3:ResourceAccount): a bucket
    of the stack's that is deleted and re-created by someone else under its name is not trusted."""
    statement.add_condition("StringEquals", {"s3:ResourceAccount": Aws.ACCOUNT_ID})
    return statement


def _objects(uri: str) -> str:
    """`bucket/prefix/*`: every object under an s3:// location."""
    bucket, prefix = _bucket_prefix(uri)
    return f"{bucket}/{prefix + '/' if prefix else ''}*"


@dataclass(frozen=True)
class CacheLocation:
    """The compile cache: its s3:// URI (a token when it is the stack's bucket) and the form cdk-nag
    writes it in a finding's id (a Ref of the bucket as <logical id>)."""

    uri: str
    nag: str
    # The stack's own bucket: every grant on it also requires that the bucket is this account's.
    own: bool = False

    def nag_form(self, text: str) -> str:
        """`text` with the URI's bucket as cdk-nag writes it."""
        return text.replace(_bucket_prefix(self.uri)[0], _bucket_prefix(self.nag)[0])


def holder_arn(config: ClusterConfig, node: str) -> str:
    """The ARN pattern of a node identity's Auto Scaling group (its id part is EC2's, not known at synth)."""
    return f"arn:{Aws.PARTITION}:autoscaling:{config.region}:{Aws.ACCOUNT_ID}:autoScalingGroup:*:autoScalingGroupName/{holder_name(config.cluster_name, node)}"


class NodePolicy(Construct):
    """What every node does, in one policy attached to every node's role. No `*` action."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        cache: CacheLocation | None,
        scripts_arn: str,
        software_parameter_arn: str | None = None,
        software_document_arn: str | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        self.config = config
        cache_uri = cache.uri if cache else None
        self.policy = iam.Policy(self, "Policy")
        stack = Stack.of(self)
        partition = stack.partition
        # The SSM agent: no resource-level permissions to narrow (see SSM_AGENT_ACTIONS).
        self.add(iam.PolicyStatement(actions=list(SSM_AGENT_ACTIONS), resources=["*"]))
        # Every node's software: the stack's asset, its one key (the current version's).
        self.add(in_account(iam.PolicyStatement(actions=["s3:GetObject"], resources=[scripts_arn])))
        if software_parameter_arn:
            # Which software version is current (gptoss-fetch-scripts, at boot): this one String parameter.
            self.add(iam.PolicyStatement(actions=["ssm:GetParameter"], resources=[software_parameter_arn]))
        if software_document_arn:
            # rollout.software=in-place: State Manager's association of the node's role (the agent lists and
            # reports the associations of its own instance, which has no resource to narrow them to) and the
            # one document it runs (gptoss-apply).
            self.add(iam.PolicyStatement(actions=list(STATE_MANAGER_AGENT_ACTIONS), resources=["*"]))
            self.add(iam.PolicyStatement(actions=["ssm:DescribeDocument", "ssm:GetDocument"], resources=[software_document_arn]))
        if config.observability.enabled:
            # The collector: streams in the cluster's one log group (each node writes only its own: its
            # role), metrics of the cluster's own namespace only.
            group = telemetry.log_group(config)
            group_arn = stack.format_arn(service="logs", resource="log-group", resource_name=f"{group}:*", arn_format=ArnFormat.COLON_RESOURCE_NAME)
            self.add(iam.PolicyStatement(actions=["logs:CreateLogStream"], resources=[group_arn]))
            metrics = iam.PolicyStatement(actions=["cloudwatch:PutMetricData"], resources=["*"])
            metrics.add_condition("StringEquals", {"cloudwatch:namespace": telemetry.namespace(config)})
            self.add(metrics)
            if config.capacity.type == "capacity-block":
                # The block's end date, for the alarms before it (EC2's Describe calls take no resource).
                self.add(iam.PolicyStatement(actions=["ec2:DescribeCapacityReservations"], resources=["*"]))
            self.acknowledge(
                f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:logs:{config.region}:<AWS::AccountId>:log-group:{group}:*]",
                "Nodes create streams in the cluster's one log group, no other group (CreateLogStream takes the group as its "
                "resource); each node writes only its own streams (node/unit, its role's PutLogEvents).",
            )
        # Reads: the checkpoint and the examples when staged in S3, and of the compile cache only
        # what an operator promoted (fleet/): one node's upload is read by no other node.
        self.reads = [config.model.s3_uri if config.model.source == "s3" else None, config.examples.s3_uri]
        for uri in filter(None, self.reads):
            self.read_prefix(partition, uri)
        if cache:
            self.read_prefix(partition, f"{cache.uri}/fleet", own=cache.own)
        # Writes: benchmark results.
        self.writes = [config.results_s3_uri]
        for uri in filter(None, self.writes):
            self.add(iam.PolicyStatement(actions=["s3:PutObject"], resources=[f"arn:{partition}:s3:::{_objects(uri)}"]))
        if config.kms_key_arns:
            # Buckets (and the token's secret) encrypted with a customer-managed key: decrypt what
            # the nodes read, make data keys for what they write; only these keys, and only when
            # S3 or Secrets Manager asks on the node's behalf.
            writes = any(self.writes) or cache_uri is not None
            actions = ["kms:Decrypt"] + (["kms:GenerateDataKey"] if writes else [])
            statement = iam.PolicyStatement(actions=actions, resources=list(config.kms_key_arns))
            services = ["s3"] + (["secretsmanager"] if config.model.hf_token_secret_arn or config.serving.endpoint.keys_secret_arn else [])
            via = [f"{s}.{config.region}.amazonaws.com" for s in services]
            statement.add_condition("StringEquals", {"kms:ViaService": via if len(via) > 1 else via[0]})
            self.add(statement)
        if config.model.hf_token_secret_arn:
            # The Hugging Face token: this one secret, by its full or partial ARN.
            self.add(iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=secret_resources(config.model.hf_token_secret_arn)))
        self.acknowledge(
            "AwsSolutions::AwsSolutions-IAM5[Resource::*]",
            "The SSM agent's registration and message-channel calls (ssm:UpdateInstanceInformation, ssmmessages:*Channel, "
            "ec2messages:*Message) take no narrower resource; none reads data. cloudwatch:PutMetricData (observability) is "
            "limited to the cluster's namespace by a condition. ec2:DescribeCapacityReservations (a Capacity Block's end, "
            "for the alarms before it) takes no resource.",
        )
        if config.model.hf_token_secret_arn:
            self.acknowledge(
                f"AwsSolutions::AwsSolutions-IAM5[Resource::{config.model.hf_token_secret_arn}-??????]",
                "The one configured secret: IAM matches its full ARN, whose random six-character suffix a partial ARN lacks.",
            )
        if cache:
            path = _objects(f"{cache.uri}/fleet")
            self.acknowledge(
                f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::{cache.nag_form(path)}]",
                "Nodes read only the compile cache's fleet/ area (what an operator promoted); no action is a wildcard.",
            )
        for location in sorted(set(filter(None, [*self.reads, *self.writes]))):
            path = _objects(location)
            self.acknowledge(
                f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::{path}]",
                f"Object access is limited to the configured prefix s3://{path}; no action is a wildcard.",
            )

    def add(self, statement: iam.PolicyStatement) -> None:
        """A statement every node needs."""
        self.policy.add_statements(statement)

    def acknowledge(self, finding: str, reason: str) -> None:
        """A cdk-nag finding of this policy, acknowledged where it arises."""
        Validations.of(self).acknowledge(Acknowledgment(id=finding, reason=reason))

    def read_prefix(self, partition: str, uri: str, *, own: bool = False) -> None:
        """GetObject under an s3:// location, and ListBucket only with that prefix (and, for a bucket of
        the stack's, only while it is this account's)."""
        bucket, prefix = _bucket_prefix(uri)
        read = iam.PolicyStatement(actions=["s3:GetObject"], resources=[f"arn:{partition}:s3:::{_objects(uri)}"])
        listing = iam.PolicyStatement(actions=["s3:ListBucket"], resources=[f"arn:{partition}:s3:::{bucket}"])
        if prefix:
            listing.add_condition("StringLike", {"s3:prefix": [prefix, f"{prefix}/*"]})
        for statement in (read, listing):
            self.add(in_account(statement) if own else statement)


class NodeIdentityRole(Construct):
    """One node identity's role and instance profile: the shared policy, plus what only this node may do."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        node: str,
        shared: NodePolicy,
        cache: CacheLocation | None,
        reads_members: bool,
        router_object_arns: tuple[str, ...],
        router_fleet_arn: str | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        partition = Stack.of(self).partition
        cache_uri = cache.uri if cache else None
        statements: list[iam.PolicyStatement] = []
        if config.observability.enabled:
            # The collector writes this node's own streams only (node/journal; node/<unit> by a collector of an earlier release
            # until its node applies this one): no node writes another's log.
            stream = f"{telemetry.log_group(config)}:log-stream:{node}/*"
            statements.append(iam.PolicyStatement(actions=["logs:PutLogEvents"], resources=[
                f"arn:{partition}:logs:{config.region}:{Aws.ACCOUNT_ID}:log-group:{stream}"]))  # fmt: skip
        if config.healing.report_unhealthy:
            # gptoss-health-watch: the replacement budget (Auto Scaling's record of the cluster's terminations;
            # no narrower resource exists), then mark this node's own instance unhealthy; its group is the only one named.
            statements.append(iam.PolicyStatement(actions=["autoscaling:DescribeScalingActivities"], resources=["*"]))
            statements.append(iam.PolicyStatement(actions=["autoscaling:SetInstanceHealth"], resources=[holder_arn(config, node)]))
        if cache_uri:
            # This identity's own area of the compile cache: what it saves, what its replacements restore.
            own = f"{cache_uri}/nodes/{node}"
            bucket, prefix = _bucket_prefix(own)
            area = iam.PolicyStatement(actions=["s3:DeleteObject", "s3:GetObject", "s3:PutObject"], resources=[f"arn:{partition}:s3:::{_objects(own)}"])
            listing = iam.PolicyStatement(actions=["s3:ListBucket"], resources=[f"arn:{partition}:s3:::{bucket}"])
            listing.add_condition("StringLike", {"s3:prefix": [prefix, f"{prefix}/*"]})
            statements += [in_account(area), in_account(listing)] if cache and cache.own else [area, listing]
        if reads_members:
            # gptoss-members: the fleet's running instances by tag, and when two run for one node (a surge), which
            # one its group is terminating (neither Describe* has a narrower resource).
            statements.append(iam.PolicyStatement(actions=["autoscaling:DescribeAutoScalingInstances", "ec2:DescribeInstances"], resources=["*"]))
        if config.wait_for_ready:
            # gptoss-signal: its verdict to this node's own group in its own stack (the cell, by its id), which it
            # finds in its instance's aws:cloudformation:* tags (a surge, or a rollback's replacement, waits for it),
            # and whether its gate was answered already (a replacement does not answer it again). Whatever the
            # rollout's policy: a policy change then changes no node's grants.
            statements.append(iam.PolicyStatement(actions=["ec2:DescribeTags"], resources=["*"]))
            statements.append(iam.PolicyStatement(actions=["cloudformation:DescribeStackResource", "cloudformation:SignalResource"],
                                                  resources=[Stack.of(self).stack_id]))  # fmt: skip
        if router_object_arns:
            # The router's pinned wheel and the API gate's pinned packages (the stack's assets), by their exact ARNs.
            statements.append(in_account(iam.PolicyStatement(actions=["s3:GetObject"], resources=list(router_object_arns))))
        if router_fleet_arn:
            # The fleet's router settings and pool (gptoss-members): this one parameter, a String (no key to decrypt).
            statements.append(iam.PolicyStatement(actions=["ssm:GetParameter"], resources=[router_fleet_arn]))
        keys = bool(router_fleet_arn) and config.endpoint_auth == "keys"
        if keys:
            # The API keys (gptoss-keys, on the router nodes alone): this one secret.
            statements.append(iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=keys_secret_resources(config)))
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description=f"{config.cluster_name} {node}: the nodes' shared policy and what only this node may do",
            inline_policies={"Node": iam.PolicyDocument(statements=statements)} if statements else None,
        )
        shared.policy.attach_to_role(self.role)
        self.profile = iam.CfnInstanceProfile(self, "Profile", roles=[self.role.role_name])
        if config.observability.enabled:
            self.acknowledge(
                f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:logs:{config.region}:<AWS::AccountId>:log-group:"
                f"{telemetry.log_group(config)}:log-stream:{node}/*]",
                f"Only this node's own log streams ({node}/journal, and {node}/<unit> of an earlier release's collector) in the cluster's log group; no other node's.",
            )
        if keys:
            for resource in keys_secret_resources(config):
                if resource.endswith("??????"):
                    self.acknowledge(
                        "AwsSolutions::AwsSolutions-IAM5[Resource::"
                        + resource.replace(Aws.PARTITION, "<AWS::Partition>").replace(Aws.ACCOUNT_ID, "<AWS::AccountId>") + "]",
                        "The cluster's one secret of API keys: IAM matches its full ARN, whose random six-character suffix its name lacks.",
                    )
        if config.healing.report_unhealthy:
            self.acknowledge(
                f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:autoscaling:{config.region}:<AWS::AccountId>:autoScalingGroup:*:"
                f"autoScalingGroupName/{holder_name(config.cluster_name, node)}]",
                "The '*' is the group's id, which EC2 assigns; the group is named: this node's own, no other.",
            )
        if cache:
            self.acknowledge(
                f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::{cache.nag_form(_objects(f'{cache.uri}/nodes/{node}'))}]",
                f"Only this node identity's own area of the compile cache ({node}); no other node reads it.",
            )
        wide = ([("ec2:DescribeInstances and autoscaling:DescribeAutoScalingInstances", "the node reads the fleet's members (instances by tag, "
                  "and which of two is leaving) with them")] if reads_members else []) + (
            [("ec2:DescribeTags", "the node reads its own instance's aws:cloudformation tags (its group, for its signal) with it")]
            if config.wait_for_ready else []) + (
            [("autoscaling:DescribeScalingActivities", "the health watch counts the cluster's recent replacements (its budget) with it")]
            if config.healing.report_unhealthy else [])  # fmt: skip
        if wide:
            self.acknowledge(
                "AwsSolutions::AwsSolutions-IAM5[Resource::*]",
                "; ".join(f"{action} takes no narrower resource: {why}" for action, why in wide) + "; neither reads data.",
            )

    def acknowledge(self, finding: str, reason: str) -> None:
        """A cdk-nag finding of this role, acknowledged where it arises."""
        Validations.of(self).acknowledge(Acknowledgment(id=finding, reason=reason))
