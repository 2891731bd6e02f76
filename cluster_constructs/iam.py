"""The nodes' instance role: SSM, and read access to exactly the configured S3 prefixes."""

from __future__ import annotations

from urllib.parse import urlparse

from aws_cdk import Acknowledgment, Stack, Validations
from aws_cdk import aws_iam as iam
from constructs import Construct

from clusterspec.config import ClusterConfig


def _bucket_prefix(uri: str) -> tuple[str, str]:
    u = urlparse(uri)
    return u.netloc, u.path.strip("/")


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
            description=f"{config.cluster_name} nodes: SSM management and read access to the staged artifacts",
            managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name("AmazonSSMManagedInstanceCore")],
        )
        partition = Stack.of(self).partition
        reads = [config.model.s3_uri if config.model.source == "s3" else None, config.examples.s3_uri, config.compile_cache_s3_uri]
        for uri in filter(None, reads):
            self._read_prefix(partition, uri)
        # Writes: benchmark results, and the compile cache that `cluster.py save-cache` uploads.
        writes = [config.results_s3_uri, config.compile_cache_s3_uri]
        for uri in filter(None, writes):
            self.role.add_to_policy(iam.PolicyStatement(actions=["s3:PutObject"], resources=[f"arn:{partition}:s3:::{_objects(uri)}"]))
        if config.kms_key_arns:
            # Buckets encrypted with a customer-managed key: decrypt what the nodes read, and
            # make data keys for what they write; only through S3, only these keys.
            actions = ["kms:Decrypt"] + (["kms:GenerateDataKey"] if any(writes) else [])
            statement = iam.PolicyStatement(actions=actions, resources=list(config.kms_key_arns))
            statement.add_condition("StringEquals", {"kms:ViaService": f"s3.{config.region}.amazonaws.com"})
            self.role.add_to_policy(statement)
        if config.model.hf_token_secret_arn:
            self.role.add_to_policy(
                iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=[config.model.hf_token_secret_arn])
            )
        self.profile = iam.CfnInstanceProfile(self, "Profile", roles=[self.role.role_name])
        Validations.of(self).acknowledge(
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonSSMManagedInstanceCore]",
                reason="AmazonSSMManagedInstanceCore is the AWS-maintained policy of the SSM agent; its actions are "
                "explicit (no '*' action) and a copy would drift from AWS updates.",
            )
        )
        for location in sorted(set(filter(None, [*reads, *writes]))):
            path = _objects(location)
            Validations.of(self).acknowledge(
                Acknowledgment(
                    id=f"AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::{path}]",
                    reason=f"Object access is limited to the configured prefix s3://{path}; no action is a wildcard.",
                )
            )

    def allow_read(self, object_arn: str) -> None:
        """Read one object (the node scripts' asset): its exact ARN, no wildcard."""
        self.role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[object_arn]))

    def _read_prefix(self, partition: str, uri: str) -> None:
        bucket, prefix = _bucket_prefix(uri)
        self.role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=[f"arn:{partition}:s3:::{_objects(uri)}"]))
        listing = iam.PolicyStatement(actions=["s3:ListBucket"], resources=[f"arn:{partition}:s3:::{bucket}"])
        if prefix:
            listing.add_condition("StringLike", {"s3:prefix": [prefix, f"{prefix}/*"]})
        self.role.add_to_policy(listing)
