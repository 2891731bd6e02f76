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

from clusterspec.loading import load_config
from tests.conftest import Synth, real_aws_cli


def of_type(template: dict[str, Any], rtype: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == rtype}


def one(template: dict[str, Any], rtype: str) -> tuple[str, dict[str, Any]]:
    found = of_type(template, rtype)
    assert len(found) == 1, f"expected one {rtype}, found {sorted(found)}"
    return next(iter(found.items()))


def group_id(template: dict[str, Any]) -> str:
    groups = [k for k in of_type(template, "AWS::EC2::SecurityGroup") if k.startswith("SecurityGroup")]
    assert len(groups) == 1
    return groups[0]


def self_ref(template: dict[str, Any]) -> dict[str, Any]:
    return {"Fn::GetAtt": [group_id(template), "GroupId"]}


def ingress_rules(template: dict[str, Any]) -> set[tuple[Any, ...]]:
    """(protocol, from, to, source) of every ingress rule of the cluster group."""
    sg = group_id(template)
    rules = set()
    for r in of_type(template, "AWS::EC2::SecurityGroupIngress").values():
        p = r["Properties"]
        if p["GroupId"] != {"Fn::GetAtt": [sg, "GroupId"]}:
            continue
        src = p.get("SourceSecurityGroupId") or p.get("CidrIp") or p.get("SourcePrefixListId")
        src = "self" if src == {"Fn::GetAtt": [sg, "GroupId"]} else json.dumps(src, sort_keys=True)
        rules.add((p["IpProtocol"], p.get("FromPort"), p.get("ToPort"), src))
    for p in template["Resources"][sg]["Properties"].get("SecurityGroupIngress", []):
        rules.add((p["IpProtocol"], p.get("FromPort"), p.get("ToPort"), p.get("CidrIp") or p.get("SourcePrefixListId")))
    return rules


