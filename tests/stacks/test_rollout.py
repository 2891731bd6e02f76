"""What a deploy does to the running nodes, said before it runs (cluster_ops/rollout.py).

Each case synthesizes two assemblies, as `gptoss deploy` synthesizes the new one, and compares
them; the expected nodes are typed out from what changes in each node's files, not computed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from cluster_ops import rollout
from clusterspec.loading import load_config
from tests.conftest import ROOT, STACK

PROD = {"decode_instances": "8"}
# Software in the launch template (rollout.software=replace): a server flag replaces the instances, as
# these cases of the replacement path need; the default applies it in place (test_in_place.py).
REPLACE = {"rollout.software": "replace"}
# The default layout is the reference's: its toy proxy runs on prefill-0.
ENDPOINT_MOVES = (
    "  prefill-0 serves the endpoint with no load balancer: a client's port forward (stack output ProxyPortForward) or address "
    "ends with the old instance; connect again once it is gone (gptoss status shows the new address), or set "
    "proxy_load_balancer=true for one address through replacements"
)


@pytest.fixture(scope="module")
def assembly(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """The cloud assembly of a parameter set, synthesized in-process (cached per set)."""
    import aws_cdk as cdk

    from stacks.cluster_stack import GptOssClusterStack

    cache: dict[str, Path] = {}

    def get(**context: str) -> Path:
        key = json.dumps(context, sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp("assembly")
            cdk_context = {k: v for k, v in context.items() if ":" in k}  # the CLI's own keys (gptoss:first-deploy)
            app = cdk.App(context=json.loads((ROOT / "cdk.json").read_text())["context"] | cdk_context, outdir=str(out))
            GptOssClusterStack(app, STACK, config=load_config({k: v for k, v in context.items() if ":" not in k}))
            cache[key] = Path(app.synth().directory)
        return cache[key]

    return get


def _rollout(assembly: Callable[..., Path], before: dict[str, str], after: dict[str, str]) -> rollout.Rollout:
    return rollout.compare(rollout.synthesized(assembly(**before), STACK), rollout.synthesized(assembly(**after), STACK))


def test_the_same_parameters_replace_nothing(assembly: Callable[..., Path]) -> None:
    r = _rollout(assembly, {}, {})
    assert (r.kept, r.replaced, r.launched, r.removed) == (["decode-0", "prefill-0"], [], [], [])
    assert rollout.describe(load_config({}), r) == ["this deploy replaces no instance (2 running nodes keep their own)"]
    assert r.batch == {}


def test_a_prefill_flag_replaces_no_instance_in_place_and_the_prefill_node_with_replace(assembly: Callable[..., Path]) -> None:
    """In place (the default) the flag is restarted on prefill-0 (tests/stacks/test_in_place.py); with
    rollout.software=replace, the node whose own software carries it is replaced, the other not."""
    r = _rollout(assembly, {}, {"serving.prefill.max_num_seqs": "2"})
    assert (r.kept, r.replaced) == (["decode-0", "prefill-0"], [])
    r = _rollout(assembly, REPLACE, REPLACE | {"serving.prefill.max_num_seqs": "2"})
    assert (r.kept, r.replaced) == (["decode-0"], ["prefill-0"])


def test_a_decode_flag_replaces_the_prefill_node_too_because_its_benchmark_unit_carries_it(assembly: Callable[..., Path]) -> None:
    """The benchmark unit on prefill-0 runs at the decode server's batch size: its user data changes as well.
    On-Demand (the default) surges: each replacement serves before its old instance goes, so even the
    two-node default keeps serving."""
    r = _rollout(assembly, REPLACE, REPLACE | {"serving.decode.max_num_seqs": "4"})
    assert (r.kept, r.replaced) == ([], ["decode-0", "prefill-0"])
    assert r.batch == {"decode-0": 1, "prefill-0": 1} and r.surge == {"decode-0": True, "prefill-0": True}
    lines = rollout.describe(load_config({"serving.decode.max_num_seqs": "4"}), r)
    assert lines[0] == ("this deploy replaces the instances of 2 of the 2 running nodes, in batches (each replacement launched and "
                        "serving before its old instance is terminated (surge)): batch 1: decode-0, prefill-0")  # fmt: skip
    assert lines[1] == ("  prefill: 1 batch, at most 0 of 1 out (surge: each replacement serves before its old instance goes), minimum "
                        "serving prefill 1/1, about 1 x a node's time to serve (each batch up to 60 min from its turn: a surge replacement's signal)")  # fmt: skip
    assert not any("serves nothing" in line for line in lines)
    assert ENDPOINT_MOVES in lines
    assert lines[-1].startswith("  with surge a replacement must serve within 60 min (CloudFormation's limit)")


def test_without_surge_the_two_node_default_says_it_is_down(assembly: Callable[..., Path]) -> None:
    before = REPLACE | {"rollout.surge": "off"}
    after = before | {"serving.decode.max_num_seqs": "4"}
    r = _rollout(assembly, before, after)
    assert r.surge == {"decode-0": False, "prefill-0": False}
    lines = rollout.describe(load_config(after), r)
    assert lines[0].endswith("in batches (each node's group terminates its instance, then launches the new one): batch 1: decode-0, prefill-0")
    assert "  a role with every node in one batch and no surge serves nothing: the endpoint is down until the replacements serve" in lines
    assert ENDPOINT_MOVES in lines


def test_a_replaced_endpoint_node_is_named_unless_a_load_balancer_keeps_the_address() -> None:
    """The default layout's endpoint is prefill-0's instance, where the reference runs its proxy (a port
    forward is a session to it); behind the NLB it is one address. A single-instance recipe's endpoint
    is its server, with no NLB to offer."""
    both = rollout.Rollout(replaced=["decode-0", "prefill-0"], batch={"decode-0": 1, "prefill-0": 1}, surge={"decode-0": True, "prefill-0": True})
    assert ENDPOINT_MOVES in rollout.describe(load_config({}), both)
    assert not any("endpoint with no load balancer" in line for line in rollout.describe(load_config({"proxy_load_balancer": "true"}), both))
    decode_only = rollout.Rollout(kept=["prefill-0"], replaced=["decode-0"], batch={"decode-0": 1}, surge={"decode-0": True})
    assert not any("endpoint" in line for line in rollout.describe(load_config({}), decode_only))
    routed = load_config({"serving.proxy.kind": "vllm-router"})  # the router runs on decode-0
    lines = rollout.describe(routed, decode_only)
    assert ENDPOINT_MOVES.replace("prefill-0", "decode-0") in lines
    single = load_config({"recipe": "gptoss-20b-single"})
    name = single.layout.nodes[0].name
    lines = rollout.describe(single, rollout.Rollout(replaced=[name], batch={name: 1}, surge={name: True}))
    assert (f"  {name} serves the endpoint with no load balancer: a client's port forward (stack output ServerPortForward) or "
            "address ends with the old instance; connect again once it is gone (gptoss status shows the new address)") in lines  # fmt: skip


def test_a_router_setting_replaces_no_instance_and_changes_only_the_fleets_document(assembly: Callable[..., Path]) -> None:
    """The routers' settings are the fleet's SSM parameter, read at run time (the routers restart one node
    at a time to take them): no node's launch template changes."""
    changed = PROD | {"serving.proxy.router.health_check_timeout_s": "12", "serving.proxy.router.request_timeout_s": "900"}
    r = _rollout(assembly, PROD, changed)
    assert (r.replaced, r.launched, r.removed) == ([], [], []) and len(r.kept) == 11
    assert rollout.describe(load_config(changed), r) == ["this deploy replaces no instance (11 running nodes keep their own)"]
    params = {p: json.loads((assembly(**c) / f"{STACK}.template.json").read_text())["Resources"] for p, c in (("before", PROD), ("after", changed))}
    values = {k: next(r["Properties"]["Value"] for r in v.values() if r["Type"] == "AWS::SSM::Parameter" and r["Properties"]["Name"].endswith("/router"))
              for k, v in params.items()}  # fmt: skip
    assert "arg --health-check-timeout-secs\narg 10\n" in values["before"] and "arg --health-check-timeout-secs\narg 12\n" in values["after"]
    assert "arg --request-timeout-secs\narg 900\n" in values["after"]


