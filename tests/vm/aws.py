"""The cluster's AWS in the VM scenarios: one moto server on the host, which every guest reaches.

A guest's AWS_ENDPOINT_URL is http://10.0.2.100:5000; QEMU's guestfwd relays each connection to
it (socat) to this server, so every node of the cluster sees one S3, one EC2, one Auto Scaling,
one CloudWatch: what one node saves (its compile cache) another instance of its identity finds,
and the members a router reads are the instances the harness runs for the nodes. The harness
plays what AWS would do around the nodes: it puts the stack's assets in S3, runs an EC2
instance record (with the identity tags and the VM's address) for each VM and attaches it to
its node's group, and terminates the record when it destroys the VM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3

from tests.local_moto import MotoServer

REGION = "us-east-2"
ASSET_BUCKET = "gptoss-vm-assets"
# The cluster's compile cache: a bucket of the stack's own (deploy.env names it).
CACHE_BUCKET = "gptoss-vm-compile-cache"
SUBNET_CIDR = "10.42.0.0/20"


class HostAws:
    """A moto server on a loopback port of the host, and what the harness does in it."""

    def __init__(self, workdir: Path, cluster: str) -> None:
        self.cluster = cluster
        self.server = MotoServer(workdir / "moto.log", host="127.0.0.1")
        self.port, self.url = self.server.port, self.server.url
        for bucket in (ASSET_BUCKET, CACHE_BUCKET):
            self.client("s3").create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": REGION})
        ec2 = self.client("ec2")
        vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
        self.subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=SUBNET_CIDR, AvailabilityZone=f"{REGION}a")["Subnet"]["SubnetId"]
        self.image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]

    def client(self, name: str) -> Any:
        return boto3.client(name, endpoint_url=self.url, region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing")

    def stop(self) -> None:
        self.server.stop()

    # ---- what the stack makes ---------------------------------------------------------------

    def put(self, uri: str, body: bytes) -> None:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        self.client("s3").put_object(Bucket=bucket, Key=key, Body=body)

    def delete(self, uri: str) -> None:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        self.client("s3").delete_object(Bucket=bucket, Key=key)

    def keys(self, uri: str) -> list[str]:
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        pages = self.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def log_group(self, name: str) -> None:
        logs = self.client("logs")
        if name not in {g["logGroupName"] for g in logs.describe_log_groups()["logGroups"]}:
            logs.create_log_group(logGroupName=name)

    def secret(self, name: str, value: str) -> None:
        sm = self.client("secretsmanager")
        if not sm.list_secrets(Filters=[{"Key": "name", "Values": [name]}])["SecretList"]:
            sm.create_secret(Name=name, SecretString=value)

    # ---- what EC2 and Auto Scaling do for the nodes -------------------------------------------

    def launch(self, node: str, role: str, ip: str) -> str:
        """The instance that now holds `node`: its record with the identity tags and its address,
        in its node's group (made on first use); returns its instance id."""
        ec2, autoscaling = self.client("ec2"), self.client("autoscaling")
        tags = [{"Key": "gptoss:cluster", "Value": self.cluster}, {"Key": "gptoss:role", "Value": role}, {"Key": "gptoss:node", "Value": node}]
        (instance,) = ec2.run_instances(ImageId=self.image, MinCount=1, MaxCount=1, SubnetId=self.subnet, PrivateIpAddress=ip,
                                        TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])["Instances"]  # fmt: skip
        group = f"{self.cluster}-{node}"
        if not autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"]:
            template = ec2.create_launch_template(LaunchTemplateName=group, LaunchTemplateData={"ImageId": self.image})
            autoscaling.create_auto_scaling_group(
                AutoScalingGroupName=group, MinSize=0, MaxSize=1, DesiredCapacity=0, VPCZoneIdentifier=self.subnet,
                LaunchTemplate={"LaunchTemplateId": template["LaunchTemplate"]["LaunchTemplateId"]},
            )  # fmt: skip
        autoscaling.attach_instances(AutoScalingGroupName=group, InstanceIds=[instance["InstanceId"]])
        return str(instance["InstanceId"])

    def terminate(self, instance_id: str) -> None:
        """The instance is gone (destroyed, or replaced by its group)."""
        autoscaling = self.client("autoscaling")
        groups = autoscaling.describe_auto_scaling_instances(InstanceIds=[instance_id])["AutoScalingInstances"]
        for g in groups:
            autoscaling.detach_instances(AutoScalingGroupName=g["AutoScalingGroupName"], InstanceIds=[instance_id], ShouldDecrementDesiredCapacity=True)
        self.client("ec2").terminate_instances(InstanceIds=[instance_id])

    def health(self, instance_id: str) -> str:
        """The instance's health in its group (Healthy, or Unhealthy once the node reported itself)."""
        (i,) = self.client("autoscaling").describe_auto_scaling_instances(InstanceIds=[instance_id])["AutoScalingInstances"]
        return str(i["HealthStatus"])
