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
            app = cdk.App(context=json.loads((ROOT / "cdk.json").read_text())["context"], outdir=str(out))
            GptOssClusterStack(app, STACK, config=load_config(context))
            cache[key] = Path(app.synth().directory)
        return cache[key]

    return get


def _rollout(assembly: Callable[..., Path], before: dict[str, str], after: dict[str, str]) -> rollout.Rollout:
    return rollout.compare(rollout.synthesized(assembly(**before), STACK), rollout.synthesized(assembly(**after), STACK))


def test_the_same_parameters_replace_nothing(assembly: Callable[..., Path]) -> None:
    r = _rollout(assembly, {}, {})
    assert (r.kept, r.replaced, r.launched, r.removed) == (["decode-0", "prefill-0"], [], [], [])
    assert rollout.describe(load_config({}), r) == ["this deploy replaces no instance (2 running nodes keep their own)"]


def test_a_prefill_flag_replaces_the_prefill_node_only(assembly: Callable[..., Path]) -> None:
    r = _rollout(assembly, {}, {"serving.prefill.max_num_seqs": "2"})
    assert (r.kept, r.replaced) == (["decode-0"], ["prefill-0"])


def test_a_decode_flag_replaces_the_prefill_node_too_because_its_benchmark_unit_carries_it(assembly: Callable[..., Path]) -> None:
    """The benchmark unit on prefill-0 runs at the decode server's batch size: its user data changes as well."""
    r = _rollout(assembly, {}, {"serving.decode.max_num_seqs": "4"})
    assert (r.kept, r.replaced) == ([], ["decode-0", "prefill-0"])
    lines = rollout.describe(load_config({"serving.decode.max_num_seqs": "4"}), r)
    assert lines[0] == ("this deploy replaces the instances of 2 of the 2 running nodes, all at the same time "
                        "(each node's group terminates its instance, then launches the new one): decode-0, prefill-0")  # fmt: skip
    assert lines[-1] == "  a role with every node replaced serves nothing: the endpoint is down until the replacements serve"


def test_a_router_setting_replaces_every_decode_node_of_the_production_layout(assembly: Callable[..., Path]) -> None:
    """The routers run on the decode nodes and their settings are in those nodes' user data (issue 33's measurement)."""
    changed = PROD | {"serving.proxy.router.health_check_timeout_s": "2"}
    r = _rollout(assembly, PROD, changed)
    assert r.replaced == [f"decode-{i}" for i in range(8)] and r.kept == ["prefill-0", "prefill-1", "prefill-2"]
    assert rollout.describe(load_config(changed), r) == [
        "this deploy replaces the instances of 8 of the 11 running nodes, all at the same time "
        "(each node's group terminates its instance, then launches the new one): decode-0..7",
        "  decode: 1 batch, at most 8 of 8 out, minimum serving decode 0/8, up to 415 min (each replacement's deploy gate)",
        "  a role with every node replaced serves nothing: the endpoint is down until the replacements serve",
        "  kept: prefill-0..2",
    ]


def test_one_more_decode_node_replaces_the_eight_it_joins_and_launches_two(assembly: Callable[..., Path]) -> None:
    """decode_instances 8 -> 9: the ninth decode node and, at 3 prefill per 8 decode, a fourth prefill node."""
    r = _rollout(assembly, PROD, {"decode_instances": "9"})
    assert r.replaced == [f"decode-{i}" for i in range(8)]
    assert r.launched == ["decode-8", "prefill-3"] and r.kept == ["prefill-0", "prefill-1", "prefill-2"] and r.removed == []


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
