"""A change of the rollout's policy deploys in an update of its own, before the change it governs, through
the pinned CDK CLI against moto (cluster_ops/policy_update.py, cluster_ops/deploy_plan.py).

moto's CloudFormation keeps what it was given (the stack's and each cell's template), though it
does not roll groups: the templates it holds after each update are what the update deployed. It
makes no change set of an update of a stack with nested stacks: the updates go directly
(`--method=direct`, UpdateStack)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from cluster_ops import policy_update, rollout
from tests.conftest import STACK
from tests.lifecycle.local_aws import LocalAws, started

pytestmark = pytest.mark.lifecycle


@pytest.fixture(scope="module")
def local_aws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAws]:
    """moto with what CloudFormation does and moto lacks (an update keeps a parameter's previous value)."""
    with started(tmp_path_factory.mktemp("local-aws"), extended=True) as aws:
        yield aws

# A machine change (the root volume): it replaces the instances, as the policy split needs (a flag is applied in place).
CHANGE = ("-c", "rollout.surge=off", "-c", "root_volume_gb=1024")


def _by_type(templates: dict[str, Any], kind: str) -> dict[str, Any]:
    return {f"{scope}/{lid}": res for scope, t in templates.items() for lid, res in t.get("Resources", {}).items() if res.get("Type") == kind}


def test_a_policy_change_deploys_alone_then_the_change_and_gptoss_deploy_makes_it_two_updates(local_aws: LocalAws, tmp_path: Any) -> None:
    aws = local_aws
    cfn = aws.client("cloudformation")
    aws.gptoss("deploy", "--yes", "--require-approval", "never")
    deployed = rollout.deployed_templates(cfn, STACK)
    groups = _by_type(deployed, "AWS::AutoScaling::AutoScalingGroup")
    assert {g["UpdatePolicy"]["AutoScalingRollingUpdate"]["MinInstancesInService"] for g in groups.values()} == {1}, "On-Demand surges"

    # The pieces: the change synthesized with surge off (with the image gptoss deploy resolves and passes), its policy
    # alone deployed by the CDK CLI from an assembly of its own.
    image = aws.client("ssm").get_parameter(Name="/gptoss/test/neuron-dlami")["Parameter"]["Value"]
    aws.cdk("synth", STACK, *CHANGE, "-c", f"ami_id={image}", "-c", "ami_ssm_parameter=null", "--quiet")
    synthesized = rollout.assembly_templates(aws.outdir, STACK)
    plan = policy_update.updates(deployed, synthesized)
    assert [name for name, _ in plan] == ["policy", "change"]
    app = tmp_path / "policy"
    policy_update.write_assembly(aws.outdir, app, STACK, plan[0][1])
    aws.cdk("deploy", STACK, "--app", str(app), "--require-approval", "never", "--method=direct")
    assert cfn.describe_stacks(StackName=STACK)["Stacks"][0]["StackStatus"].endswith("_COMPLETE")
    after = rollout.deployed_templates(cfn, STACK)
    for lid, g in _by_type(after, "AWS::AutoScaling::AutoScalingGroup").items():
        want = _by_type(synthesized, "AWS::AutoScaling::AutoScalingGroup")[lid]
        assert (g["UpdatePolicy"], g["Properties"]["MaxSize"]) == (want["UpdatePolicy"], "1"), lid
        assert g["Properties"]["LaunchTemplate"] == groups[lid]["Properties"]["LaunchTemplate"], lid
    templates = _by_type(after, "AWS::EC2::LaunchTemplate")
    assert templates == _by_type(deployed, "AWS::EC2::LaunchTemplate"), "no node's launch template changed: no instance is replaced"
    assert templates != _by_type(synthesized, "AWS::EC2::LaunchTemplate"), "the change itself is the next update's"

    # Back to surge (a policy change alone: one update), then the whole deploy of the change from the CLI.
    out = aws.gptoss("deploy", "--yes", "--require-approval", "never", "--method=direct")
    assert "two CloudFormation updates" not in out.stderr and "update 1 of 2" not in out.stderr
    out = aws.gptoss("deploy", *CHANGE, "--yes", "--require-approval", "never", "--method=direct")
    assert ("two CloudFormation updates: first the rollout policy of 2 node groups alone (decode-0, prefill-0: surge on or off; no "
            "instance replaced), then the change") in out.stderr, out.stderr  # fmt: skip
    assert out.stderr.index("update 1 of 2: the rollout policy alone") < out.stderr.index("update 2 of 2: the change"), out.stderr
    final = rollout.deployed_templates(cfn, STACK)

    assert _by_type(final, "AWS::EC2::LaunchTemplate") == _by_type(synthesized, "AWS::EC2::LaunchTemplate")
    policies = {k: (g["UpdatePolicy"], g["Properties"]["MaxSize"]) for k, g in _by_type(final, "AWS::AutoScaling::AutoScalingGroup").items()}
    assert policies == {k: (g["UpdatePolicy"], "1") for k, g in _by_type(synthesized, "AWS::AutoScaling::AutoScalingGroup").items()}
    shutil.rmtree(app)
