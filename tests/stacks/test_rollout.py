"""What a deploy does to the running nodes, said before it runs (cluster_ops/rollout.py).

Each case synthesizes two assemblies, as `gptoss deploy` synthesizes the new one, and compares
them; the expected nodes are typed out from what changes in each node's files, not computed.
"""

from __future__ import annotations

import json
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


def test_a_prefill_flag_replaces_the_prefill_node_only(assembly: Callable[..., Path]) -> None:
    r = _rollout(assembly, {}, {"serving.prefill.max_num_seqs": "2"})
    assert (r.kept, r.replaced) == (["decode-0"], ["prefill-0"])


def test_a_decode_flag_replaces_the_prefill_node_too_because_its_benchmark_unit_carries_it(assembly: Callable[..., Path]) -> None:
    """The benchmark unit on prefill-0 runs at the decode server's batch size: its user data changes as well.
    On-Demand (the default) surges: each replacement serves before its old instance goes, so even the
    two-node default keeps serving."""
    r = _rollout(assembly, {}, {"serving.decode.max_num_seqs": "4"})
    assert (r.kept, r.replaced) == ([], ["decode-0", "prefill-0"])
    assert r.batch == {"decode-0": 1, "prefill-0": 1} and r.surge == {"decode-0": True, "prefill-0": True}
    lines = rollout.describe(load_config({"serving.decode.max_num_seqs": "4"}), r)
    assert lines[0] == ("this deploy replaces the instances of 2 of the 2 running nodes, in batches (each replacement launched and "
                        "serving before its old instance is terminated (surge)): batch 1: decode-0, prefill-0")  # fmt: skip
    assert lines[1] == ("  prefill: 1 batch, at most 0 of 1 out (surge: each replacement serves before its old instance goes), minimum "
                        "serving prefill 1/1, about 1 x a node's time to serve (each batch waits for its deploy gates, up to 415 min each)")  # fmt: skip
    assert not any("serves nothing" in line for line in lines)
    assert lines[-1].startswith("  with surge a replacement must serve within 60 min (CloudFormation's limit)")


def test_without_surge_the_two_node_default_says_it_is_down(assembly: Callable[..., Path]) -> None:
    before, after = {"rollout.surge": "off"}, {"rollout.surge": "off", "serving.decode.max_num_seqs": "4"}
    r = _rollout(assembly, before, after)
    assert r.surge == {"decode-0": False, "prefill-0": False}
    lines = rollout.describe(load_config(after), r)
    assert lines[0].endswith("in batches (each node's group terminates its instance, then launches the new one): batch 1: decode-0, prefill-0")
    assert "  a role with every node in one batch and no surge serves nothing: the endpoint is down until the replacements serve" in lines


def test_a_router_setting_rolls_the_production_layouts_decode_nodes_one_at_a_time(assembly: Callable[..., Path]) -> None:
    """The routers run on the decode nodes and their settings are in those nodes' user data (issue 33's
    measurement): still eight replacements, but in eight batches, each after the one before serves."""
    base = PROD | {"rollout.surge": "off"}
    changed = base | {"serving.proxy.router.health_check_timeout_s": "2"}
    r = _rollout(assembly, base, changed)
    assert r.replaced == [f"decode-{i}" for i in range(8)] and r.kept == ["prefill-0", "prefill-1", "prefill-2"]
    assert r.batch == {f"decode-{i}": i + 1 for i in range(8)}
    assert rollout.describe(load_config(changed), r) == [
        "this deploy replaces the instances of 8 of the 11 running nodes, in batches (each node's group terminates its instance, then "
        "launches the new one): batch 1: decode-0; batch 2: decode-1; batch 3: decode-2; batch 4: decode-3; batch 5: decode-4; "
        "batch 6: decode-5; batch 7: decode-6; batch 8: decode-7",
        "  decode: 8 batches, at most 1 of 8 out, minimum serving decode 7/8, about 8 x a node's time to serve (each batch waits for "
        "its deploy gates, up to 415 min each)",
        "  kept: prefill-0..2",
    ]
    assert rollout.role_lines(load_config(changed), r, ready_min=40) == [
        "decode: 8 batches, at most 1 of 8 out, minimum serving decode 7/8, about 320 min (8 x 40 min, a node's time to serve at the last deploy)"
    ]