def launch_templates(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """LaunchTemplateData by role (of the first node of each: every node identity has its own)."""
    out = {}
    for k, v in of_type(template, "AWS::EC2::LaunchTemplate").items():
        role = "prefill" if k.startswith("Prefill") else "decode"
        out.setdefault(role, v["Properties"]["LaunchTemplateData"])
    return out


def groups(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each node identity's Auto Scaling group (its properties), by node name."""
    out = {}
    for v in of_type(template, "AWS::AutoScaling::AutoScalingGroup").values():
        node = next(t["Value"] for t in v["Properties"]["Tags"] if t["Key"] == "gptoss:node")
        out[node] = v["Properties"] | {"UpdatePolicy": v.get("UpdatePolicy"), "DependsOn": v.get("DependsOn", [])}
    return out


# Ports of the tested deployment (reference 000 "Prerequisites", FACTS side-channel formulas),
# typed out here so the test does not read them back from the spec it checks.
EXPECTED_6P1D_INGRESS = {
    ("-1", None, None, "self"),
    ("tcp", 8000, 8000, "self"),
    ("tcp", 8100, 8105, "self"),
    ("tcp", 8200, 8200, "self"),
    ("tcp", 5559, 5562, "self"),
    ("tcp", 5659, 5662, "self"),
    ("tcp", 5759, 5762, "self"),
    ("tcp", 5859, 5862, "self"),
    ("tcp", 5959, 5962, "self"),
    ("tcp", 6059, 6062, "self"),
    ("tcp", 8759, 8886, "self"),
}


class TestNetwork:
    def test_one_private_subnet_in_the_configured_az(self, default_synth: Synth) -> None:
        subnets = of_type(default_synth.template, "AWS::EC2::Subnet")
        nodes = [v["Properties"] for k, v in subnets.items() if "NodeSubnet" in k]
        assert len(nodes) == 1
        assert nodes[0]["AvailabilityZone"] == "us-east-2a"
        assert nodes[0]["MapPublicIpOnLaunch"] is False
        assert all(v["Properties"]["MapPublicIpOnLaunch"] is False for v in subnets.values())

    def test_nat_egress_by_default_and_s3_gateway_endpoint(self, default_synth: Synth) -> None:
        t = default_synth.template
        assert len(of_type(t, "AWS::EC2::NatGateway")) == 1
        routes = [r["Properties"] for r in of_type(t, "AWS::EC2::Route").values()]
        assert any("NatGatewayId" in r and r["DestinationCidrBlock"] == "0.0.0.0/0" for r in routes)
        _, ep = one(t, "AWS::EC2::VPCEndpoint")
        assert ep["Properties"]["VpcEndpointType"] == "Gateway"
        assert ep["Properties"]["ServiceName"] == "com.amazonaws.us-east-2.s3"

    def test_no_egress_mode_has_no_route_out_and_reaches_ssm_by_endpoints(self, synth_variant: Any) -> None:
        t = synth_variant(
            network={"egress": "none"},
            model={"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"},
            examples={"s3_uri": "s3://models-bucket/vllm-neuron"},
        )
        assert not of_type(t, "AWS::EC2::NatGateway")
        assert not of_type(t, "AWS::EC2::InternetGateway")
        assert not of_type(t, "AWS::EC2::Route")
        services = sorted(v["Properties"]["ServiceName"] for v in of_type(t, "AWS::EC2::VPCEndpoint").values())
        # SSM for the operator, EC2 for the members (and a node's own tags), Auto Scaling for a node's report on
        # itself and the members' leaving instance, CloudFormation for a node's signal to its group (a surge's or a
        # rollback's update waits for it), CloudWatch Logs and metrics for the nodes' collector.
        assert services == [f"com.amazonaws.us-east-2.{s}" for s in
                            ("autoscaling", "cloudformation", "ec2", "ec2messages", "logs", "monitoring", "s3", "ssm", "ssmmessages")]  # fmt: skip
        # Without surge too: the rollout's policy changes no endpoint (a rollback still waits for the nodes' signals).
        off = synth_variant(network={"egress": "none"}, model={"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"},
                            examples={"s3_uri": "s3://models-bucket/vllm-neuron"}, rollout={"surge": "off"})  # fmt: skip
        assert sorted(v["Properties"]["ServiceName"] for v in of_type(off, "AWS::EC2::VPCEndpoint").values()) == services
        # Without a deploy gate nothing signals: no CloudFormation endpoint.
        ungated = synth_variant(network={"egress": "none"}, model={"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"},
                                examples={"s3_uri": "s3://models-bucket/vllm-neuron"}, wait_for_ready=False)  # fmt: skip
        assert "com.amazonaws.us-east-2.cloudformation" not in {v["Properties"]["ServiceName"] for v in of_type(ungated, "AWS::EC2::VPCEndpoint").values()}

    def test_without_egress_the_endpoints_admit_only_this_accounts_principals_and_the_clusters_buckets(self, synth_variant: Any) -> None:
        t = synth_variant(
            network={"egress": "none"},
            model={"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"},
            examples={"s3_uri": "s3://examples-bucket/vllm-neuron"},
            results_s3_uri="s3://results-bucket/runs",
            **{"serving.proxy.kind": "vllm-router"},
        )
        eps = {v["Properties"]["ServiceName"].rpartition(".")[2]: v["Properties"] for v in of_type(t, "AWS::EC2::VPCEndpoint").values()}
        account = {"StringEquals": {"aws:PrincipalAccount": {"Ref": "AWS::AccountId"}}}
        for service in ("ssm", "ec2", "autoscaling", "logs", "monitoring", "cloudformation"):
            assert eps[service]["PolicyDocument"]["Statement"] == [
                {"Sid": "ThisAccountsPrincipals", "Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "*", "Resource": "*", "Condition": account}
            ], service
        assert "PolicyDocument" not in eps["ssmmessages"] and "PolicyDocument" not in eps["ec2messages"]

        ours, gate, agent = eps["s3"]["PolicyDocument"]["Statement"]
        assert ours["Condition"] == account and ours["Principal"] == {"AWS": "*"}
        assert sorted(ours["Action"]) == ["s3:DeleteObject", "s3:GetObject", "s3:ListBucket", "s3:PutObject"]
        named = {json.dumps(r) for r in ours["Resource"]}
        for bucket in ("models-bucket", "examples-bucket", "results-bucket"):
            assert any(f":s3:::{bucket}\"" in r for r in named) and any(f":s3:::{bucket}/*" in r for r in named), bucket
        assert any("cdk-hnb659fds-assets-${AWS::AccountId}-us-east-2" in r for r in named), "the scripts' asset bucket"
        assert any('"Ref": "CompileCacheBucket' in r for r in named), "the stack's compile cache"
        assert len(ours["Resource"]) == 2 * 5, "these five buckets (each as a bucket and its objects), nothing else"
        assert gate["Action"] == "s3:PutObject" and "Condition" not in gate, "CloudFormation presigns the handle: no account of ours signs it"
        assert json.dumps(gate["Resource"]).endswith(':s3:::cloudformation-waitcondition-us-east-2/*"]]}')
        assert agent["Action"] == "s3:GetObject"
        assert {json.dumps(r).split(":s3:::")[1].split("/*")[0] for r in agent["Resource"]} == {
            "aws-ssm-us-east-2", "amazon-ssm-us-east-2", "amazon-ssm-packages-us-east-2", "us-east-2-birdwatcher-prod",
            "aws-ssm-distributor-file-us-east-2", "aws-ssm-document-attachments-us-east-2", "patch-baseline-snapshot-us-east-2"}  # fmt: skip

    def test_with_egress_through_nat_the_s3_gateway_keeps_its_default_policy(self, default_synth: Synth) -> None:
        _, ep = one(default_synth.template, "AWS::EC2::VPCEndpoint")
        assert "PolicyDocument" not in ep["Properties"], "Hugging Face, GitHub and PyPI are reached through the NAT; S3 is not narrowed here"

    def test_an_existing_vpc_without_egress_gets_its_s3_and_ssm_endpoints(self, synth_variant: Any) -> None:
        t = synth_variant(
            network={"vpc_id": "vpc-0123456789abcdef0", "subnet_id": "subnet-0123456789abcdef0", "route_table_id": "rtb-0123456789abcdef0",
                     "egress": "none"},
            model={"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"},
            examples={"s3_uri": "s3://models-bucket/vllm-neuron"},
        )  # fmt: skip
        eps = {v["Properties"]["ServiceName"]: v["Properties"] for v in of_type(t, "AWS::EC2::VPCEndpoint").values()}
        assert sorted(eps) == [f"com.amazonaws.us-east-2.{s}" for s in
                               ("autoscaling", "cloudformation", "ec2", "ec2messages", "logs", "monitoring", "s3", "ssm", "ssmmessages")]  # fmt: skip
        assert eps["com.amazonaws.us-east-2.s3"]["RouteTableIds"] == ["rtb-0123456789abcdef0"]
        assert all(e["SubnetIds"] == ["subnet-0123456789abcdef0"] for n, e in eps.items() if not n.endswith("s3"))
        assert all(e["VpcId"] == "vpc-0123456789abcdef0" for e in eps.values())

    def test_flow_logs_record_rejected_traffic_unless_asked_for_all(self, default_synth: Synth, synth_variant: Any) -> None:
        _, log = one(default_synth.template, "AWS::EC2::FlowLog")
        assert log["Properties"]["TrafficType"] == "REJECT"
        _, log = one(synth_variant(network={"flow_logs_traffic": "ALL"}), "AWS::EC2::FlowLog")
        assert log["Properties"]["TrafficType"] == "ALL"

    def test_existing_vpc_and_subnet_are_used_by_id(self, synth_variant: Any) -> None:
        t = synth_variant(network={"vpc_id": "vpc-0123456789abcdef0", "subnet_id": "subnet-0123456789abcdef0"})
        assert not of_type(t, "AWS::EC2::VPC")
        assert not of_type(t, "AWS::EC2::Subnet")
        for lt in launch_templates(t).values():
            assert not [n for n in lt["NetworkInterfaces"] if "SubnetId" in n], "a group launches every interface into its own subnet"
        assert {tuple(g["VPCZoneIdentifier"]) for g in groups(t).values()} == {("subnet-0123456789abcdef0",)}
        _, sg = one(t, "AWS::EC2::SecurityGroup")
        assert sg["Properties"]["VpcId"] == "vpc-0123456789abcdef0"

    def test_cluster_placement_group_holds_every_node(self, default_synth: Synth) -> None:
        t = default_synth.template
        pg_id, pg = one(t, "AWS::EC2::PlacementGroup")
        assert pg["Properties"]["Strategy"] == "cluster"
        lts = launch_templates(t)
        assert {r: lt["Placement"]["GroupName"] for r, lt in lts.items()} == {
            "prefill": {"Ref": pg_id},
            "decode": {"Ref": pg_id},
        }
        lt_ids = {k for k in of_type(t, "AWS::EC2::LaunchTemplate")}
        assert {g["LaunchTemplate"]["LaunchTemplateId"]["Ref"] for g in groups(t).values()} == lt_ids, "each group its own template"
        for g in groups(t).values():
            assert g["LaunchTemplate"]["Version"] == {"Fn::GetAtt": [g["LaunchTemplate"]["LaunchTemplateId"]["Ref"], "LatestVersionNumber"]}


class TestSecurityGroup:
    def test_self_referencing_all_traffic_ingress_and_egress(self, default_synth: Synth) -> None:
        t = default_synth.template
        assert ("-1", None, None, "self") in ingress_rules(t)
        egress = [e["Properties"] for e in of_type(t, "AWS::EC2::SecurityGroupEgress").values()]
        assert {"IpProtocol": "-1", "DestinationSecurityGroupId": self_ref(t)}.items() <= egress[0].items()
        assert len(egress) == 1

    def test_every_spec_port_is_opened_from_the_group_and_nothing_else(self, default_synth: Synth) -> None:
        assert ingress_rules(default_synth.template) == EXPECTED_6P1D_INGRESS

    def test_no_public_ingress_and_no_ssh(self, default_synth: Synth, fleet_synth: Synth) -> None:
        for s in (default_synth, fleet_synth):
            # Every source is the cluster group itself or, in the fleet, the load balancer's group.
            for r in ingress_rules(s.template):
                assert r[3] == "self" or "ProxyEndpointGroup" in r[3], r
                assert not (r[1] is not None and r[1] <= 22 <= r[2]), "port 22 is open"

    def test_egress_to_the_world_is_https_only(self, default_synth: Synth) -> None:
        sg = default_synth.template["Resources"][group_id(default_synth.template)]["Properties"]
        assert sg["SecurityGroupEgress"] == [
            {"CidrIp": "0.0.0.0/0", "Description": "HTTPS: S3, SSM, model and examples downloads", "FromPort": 443, "IpProtocol": "tcp", "ToPort": 443}
        ]

    def test_without_egress_https_reaches_the_s3_prefix_list_alone_when_named(self, synth_variant: Any) -> None:
        t = synth_variant(network={"egress": "none", "s3_prefix_list_id": "pl-7ba54012"},
                          model={"source": "s3", "s3_uri": "s3://models-bucket/gpt"}, examples={"s3_uri": "s3://models-bucket/ex"})  # fmt: skip
        sg = t["Resources"][group_id(t)]["Properties"]
        assert "SecurityGroupEgress" not in sg, "no egress to any address"
        egress = [e["Properties"] for e in of_type(t, "AWS::EC2::SecurityGroupEgress").values()]
        outside = [e for e in egress if "DestinationSecurityGroupId" not in e]
        assert outside == [{"GroupId": {"Fn::GetAtt": [group_id(t), "GroupId"]}, "DestinationPrefixListId": "pl-7ba54012",
                            "Description": "HTTPS: S3 (gateway endpoint) only", "FromPort": 443, "IpProtocol": "tcp", "ToPort": 443}]  # fmt: skip

    def test_proxy_opened_to_an_operator_cidr_only_when_given(self, synth_variant: Any) -> None:
        t = synth_variant(proxy_ingress_cidr="203.0.113.0/24")
        assert ingress_rules(t) - EXPECTED_6P1D_INGRESS == {("tcp", 8000, 8000, "203.0.113.0/24")}
        t = synth_variant(proxy_ingress_prefix_list_id="pl-0123456789abcdef0")
        assert ingress_rules(t) - EXPECTED_6P1D_INGRESS == {("tcp", 8000, 8000, '"pl-0123456789abcdef0"')}


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


class TestIam:
    def _statements(self, t: dict[str, Any]) -> list[dict[str, Any]]:
        """Every statement a node's role holds (the shared policy's and the roles' own), one per action
        and resource: the CLI's policy minimization may merge statements, which says nothing of what is granted."""
        out = []
        for p in of_type(t, "AWS::IAM::Policy").values():
            if any(r["Ref"].startswith(("Prefill", "Decode", "Server")) for r in p["Properties"]["Roles"]):
                out += p["Properties"]["PolicyDocument"]["Statement"]
        for lid, r in of_type(t, "AWS::IAM::Role").items():
            if lid.startswith(("Prefill", "Decode", "Server")):
                out += [st for doc in r["Properties"].get("Policies", []) for st in doc["PolicyDocument"]["Statement"]]
        flat: dict[str, dict[str, Any]] = {}  # each cell's copy of the shared policy grants the same: once
        for st in out:
            for a in st["Action"] if isinstance(st["Action"], list) else [st["Action"]]:
                for res in st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]:
                    one = {k: v for k, v in st.items() if k not in ("Action", "Resource")} | {"Action": a, "Resource": res}
                    flat[json.dumps(one, sort_keys=True)] = one
        return list(flat.values())

    def test_no_managed_policy_no_parameter_store_and_no_wildcard_action(self, default_synth: Synth) -> None:
        t = default_synth.template
        roles = {k: v for k, v in of_type(t, "AWS::IAM::Role").items() if k.startswith(("Prefill", "Decode"))}
        assert len(roles) == 2, "one role per node identity"
        for role in roles.values():
            assert "ManagedPolicyArns" not in role["Properties"], "AmazonSSMManagedInstanceCore reads every parameter of the account"
        for s in self._statements(t):
            actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
            assert not any(a == "*" or a.endswith(":*") for a in actions), s
            assert not any(a.startswith("ssm:GetParameter") for a in actions), s

    def test_every_optional_permission_is_exactly_the_allowlist(self, synth_variant: Any) -> None:
        """Model and examples in S3, the compile cache, results, KMS keys and the token's secret: each grant on its own resource."""
        from tests.stacks.least_privilege import assert_least_privilege

        key = "arn:aws:kms:us-east-2:123456789012:key/0123abcd-0123-4567-89ab-0123456789ab"
        for secret in ("arn:aws:secretsmanager:us-east-2:123456789012:secret:hf-token-AbCdEf", "arn:aws:secretsmanager:us-east-2:123456789012:secret:hf-token"):
            context = {"model": {"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b", "hf_token_secret_arn": secret},
                       "examples": {"s3_uri": "s3://models-bucket/vllm-neuron"}, "compile_cache_s3_uri": "s3://cache-bucket/neuron/2.33",
                       "results_s3_uri": "s3://results-bucket/runs", "kms_key_arns": [key]}  # fmt: skip
            assert_least_privilege(synth_variant(**context), load_config(context))

    def test_the_default_nodes_read_the_scripts_and_their_own_and_the_fleets_compile_cache(self, default_synth: Synth) -> None:
        from tests.stacks.least_privilege import assert_least_privilege

        assert_least_privilege(default_synth.template, load_config({}))
        t = default_synth.template
        resources = [s["Resource"] for s in self._statements(t) if s["Action"] == "s3:GetObject"]
        (scripts,) = [r for r in resources if ".xz" in json.dumps(r)]
        bucket = {"Fn::Sub": "cdk-hnb659fds-assets-${AWS::AccountId}-us-east-2"}
        parts = scripts["Fn::Join"][1]
        assert parts[:4] == ["arn:", {"Ref": "AWS::Partition"}, ":s3:::", bucket]
        assert len(parts) == 5 and parts[4].startswith("/") and parts[4].endswith(".xz") and "*" not in parts[4]
        manifest = json.loads((default_synth.outdir / "GptOss8k1kStack.assets.json").read_text())
        keys = {dest["objectKey"]: f["source"]["path"] for f in manifest["files"].values() for dest in f["destinations"].values()}
        assert keys[parts[4][1:]].startswith("asset.") and keys[parts[4][1:]].endswith(".xz")

    def test_model_prefix_read_only_when_configured(self, default_synth: Synth, synth_variant: Any) -> None:
        t = synth_variant(model={"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"})
        stmts = [s for s in self._statements(t) if "s3:" in json.dumps(s["Action"]) and "models-bucket" in json.dumps(s)]
        get = next(s for s in stmts if s["Action"] == "s3:GetObject")
        assert get["Resource"] == {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":s3:::models-bucket/gpt-oss-120b/*"]]}
        lst = next(s for s in stmts if s["Action"] == "s3:ListBucket")
        assert lst["Condition"] == {"StringLike": {"s3:prefix": ["gpt-oss-120b", "gpt-oss-120b/*"]}}

    def test_nodes_read_the_promoted_compile_cache_and_write_only_their_own_identitys_area(self, synth_variant: Any) -> None:
        t = synth_variant(compile_cache_s3_uri="s3://cache-bucket/neuron/2.33")
        roles = {lid: r for lid, r in of_type(t, "AWS::IAM::Role").items() if lid.startswith(("Prefill", "Decode"))}
        for lid, role in roles.items():
            node = "prefill-0" if lid.startswith("Prefill") else "decode-0"
            own = [st for doc in role["Properties"]["Policies"] for st in doc["PolicyDocument"]["Statement"] if "cache-bucket" in json.dumps(st)]
            writes = [st for st in own if "s3:PutObject" in st["Action"]]
            (w,) = writes
            assert w["Resource"] == {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, f":s3:::cache-bucket/neuron/2.33/nodes/{node}/*"]]}
        shared = [st for st in self._statements(t) if "cache-bucket" in json.dumps(st) and st["Action"] == "s3:GetObject"]
        fleet = {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":s3:::cache-bucket/neuron/2.33/fleet/*"]]}
        assert fleet in [st["Resource"] for st in shared]
        puts = [st for st in self._statements(t) if st["Action"] == "s3:PutObject"]
        assert puts and all("/nodes/prefill-0/" in json.dumps(st) or "/nodes/decode-0/" in json.dumps(st) for st in puts), "no shared write"

    def test_a_node_may_mark_only_its_own_instance_unhealthy(self, default_synth: Synth) -> None:
        t = default_synth.template
        for lid, role in of_type(t, "AWS::IAM::Role").items():
            if not lid.startswith(("Prefill", "Decode")):
                continue
            node = "prefill-0" if lid.startswith("Prefill") else "decode-0"
            sts = [st for doc in role["Properties"]["Policies"] for st in doc["PolicyDocument"]["Statement"] if "autoscaling:" in json.dumps(st)]
            def actions(st: dict[str, Any]) -> list[str]:
                return st["Action"] if isinstance(st["Action"], list) else [st["Action"]]

            # The replacement budget reads Auto Scaling's record (no narrower resource exists; CDK may merge it with another read on '*').
            assert [st["Resource"] for st in sts if "autoscaling:DescribeScalingActivities" in actions(st)] == ["*"], sts
            (st,) = [st for st in sts if "autoscaling:SetInstanceHealth" in actions(st)]
            assert actions(st) == ["autoscaling:SetInstanceHealth"]
            parts = st["Resource"]["Fn::Join"][1]
            assert parts[-1] == f":autoScalingGroup:*:autoScalingGroupName/gptoss-8k1k-{node}", parts
        everyone = [st for p in of_type(t, "AWS::IAM::Policy").values() for st in p["Properties"]["PolicyDocument"]["Statement"]]
        assert not [st for st in everyone if "autoscaling:" in json.dumps(st)], "no shared permission on any group"

    def test_customer_managed_keys_are_used_through_s3_and_secrets_manager_only(self, synth_variant: Any) -> None:
        key = "arn:aws:kms:us-east-2:123456789012:key/0123abcd-0123-4567-89ab-0123456789ab"
        t = synth_variant(kms_key_arns=[key], compile_cache_bucket=False, model={"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"})
        (st,) = [s for s in self._statements(t) if "kms:" in json.dumps(s["Action"])]
        assert (st["Action"], st["Resource"]) == ("kms:Decrypt", key), "reads only: no data keys without a write prefix"
        assert st["Condition"] == {"StringEquals": {"kms:ViaService": "s3.us-east-2.amazonaws.com"}}
        secret = "arn:aws:secretsmanager:us-east-2:123456789012:secret:hf-token-AbCdEf"
        t = synth_variant(kms_key_arns=[key], compile_cache_bucket=False, model={"hf_token_secret_arn": secret})
        (st,) = [s for s in self._statements(t) if "kms:" in json.dumps(s["Action"])]
        assert st["Condition"] == {"StringEquals": {"kms:ViaService": ["s3.us-east-2.amazonaws.com", "secretsmanager.us-east-2.amazonaws.com"]}}
        t = synth_variant(kms_key_arns=[key], results_s3_uri="s3://results-bucket/runs")
        assert sorted(s["Action"] for s in self._statements(t) if "kms:" in s["Action"]) == ["kms:Decrypt", "kms:GenerateDataKey"]
        assert not [s for s in self._statements(synth_variant()) if "kms:" in json.dumps(s)]

    def test_each_launch_template_names_its_own_nodes_instance_profile(self, default_synth: Synth) -> None:
        t = default_synth.template
        profiles = of_type(t, "AWS::IAM::InstanceProfile")
        named = [lt["Properties"]["LaunchTemplateData"]["IamInstanceProfile"]["Arn"]["Fn::GetAtt"][0] for lt in of_type(t, "AWS::EC2::LaunchTemplate").values()]
        assert sorted(named) == sorted(profiles), "one profile per node identity, each in its node's template"


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


