"""Every recipe's stack: what it provisions, cfn-lint and cdk-nag clean, and a snapshot each."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CDK, OTHER_RECIPES, ROOT, cfn_lint, cli_env
from tests.stacks.template import launch_templates, normalized, of_type


def _ingress(t: dict[str, Any]) -> set[tuple[Any, ...]]:
    from tests.stacks.template import ingress_rules

    return ingress_rules(t)


def test_single_instance_recipes_run_one_server_without_efa(recipe_synth: dict[str, Any]) -> None:
    for recipe in ("gptoss-120b-single", "gptoss-20b-single"):
        t = recipe_synth["templates"][recipe]
        (holder,) = of_type(t, "AWS::AutoScaling::AutoScalingGroup").values()
        assert {x["Key"]: x["Value"] for x in holder["Properties"]["Tags"]}["gptoss:node"] == "server-0"
        assert not of_type(t, "AWS::EC2::PlacementGroup"), "one server needs no cluster placement group"
        (lt,) = launch_templates(t).values()
        assert [(n["NetworkCardIndex"], n.get("InterfaceType")) for n in lt["NetworkInterfaces"]] == [(0, None)]
        assert "Placement" not in lt
        assert {r for r in _ingress(t) if r[0] == "tcp"} == {("tcp", 8000, 8000, "self")}
        assert sorted(t["Outputs"]) == ["AlarmSubscribe", "AlarmTopic", "ServerNodes", "ServerPortForward"]
        assert not of_type(t, "AWS::ElasticLoadBalancingV2::LoadBalancer")


def test_di_recipes_open_the_references_ports(recipe_synth: dict[str, Any]) -> None:
    """001: prefill 8100 and side channel 5559 (+1 per replica), decode 8200 and 5659 (+ its ranks), proxy 8000."""
    for recipe in ("gptoss-120b-di", "gptoss-20b-di"):
        t = recipe_synth["templates"][recipe]
        assert len(of_type(t, "AWS::AutoScaling::AutoScalingGroup")) == 2 and of_type(t, "AWS::EC2::PlacementGroup")
        tcp = {r[1:3] for r in _ingress(t) if r[0] == "tcp"}
        assert {(8000, 8000), (8100, 8100), (8200, 8200), (5559, 5559)} <= tcp
        decode_side = next(r for r in tcp if r[0] == 5659)
        assert decode_side[1] >= 5659 + 8 - 1, "covers one listener per DP rank"
        for lt in launch_templates(t).values():
            assert [n["InterfaceType"] for n in lt["NetworkInterfaces"]] == ["efa"] + ["efa-only"] * 15


def test_every_recipe_is_cdk_nag_clean_with_reasons(recipe_synth: dict[str, Any]) -> None:
    (report,) = [r for r in recipe_synth["report"]["pluginReports"] if r["pluginName"] == "AwsSolutions"]
    assert report["conclusion"] == "success" and report["violations"] == []
    assert all(len(v["reason"]) > 40 for v in report["suppressedViolations"])


def test_every_recipe_is_cfn_lint_clean(recipe_synth: dict[str, Any]) -> None:
    r = cfn_lint(list(recipe_synth["paths"].values()))
    assert r.returncode == 0, (r.stdout + r.stderr)[:4000]


@pytest.mark.parametrize("recipe", OTHER_RECIPES)
def test_recipe_snapshot(recipe_synth: dict[str, Any], recipe: str, snapshot: Any) -> None:
    from syrupy.extensions.json import JSONSnapshotExtension

    assert normalized(recipe_synth["templates"][recipe]) == snapshot(extension_class=JSONSnapshotExtension)


def test_cdk_synth_takes_the_recipe_from_the_command_line(tmp_path: Path) -> None:
    """`cdk synth -c recipe=gptoss-20b-single` through the pinned CLI names the recipe's stack."""
    r = subprocess.run(
        [str(CDK), "synth", "--no-notices", "--quiet", "-o", str(tmp_path), "-c", "recipe=gptoss-20b-single"],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert [p.name for p in tmp_path.glob("*.template.json") if ".nested." not in p.name] == ["GptOss20bSingleStack.template.json"]
    names = sorted(p.name for p in tmp_path.glob("*.nested.template.json"))
    assert [n.startswith("GptOss20bSingleStackServerCell0Alarms") for n in names] == [False, True], names
    assert names[0].startswith("GptOss20bSingleStackServerCell0") and len(names) == 2, "its one cell, and its NodeSilent alarms"


def test_every_recipe_grants_the_node_exactly_the_allowlist(recipe_synth: dict[str, Any], default_synth: Any) -> None:
    from clusterspec.loading import load_config
    from tests.stacks.least_privilege import assert_least_privilege

    assert_least_privilege(default_synth.template, load_config({}))
    for recipe, t in recipe_synth["templates"].items():
        assert_least_privilege(t, load_config({"recipe": recipe}))