def test_a_percentage_makes_lanes_and_a_script_change_rolls_both_roles(assembly: Callable[..., Path]) -> None:
    """max_unavailable 25 %: 2 lanes of the 8 decode nodes (8 x 25 % = 2), 1 of the 3 prefill nodes (rounded down, at least 1)."""
    base = PROD | {"rollout.surge": "off", "rollout.max_unavailable": "25%"}
    r = _rollout(assembly, base, base | {"ami_id": "ami-0fedcba9876543210"})
    assert r.batch == {"prefill-0": 1, "prefill-1": 2, "prefill-2": 3,
                       "decode-0": 1, "decode-1": 1, "decode-2": 2, "decode-3": 2, "decode-4": 3, "decode-5": 3, "decode-6": 4, "decode-7": 4}  # fmt: skip
    assert rollout.role_lines(load_config(base), r) == [
        "prefill: 3 batches, at most 1 of 3 out, minimum serving prefill 2/3, about 3 x a node's time to serve (each batch waits for its "
        "deploy gates, up to 415 min each)",
        "decode: 4 batches, at most 2 of 8 out, minimum serving decode 6/8, about 4 x a node's time to serve (each batch waits for its "
        "deploy gates, up to 415 min each)",
    ]


def test_one_more_decode_node_replaces_the_eight_it_joins_and_launches_two(assembly: Callable[..., Path]) -> None:
    """decode_instances 8 -> 9: the ninth decode node and, at 3 prefill per 8 decode, a fourth prefill node.
    The launched ones wait for nothing of the rollout (their lane's earlier nodes keep their gates)."""
    r = _rollout(assembly, PROD, {"decode_instances": "9"})
    assert r.replaced == [f"decode-{i}" for i in range(8)]
    assert r.launched == ["decode-8", "prefill-3"] and r.kept == ["prefill-0", "prefill-1", "prefill-2"] and r.removed == []


def _groups(path: Path) -> dict[str, dict[str, Any]]:
    """Each node's group resource (flattened), by node."""
    groups = [res for res in rollout.synthesized(path, STACK).values() if res["Type"] == "AWS::AutoScaling::AutoScalingGroup"]
    return {next(t["Value"] for t in g["Properties"]["Tags"] if t["Key"] == "gptoss:node"): g for g in groups}


def test_a_nodes_group_waits_for_every_earlier_gate_of_its_lane_so_an_unchanged_node_holds_nothing(assembly: Callable[..., Path]) -> None:
    """decode-2 waits for decode-0's gate too, not only decode-1's: when a change leaves decode-1 alone (its
    gate does not change, so it is passed at once), decode-2 still waits for decode-0 to serve."""
    groups = _groups(assembly(**PROD))
    deps = {node: sorted(d.split("Ready")[0] for d in g.get("DependsOn", [])) for node, g in groups.items()}
    assert deps["decode-0"] == [] and deps["prefill-0"] == []
    assert deps["decode-2"] == ["Decode0", "Decode1"]
    assert deps["decode-7"] == [f"Decode{i}" for i in range(7)]
    assert deps["prefill-2"] == ["Prefill0", "Prefill1"]
    assert rollout.batches(["decode-0", "decode-2"], rollout.waits_for(rollout.synthesized(assembly(**PROD), STACK))) == {"decode-0": 1, "decode-2": 2}


def test_the_first_deploy_is_not_chained(assembly: Callable[..., Path]) -> None:
    """gptoss deploy of a stack that does not exist yet (gptoss:first-deploy): every node launches at once."""
    groups = _groups(assembly(**PROD, **{"gptoss:first-deploy": "true"}))
    assert len(groups) == 11 and all("DependsOn" not in g for g in groups.values())


def test_each_group_rolls_its_one_instance_with_or_without_surge(assembly: Callable[..., Path]) -> None:
    """Surge (On-Demand): the group grows to two, the replacement launches first and the update waits up to an
    hour for its signal; off: terminate, then launch. Both: a leaving instance runs 90 s more (the drain hook)."""
    hook = [{"LifecycleHookName": "gptoss-drain", "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING", "HeartbeatTimeout": 90, "DefaultResult": "CONTINUE"}]
    suspended = ["HealthCheck", "ReplaceUnhealthy", "AZRebalance", "AlarmNotification", "ScheduledActions"]
    for context, (size, update) in {
        (): ("2", {"MaxBatchSize": 1, "MinInstancesInService": 1, "PauseTime": "PT3600S", "WaitOnResourceSignals": True, "SuspendProcesses": suspended}),
        (("rollout.surge", "off"),): ("1", {"MaxBatchSize": 1, "MinInstancesInService": 0, "PauseTime": "PT0S", "WaitOnResourceSignals": False, "SuspendProcesses": suspended}),
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
    assert len(cells) == 2
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
