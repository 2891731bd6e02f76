"""The CDK's own commands as the README types them: `npx cdk synth`, `bootstrap`, `deploy
GptOss8k1kStack`, `diff GptOss8k1kStack` and `destroy`, verbatim, in a copy of the checkout, with
no virtual environment activated, against a local AWS (moto on loopback).

What moto cannot do is done around the commands, never in them: its CloudFormation lacks a
placement group and answers 500 when the CDK looks up a
nested stack (cluster_ops/local_aws.py, the local AWS of `gptoss local`, adds the one and mends the other), it cannot resolve the DLAMI parameter under
/aws/ (the copy carries the pin `gptoss pin-ami` writes, with one of moto's images), and it cannot
delete a NAT gateway, an internet gateway, VPC endpoints, flow logs or route tables (removed by
their recorded ids before `cdk destroy`, as `make local-down` does).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from cluster_ops import ami
from cluster_ops.local import _stack_resources, remove_what_moto_cannot_delete
from tests.conftest import ROOT
from tests.local_moto import MotoServer
from tests.terminal import run

pytestmark = pytest.mark.lifecycle

REGION = "us-east-2"
STACK = "GptOss8k1kStack"


def readme_cdk_lines() -> list[str]:
    """The `npx cdk` lines of the README's deploy section, as written (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Deploy to AWS") :].split("\n## ", 1)[0]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for body in re.findall(r"```console\n(.*?)```", section, re.S) for line in body.splitlines()]
    return [line for line in lines if line.startswith("npx cdk ")]