def test_a_decode_machine_change_rolls_the_production_layouts_decode_nodes_one_at_a_time(assembly: Callable[..., Path]) -> None:
    """Without surge (a reservation's default): eight replacements in eight batches, each after the one before serves.
    The change: the reservation the decode role launches into (its machine; the prefill role's stays)."""
    base = PROD | {"capacity.type": "odcr", "capacity.reservation_id": "cr-0aaaaaaaaaaaaaaa1", "rollout.surge": "off"}
    changed = base | {"capacity.roles.decode.reservation_id": "cr-0bbbbbbbbbbbbbbb2"}
    r = _rollout(assembly, base, changed)
    assert r.replaced == [f"decode-{i}" for i in range(8)] and r.kept == ["prefill-0", "prefill-1", "prefill-2"]
    assert r.batch == {f"decode-{i}": i + 1 for i in range(8)}
    assert rollout.describe(load_config(changed), r) == [
        "this deploy replaces the instances of 8 of the 11 running nodes, in batches (each node's group terminates its instance, then "
        "launches the new one): batch 1: decode-0; batch 2: decode-1; batch 3: decode-2; batch 4: decode-3; batch 5: decode-4; "
        "batch 6: decode-5; batch 7: decode-6; batch 8: decode-7",
        "  decode: 8 batches, at most 1 of 8 out, minimum serving decode 7/8, about 8 x a node's time to serve (each batch waits for "
        "its deploy gates, up to 415 min from its turn)",
        "  kept: prefill-0..2",
    ]
    assert rollout.role_lines(load_config(changed), r, ready_min=40)[0] == (
        "decode: 8 batches, at most 1 of 8 out, minimum serving decode 7/8, about 320 min (8 x 40 min, a node's time to serve at the last deploy)"
    )


