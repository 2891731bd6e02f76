"""`cdk deploy` and `cdk destroy` of GptOss8k1kStack against a local moto server, checked with boto3.

The local configuration is one users can also choose on AWS: no NAT and no internet
gateway (nodes reach S3 through the gateway endpoint and SSM through interface endpoints),
model and examples from S3, the DLAMI from a named SSM parameter. Each node identity is an
Auto Scaling group of one; moto launches its instance, and replaces it when the group is told
to terminate it (what EC2 Auto Scaling does with an instance that failed a health check).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any

import pytest

from node_render.userdata import parse_user_data
from tests.conftest import STACK
from tests.lifecycle.local_aws import ACCOUNT, CLUSTER, REGION, LocalAws, inventory

pytestmark = pytest.mark.lifecycle

# egress none: S3 gateway, SSM for operators, CloudWatch logs and metrics for node telemetry
EGRESS_NONE_ENDPOINTS = {
    f"com.amazonaws.{REGION}.{service}": kind
    for service, kind in {
        "s3": "Gateway",
        "ssm": "Interface",
        "ssmmessages": "Interface",
        "ec2messages": "Interface",
        "ec2": "Interface",  # the fleet's members, by tag
        "autoscaling": "Interface",  # a node marking its own instance unhealthy
        "cloudformation": "Interface",  # a node's signal to its group (a surge or a rollback waits for it)
        "logs": "Interface",
        "monitoring": "Interface",
    }.items()
}


def rules(perms: list[dict[str, Any]], group_id: str) -> set[tuple[Any, ...]]:
    out = set()
    for p in perms:
        for pair in p.get("UserIdGroupPairs", []):
            out.add((p["IpProtocol"], p.get("FromPort"), p.get("ToPort"), "self" if pair["GroupId"] == group_id else pair["GroupId"]))
        for r in p.get("IpRanges", []):
            out.add((p["IpProtocol"], p.get("FromPort"), p.get("ToPort"), r["CidrIp"]))
    return out


# Resource types moto's CloudFormation creates but has no delete handler for (moto 5.2.x):
# a `cdk destroy` there leaves them, and the VPC behind them. CloudFormation on AWS deletes them.
MOTO_CANNOT_DELETE = ("AWS::EC2::VPCEndpoint", "AWS::EC2::FlowLog", "AWS::EC2::SubnetRouteTableAssociation", "AWS::EC2::RouteTable")


def remove_what_moto_cannot_delete(aws: LocalAws, resources: list[dict[str, Any]]) -> None:
    """Delete, through the EC2 API and by the ids CloudFormation recorded, only those types."""
    ec2 = aws.client("ec2")
    ids = {t: [r["PhysicalResourceId"] for r in resources if r["ResourceType"] == t] for t in MOTO_CANNOT_DELETE}
    if ids["AWS::EC2::VPCEndpoint"]:
        ec2.delete_vpc_endpoints(VpcEndpointIds=ids["AWS::EC2::VPCEndpoint"])
    if ids["AWS::EC2::FlowLog"]:
        ec2.delete_flow_logs(FlowLogIds=ids["AWS::EC2::FlowLog"])
    for table in ec2.describe_route_tables(RouteTableIds=ids["AWS::EC2::RouteTable"])["RouteTables"]:
        # moto records the table's id as the association's physical id: read the table's own.
        for assoc in table["Associations"]:
            if not assoc.get("Main"):
                ec2.disassociate_route_table(AssociationId=assoc["RouteTableAssociationId"])
        ec2.delete_route_table(RouteTableId=table["RouteTableId"])


def _doc(doc: Any) -> dict[str, Any]:
    """A role policy as boto3 hands it: parsed (AWS), or as the text moto stored from CloudFormation
    (JSON, or the Python form of the dict)."""
    if isinstance(doc, dict):
        return doc
    import ast

    try:
        return dict(json.loads(doc))
    except ValueError:
        return dict(ast.literal_eval(doc))


def deploy_check_destroy(
    aws: LocalAws, *context: str, stack: str = STACK, cluster: str = CLUSTER, via_gptoss: bool = False, between: Any = None
) -> dict[str, Any]:
    """Deploy, collect what was created, run `between` on it, destroy, and prove nothing created remains."""
    before = inventory(aws)
    ctx = [a for c in context for a in ("-c", c)]
    if via_gptoss:
        out = aws.gptoss("deploy", *ctx, "--require-approval", "never")
        assert out.stderr.splitlines()[0].startswith(f"stack {stack} · region {REGION}"), out.stderr
    else:
        aws.cdk("deploy", stack, "--require-approval", "never", *ctx)
    cf, ec2, iam, autoscaling = aws.client("cloudformation"), aws.client("ec2"), aws.client("iam"), aws.client("autoscaling")
    # A deploy can report success while a resource failed: read every resource's status, the cells' too.
    resources = cf.list_stack_resources(StackName=stack)["StackResourceSummaries"]
    nested = [r["PhysicalResourceId"] for r in resources if r["ResourceType"] == "AWS::CloudFormation::Stack"]
    assert nested, "the nodes are in cells (nested stacks)"
    for cell in nested:
        cell_resources = cf.list_stack_resources(StackName=cell)["StackResourceSummaries"]
        assert {r["ResourceStatus"] for r in cell_resources} == {"CREATE_COMPLETE"}, cell
        resources += cell_resources
    assert {r["ResourceStatus"] for r in resources} == {"CREATE_COMPLETE"}
    created = {k: v - before[k] for k, v in inventory(aws).items()}

    (group_id,) = [
        g["GroupId"] for g in ec2.describe_security_groups(GroupIds=sorted(created["security_groups"]))["SecurityGroups"]
        if {"Key": "gptoss:cluster", "Value": cluster} in g.get("Tags", [])
    ]  # fmt: skip
    group = ec2.describe_security_groups(GroupIds=[group_id])["SecurityGroups"][0]
    vpc = ec2.describe_vpcs(VpcIds=[group["VpcId"]])["Vpcs"][0]
    # Each node identity: its group of one, the template it launches from, the instance it holds now.
    holders = {g["AutoScalingGroupName"]: g for g in autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=sorted(created["groups"]))["AutoScalingGroups"]}
    nodes = {}
    for name, g in holders.items():
        tags = {t["Key"]: t["Value"] for t in g["Tags"]}
        (held,) = g["Instances"]
        data = ec2.describe_launch_template_versions(LaunchTemplateId=g["LaunchTemplate"]["LaunchTemplateId"])["LaunchTemplateVersions"][0]["LaunchTemplateData"]
        nodes[tags["gptoss:node"]] = {"group": g, "group_name": name, "tags": tags, "template": data, "instance_id": held["InstanceId"]}
    (subnet_id,) = {s for n in nodes.values() for s in n["group"]["VPCZoneIdentifier"].split(",")}
    subnet = ec2.describe_subnets(SubnetIds=[subnet_id])["Subnets"][0]
    instances = [i for r in ec2.describe_instances(InstanceIds=sorted(created["instances"]))["Reservations"] for i in r["Instances"]]
    # Each node's role, read back: its own inline statements and the shared policy (the allowlist is asserted on the templates).
    profiles = {p["InstanceProfileName"]: p for p in iam.list_instance_profiles()["InstanceProfiles"] if p["InstanceProfileName"] in created["instance_profiles"]}
    statements = {}
    for node, n in nodes.items():
        (profile,) = [p for p in profiles.values() if p["Arn"] == n["template"]["IamInstanceProfile"]["Arn"]]
        (role,) = [r["RoleName"] for r in profile["Roles"]]
        docs = [iam.get_role_policy(RoleName=role, PolicyName=pol)["PolicyDocument"] for pol in iam.list_role_policies(RoleName=role)["PolicyNames"]]
        # moto hands a policy that CloudFormation wrote back as JSON text; AWS as the parsed document.
        statements[node] = [st for doc in docs for st in (_doc(doc))["Statement"]]
        assert len(docs) == 2, f"{node}: its own policy and the shared one ({docs})"
    endpoints = {
        e["ServiceName"]: e["VpcEndpointType"]
        for e in ec2.describe_vpc_endpoints()["VpcEndpoints"]
        if e["VpcEndpointId"] in created["endpoints"]
    }
    # What each node will fetch at boot: the object its template's user data names, in the bootstrap
    # bucket, with the sha256 its user data names.
    s3 = aws.client("s3")
    for n in nodes.values():
        _, deploy, _ = parse_user_data(base64.b64decode(n["template"]["UserData"]).decode())
        # rollout.software=in-place: the version is the one the stack's parameter names (the user data names the parameter).
        version = aws.client("ssm").get_parameter(Name=deploy["GPTOSS_SOFTWARE_PARAMETER"])["Parameter"]["Value"]
        uri, sha = version.split(" ")
        bucket, key = uri.removeprefix("s3://").split("/", 1)
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert hashlib.sha256(body).hexdigest() == sha
        assert not [k for k in deploy if k.startswith("GPTOSS_HOST_")], "no node's user data names another's address"
        n["deploy"] = deploy
        asset_arn = f"arn:aws:s3:::{bucket}/{key}"
    seen = {
        "asset_arn": asset_arn,
        "vpc": vpc,
        "subnet": subnet,
        "group": group,
        "rules_in": rules(group["IpPermissions"], group["GroupId"]),
        "nodes": nodes,
        "instances": instances,
        "statements": statements,
        "endpoints": endpoints,
        "created": created,
        "nested_stacks": [cf.describe_stacks(StackName=c)["Stacks"][0]["StackName"] for c in nested],
    }
    if between:
        between(seen)

    remove_what_moto_cannot_delete(aws, resources)
    if via_gptoss:
        seen["destroy"] = aws.gptoss("destroy", "--yes", *ctx).stderr
    else:
        aws.cdk("destroy", stack, "--force", *ctx)
    stacks = [s for s in cf.list_stacks()["StackSummaries"] if s["StackName"] == stack]
    assert stacks and all(s["StackStatus"] == "DELETE_COMPLETE" for s in stacks), stacks
    after = inventory(aws)
    left = {k: sorted(created[k] & after[k]) for k in created if created[k] & after[k]}
    assert left == {}, f"resources the stack created are still there after destroy: {left}\n{seen.get('destroy', '')[-3000:]}"
    live = [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"] if i["State"]["Name"] != "terminated"
            and {"Key": "gptoss:cluster", "Value": cluster} in i.get("Tags", [])]  # fmt: skip
    assert live == [], f"instances of {cluster} still run after destroy (a replacement among them?): {[i['InstanceId'] for i in live]}"
    assert not aws.client("ec2").describe_flow_logs()["FlowLogs"]
    seen["after"] = after
    return seen


EXPECTED_6P1D = {
    ("-1", None, None, "self"),
    ("tcp", 8000, 8000, "self"),
    ("tcp", 8100, 8105, "self"),
    ("tcp", 8200, 8200, "self"),
    *{("tcp", 5559 + 100 * i, 5562 + 100 * i, "self") for i in range(6)},
    ("tcp", 8759, 8886, "self"),
}


def _check_templates(nodes: dict[str, Any], group_id: str) -> None:
    for node, n in nodes.items():
        data = n["template"]
        nics = sorted(data["NetworkInterfaces"], key=lambda x: x["NetworkCardIndex"])
        assert [x["NetworkCardIndex"] for x in nics] == list(range(16)), node
        assert [x["InterfaceType"] for x in nics] == ["efa"] + ["efa-only"] * 15
        assert not [x for x in nics if "SubnetId" in x], "the group launches every interface into its subnet"
        assert all(x["Groups"] == [group_id] for x in nics)
        assert nics[0]["AssociatePublicIpAddress"] is False
        assert data["MetadataOptions"]["HttpTokens"] == "required"
        assert data["InstanceType"] == "trn3.48xlarge"
        (root,) = data["BlockDeviceMappings"]
        assert root["Ebs"]["Encrypted"] is True and root["Ebs"]["VolumeSize"] >= 512


def _identities(instances: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return sorted((t["gptoss:role"], t["gptoss:node"]) for t in ({x["Key"]: x["Value"] for x in i["Tags"]} for i in instances))


def _replace_one_instance_and_see_it_in_status(aws: LocalAws, seen: dict[str, Any]) -> None:
    """prefill-0's instance goes (its group terminates it, as it does one that failed a health check);
    the group launches one of the same identity; `gptoss status` shows the new one under prefill-0."""
    autoscaling, ec2 = aws.client("autoscaling"), aws.client("ec2")
    prefill = seen["nodes"]["prefill-0"]
    old = prefill["instance_id"]
    autoscaling.terminate_instance_in_auto_scaling_group(InstanceId=old, ShouldDecrementDesiredCapacity=False)
    (held,) = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[prefill["group_name"]])["AutoScalingGroups"][0]["Instances"]
    new = held["InstanceId"]
    assert new != old
    (inst,) = [i for r in ec2.describe_instances(InstanceIds=[new])["Reservations"] for i in r["Instances"]]
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert {k: tags[k] for k in ("gptoss:cluster", "gptoss:role", "gptoss:node")} == {"gptoss:cluster": CLUSTER, "gptoss:role": "prefill", "gptoss:node": "prefill-0"}
    assert inst["SubnetId"] == seen["subnet"]["SubnetId"], "the same subnet"
    (gone,) = [i for r in ec2.describe_instances(InstanceIds=[old])["Reservations"] for i in r["Instances"]]
    assert gone["State"]["Name"] in ("shutting-down", "terminated")
    # moto's Run Command answers no node (its status report is empty): not ready, exit 1, and the nodes table shows who holds what.
    out = aws.gptoss("status", codes=(1,)).stdout
    line = next(x for x in out.splitlines() if "prefill-0" in x and "i-" in x)
    assert new in line and old not in out, out
    seen["replacement"] = (old, new)


def test_default_two_node_stack_deploys_replaces_a_lost_node_and_is_destroyed(local_aws: LocalAws) -> None:
    seen = deploy_check_destroy(local_aws, between=lambda s: _replace_one_instance_and_see_it_in_status(local_aws, s))
    assert seen["created"]["vpcs"] == {seen["vpc"]["VpcId"]} and seen["created"]["subnets"] == {seen["subnet"]["SubnetId"]}
    assert seen["vpc"]["CidrBlock"] == "10.42.0.0/16"
    assert (seen["subnet"]["CidrBlock"], seen["subnet"]["AvailabilityZone"]) == ("10.42.0.0/20", "us-east-2a")
    assert seen["subnet"]["MapPublicIpOnLaunch"] is False
    assert seen["rules_in"] == EXPECTED_6P1D
    _check_templates(seen["nodes"], seen["group"]["GroupId"])
    assert sorted(seen["nodes"]) == ["decode-0", "prefill-0"]
    assert _identities(seen["instances"]) == [("decode", "decode-0"), ("prefill", "prefill-0")]
    assert all(i["State"]["Name"] == "running" for i in seen["instances"])
    for node, sts in seen["statements"].items():
        reads = {r for st in sts if "s3:GetObject" in st["Action"] for r in (st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]])}
        assert reads == {
            seen["asset_arn"],
            "arn:aws:s3:::gptoss-local-models/gpt-oss-120b/*",
            "arn:aws:s3:::gptoss-local-models/vllm-neuron/*",
            "arn:aws:s3:::gptoss-local-models/neuron-cache/fleet/*",
            f"arn:aws:s3:::gptoss-local-models/neuron-cache/nodes/{node}/*",
        }, node
        writes = {r for st in sts if "s3:PutObject" in st["Action"] for r in (st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]])}
        assert writes == {f"arn:aws:s3:::gptoss-local-models/neuron-cache/nodes/{node}/*"}, node
        health = [st for st in sts if st["Action"] == "autoscaling:SetInstanceHealth"]
        assert [st["Resource"] for st in health] == [f"arn:aws:autoscaling:us-east-2:{ACCOUNT}:autoScalingGroup:*:autoScalingGroupName/gptoss-8k1k-{node}"]
    assert seen["endpoints"] == EGRESS_NONE_ENDPOINTS
    assert seen["replacement"][0] != seen["replacement"][1]


def test_production_three_plus_eight_in_an_existing_vpc_deploys_and_is_destroyed(local_aws: LocalAws) -> None:
    """The operator's own network (VPC, subnet, S3 endpoint) stays; everything the stack made goes."""
    ec2 = local_aws.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.50.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.50.0.0/20", AvailabilityZone="us-east-2a")["Subnet"]["SubnetId"]
    table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    ec2.associate_route_table(RouteTableId=table, SubnetId=subnet)
    ec2.create_vpc_endpoint(VpcId=vpc, ServiceName=f"com.amazonaws.{REGION}.s3", VpcEndpointType="Gateway", RouteTableIds=[table])
    # moto's CloudFormation creates every ELBv2 load balancer as an application one and then
    # rejects the NLB's TCP listener: the local run uses per-proxy URLs (proxy_load_balancer=false).
    seen = deploy_check_destroy(
        local_aws,
        "decode_instances=8",
        # Cells of at most 4 nodes: the decode nodes in two nested stacks, the prefill nodes in one.
        "cell_nodes=4",
        "proxy_load_balancer=false",
        f'network={{"vpc_id": "{vpc}", "subnet_id": "{subnet}", "placement_group": "gptoss-local-cpg"}}',
    )
    assert (seen["vpc"]["VpcId"], seen["subnet"]["SubnetId"]) == (vpc, subnet)
    assert not seen["created"]["vpcs"] and not seen["created"]["subnets"] and not seen["created"]["endpoints"]
    assert vpc in seen["after"]["vpcs"] and subnet in seen["after"]["subnets"]
    assert [r for r, _ in _identities(seen["instances"])] == ["decode"] * 8 + ["prefill"] * 3
    assert ("tcp", 8100, 8115, "self") in seen["rules_in"]
    assert {("tcp", 5559 + 100 * i, 5562 + 100 * i, "self") for i in range(16)} <= seen["rules_in"]
    _check_templates(seen["nodes"], seen["group"]["GroupId"])
    cells = sorted(c.split("-")[1].split("NestedStack")[0] for c in seen["nested_stacks"])
    assert cells == ["DecodeCell0", "DecodeCell0Alarms", "DecodeCell1", "DecodeCell1Alarms", "PrefillCell0", "PrefillCell0Alarms"], seen["nested_stacks"]