def checkout_copy(dest: Path) -> Path:
    """The tracked files of this checkout, plus what `make setup` made (linked, used read-only)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    for made in (".venv", "node_modules", ".wheels"):
        (dest / made).symlink_to(ROOT / made)
    return dest


def no_venv_path() -> str:
    """PATH as a shell without the venv activated has it: no .venv/bin, no node_modules/.bin."""
    keep = [p for p in os.environ["PATH"].split(os.pathsep) if ".venv" not in p and "node_modules" not in p]
    return os.pathsep.join(keep)


@pytest.fixture(scope="module")
def aws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log", extended=True)
    try:
        yield server.url, checkout_copy(tmp_path_factory.mktemp("checkout"))
    finally:
        server.stop()


def client(url: str, name: str) -> Any:
    return boto3.client(name, endpoint_url=url, region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing")


def test_the_readme_shows_the_cards_commands() -> None:
    assert readme_cdk_lines() == ["npx cdk synth", "npx cdk bootstrap", f"npx cdk deploy {STACK}", f"npx cdk diff {STACK}", "npx cdk destroy"]


def test_cdk_synth_deploy_diff_destroy_as_typed(aws: tuple[str, Path]) -> None:
    url, checkout = aws
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VIRTUAL_ENV", "CDK_"))}
    env |= {"PATH": no_venv_path(), "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true", "CDK_DISABLE_CLI_TELEMETRY": "true",
            "AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED": "true", "HOME": str(checkout.parent), "TERM": "dumb"}  # fmt: skip
    assert subprocess.run(["python3", "-c", "import aws_cdk"], env=env, capture_output=True).returncode != 0, \
        "the shell's own python3 has no aws_cdk: the run shows app.py finds the venv itself"  # fmt: skip
    image = client(url, "ec2").describe_images(Owners=["amazon"])["Images"][0]
    ami.write(checkout / "cdk.context.json", REGION, {"ami_id": image["ImageId"], "name": image.get("Name", ""), "created": "",
                                                      "parameter": "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"})  # fmt: skip
    outputs: dict[str, str] = {}
    for line in readme_cdk_lines():
        verb = line.split()[2]
        if verb == "destroy":
            # moto's CloudFormation leaves these behind and the VPC's delete fails on them; on AWS it deletes them itself.
            _remove_what_moto_cannot(url)
        # deploy asks before IAM and security-group changes, destroy before it deletes: answered as a person would.
        r = run(line.split(), cwd=checkout, env=env, answers={"(y/n)": "y"}, timeout=600)
        outputs[verb] = r.output
        assert r.code == 0, f"{line} exited {r.code}:\n{r.output[-3000:]}"
        assert "Traceback" not in r.output and "No module named" not in r.output, r.output[-3000:]
        if verb in ("deploy", "destroy"):
            assert r.answered == ["(y/n)"], (line, r.answered)
        if verb == "synth":
            assert (checkout / "cdk.out" / f"{STACK}.template.json").exists()
            assert "AwsSolutions" not in r.output, "cdk-nag ran and found nothing unacknowledged"
        if verb == "deploy":
            stack = client(url, "cloudformation").describe_stacks(StackName=STACK)["Stacks"][0]
            assert stack["StackStatus"] == "CREATE_COMPLETE"
            groups = client(url, "autoscaling").describe_auto_scaling_groups()["AutoScalingGroups"]
            tags = sorted(t["Value"] for g in groups for t in g["Tags"] if t["Key"] == "gptoss:node")
            assert tags == ["decode-0", "prefill-0"]
            images = {v["LaunchTemplateData"]["ImageId"] for t in client(url, "ec2").describe_launch_templates()["LaunchTemplates"]
                      for v in client(url, "ec2").describe_launch_template_versions(LaunchTemplateId=t["LaunchTemplateId"])["LaunchTemplateVersions"]}  # fmt: skip
            assert images == {image["ImageId"]}, "the pinned image, not the DLAMI parameter"
        if verb == "diff":
            # The stack, each of its two cells and each cell's NodeSilent alarms (nested stacks), each compared with what is deployed.
            assert r.output.count("There were no differences") == 5, r.output[-3000:]
            assert not re.search(r"^\[[-+~]\]", r.output, re.M), r.output[-3000:]
    live = [s for s in client(url, "cloudformation").list_stacks()["StackSummaries"] if s["StackName"] == STACK and s["StackStatus"] != "DELETE_COMPLETE"]
    assert live == [], live
    assert json.loads((checkout / "cdk.context.json").read_text()), "the pin is still there: destroy left the checkout alone"


def _remove_what_moto_cannot(url: str) -> None:
    def c(name: str) -> Any:
        return client(url, name)

    resources = _stack_resources(c("cloudformation"), STACK)
    remove_what_moto_cannot_delete(c, STACK)
    ec2 = c("ec2")
    for r in resources:
        if r["ResourceType"] == "AWS::EC2::NatGateway" and r.get("PhysicalResourceId"):
            ec2.delete_nat_gateway(NatGatewayId=r["PhysicalResourceId"])
    for r in resources:
        if r["ResourceType"] == "AWS::EC2::InternetGateway" and r.get("PhysicalResourceId"):
            gateway = ec2.describe_internet_gateways(InternetGatewayIds=[r["PhysicalResourceId"]])["InternetGateways"][0]
            for attachment in gateway.get("Attachments", []):
                ec2.detach_internet_gateway(InternetGatewayId=gateway["InternetGatewayId"], VpcId=attachment["VpcId"])
            ec2.delete_internet_gateway(InternetGatewayId=gateway["InternetGatewayId"])


def test_cdk_synth_as_typed_with_the_venv_activated_too(aws: tuple[str, Path]) -> None:
    """`source .venv/bin/activate` first: the CDK then finds the venv's python3 itself, and app.py runs in it as is."""
    _, checkout = aws
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CDK_"))}
    env |= {"PATH": f"{checkout / '.venv' / 'bin'}{os.pathsep}{no_venv_path()}", "VIRTUAL_ENV": str(checkout / ".venv"), "AWS_REGION": REGION,
            "CDK_DISABLE_CLI_TELEMETRY": "true", "HOME": str(checkout.parent)}  # fmt: skip
    r = subprocess.run(["npx", "cdk", "synth", "--quiet", "--output", str(checkout / "cdk.out.activated")], cwd=checkout, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (checkout / "cdk.out.activated" / f"{STACK}.template.json").exists()