def test_a_percentage_makes_lanes_and_a_script_change_rolls_both_roles(assembly: Callable[..., Path]) -> None:
    """max_unavailable 25 %: 2 lanes of the 8 decode nodes (8 x 25 % = 2), 1 of the 3 prefill nodes (rounded down, at least 1)."""
    base = PROD | {"rollout.surge": "off", "rollout.max_unavailable": "25%"}
    r = _rollout(assembly, base, base | {"ami_id": "ami-0fedcba9876543210"})
    assert r.batch == {"prefill-0": 1, "prefill-1": 2, "prefill-2": 3,
                       "decode-0": 1, "decode-1": 1, "decode-2": 2, "decode-3": 2, "decode-4": 3, "decode-5": 3, "decode-6": 4, "decode-7": 4}  # fmt: skip
    assert rollout.role_lines(load_config(base), r) == [
        "prefill: 3 batches, at most 1 of 3 out, minimum serving prefill 2/3, about 3 x a node's time to serve (each batch waits for its "
        "deploy gates, up to 415 min from its turn)",
        "decode: 4 batches, at most 2 of 8 out, minimum serving decode 6/8, about 4 x a node's time to serve (each batch waits for its "
        "deploy gates, up to 415 min from its turn)",
    ]


def test_one_more_decode_node_launches_two_and_replaces_none(assembly: Callable[..., Path]) -> None:
    """decode_instances 8 -> 9: the ninth decode node and, at 3 prefill per 8 decode, a fourth prefill node.
    The pool is the fleet's document, not the existing nodes' user data: all eleven keep their instance
    and launch template; the launched ones wait for nothing of the rollout."""
    r = _rollout(assembly, PROD, {"decode_instances": "9"})
    assert r.replaced == [] and r.removed == []
    assert r.launched == ["decode-8", "prefill-3"] and len(r.kept) == 11
    before, after = (rollout.synthesized(assembly(**c), STACK) for c in (PROD, {"decode_instances": "9"}))
    templates = {k: {lid: res for lid, res in v.items() if res["Type"] == "AWS::EC2::LaunchTemplate"} for k, v in (("b", before), ("a", after))}
    assert len(templates["b"]) == 11 and all(templates["a"][lid] == res for lid, res in templates["b"].items()), "byte for byte the same"


def _groups(path: Path) -> dict[str, dict[str, Any]]:
    """Each node's group resource (flattened), by node."""
    groups = [res for res in rollout.synthesized(path, STACK).values() if res["Type"] == "AWS::AutoScaling::AutoScalingGroup"]
    return {next(t["Value"] for t in g["Properties"]["Tags"] if t["Key"] == "gptoss:node"): g for g in groups}


