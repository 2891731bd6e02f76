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

import json
from pathlib import Path
from typing import Any

import boto3

from tests.local_moto import MotoServer

REGION = "us-east-2"
ASSET_BUCKET = "gptoss-vm-assets"
# The cluster's compile cache: a bucket of the stack's own (deploy.env names it).
CACHE_BUCKET = "gptoss-vm-compile-cache"
SUBNET_CIDR = "10.42.0.0/20"
# What CloudFormation tags a group's instances with (the stack's name, the group's logical id).
STACK = "GptOss8k1kStack"


def group_logical_id(node: str) -> str:
    """A node's group's logical id, as the CDK makes one (a name and a hash)."""
    return f"{node.replace('-', '').title()}Group0A1B2C3D"


class HostAws:
    """A moto server on a loopback port of the host, and what the harness does in it."""

    def __init__(self, workdir: Path, cluster: str) -> None:
        self.cluster = cluster
        # CloudFormation's SignalResource, which moto lacks, is accepted and recorded there (a surge's signal).
        self.signals_file = workdir / "group-signals.jsonl"
        self.server = MotoServer(workdir / "moto.log", host="127.0.0.1", module="tests.vm.moto_signals",
                                 env={"GPTOSS_VM_SIGNALS": str(self.signals_file)})  # fmt: skip
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

    def launch(self, node: str, role: str, ip: str, *, rolling_update: bool = False) -> str:
        """The instance that now holds `node`: its record with the identity tags and its address,
        in its node's group (made on first use, MaxSize 2 as with surge); returns its instance id.
        `rolling_update`: launched by CloudFormation's rolling update of the node's group, so it
        carries the aws:cloudformation tags CloudFormation puts on the instances of a group it made."""
        ec2, autoscaling = self.client("ec2"), self.client("autoscaling")
        tags = [{"Key": "gptoss:cluster", "Value": self.cluster}, {"Key": "gptoss:role", "Value": role}, {"Key": "gptoss:node", "Value": node}]
        if rolling_update:
            tags += [{"Key": "aws:cloudformation:stack-name", "Value": STACK}, {"Key": "aws:cloudformation:logical-id", "Value": group_logical_id(node)}]
        (instance,) = ec2.run_instances(ImageId=self.image, MinCount=1, MaxCount=1, SubnetId=self.subnet, PrivateIpAddress=ip,
                                        TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])["Instances"]  # fmt: skip
        group = f"{self.cluster}-{node}"
        if not autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"]:
            template = ec2.create_launch_template(LaunchTemplateName=group, LaunchTemplateData={"ImageId": self.image})
            autoscaling.create_auto_scaling_group(
                AutoScalingGroupName=group, MinSize=0, MaxSize=2, DesiredCapacity=0, VPCZoneIdentifier=self.subnet,
                LaunchTemplate={"LaunchTemplateId": template["LaunchTemplate"]["LaunchTemplateId"]},
            )  # fmt: skip
        autoscaling.attach_instances(AutoScalingGroupName=group, InstanceIds=[instance["InstanceId"]])
        return str(instance["InstanceId"])

    def leave(self, instance_id: str) -> None:
        """Its group starts terminating the instance (a surge's replacement signalled): moto has no
        Terminating:Wait, the state the drain hook holds it in, so it goes to Standby, which the
        nodes read the same way (any state but InService or Pending* is leaving)."""
        autoscaling = self.client("autoscaling")
        (i,) = autoscaling.describe_auto_scaling_instances(InstanceIds=[instance_id])["AutoScalingInstances"]
        autoscaling.enter_standby(AutoScalingGroupName=i["AutoScalingGroupName"], InstanceIds=[instance_id], ShouldDecrementDesiredCapacity=True)

    def group_signals(self) -> list[dict[str, Any]]:
        """Every SignalResource call the nodes made, oldest first."""
        text = self.signals_file.read_text() if self.signals_file.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def terminate(self, instance_id: str) -> None:
        """The instance is gone (destroyed, or replaced by its group)."""
        autoscaling = self.client("autoscaling")
        groups = autoscaling.describe_auto_scaling_instances(InstanceIds=[instance_id])["AutoScalingInstances"]
        for g in groups:
            # One that left (Standby) no longer counts in the group's desired capacity.
            autoscaling.detach_instances(AutoScalingGroupName=g["AutoScalingGroupName"], InstanceIds=[instance_id],
                                         ShouldDecrementDesiredCapacity=g["LifecycleState"] != "Standby")  # fmt: skip
        self.client("ec2").terminate_instances(InstanceIds=[instance_id])

    def health(self, instance_id: str) -> str:
        """The instance's health in its group (Healthy, or Unhealthy once the node reported itself)."""
        (i,) = self.client("autoscaling").describe_auto_scaling_instances(InstanceIds=[instance_id])["AutoScalingInstances"]
        return str(i["HealthStatus"])