def test_single_instance_recipe_with_the_stacks_own_cache_bucket_deploys_and_is_destroyed(local_aws: LocalAws) -> None:
    """`gptoss deploy -c recipe=gptoss-20b-single` (the CLI, as an operator runs it): one server, one
    interface, port 8000, and the compile cache in a bucket of the stack's, which `gptoss destroy`
    empties (a node saved its graphs there) before CloudFormation deletes it."""

    def a_node_saved_its_cache(seen: dict[str, Any]) -> None:
        (bucket,) = [b for b in seen["created"]["buckets"]]
        assert seen["nodes"]["server-0"]["deploy"]["GPTOSS_COMPILE_CACHE_URI"] == f"s3://{bucket}"
        local_aws.client("s3").put_object(Bucket=bucket, Key="nodes/server-0/manifest.json", Body=b"{}")
        # `gptoss diff` before a change: the deployed stack and its cell read back from CloudFormation
        # (get_template of each) and compared node by node with the new synth; nothing is deployed.
        ctx = ["-c", "recipe=gptoss-20b-single", "-c", "compile_cache_s3_uri=null"]
        same = local_aws.gptoss("diff", *ctx).stderr
        assert "this deploy replaces no instance (1 running node keeps its own)" in same, same[-3000:]
        # A software change (the device wait: the node's settings and its check's unit), applied in place: the deployed
        # version read where the stack's parameter names it (S3, checked by its sha256), compared file by file.
        changed = local_aws.gptoss("diff", *ctx, "-c", "boot.devices_s=240").stderr
        assert "this deploy replaces no instance (1 running node keeps its own)" in changed, changed[-3000:]
        assert re.search(r"^software [0-9a-f]{12} -> [0-9a-f]{12}, in place \(no instance replaced\)", changed, re.M), changed[-3000:]
        # Every unit that reads the node's settings (cluster.env) restarts; the collector (telemetry.json) does not.
        assert ("  server-0: restart gptoss-nvme.service, gptoss-identity.service, gptoss-node-check.service, gptoss-stage.service, "
                "gptoss-server.service") in changed, changed[-3000:]  # fmt: skip
        assert "  server: 1 batch of at most 1, minimum serving server 0/1, about 1 x a node's restart (not measured yet; each at most 30 min)" in changed
        # A machine change (the root volume): the instance is replaced, with surge, and the reason said.
        machine = local_aws.gptoss("diff", *ctx, "-c", "root_volume_gb=700").stderr
        assert ("this deploy replaces the instances of 1 of the 1 running nodes, in batches (each replacement launched and "
                "serving before its old instance is terminated (surge)): batch 1: server-0") in machine, machine[-3000:]  # fmt: skip
        assert "server: 1 batch, at most 0 of 1 out (surge: each replacement serves before its old instance goes), minimum serving server 1/1" in machine
        assert "  why server-0: the root volume (a new machine)" in machine, machine[-3000:]

    seen = deploy_check_destroy(
        local_aws, "recipe=gptoss-20b-single", "compile_cache_s3_uri=null", stack="GptOss20bSingleStack", cluster="gptoss-20b-single",
        via_gptoss=True, between=a_node_saved_its_cache,
    )  # fmt: skip
    assert [n for _, n in _identities(seen["instances"])] == ["server-0"]
    data = seen["nodes"]["server-0"]["template"]
    (nic,) = data["NetworkInterfaces"]
    assert (nic["NetworkCardIndex"], nic.get("InterfaceType", "interface")) == (0, "interface")
    assert data["MetadataOptions"]["HttpTokens"] == "required" and "Placement" not in data
    assert {r for r in seen["rules_in"] if r[0] == "tcp"} == {("tcp", 8000, 8000, "self")}
    # A single server has no peers, but it surges (On-Demand): it reads its own tags (EC2) and signals its group
    # (CloudFormation) when a rollout replaces it, so the endpoints are the fleet's.
    assert seen["endpoints"] == EGRESS_NONE_ENDPOINTS