def _handles(path: Path) -> dict[str, dict[str, Any]]:
    """Each node's deploy gate handle (flattened), by node: the one its group's launch template names."""
    flat = rollout.synthesized(path, STACK)
    out = {}
    for lid, g in flat.items():
        if g["Type"] != "AWS::AutoScaling::AutoScalingGroup":
            continue
        node = next(t["Value"] for t in g["Properties"]["Tags"] if t["Key"] == "gptoss:node")
        scope = lid.rpartition("/")[0]
        template = flat[f"{scope}/{g['Properties']['LaunchTemplate']['LaunchTemplateId']['Ref']}"]
        (handle,) = [f"{scope}/{r}" for r in re.findall(r'"Ref": "([^"]+Handle[^"]*)"', json.dumps(template)) if f"{scope}/{r}" in flat]
        out[node] = flat[handle]
    return out


def test_a_nodes_turn_waits_for_every_earlier_node_of_its_lane_so_an_unchanged_node_holds_nothing(assembly: Callable[..., Path]) -> None:
    """A node's turn: its gate's handle (made then, with its 24-hour URL, and so the launch template
    version that carries it) waits for the gates of the earlier nodes of its lane, and its group for
    their groups (what paces a rollback, which re-applies the previous template whose gates are done).
    decode-2 waits for decode-0 too, not only decode-1: when a change leaves decode-1 alone (its gate
    does not change, so it is passed at once), decode-2 still waits for decode-0 to serve."""
    groups, handles = _groups(assembly(**PROD)), _handles(assembly(**PROD))
    on_groups = {node: sorted(d.split("Group")[0] for d in g.get("DependsOn", [])) for node, g in groups.items()}
    on_gates = {node: sorted(d.split("Ready")[0] for d in h.get("DependsOn", [])) for node, h in handles.items()}
    for deps in (on_groups, on_gates):
        assert deps["decode-0"] == [] and deps["prefill-0"] == []
        assert deps["decode-2"] == ["Decode0", "Decode1"]
        assert deps["decode-7"] == [f"Decode{i}" for i in range(7)]
        assert deps["prefill-2"] == ["Prefill0", "Prefill1"]
    assert all(d.split("Ready")[1].startswith(tuple("0123456789abcdef")) and "Condition" in d for h in handles.values() for d in h.get("DependsOn", []))
    assert rollout.batches(["decode-0", "decode-2"], rollout.waits_for(rollout.synthesized(assembly(**PROD), STACK))) == {"decode-0": 1, "decode-2": 2}


