"""The nodes' instance role: exactly what a node does, each statement with its reason (README 'Security').

No managed policy: AmazonSSMManagedInstanceCore would also grant ssm:GetParameter(s) on every
parameter of the account (SecureStrings under the default key included) to processes that run
vLLM as root, and no node reads Parameter Store (the image id is resolved by CloudFormation).
"""

from __future__ import annotations

from urllib.parse import urlparse

from aws_cdk import Acknowledgment, Stack, Validations
from aws_cdk import aws_iam as iam
from constructs import Construct

from clusterspec.config import ClusterConfig
from clusterspec.paths import cache_fleet_uri, cache_nodes_uri


def _bucket_prefix(uri: str) -> tuple[str, str]:
    u = urlparse(uri)
    return u.netloc, u.path.strip("/")


# The SSM agent's own calls for Session Manager and Run Command (`gptoss status`, `wait-ready`,
# `bench`, `save-cache`, the port forward): registering the instance, and its message channels.
# None reads data; none supports a narrower resource than "*" (ssmmessages, ec2messages) or the
# instance itself. State Manager associations, inventory and patching are not used.
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


def secret_resources(arn: str) -> list[str]:
    """The IAM resources of a secret given by its full ARN or by the partial one (no -XXXXXX suffix).

    IAM matches the secret's full ARN, which ends in '-' and six random characters; a partial
    ARN alone would match nothing, so its '-??????' form is granted too.
    """
    return [arn, f"{arn}-??????"]


def _objects(uri: str) -> str:
    """`bucket/prefix/*`: every object under an s3:// location."""
    bucket, prefix = _bucket_prefix(uri)
    return f"{bucket}/{prefix + '/' if prefix else ''}*"


class NodeRole(Construct):
    """Instance role and profile. No `*` action; object access scoped to the given prefixes."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig) -> None:
        super().__init__(scope, construct_id)
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description=f"{config.cluster_name} nodes: the SSM agent, and access to exactly the configured artifacts",
        )
        partition = Stack.of(self).partition
        # The SSM agent: no resource-level permissions to narrow (see SSM_AGENT_ACTIONS).
        self.role.add_to_policy(iam.PolicyStatement(actions=list(SSM_AGENT_ACTIONS), resources=["*"]))
        cache = config.compile_cache_s3_uri
        # Reads: the checkpoint and the examples when staged in S3, and of the compile cache only
        # what an operator promoted (fleet/): one node's upload is never read by another.
        reads = [config.model.s3_uri if config.model.source == "s3" else None, config.examples.s3_uri, cache_fleet_uri(cache) if cache else None]
        for uri in filter(None, reads):
            self._read_prefix(partition, uri)
        # Writes: benchmark results, and the node's own area of the compile cache (nodes/<role
        # id>:<instance id>, IAM's ${aws:userid} for an instance role): a node cannot write what
        # another node restores.
        writes = [config.results_s3_uri, f"{cache_nodes_uri(cache)}/${{aws:userid}}" if cache else None]
        for uri in filter(None, writes):
            self.role.add_to_policy(iam.PolicyStatement(actions=["s3:PutObject"], resources=[f"arn:{partition}:s3:::{_objects(uri)}"]))
        if config.kms_key_arns:
            # Buckets (and the token's secret) encrypted with a customer-managed key: decrypt what
            # the nodes read, make data keys for what they write; only these keys, and only when
            # S3 or Secrets Manager asks on the node's behalf.
            actions = ["kms:Decrypt"] + (["kms:GenerateDataKey"] if any(writes) else [])
            statement = iam.PolicyStatement(actions=actions, resources=list(config.kms_key_arns))
            services = ["s3"] + (["secretsmanager"] if config.model.hf_token_secret_arn else [])
            via = [f"{s}.{config.region}.amazonaws.com" for s in services]
            statement.add_condition("StringEquals", {"kms:ViaService": via if len(via) > 1 else via[0]})
            self.role.add_to_policy(statement)
        if config.model.hf_token_secret_arn:
            # The Hugging Face token: this one secret, by its full or partial ARN.
            self.role.add_to_policy(
                iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=secret_resources(config.model.hf_token_secret_arn))
            )
        self.profile = iam.CfnInstanceProfile(self, "Profile", roles=[self.role.role_name])
        Validations.of(self).acknowledge(
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-IAM5[Resource::*]",
                reason="The SSM agent's registration and message-channel calls (ssm:UpdateInstanceInformation, ssmmessages:*Channel, "
                "ec2messages:*Message) take no narrower resource; none reads data. Parameter Store: only the fleet's members parameter (routers), by its exact ARN. "
                "cloudwatch:PutMetricData (observability) is limited to the cluster's namespace by a condition.",
            )
        )
        if config.model.hf_token_secret_arn:
            Validations.of(self).acknowledge(
                Acknowledgment(
                    id=f"AwsSolutions::AwsSolutions-IAM5[Resource::{config.model.hf_token_secret_arn}-??????]",
                    reason="The one configured secret: IAM matches its full ARN, whose random six-character suffix a partial ARN lacks.",
                )
            )
        for location in sorted(set(filter(None, [*reads, *writes]))):
            path = _objects(location)
            Validations.of(self).acknowledge(
                Acknowledgment(
                    # cdk-nag writes the policy variable ${aws:userid} as <aws:userid> in the finding's id.
                    id=f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::{path.replace('${aws:userid}', '<aws:userid>')}]",
                    reason=f"Object access is limited to the configured prefix s3://{path}"
                    + (" (${aws:userid}: each node its own area)" if "${aws:userid}" in path else "")
                    + "; no action is a wildcard.",
                )
            )

    def allow_read(self, *object_arns: str) -> None:
        """Read the stack's own assets (the node scripts, the router wheel): their exact ARNs, no wildcard."""
        self.role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=list(object_arns)))

    def allow_get_parameter(self, parameter_arn: str) -> None:
        """Read one SSM parameter (the fleet's members): its exact ARN."""
        self.role.add_to_policy(iam.PolicyStatement(actions=["ssm:GetParameter"], resources=[parameter_arn]))

    def _read_prefix(self, partition: str, uri: str) -> None:
        bucket, prefix = _bucket_prefix(uri)
        self.role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[f"arn:{partition}:s3:::{_objects(uri)}"]))
        listing = iam.PolicyStatement(actions=["s3:ListBucket"], resources=[f"arn:{partition}:s3:::{bucket}"])
        if prefix:
            listing.add_condition("StringLike", {"s3:prefix": [prefix, f"{prefix}/*"]})
        self.role.add_to_policy(listing)
