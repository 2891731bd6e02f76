"""The local AWS the lifecycle tests deploy to: a moto server on loopback, bootstrapped for the CDK,
with the test's AMI parameter and model bucket, and the pinned CDK CLI and gptoss CLI run against it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

from tests.conftest import CDK, ROOT, cli_env
from tests.local_moto import MotoServer

REGION = "us-east-2"
ACCOUNT = "123456789012"  # moto's account
CLUSTER = "gptoss-8k1k"
LOCAL_CONFIG = """\
ami_ssm_parameter: /gptoss/test/neuron-dlami
network:
  egress: none
  # moto's CloudFormation makes no AWS::EC2::PlacementGroup (its Ref, which the cells take as a
  # parameter, is empty there): an existing group by name, as an operator may give one.
  placement_group: gptoss-local-cpg
model:
  source: s3
  s3_uri: s3://gptoss-local-models/gpt-oss-120b
examples:
  s3_uri: s3://gptoss-local-models/vllm-neuron
compile_cache_s3_uri: s3://gptoss-local-models/neuron-cache
"""



@dataclass
class LocalAws:
    endpoint: str
    env: dict[str, str]
    config: Path

    @property
    def outdir(self) -> Path:
        return self.config.parent / "cdk.out"

    def client(self, name: str) -> Any:
        return boto3.client(
            name, endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing"
        )

    def cdk(self, *args: str, timeout: int = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            # Its own cloud assembly directory: other tests synthesize into the checkout's cdk.out.
            ["timeout", str(timeout), str(CDK), *args, "--no-notices", "-c", f"config={self.config}", "--output", str(self.outdir)],
            cwd=cwd,
            env=self.env,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, f"cdk {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r

    def gptoss(self, command: str, *args: str, timeout: int = 300, codes: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
        """The operator CLI as installed (it runs the same pinned cdk), records kept out of the checkout."""
        gptoss = str(Path(sys.executable).parent / "gptoss")
        passthrough = ["--output", str(self.outdir)] if command in ("deploy", "destroy", "diff") else []
        r = subprocess.run(
            ["timeout", str(timeout), gptoss, command, "-c", f"config={self.config}", *args, *passthrough],
            cwd=ROOT,
            env=self.env | {"GPTOSS_STATE_DIR": str(self.config.parent / "gptoss-state")},
            capture_output=True,
            text=True,
        )
        assert r.returncode in codes, f"gptoss {command} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r



@contextmanager
def started(workdir: Path, *, extended: bool = False) -> Iterator[LocalAws]:
    """A moto server on loopback, bootstrapped for the CDK, with the test's AMI parameter and bucket
    (EXTENDED: with what CloudFormation does and moto lacks, cluster_ops/local_aws.py)."""
    # The name `localhost`: the CDK parses the asset bucket URL by that name. The stack attaches
    # no AWS managed policy: moto needs none loaded.
    server = MotoServer(workdir / "moto.log", extended=extended)
    endpoint = server.url
    try:
        config = workdir / "local.yaml"
        config.write_text(LOCAL_CONFIG)
        env = cli_env(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION=REGION,
        )
        aws = LocalAws(endpoint, env, config)
        image = aws.client("ec2").describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        # moto cannot create names under /aws/...: the parameter name is configurable for this reason.
        aws.client("ssm").put_parameter(Name="/gptoss/test/neuron-dlami", Value=image, Type="String", DataType="aws:ec2:image")
        aws.client("s3").create_bucket(Bucket="gptoss-local-models", CreateBucketConfiguration={"LocationConstraint": REGION})
        # Outside the checkout (no cdk.json): with its environment named, bootstrap needs no app, and
        # from the checkout it would synthesize one anyway (3 s of CPU for nothing).
        aws.cdk("bootstrap", f"aws://{ACCOUNT}/{REGION}", cwd=workdir)
        yield aws
    finally:
        server.stop()


def inventory(aws: LocalAws) -> dict[str, set[str]]:
    """Every resource of the kinds the stack creates, by id."""
    ec2, iam = aws.client("ec2"), aws.client("iam")
    live = [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"] if i["State"]["Name"] != "terminated"]
    return {
        "groups": {g["AutoScalingGroupName"] for g in aws.client("autoscaling").describe_auto_scaling_groups()["AutoScalingGroups"]},
        "buckets": {b["Name"] for b in aws.client("s3").list_buckets()["Buckets"]},
        "event_rules": {r["Name"] for r in aws.client("events").list_rules()["Rules"]},
        "alarms": {a["AlarmName"] for a in aws.client("cloudwatch").describe_alarms()["MetricAlarms"]},
        "vpcs": {v["VpcId"] for v in ec2.describe_vpcs()["Vpcs"]},
        "subnets": {s["SubnetId"] for s in ec2.describe_subnets()["Subnets"]},
        "route_tables": {t["RouteTableId"] for t in ec2.describe_route_tables()["RouteTables"]},
        "security_groups": {g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]},
        "instances": {i["InstanceId"] for i in live},
        "launch_templates": {t["LaunchTemplateId"] for t in ec2.describe_launch_templates()["LaunchTemplates"]},
        "endpoints": {
            e["VpcEndpointId"] for e in ec2.describe_vpc_endpoints()["VpcEndpoints"] if e["State"].lower() != "deleted"
        },
        "roles": {r["RoleName"] for r in iam.list_roles()["Roles"]},
        "instance_profiles": {p["InstanceProfileName"] for p in iam.list_instance_profiles()["InstanceProfiles"]},
        "log_groups": {g["logGroupName"] for g in aws.client("logs").describe_log_groups()["logGroups"]},
    }


