"""The network the template provisions: the VPC and its one subnet, endpoints without egress, the security
group that references itself for EFA and opens only the serving ports."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import Synth
from tests.stacks.template import group_id, groups, ingress_rules, launch_templates, of_type, one, self_ref

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
            # The router's API gate: HAProxy from the image (no apt source without egress).
            **{"serving.proxy.kind": "vllm-router", "serving.proxy.gate.from_image": "true"},
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
