"""What the synthesized template provisions, asserted on the template the pinned CLI writes."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.conftest import Synth, real_aws_cli
from tests.stacks.template import groups, launch_templates, normalized, of_type


class TestNodes:
    def test_each_node_identity_is_a_group_of_one_instance_tagged_with_its_identity(self, default_synth: Synth) -> None:
        t = default_synth.template
        assert not of_type(t, "AWS::EC2::Instance"), "no instance of a fixed id: each node keeps its identity, not its instance"
        gs = groups(t)
        assert sorted(gs) == ["decode-0", "prefill-0"]
        for node, g in gs.items():
            # Room for a surge's second instance (On-Demand): the group holds one, and two only while a rollout replaces it.
            assert (g["MinSize"], g["MaxSize"], g["DesiredCapacity"]) == ("1", "2", "1"), node
            assert g["AutoScalingGroupName"] == f"gptoss-8k1k-{node}"
            tags = {x["Key"]: (x["Value"], x["PropagateAtLaunch"]) for x in g["Tags"]}
            role = node.split("-")[0]
            assert {k: tags[k] for k in ("gptoss:cluster", "gptoss:role", "gptoss:node", "Name")} == {
                "gptoss:cluster": ("gptoss-8k1k", True), "gptoss:role": (role, True), "gptoss:node": (node, True), "Name": (f"gptoss-8k1k-{node}", True)}
        for lt in launch_templates(t).values():
            assert lt["InstanceType"] == "trn3.48xlarge"

    def test_a_failed_instance_is_replaced_and_a_new_template_version_replaces_only_its_node(self, default_synth: Synth) -> None:
        """EC2's status checks (and the node's own SetInstanceHealth) replace a failed instance; a
        redeploy that changes a node's template replaces that node's instance: On-Demand (the default)
        surges, the replacement first, the old instance after the replacement's signal (within the
        hour CloudFormation allows); without surge, terminate then launch, and the deploy gate waits."""
        for node, g in groups(default_synth.template).items():
            assert g["HealthCheckType"] == "EC2" and g["HealthCheckGracePeriod"] == 900, node
            rolling = g["UpdatePolicy"]["AutoScalingRollingUpdate"]
            assert (rolling["MinInstancesInService"], rolling["MaxBatchSize"], rolling["WaitOnResourceSignals"], rolling["PauseTime"]) == (1, 1, True, "PT3600S"), node
            assert {"HealthCheck", "ReplaceUnhealthy"} <= set(rolling["SuspendProcesses"]), "no replacement fights the update"

    def test_one_interface_per_network_card_primary_efa_then_efa_only(self, default_synth: Synth) -> None:
        for lt in launch_templates(default_synth.template).values():
            nics = lt["NetworkInterfaces"]
            assert [n["NetworkCardIndex"] for n in nics] == list(range(16))
            assert [n["DeviceIndex"] for n in nics] == [0] * 16
            assert [n["InterfaceType"] for n in nics] == ["efa"] + ["efa-only"] * 15
            assert nics[0]["AssociatePublicIpAddress"] is False
            assert all("AssociatePublicIpAddress" not in n for n in nics[1:])

    def test_interface_count_follows_the_instance_table_and_overrides(self, synth_variant: Any) -> None:
        t = synth_variant(instance_type="trn2.48xlarge", serving={"shape": {"quantization": "bf16"}})
        lt = launch_templates(t)["decode"]
        assert lt["InstanceType"] == "trn2.48xlarge"
        assert len(lt["NetworkInterfaces"]) == 16
        t = synth_variant(instance_overrides={"network_cards": 8, "efa_interfaces": 8})
        assert [n["NetworkCardIndex"] for n in launch_templates(t)["prefill"]["NetworkInterfaces"]] == list(range(8))

    def test_imdsv2_required_and_encrypted_gp3_root(self, default_synth: Synth) -> None:
        for lt in launch_templates(default_synth.template).values():
            assert lt["MetadataOptions"]["HttpTokens"] == "required"
            (root,) = lt["BlockDeviceMappings"]
            assert root["Ebs"]["Encrypted"] is True
            assert root["Ebs"]["VolumeType"] == "gp3"
            assert root["Ebs"]["VolumeSize"] >= 512

    def test_ami_from_the_dlami_ssm_parameter_resolved_at_deploy(self, default_synth: Synth) -> None:
        param = default_synth.template["Parameters"]["NeuronDlamiAmi"]
        assert param["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"
        assert param["Default"] == "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"
        for lt in launch_templates(default_synth.template).values():
            assert lt["ImageId"] == {"Ref": "NeuronDlamiAmi"}

    def test_fixed_ami_id_replaces_the_parameter(self, synth_variant: Any) -> None:
        t = synth_variant(ami_id="ami-0123456789abcdef0", ami_ssm_parameter=None)
        assert "NeuronDlamiAmi" not in t.get("Parameters", {})
        assert {lt["ImageId"] for lt in launch_templates(t).values()} == {"ami-0123456789abcdef0"}

    def test_no_public_ip_anywhere(self, default_synth: Synth) -> None:
        for lt in launch_templates(default_synth.template).values():
            assert lt["NetworkInterfaces"][0]["AssociatePublicIpAddress"] is False
        assert all(not v["Properties"]["MapPublicIpOnLaunch"] for v in of_type(default_synth.template, "AWS::EC2::Subnet").values())


def test_every_node_waits_for_its_network_path(default_synth: Synth, synth_variant: Any) -> None:
    """A first boot fetches its scripts from S3 and answers its gate through the S3 endpoint: the
    route table association, the NAT route, the S3 gateway and the interface endpoints exist first."""
    for t, needs in (
        (default_synth.template, ("AWS::EC2::SubnetRouteTableAssociation", "AWS::EC2::Route", "AWS::EC2::VPCEndpoint")),
        (synth_variant(network={"egress": "none"}, model={"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"},
                       examples={"s3_uri": "s3://models-bucket/vllm-neuron"}), ("AWS::EC2::SubnetRouteTableAssociation", "AWS::EC2::VPCEndpoint")),
    ):  # fmt: skip
        resources = t["Resources"]
        node_routes = next(k for k, v in resources.items() if v["Type"] == "AWS::EC2::RouteTable" and k.startswith("NetworkNodeRoutes"))
        path = {
            k
            for k, v in resources.items()
            if v["Type"] in needs
            and (
                v["Type"] == "AWS::EC2::VPCEndpoint"
                or v["Properties"].get("RouteTableId") == {"Ref": node_routes}
            )
        }
        endpoints = {k for k in path if resources[k]["Type"] == "AWS::EC2::VPCEndpoint"}
        assert len(path) >= 3 and endpoints, path
        def before(lid: str, resources: dict[str, Any] = resources) -> set[str]:
            """Everything CloudFormation creates before `lid` (DependsOn, transitively)."""
            out: set[str] = set()
            todo = list(resources[lid].get("DependsOn", []))
            while todo:
                d = todo.pop()
                if d not in out:
                    out.add(d)
                    todo += resources[d].get("DependsOn", [])
            return out

        holders = of_type(t, "AWS::AutoScaling::AutoScalingGroup")
        assert holders
        for lid in holders:
            assert path <= before(lid), f"{lid} may launch before {sorted(path - before(lid))}"


class TestOutputs:
    def test_the_endpoint_and_a_port_forward_that_finds_the_current_instance(self, default_synth: Synth, fleet_synth: Synth) -> None:
        out = default_synth.template["Outputs"]
        assert not [k for k in out if k.endswith(("InstanceId", "PrivateIp"))], "an instance id or address goes stale with a replacement"
        assert out["ProxyNodes"]["Value"] == "prefill-0"
        fwd = out["ProxyPortForward"]["Value"]
        assert fwd.startswith("aws ssm start-session --region us-east-2 --target $(aws ec2 describe-instances --region us-east-2 "
                              "--filters Name=tag:gptoss:cluster,Values=gptoss-8k1k Name=instance-state-name,Values=running "
                              "Name=tag:gptoss:node,Values=prefill-0 --query 'sort_by(Reservations[].Instances[], &LaunchTime)[0].InstanceId' --output text)")  # fmt: skip
        assert fwd.endswith("--document-name AWS-StartPortForwardingSession --parameters portNumber=8000,localPortNumber=8000")
        fleet = fleet_synth.template["Outputs"]
        assert "ProxyEndpointNlb" in json.dumps(fleet["ProxyUrl"]["Value"])
        assert "AWS-StartPortForwardingSessionToRemoteHost --parameters host=" in json.dumps(fleet["ProxyPortForward"]["Value"])

    def test_the_port_forwards_lookup_finds_the_instance_that_serves_through_a_surge(self, default_synth: Synth, moto_url: str, tmp_path: Path) -> None:
        """The output's own lookup, run by the AWS CLI the nodes run. Against moto: with a surge's two
        running instances of prefill-0 it names the old one (it serves until its group lets it go), then
        the new one once the old is terminated; never another cluster's or node's. EC2 promises no order,
        so against a loopback EC2 that lists the newer instance first, it still names the older."""
        fwd = default_synth.template["Outputs"]["ProxyPortForward"]["Value"]
        lookup = fwd[fwd.index("$(") + 2 : fwd.index(")", fwd.index("--output text"))]
        ec2 = boto3.client("ec2", endpoint_url=moto_url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
        image = ec2.describe_images()["Images"][0]["ImageId"]

        def launch(cluster: str, node: str) -> str:
            tags = [{"Key": "gptoss:cluster", "Value": cluster}, {"Key": "gptoss:node", "Value": node}]
            return str(ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])["Instances"][0]["InstanceId"])

        launch("gptoss-other", "prefill-0")  # the oldest of all, of another cluster
        old = launch("gptoss-8k1k", "prefill-0")
        launch("gptoss-8k1k", "decode-0")  # older than the replacement, another node
        new = launch("gptoss-8k1k", "prefill-0")
        real_aws_cli(tmp_path / "bin")

        def found(endpoint: str) -> str:
            env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "AWS_ENDPOINT_URL": endpoint,
                   "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}  # fmt: skip
            done = subprocess.run(["bash", "-c", lookup], env=env, capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 0, done.stderr
            return done.stdout.strip()

        assert found(moto_url) == old
        ec2.terminate_instances(InstanceIds=[old])
        assert found(moto_url) == new

        listed = [("i-0newer00000000001", "2026-12-04T10:30:00.000Z"), ("i-0older00000000001", "2026-12-04T09:00:00.000Z")]
        body = "".join(f"<item><reservationId>r-{i}</reservationId><ownerId>123456789012</ownerId><instancesSet><item><instanceId>{i}"
                       f"</instanceId><launchTime>{at}</launchTime></item></instancesSet></item>" for i, at in listed)  # fmt: skip
        answer = (f'<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>1</requestId>'
                  f"<reservationSet>{body}</reservationSet></DescribeInstancesResponse>").encode()  # fmt: skip

        class Ec2(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ec2)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            assert found(f"http://127.0.0.1:{server.server_address[1]}") == "i-0older00000000001"
        finally:
            server.shutdown()


class TestQualityGates:
    def test_cdk_nag_clean_with_every_acknowledgement_reasoned(self, default_synth: Synth, fleet_synth: Synth) -> None:
        for s in (default_synth, fleet_synth):
            (report,) = [r for r in s.report["pluginReports"] if r["pluginName"] == "AwsSolutions"]
            assert report["conclusion"] == "success"
            assert report["violations"] == []
            for v in report["suppressedViolations"]:
                assert len(v["reason"]) > 40, v["ruleName"]

    def test_cloudformation_limits(self, default_synth: Synth, fleet_synth: Synth) -> None:
        for s in (default_synth, fleet_synth):
            assert len(s.template["Resources"]) < 500
            assert s.template_path.stat().st_size < 1_000_000

    @pytest.mark.parametrize("which", ["default_synth", "fleet_synth"])
    def test_cfn_lint_clean(self, which: str, request: pytest.FixtureRequest) -> None:
        import subprocess
        import sys
        from pathlib import Path

        s = request.getfixturevalue(which)
        # E3628 (unknown instance type) only: cfn-lint's data has no trn3 type yet.
        r = subprocess.run(
            [str(Path(sys.executable).parent / "cfn-lint"), "--regions", "us-east-2", "--ignore-checks", "E3628", "--", str(s.template_path)],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, (r.stdout + r.stderr)[:4000]

    def test_constructs_resolves_to_the_installed_library(self) -> None:
        import constructs

        from tests.conftest import ROOT

        assert "site-packages" in constructs.__file__
        assert not (ROOT / "constructs").exists()


def test_template_snapshot(default_synth: Synth, snapshot: Any) -> None:
    from syrupy.extensions.json import JSONSnapshotExtension

    from node_render.userdata import unbundle

    # The software the nodes fetch (rollout.software=in-place: not in their user data), file by file.
    software = {path: {"mode": oct(mode), "text": text.splitlines()} for path, (text, mode) in sorted(unbundle(default_synth.software()).items())}
    assert normalized(default_synth.template) | {"Software": software} == snapshot(extension_class=JSONSnapshotExtension)


def test_the_compile_cache_bucket_is_private_encrypted_and_keeps_replaced_graphs_for_30_days(default_synth: Synth) -> None:
    (bucket,) = [b["Properties"] for b in default_synth.resources("AWS::S3::Bucket").values()]
    assert bucket["VersioningConfiguration"] == {"Status": "Enabled"}, "a bad promotion can be rolled back"
    (rule,) = bucket["LifecycleConfiguration"]["Rules"]
    assert rule["NoncurrentVersionExpiration"] == {"NoncurrentDays": 30} and rule["Status"] == "Enabled"
    assert rule["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 7}
    assert bucket["PublicAccessBlockConfiguration"] == {"BlockPublicAcls": True, "BlockPublicPolicy": True, "IgnorePublicAcls": True,
                                                         "RestrictPublicBuckets": True}  # fmt: skip
    assert bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"] == {"SSEAlgorithm": "AES256"}