def test_max_surge_makes_parallel_lanes(assembly: Callable[..., Path]) -> None:
    """rollout.max_surge 25 %: 2 lanes of the 8 decode nodes (8 x 25 % = 2), 1 of the 3 prefill nodes
    (0.75, rounded up); a surge change of all eleven rolls in ceil(8 / 2) = 4 and 3 batches."""
    ctx = PROD | REPLACE | {"rollout.max_surge": "25%"}
    on_groups = {node: sorted(d.split("Group")[0] for d in g.get("DependsOn", [])) for node, g in _groups(assembly(**ctx)).items()}
    assert on_groups["decode-1"] == [] and on_groups["decode-5"] == ["Decode1", "Decode3"] and on_groups["prefill-2"] == ["Prefill0", "Prefill1"]
    r = _rollout(assembly, ctx, ctx | {"serving.prefill.max_num_seqs": "2", "serving.decode.max_num_seqs": "4"})
    assert {n: r.batch[n] for n in r.replaced if n.startswith("decode")} == {f"decode-{i}": i // 2 + 1 for i in range(8)}
    assert rollout.role_lines(load_config(ctx), r)[0].startswith("prefill: 3 batches, at most 0 of 3 out (surge")
    assert rollout.role_lines(load_config(ctx), r)[1].startswith("decode: 4 batches, at most 0 of 8 out (surge")


def test_the_first_deploy_is_not_chained(assembly: Callable[..., Path]) -> None:
    """gptoss deploy of a stack that does not exist yet (gptoss:first-deploy): every node launches at once."""
    groups = _groups(assembly(**PROD, **{"gptoss:first-deploy": "true"}))
    assert len(groups) == 11 and all("DependsOn" not in g for g in groups.values())


def test_each_group_rolls_its_one_instance_with_or_without_surge(assembly: Callable[..., Path]) -> None:
    """Surge (On-Demand): the group grows to two, the replacement launches first and the update waits up to an
    hour for its signal; off: terminate, then launch, and wait up to an hour for a signal it does not require;
    no gate: nothing to wait for. All: a leaving instance runs 90 s more (the drain hook)."""
    hook = [{"LifecycleHookName": "gptoss-drain", "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING", "HeartbeatTimeout": 90, "DefaultResult": "CONTINUE"}]
    suspended = ["HealthCheck", "ReplaceUnhealthy", "AZRebalance", "AlarmNotification", "ScheduledActions"]
    for context, (size, update) in {
        (): ("2", {"MaxBatchSize": 1, "MinInstancesInService": 1, "PauseTime": "PT3600S", "WaitOnResourceSignals": True, "SuspendProcesses": suspended}),
        # Without surge: the update waits up to an hour for the replacement's signal and goes on without it (0 %):
        # the gate judges the node; the wait paces a rollback, which re-applies this policy to the previous version.
        (("rollout.surge", "off"),): ("1", {"MaxBatchSize": 1, "MinInstancesInService": 0, "PauseTime": "PT3600S", "WaitOnResourceSignals": True,
                                            "MinSuccessfulInstancesPercent": 0, "SuspendProcesses": suspended}),
        (("rollout.surge", "off"), ("wait_for_ready", "false")): ("1", {"MaxBatchSize": 1, "MinInstancesInService": 0, "PauseTime": "PT0S",
                                                                        "WaitOnResourceSignals": False, "SuspendProcesses": suspended}),
    }.items():  # fmt: skip
        for node, g in _groups(assembly(**dict(context))).items():
            assert (g["Properties"]["MinSize"], g["Properties"]["MaxSize"], g["Properties"]["DesiredCapacity"]) == ("1", size, "1"), node
            assert g["UpdatePolicy"] == {"AutoScalingRollingUpdate": update}, node
            assert g["Properties"]["LifecycleHookSpecificationList"] == hook, node


def test_the_deployed_side_is_read_from_cloudformation_stack_and_cells(assembly: Callable[..., Path]) -> None:
    """get_template of the stack and of each cell (its physical id from the stack's resources), flattened
    the same way: what is deployed from this assembly compares as unchanged."""
    path = assembly()
    parent = json.loads((path / f"{STACK}.template.json").read_text())
    cfn = boto3.client("cloudformation", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(cfn)
    stub.add_response("get_template", {"TemplateBody": json.dumps(parent)}, {"StackName": STACK, "TemplateStage": "Original"})
    cells = [lid for lid, res in parent["Resources"].items() if res["Type"] == "AWS::CloudFormation::Stack"]
    assert len(cells) == 4, "two cells, and each cell's NodeSilent alarms"
    summaries: list[dict[str, Any]] = [
        {"LogicalResourceId": lid, "PhysicalResourceId": f"arn:aws:cloudformation:us-east-2:123456789012:stack/{STACK}-{lid}/1",
         "ResourceType": "AWS::CloudFormation::Stack", "LastUpdatedTimestamp": "2026-12-03T00:00:00Z", "ResourceStatus": "CREATE_COMPLETE"}
        for lid in cells
    ]  # fmt: skip
    stub.add_response("list_stack_resources", {"StackResourceSummaries": summaries}, {"StackName": STACK})
    nested = rollout.synthesized(path, STACK)
    for lid, s in zip(cells, summaries, strict=True):
        body = next(json.loads(p.read_text()) for p in path.glob("*.nested.template.json")
                    if set(json.loads(p.read_text())["Resources"]) == {k.split("/", 1)[1] for k in nested if k.startswith(lid + "/")})  # fmt: skip
        stub.add_response("get_template", {"TemplateBody": json.dumps(body)}, {"StackName": s["PhysicalResourceId"], "TemplateStage": "Original"})
    stub.activate()
    r = rollout.compare(rollout.deployed(cfn, STACK), nested)
    stub.assert_no_pending_responses()
    assert (r.kept, r.replaced) == (["decode-0", "prefill-0"], [])


def test_status_shows_a_rollout_in_progress_node_by_node(assembly: Callable[..., Path]) -> None:
    """The 3+8 fleet halfway through a new image without surge: decode-0 and -1 run the group's new
    version, decode-2's old instance is gone and its replacement is launching (its deploy gate open),
    decode-3..7 still run the old one; two prefill nodes are done and prefill-2 surges (old and new run). CloudFormation (Stubber: moto runs no
    rolling update) is in UPDATE_IN_PROGRESS; the groups come from Auto Scaling (Stubber too)."""
    base = PROD | {"rollout.surge": "off"}
    path = assembly(**base)
    parent = json.loads((path / f"{STACK}.template.json").read_text())
    flat = rollout.synthesized(path, STACK)
    cells = [lid for lid, res in parent["Resources"].items() if res["Type"] == "AWS::CloudFormation::Stack"]
    arn = {lid: f"arn:aws:cloudformation:us-east-2:123456789012:stack/{STACK}-{lid}/1" for lid in cells}
    bodies = {lid: next(json.loads(p.read_text()) for p in path.glob("*.nested.template.json")
                        if set(json.loads(p.read_text())["Resources"]) == {k.split("/", 1)[1] for k in flat if k.startswith(lid + "/")})
              for lid in cells}  # fmt: skip
    gate2 = next(k.split("/", 1)[1] for k in flat if "/Decode2Ready" in k and flat[k]["Type"] == "AWS::CloudFormation::WaitCondition")

    def summary(lid: str, kind: str, state: str = "UPDATE_COMPLETE", physical: str = "x") -> dict[str, Any]:
        return {"LogicalResourceId": lid, "PhysicalResourceId": physical, "ResourceType": kind, "ResourceStatus": state,
                "LastUpdatedTimestamp": "2026-12-03T00:00:00Z"}  # fmt: skip

    cfn = boto3.client("cloudformation", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(cfn)
    stub.add_response("describe_stacks", {"Stacks": [{"StackName": STACK, "StackStatus": "UPDATE_IN_PROGRESS", "CreationTime": "2026-12-01T00:00:00Z"}]},
                      {"StackName": STACK})  # fmt: skip
    top = [summary(lid, "AWS::CloudFormation::Stack", "UPDATE_IN_PROGRESS", arn[lid]) for lid in cells]
    stub.add_response("list_stack_resources", {"StackResourceSummaries": top}, {"StackName": STACK})
    for lid in cells:
        inner = [summary(gate2, "AWS::CloudFormation::WaitCondition", "CREATE_IN_PROGRESS")] if lid.startswith("DecodeCell0NestedStack") else []
        stub.add_response("list_stack_resources", {"StackResourceSummaries": inner}, {"StackName": arn[lid]})
    stub.add_response("get_template", {"TemplateBody": json.dumps(parent)}, {"StackName": STACK, "TemplateStage": "Original"})
    stub.add_response("list_stack_resources", {"StackResourceSummaries": top}, {"StackName": STACK})
    for lid in cells:
        stub.add_response("get_template", {"TemplateBody": json.dumps(bodies[lid])}, {"StackName": arn[lid], "TemplateStage": "Original"})
    stub.activate()

    def group(node: str, version: str, *instances: tuple[str, str, str]) -> dict[str, Any]:
        return {"AutoScalingGroupName": f"gptoss-8k1k-{node}", "LaunchTemplate": {"LaunchTemplateId": "lt-1", "Version": version},
                "MinSize": 1, "MaxSize": 1, "DesiredCapacity": 1, "DefaultCooldown": 300, "AvailabilityZones": ["us-east-2a"],
                "HealthCheckType": "EC2", "CreatedTime": "2026-12-01T00:00:00Z",
                "Instances": [{"InstanceId": i, "LaunchTemplate": {"LaunchTemplateId": "lt-1", "Version": v}, "LifecycleState": s,
                               "AvailabilityZone": "us-east-2a", "HealthStatus": "Healthy", "ProtectedFromScaleIn": False} for i, v, s in instances]}  # fmt: skip

    groups = [group(f"prefill-{i}", "2", (f"i-p{i}", "2", "InService")) for i in range(2)]
    groups += [group("prefill-2", "2", ("i-p2", "1", "InService"), ("i-p2n", "2", "Pending"))]  # a surge: both run
    groups += [group(f"decode-{i}", "2", (f"i-d{i}n", "2", "InService")) for i in range(2)]
    groups += [group("decode-2", "2", ("i-d2n", "2", "Pending"))]
    groups += [group(f"decode-{i}", "2", (f"i-d{i}", "1", "InService")) for i in range(3, 8)]
    autoscaling = boto3.client("autoscaling", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    astub = Stubber(autoscaling)
    names = [f"gptoss-8k1k-{n}" for n in ["prefill-0", "prefill-1", "prefill-2", *(f"decode-{i}" for i in range(8))]]
    astub.add_response("describe_auto_scaling_groups", {"AutoScalingGroups": groups}, {"AutoScalingGroupNames": names})
    astub.activate()
    lines = rollout.progress(load_config(base), cfn, autoscaling)
    stub.assert_no_pending_responses()
    assert lines == [
        "rollout in progress (UPDATE_IN_PROGRESS): 4 of 11 nodes on their group's current version",
        "  decode-0: new (group launches v2; runs i-d0n v2 InService)",
        "  decode-1: new (group launches v2; runs i-d1n v2 InService)",
        "  decode-2: replacing (group launches v2; runs i-d2n v2 Pending), batch 1 of those left",
        *(f"  decode-{i}: old (group launches v2; runs i-d{i} v1 InService), batch {i - 1} of those left" for i in range(3, 8)),
        "  prefill-0: new (group launches v2; runs i-p0 v2 InService)",
        "  prefill-1: new (group launches v2; runs i-p1 v2 InService)",
        "  prefill-2: surging (group launches v2; runs i-p2 v1 InService, i-p2n v2 Pending), batch 1 of those left",
        f"  waits for: {gate2}: a deploy gate (the replacement serving)",
    ]


def test_status_says_nothing_of_a_rollout_when_none_runs() -> None:
    cfn = boto3.client("cloudformation", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(cfn)
    stub.add_response("describe_stacks", {"Stacks": [{"StackName": STACK, "StackStatus": "UPDATE_COMPLETE", "CreationTime": "2026-12-01T00:00:00Z"}]},
                      {"StackName": STACK})  # fmt: skip
    stub.activate()
    assert rollout.progress(load_config({}), cfn, autoscaling=None) == []


def test_the_time_a_deploy_states_is_the_last_deploys_slowest_gate() -> None:
    """A node's time to serve, for 'about B x T min': the longest wait of a deploy gate (a WaitCondition
    from CREATE_IN_PROGRESS to CREATE_COMPLETE) in the stack's cells at their last completion; an
    earlier, slower attempt of the same gate does not count; other resources' events do not either."""
    import datetime as dt

    cfn = boto3.client("cloudformation", region_name="us-east-2", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(cfn)
    cell = f"arn:aws:cloudformation:us-east-2:123456789012:stack/{STACK}-Decode/1"
    t0 = dt.datetime(2026, 12, 3, 10, 0, tzinfo=dt.UTC)

    def event(lid: str, kind: str, state: str, minutes: float) -> dict[str, Any]:
        return {"StackId": cell, "EventId": f"{lid}-{state}-{minutes}", "StackName": STACK, "LogicalResourceId": lid, "ResourceType": kind,
                "ResourceStatus": state, "Timestamp": t0 + dt.timedelta(minutes=minutes)}  # fmt: skip

    stub.add_response("list_stack_resources", {"StackResourceSummaries": [
        {"LogicalResourceId": "Decode", "PhysicalResourceId": cell, "ResourceType": "AWS::CloudFormation::Stack",
         "LastUpdatedTimestamp": t0, "ResourceStatus": "UPDATE_COMPLETE"}]}, {"StackName": STACK})  # fmt: skip
    stub.add_response("describe_stack_events", {"StackEvents": []}, {"StackName": STACK})
    stub.add_response("list_stack_resources", {"StackResourceSummaries": []}, {"StackName": cell})
    gate, wait = "Decode0Ready1a2b", "AWS::CloudFormation::WaitCondition"
    stub.add_response("describe_stack_events", {"StackEvents": [  # newest first
        event("Decode1Ready9f8e", wait, "CREATE_COMPLETE", 300 + 41),
        event(gate, wait, "CREATE_COMPLETE", 300 + 38),
        event("Decode1Ready9f8e", wait, "CREATE_IN_PROGRESS", 300 + 4),
        event(gate, wait, "CREATE_IN_PROGRESS", 300),
        event("Decode0Group", "AWS::AutoScaling::AutoScalingGroup", "UPDATE_COMPLETE", 299),
        event(gate, wait, "CREATE_COMPLETE", 200),  # an earlier deploy's attempt, slower: not the last
        event(gate, wait, "CREATE_IN_PROGRESS", 100),
    ]}, {"StackName": cell})  # fmt: skip
    stub.activate()
    assert rollout.measured_ready_min(cfn, STACK) == pytest.approx(38.0)
    stub.assert_no_pending_responses()
    # CloudFormation does not say (denied, throttled): no time, not a traceback.
    stub.add_client_error("list_stack_resources", "AccessDenied", "not allowed", 403, expected_params={"StackName": STACK})
    assert rollout.measured_ready_min(cfn, STACK) is None


BLOCK_A, BLOCK_B = "cr-0aaaaaaaaaaaaaaa1", "cr-0bbbbbbbbbbbbbbb2"


def test_a_move_onto_the_next_capacity_block_surges_every_node_and_says_the_gap_before(assembly: Callable[..., Path]) -> None:
    """Deploying the 3+8 fleet with the next block's id: every group's target moves from block A to block B
    (policy_update.capacity_moves); `gptoss deploy` then synthesizes it with surge (rollout.surge=on: a block's
    default is no surge), so each replacement launches in block B while its old instance serves in A: the move's
    plan keeps every role whole (minimum serving 3/3 and 8/8), printed as the other rollout lines. When B starts
    after A's instances are reclaimed (A's end less 30 min), the plan says the gap before anything changes."""
    from cluster_ops import policy_update

    a = PROD | {"capacity.type": "capacity-block", "capacity.reservation_id": BLOCK_A}
    b = a | {"capacity.reservation_id": BLOCK_B}
    before = rollout.flatten_templates(rollout.assembly_templates(assembly(**a), STACK))
    after = rollout.flatten_templates(rollout.assembly_templates(assembly(**b), STACK))
    moves = policy_update.capacity_moves(before, after)
    assert len(moves) == 11 and set(moves.values()) == {((BLOCK_A,), (BLOCK_B,))}
    assert policy_update.capacity_moves(before, before) == {}, "no move, no line"
    surged = b | {"rollout.surge": "on"}
    r = _rollout(assembly, a, surged)
    assert sorted(r.replaced) == sorted([f"decode-{i}" for i in range(8)] + [f"prefill-{i}" for i in range(3)])
    assert rollout.role_lines(load_config(surged), r, ready_min=50) == [
        "prefill: 3 batches, at most 0 of 3 out (surge: each replacement serves before its old instance goes), minimum serving prefill 3/3, "
        "about 150 min (3 x 50 min, a node's time to serve at the last deploy)",
        "decode: 8 batches, at most 0 of 8 out (surge: each replacement serves before its old instance goes), minimum serving decode 8/8, "
        "about 400 min (8 x 50 min, a node's time to serve at the last deploy)",
    ]
    import datetime as dt

    now = dt.datetime(2026, 12, 10, 0, 0, tzinfo=dt.UTC)

    def cr(rid: str, start: dt.datetime, end: dt.datetime) -> dict[str, Any]:
        return {"CapacityReservationId": rid, "ReservationType": "capacity-block", "StartDate": start, "EndDate": end}

    overlap = {BLOCK_A: cr(BLOCK_A, now - dt.timedelta(days=2), now + dt.timedelta(days=1)), BLOCK_B: cr(BLOCK_B, now - dt.timedelta(hours=1), now + dt.timedelta(days=3))}
    assert policy_update.move_lines(moves, overlap, now) == [
        f"moving 11 node(s) from {BLOCK_A} to {BLOCK_B}: with surge, each replacement launched in the new capacity while its old instance serves"]  # fmt: skip
    apart = overlap | {BLOCK_B: cr(BLOCK_B, now + dt.timedelta(days=1, hours=2), now + dt.timedelta(days=4))}
    (line,) = policy_update.move_lines(moves, apart, now)
    assert "the new capacity starts 2026-12-11 02:00 UTC: no replacement can launch before then" in line
    assert "THE TWO DO NOT OVERLAP: from 2026-12-10 23:30 UTC (the old capacity reclaimed) to 2026-12-11 02:00 UTC these nodes have no instance (2.5 h without them)" in line