def normalized(template: dict[str, Any]) -> dict[str, Any]:
    """The template without what the CLI adds on its own (metadata, bootstrap-version rule)."""
    t = json.loads(json.dumps(template))
    t["Resources"].pop("CDKMetadata", None)
    t.get("Conditions", {}).pop("CDKMetadataAvailable", None)
    if not t.get("Conditions"):
        t.pop("Conditions", None)
    t.get("Parameters", {}).pop("BootstrapVersion", None)
    t.pop("Rules", None)
    for r in t["Resources"].values():
        r.pop("Metadata", None)
        if r["Type"] == "AWS::CloudFormation::Stack":
            # A cell's template travels as an asset named by its hash; its resources are compared here flattened.
            r["Properties"]["TemplateURL"] = "<the cell's template>"
        if r["Type"] == "AWS::EC2::LaunchTemplate":
            # Decode the bundle so a change to one script reads as a diff of that script.
            from node_render.userdata import parse_user_data

            data = r["Properties"]["LaunchTemplateData"]
            joined = data["UserData"]["Fn::Base64"]
            parts = joined["Fn::Join"][1] if isinstance(joined, dict) else [joined]
            text = "".join(
                p
                if isinstance(p, str)
                else "<" + (".".join(p["Fn::GetAtt"]) if "Fn::GetAtt" in p else p["Ref"].rstrip("0123456789ABCDEF") if "Ref" in p else "bucket") + ">"
                for p in parts
            )
            files, deploy, doc = parse_user_data(text)
            data["UserData"] = {
                "bootcmd": [c[:3] + (["<bundle>"] if c[2].startswith("mkdir") else c[3:]) for c in doc["bootcmd"][:2]]
                + doc["bootcmd"][2:],
                "deploy.env": deploy,
                "bundle": {path: {"mode": oct(mode), "text": body.splitlines()} for path, (body, mode) in files.items()},
            }
        # The CLI's minimizePolicies flag sorts a statement's resources; an in-process synth does not.
        docs = [r["Properties"]["PolicyDocument"]] if r["Type"] == "AWS::IAM::Policy" else []
        docs += [p["PolicyDocument"] for p in r["Properties"].get("Policies", [])] if r["Type"] == "AWS::IAM::Role" else []
        for doc in docs:
            for st in doc["Statement"]:
                if isinstance(st.get("Resource"), list):
                    st["Resource"] = sorted(st["Resource"], key=lambda x: json.dumps(x, sort_keys=True))
    return t


def test_template_snapshot(default_synth: Synth, snapshot: Any) -> None:
    from syrupy.extensions.json import JSONSnapshotExtension

    assert normalized(default_synth.template) == snapshot(extension_class=JSONSnapshotExtension)


def test_the_compile_cache_bucket_is_private_encrypted_and_keeps_replaced_graphs_for_30_days(default_synth: Synth) -> None:
    (bucket,) = [b["Properties"] for b in default_synth.resources("AWS::S3::Bucket").values()]
    assert bucket["VersioningConfiguration"] == {"Status": "Enabled"}, "a bad promotion can be rolled back"
    (rule,) = bucket["LifecycleConfiguration"]["Rules"]
    assert rule["NoncurrentVersionExpiration"] == {"NoncurrentDays": 30} and rule["Status"] == "Enabled"
    assert rule["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 7}
    assert bucket["PublicAccessBlockConfiguration"] == {"BlockPublicAcls": True, "BlockPublicPolicy": True, "IgnorePublicAcls": True,
                                                         "RestrictPublicBuckets": True}  # fmt: skip
    assert bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"] == {"SSEAlgorithm": "AES256"}
