"""Cells: a fleet of any size is one stack, each nested template within CloudFormation's limits."""

from __future__ import annotations

import json
from typing import Any

import pytest

from clusterspec.cells import cell_name, cells
from clusterspec.loading import load_config
from tests.conftest import cfn_lint, nag_synth
from tests.stacks.template import of_type


@pytest.fixture(scope="module")
def big_synth(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """200 decode instances (75 prefill + 200 decode nodes), with cdk-nag, as app.py builds them."""
    return nag_synth(tmp_path_factory.mktemp("big.out"), {"big": {"decode_instances": "200"}})


def test_two_hundred_decode_instances_are_one_stack_of_cells_each_within_the_limits(big_synth: dict[str, Any]) -> None:
    parent = json.loads(big_synth["paths"]["big"].read_text())
    everything = {k: p for k, p in big_synth["paths"].items() if k.startswith("big/")}
    nested = {k: p for k, p in everything.items() if "Alarms" not in k}
    # 75 prefill nodes in cells of 24: 4; 200 decode nodes: 9; and each cell's NodeSilent alarms.
    assert len(of_type(parent, "AWS::CloudFormation::Stack")) == len(everything) == 26 and len(nested) == 13
    for path in [big_synth["paths"]["big"], *everything.values()]:
        template = json.loads(path.read_text())
        assert path.stat().st_size < 1_000_000, (path.name, path.stat().st_size)
        assert len(template["Resources"]) < 500 and len(template.get("Parameters", {})) < 200 and len(template.get("Outputs", {})) < 200, path.name
    t = big_synth["templates"]["big"]
    holders = of_type(t, "AWS::AutoScaling::AutoScalingGroup")
    assert len(holders) == 275
    (report,) = [r for r in big_synth["report"]["pluginReports"] if r["pluginName"] == "AwsSolutions"]
    assert report["conclusion"] == "success" and report["violations"] == []
    # cfn-lint on the parent and on the first and the last cell of each role (a role's cells are one
    # template but for the nodes' indices and names): 5 templates, not 14 (40 s of make test).
    by_role: dict[str, list[str]] = {}
    for key in sorted(nested, key=lambda k: (k.split("Cell")[0], int(k.split("Cell")[1].split("NestedStack")[0]))):
        by_role.setdefault(key.split("Cell")[0], []).append(key)
    alarms = sorted(k for k in everything if "Alarms" in k)
    linted = [big_synth["paths"]["big"]] + [nested[k] for keys in by_role.values() for k in {keys[0], keys[-1]}] + [everything[alarms[0]]]
    assert len(by_role) == 2 and len(linted) == 6, sorted(nested)
    r = cfn_lint(linted)
    assert r.returncode == 0, (r.stdout + r.stderr)[:4000]


def test_each_node_is_in_the_cell_plan_names(big_synth: dict[str, Any]) -> None:
    cfg = load_config({"decode_instances": "200"})
    planned = {n.name: c.name for c in cells(cfg.layout, cfg.cell_nodes) for n in c.nodes}
    for key, path in big_synth["paths"].items():
        if not key.startswith("big/"):
            continue
        template = json.loads(path.read_text())
        for g in of_type(template, "AWS::AutoScaling::AutoScalingGroup").values():
            node = next(x["Value"] for x in g["Properties"]["Tags"] if x["Key"] == "gptoss:node")
            assert key.removeprefix("big/").startswith(planned[node] + "NestedStack"), (node, key)
        for a in of_type(template, "AWS::CloudWatch::Alarm").values():
            node = a["Properties"]["AlarmName"].removeprefix("gptoss-8k1k-").removesuffix("-NodeSilent")
            assert key.removeprefix("big/").startswith(planned[node] + "AlarmsNestedStack"), (node, key)


def test_a_first_deploy_of_two_hundred_decode_makes_at_most_three_alarms_at_once(big_synth: dict[str, Any]) -> None:
    """CloudWatch takes PutMetricAlarm at 3 per second; CloudFormation makes every resource with nothing left to wait
    for at once. Replayed by CloudFormation's rules (tests/fakes/cloudformation.py), the first deploy of 275 nodes
    makes its 285 alarms (275 NodeSilent, 10 of the fleet's) at most 3 at a time, and every node serves."""
    from cluster_ops import rollout
    from tests.fakes import cloudformation as cf

    stack = big_synth["paths"]["big"].name.removesuffix(".template.json")
    cf.register_assembly(big_synth["outdir"])
    after = rollout.synthesized(big_synth["outdir"], stack)
    alarms = [r for r in after.values() if r["Type"] == "AWS::CloudWatch::Alarm"]
    assert len(alarms) == 275 + 10
    o = cf.replay({}, after, cf.NodeTimes({"prefill": 90 * 60, "decode": 90 * 60}))
    assert o.state == "UPDATE_COMPLETE", o.reasons
    assert o.alarms_at_once == cf.PUT_METRIC_ALARM_TPS == 3
    assert len(o.served) == 275 and o.late == []


def test_a_growing_fleet_never_moves_a_node_from_one_cell_to_another(synth_variant: Any) -> None:
    """From 8 to 40 decode instances (3 to 15 prefill nodes): every node that was there stays in its
    cell, under the same logical ids, so CloudFormation replaces no instance of it."""
    before, after = load_config({"decode_instances": "8"}), load_config({"decode_instances": "40"})
    was = {n.name: cell_name(n, before.cell_nodes) for n in before.layout.nodes}
    now = {n.name: cell_name(n, after.cell_nodes) for n in after.layout.nodes}
    assert {n: now[n] for n in was} == was
    ids = [{lid: json.dumps(r["Properties"].get("Tags"), sort_keys=True) for lid, r in of_type(synth_variant(decode_instances=str(n)),
           "AWS::AutoScaling::AutoScalingGroup").items()} for n in (8, 40)]  # fmt: skip
    assert ids[0].items() <= ids[1].items(), "a node's group keeps its logical id and identity"
