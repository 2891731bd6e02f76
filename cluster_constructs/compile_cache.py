"""The compile cache's bucket, when the config names none: nodes save their compiled graphs here."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Duration, Names, RemovalPolicy, Validations
from aws_cdk import aws_s3 as s3
from constructs import Construct

from cluster_constructs.iam import CacheLocation
from clusterspec.config import ClusterConfig


class CompileCacheBucket(Construct):
    """A private, encrypted bucket of the stack's own: nodes/<node>/<toolchain key>/ (each node identity's
    uploads) and fleet/<toolchain key>/ (what an operator promotes).

    Deleted with the stack: CloudFormation deletes only an empty bucket, so `gptoss destroy`
    empties it first (a plain `cdk destroy` of a bucket that holds caches stops at it, and says so).
    """

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig) -> None:
        super().__init__(scope, construct_id)
        self.bucket = s3.Bucket(
            self,
            "Bucket",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            removal_policy=RemovalPolicy.DESTROY,
            # Versioned: a promotion or an upload that replaces a graph keeps the one before (30 days),
            # so a bad promotion can be rolled back and nothing a node overwrites is lost at once.
            versioned=True,
            lifecycle_rules=[
                s3.LifecycleRule(
                    noncurrent_version_expiration=Duration.days(30), abort_incomplete_multipart_upload_after=Duration.days(7)
                )
            ],
        )
        cfn = self.bucket.node.default_child
        assert isinstance(cfn, s3.CfnBucket)
        # The nodes' policies are in the cells (nested stacks), where the bucket's name is a parameter CDK
        # names after the bucket's unique id: cdk-nag writes it so in a finding's id.
        self.location = CacheLocation(uri=f"s3://{self.bucket.bucket_name}", nag=f"s3://<referenceto{Names.unique_id(cfn)}Ref>", own=True)
        Validations.of(self).acknowledge(
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-S1",
                reason="The compile cache holds compiled graphs the nodes wrote themselves; its writes are the nodes' own "
                "(one area each, by IAM) and CloudTrail data events can record them where policy asks for access logs.",
            )
        )
