"""`gptoss deploy` and `destroy`: the cluster each acts on, destroy that asks, deploy that keeps CDK's approval,
surge fallbacks, a fleet confirmed before it bills, a move onto other capacity said first."""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from cluster_ops import cli, common, deploy_plan, stack
from cluster_ops.commands import deploy, destroy
from clusterspec.loading import load_config
from tests.cluster_ops.cli_helpers import PROD, REGION, Session, gates_took, no_credentials
from tests.conftest import ROOT

# ---- destroy asks; deploy keeps the approval ------------------------------------------------


def test_destroy_without_a_named_cluster_deletes_nothing(checkout: Path, capsys: Any) -> None:
    assert cli.main(["destroy", "--yes"]) == 2
    err = capsys.readouterr().err
    assert "destroy deletes a cluster: name it (-c config=FILE, -c KEY=VALUE or --stack NAME" in err and "Nothing was deleted." in err


def test_make_destroy_without_credentials_stops_in_one_line_before_cdk(tmp_path: Path) -> None:
    r = subprocess.run(["make", "-s", "destroy", "CDK_ARGS=-c config=examples/production-3p8d.yaml"], cwd=ROOT, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, env=no_credentials(tmp_path), timeout=600)  # fmt: skip
    assert r.returncode != 0
    said = [line for line in r.stderr.splitlines() if line.startswith("gptoss destroy:")]
    assert len(said) == 1 and "no AWS credentials" in said[0] and said[0].endswith("then run the command again."), r.stderr
    assert "Traceback" not in r.stderr and "cdk destroy" not in r.stderr


def test_make_destroy_without_yes_and_without_a_terminal_refuses_naming_what_it_would_delete(moto_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"AWS_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
    cfn = boto3.client("cloudformation", endpoint_url=moto_url, region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing")
    cfn.create_stack(StackName="GptOss8k1kProd", TemplateBody='{"Resources": {"T": {"Type": "AWS::SNS::Topic"}}}')  # a deployed cluster
    r = subprocess.run(["make", "-s", "destroy", "CDK_ARGS=-c config=examples/production-3p8d.yaml"], cwd=ROOT, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, env=env, timeout=600)  # fmt: skip
    cfn.delete_stack(StackName="GptOss8k1kProd")
    assert r.returncode != 0
    assert "stack GptOss8k1kProd · region us-east-2 · cluster tag gptoss:cluster=gptoss-prod" in r.stderr
    assert "account 123456789012" in r.stderr
    assert ("destroy GptOss8k1kProd in us-east-2 deletes: 11 x trn3.48xlarge (3 prefill, 8 decode), the internal NLB, "
            "the VPC and its NAT gateway, the log group /gptoss/gptoss-prod; running now: 0 instances tagged gptoss:cluster=gptoss-prod") in r.stderr  # fmt: skip
    assert "refusing to destroy GptOss8k1kProd without confirmation (no terminal). Fix: run it in a terminal, or pass --yes (make destroy YES=1)." in r.stderr
    assert "cdk destroy" not in r.stderr


def test_destroy_asks_for_the_stack_name_and_runs_cdk_only_when_it_is_typed(
    checkout: Path, account: None, monkeypatch: pytest.MonkeyPatch, capsys: Any, tmp_path: Path
) -> None:
    ran: list[tuple[str, str, list[str], list[str]]] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: ran.append((verb, cfg.stack_name, context, extra)) or 0)
    monkeypatch.setattr(destroy, "what_goes", lambda cfg: "11 x trn3.48xlarge")

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Tty("GptOss8k1kStack\n"))
    assert cli.main(["destroy", *PROD]) == 1
    assert "not confirmed ('GptOss8k1kStack' is not GptOss8k1kProd): nothing was deleted." in capsys.readouterr().err
    assert ran == []
    monkeypatch.setattr(sys, "stdin", Tty("GptOss8k1kProd\n"))
    assert cli.main(["destroy", *PROD]) == 0
    assert ran == [("destroy", "GptOss8k1kProd", ["config=examples/production-3p8d.yaml"], ["--force"])]


def _planned(monkeypatch: pytest.MonkeyPatch, changes: Any, updates: Any) -> list[tuple[str, list[str]]]:
    """The deploy's plan on a deployed stack whose templates the test does not build: CHANGES(cfg) is what
    the comparison finds, UPDATES(cfg) the updates; the measured time and the surge decision are the
    plan's own. Returns the (surge, context) of every plan made."""
    from cluster_ops import policy_update, rollout

    plans: list[tuple[str, list[str]]] = []
    state: dict[str, Any] = {}
    monkeypatch.setattr(stack, "exists", lambda cfg: True)
    monkeypatch.setattr(rollout, "deployed_templates", lambda cfn, name: {"": {}})
    monkeypatch.setattr(rollout, "assembly_templates", lambda assembly, name: {"": {}})
    monkeypatch.setattr(rollout, "flatten_templates", lambda t: {})
    monkeypatch.setattr(policy_update, "image_changes", lambda a, b: False)
    real_make = deploy_plan.make

    def make(cfg: Any, context: list[str], workdir: Path) -> Any:
        plans.append((cfg.rollout.surge, context))
        state["cfg"] = cfg
        return real_make(cfg, context, workdir)

    monkeypatch.setattr(deploy_plan, "make", make)
    monkeypatch.setattr(rollout, "compare", lambda before, after: changes(state["cfg"]))
    monkeypatch.setattr(policy_update, "updates", lambda deployed, synthesized: updates(state["cfg"]))
    monkeypatch.setattr(policy_update, "policy_nodes", lambda deployed, synthesized: ["decode-3"] if len(updates(state["cfg"])) > 1 else [])
    return plans


def test_a_surge_that_finds_no_capacity_is_deployed_again_in_place_and_says_so(
    checkout: Path, account: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """decode-3's group could not launch its surge replacement (InsufficientInstanceCapacity, in its own
    scaling activities since the deploy began) and the stack rolled back: the deploy says so and deploys
    the same change with rollout.surge=off, whose preview and confirmation run again, as two updates:
    the policy alone (surge off), then the change."""
    from cluster_ops import policy_update, rollout

    ran: list[tuple[str, list[str], list[str]]] = []
    codes = iter([0, 1, 0, 0, 0, 0])
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: ran.append((verb, context, extra)) or next(codes))
    monkeypatch.setattr(stack, "deployed_status", lambda cfg: "UPDATE_ROLLBACK_COMPLETE")
    written: list[str] = []
    monkeypatch.setattr(policy_update, "write_assembly", lambda source, dest, name, templates: written.append(dest.name))
    plans = _planned(
        monkeypatch,
        lambda cfg: rollout.Rollout(kept=["decode-0"], replaced=["decode-3"], batch={"decode-3": 1}, surge={"decode-3": cfg.rollout.surge != "off"}),
        lambda cfg: [("change", {})] if cfg.rollout.surge != "off" else [("policy", {"": {}}), ("change", {})],
    )
    autoscaling = boto3.client("autoscaling", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(autoscaling)
    ice = ("Could not launch On-Demand Instances. InsufficientInstanceCapacity - We currently do not have sufficient "
           "trn3.48xlarge capacity in the Availability Zone you requested (us-east-2a). Launching EC2 instance failed.")  # fmt: skip
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    earlier = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    activity = {"ActivityId": "a", "AutoScalingGroupName": "gptoss-prod-decode-3", "Cause": "rolling update", "Progress": 100}
    stub.add_response("describe_scaling_activities", {"Activities": [
        {**activity, "StartTime": later, "StatusCode": "Failed", "StatusMessage": ice, "Description": "Launching a new EC2 instance.  Status Reason: " + ice},
        {**activity, "ActivityId": "b", "StartTime": earlier, "StatusCode": "Failed", "StatusMessage": "an old failure", "Description": "Launching"},
    ]}, {"AutoScalingGroupName": "gptoss-prod-decode-3"})  # fmt: skip
    stub.activate()
    monkeypatch.setattr(common, "session", lambda cfg: Session(autoscaling=autoscaling, cloudformation=gates_took(37, rounds=2)))
    assert cli.main(["deploy", *PROD, "--yes"]) == 0
    stub.assert_no_pending_responses()
    deploys = [(c, e[:2]) for v, c, e in ran if v == "deploy"]
    assert [c for c, _ in deploys] == [["config=examples/production-3p8d.yaml"]] + [["config=examples/production-3p8d.yaml", "rollout.surge=off"]] * 2
    # The retry's first update is the policy's own assembly, then the change's.
    assert [Path(app).name for _, (_, app) in deploys] == ["change", "policy", "change"] and written == ["policy"]
    assert [surge for surge, _ in plans] == ["auto", "off"]
    err = capsys.readouterr().err
    # The stated time is the last deploy's slowest gate, CloudFormation's own record.
    assert "decode: 1 batch, at most 0 of 8 out (surge: each replacement serves before its old instance goes), minimum serving decode 8/8, about 37 min (1 x 37 min, a node's time to serve at the last deploy)" in err, err
    assert ("the surge found no capacity for a replacement (decode-3: Could not launch On-Demand Instances. InsufficientInstanceCapacity - We "
            "currently do not have sufficient trn3.48xlarge capacity") in err, err  # fmt: skip
    assert ("Deploying the same change again without surge (rollout.surge=off): each node's instance goes before its replacement "
            "launches, at most 1 per role at a time") in err, err  # fmt: skip
    assert ("  two CloudFormation updates: first the rollout policy of 1 node groups alone (decode-3: surge on or off; no instance "
            "replaced), then the change, whose rollback then keeps that policy (AWS: an update policy changes in an update of its own)") in err, err
    assert "update 1 of 2: the rollout policy alone (GptOss8k1kProd)" in err and "update 2 of 2: the change (GptOss8k1kProd)" in err


def test_a_deploy_whose_nodes_took_longer_than_a_surge_may_deploys_without_surge_and_says_why(
    checkout: Path, account: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The last deploy's slowest gate took 90 min: a surge replacement has 60 (PauseTime, less 10 min), and a
    rollback would re-apply it. rollout.surge=auto: the plan turns surge off, synthesizes again and says why."""
    from cluster_ops import rollout

    ran: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: ran.append((verb, context)) or 0)
    monkeypatch.setattr(common, "session", lambda cfg: Session(cloudformation=gates_took(90)))
    plans = _planned(
        monkeypatch,
        lambda cfg: rollout.Rollout(kept=["decode-0"], replaced=["decode-3"], batch={"decode-3": 1}, surge={"decode-3": cfg.rollout.surge != "off"}),
        lambda cfg: [("change", {})],
    )
    assert cli.main(["deploy", *PROD, "--yes"]) == 0
    assert plans == [("auto", ["config=examples/production-3p8d.yaml"])]
    assert [v for v, _ in ran] == ["synth", "synth", "deploy"] and ran[-1][1][-1] == "rollout.surge=off"
    err = capsys.readouterr().err
    assert ("this deploy replaces nodes without surge: a node took 90 min to serve at the last deploy, more than the 50 min a surge "
            "replacement may take (60 min, CloudFormation's PauseTime, less 10 min): a surge, and the rollback of one, would time out "
            "(rollout.surge=off for this deploy; set rollout.surge=on to surge anyway)") in err, err


def test_a_failed_deploy_for_another_cause_is_not_deployed_again(checkout: Path, account: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster_ops import rollout

    ran: list[str] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: ran.append(verb) or (0 if verb == "synth" else 1))
    monkeypatch.setattr(stack, "failure_line", lambda cfg: None)
    _planned(monkeypatch, lambda cfg: rollout.Rollout(replaced=["decode-3"], batch={"decode-3": 1}, surge={"decode-3": True}), lambda cfg: [("change", {})])
    autoscaling = boto3.client("autoscaling", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(autoscaling)
    stub.add_response("describe_scaling_activities", {"Activities": []}, {"AutoScalingGroupName": "gptoss-prod-decode-3"})
    stub.activate()
    monkeypatch.setattr(common, "session", lambda cfg: Session(autoscaling=autoscaling, cloudformation=gates_took(37)))
    assert cli.main(["deploy", *PROD, "--yes"]) == 1
    assert ran == ["synth", "deploy"], "no capacity failure of a surge: nothing is deployed again"


def test_make_deploy_keeps_cdks_approval_prompt() -> None:
    r = subprocess.run(["make", "-n", "deploy", "CDK_ARGS=-c config=examples/production-3p8d.yaml"], cwd=ROOT, capture_output=True, text=True)
    (line,) = [x for x in r.stdout.splitlines() if "gptoss deploy" in x]
    assert line.strip() == ".venv/bin/gptoss deploy -c config=examples/production-3p8d.yaml"
    assert "never" not in r.stdout
    ci = subprocess.run(["make", "-n", "deploy", "DEPLOY_ARGS=--require-approval never"], cwd=ROOT, capture_output=True, text=True)
    assert ".venv/bin/gptoss deploy  --require-approval never" in ci.stdout


def test_deploy_names_the_stack_records_it_and_later_commands_find_it(checkout: Path, account: None, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    ran: list[tuple[str, str, list[str], list[str]]] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: ran.append((verb, cfg.stack_name, context, extra)) or 0)
    assert cli.main(["deploy", *PROD, "--require-approval", "never"]) == 0
    # Synthesized once into an assembly, which the deploy then deploys as it is (what the rollout was computed from);
    # the stack does not exist yet, so the synth leaves the rollout's chain out (every node launches at once).
    (synth, deploy_call) = ran
    assert synth[:3] == ("synth", "GptOss8k1kProd", ["config=examples/production-3p8d.yaml", "gptoss:first-deploy=true"])
    assert synth[3][:2] == ["--quiet", "--output"]
    assert deploy_call == ("deploy", "GptOss8k1kProd", ["config=examples/production-3p8d.yaml"], ["--app", synth[3][2], "--require-approval", "never"])
    err = capsys.readouterr().err
    assert "GptOss8k1kProd is not deployed: a deploy launches all 11 nodes at once" in err
    assert err.splitlines()[0].startswith("stack GptOss8k1kProd")
    assert "billed by the hour once deployed: 11 x trn3.48xlarge (on-demand)" in err
    # Later commands can name the cluster by its stack alone.
    assert cli.main(["plan", "--stack", "GptOss8k1kProd", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["totals"]["nodes"] == 11 and err.startswith("stack GptOss8k1kProd")
    assert cli.main(["plan", "--stack", "GptOssNope"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--stack GptOssNope: neither a stack this checkout deployed (GptOss8k1kProd) nor a recipe's stack (GptOss120bDiStack," in err, err
    assert "Fix: one of those names, or name its parameters instead" in err


def test_a_fleet_many_times_the_expected_size_is_confirmed_before_it_bills(checkout: Path, account: None, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """prefill_per_decode=128 means 9 instances: plan says so, deploy asks (or refuses without a
    terminal) and runs nothing unconfirmed; the 3 + 8 layout asked by decode_instances does not ask,
    and a later deploy of that stack is compared with what it had."""
    ran: list[str] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: (verb == "deploy" and ran.append(cfg.stack_name)) or 0)
    big = ["-c", "prefill_per_decode=128"]
    assert cli.main(["plan", *big]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "check the size: 9 x trn3.48xlarge is 4x the gptoss-120b-8k1k recipe's 2 for decode_instances=1" in out
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no terminal
    assert cli.main(["deploy", *big]) == 1
    assert "refusing to deploy without confirmation: 9 x trn3.48xlarge is 4x" in capsys.readouterr().err and ran == []
    tty = io.StringIO("8\n")
    tty.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stdin", tty)
    assert cli.main(["deploy", *big]) == 1
    assert "not confirmed ('8' is not 9): nothing was deployed." in capsys.readouterr().err and ran == []
    tty = io.StringIO("9\n")
    tty.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stdin", tty)
    assert cli.main(["deploy", *big]) == 0 and ran == ["GptOss8k1kStack"]
    capsys.readouterr()
    # Asked for: no question. Compared with the last deploy of the stack: 11 -> 11 is fine, 11 -> 56 asks.
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(["deploy", *PROD]) == 0 and ran[-1] == "GptOss8k1kProd"
    assert cli.main(["deploy", *PROD, "-c", "replicas_per_prefill_instance=1"]) == 1
    assert "56 x trn3.48xlarge is 5x the 11 instances last deployed as GptOss8k1kProd from this checkout" in capsys.readouterr().err
    assert cli.main(["deploy", *PROD, "-c", "replicas_per_prefill_instance=1", "--yes"]) == 0 and ran[-1] == "GptOss8k1kProd"


def test_a_failed_deploy_is_explained_in_one_line(checkout: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: 0 if verb == "synth" else 1)
    cfn = boto3.client("cloudformation", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(cfn)
    now = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
    stub.add_response("describe_stack_events", {"StackEvents": [
        {"StackId": "s", "EventId": "1", "StackName": "GptOss8k1kProd", "Timestamp": now, "LogicalResourceId": "Decode5InstanceA1B2C3D4",
         "ResourceStatus": "CREATE_FAILED", "ResourceStatusReason": "Insufficient capacity. (InsufficientInstanceCapacity)"}]},
        {"StackName": "GptOss8k1kProd"})  # fmt: skip
    stub.activate()
    monkeypatch.setattr(common, "session", lambda cfg: Session(cloudformation=cfn))
    monkeypatch.setattr(common, "account", lambda cfg: "123456789012")
    monkeypatch.setattr(deploy, "resolve_image", lambda cfg, args, verb: [])
    monkeypatch.setattr(stack, "exists", lambda cfg: False)
    assert cli.main(["deploy", *PROD]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("deploy failed: no capacity for decode (trn3.48xlarge in us-east-2a, on-demand)")
    assert not (checkout / ".gptoss/deployed.json").exists(), "a deploy that made no stack is not recorded"
    stub.assert_no_pending_responses()


@mock_aws
def test_status_with_nothing_running_names_the_stacks_this_checkout_deployed(moto_aws: None, checkout: Path, capsys: Any) -> None:
    """The stack exists, no instance of it runs (all lost, or still launching): said, with the other clusters of this checkout."""
    boto3.client("cloudformation", region_name=REGION).create_stack(StackName="GptOss8k1kStack", TemplateBody='{"Resources": {"T": {"Type": "AWS::SNS::Topic"}}}')
    (checkout / ".gptoss").mkdir()
    (checkout / ".gptoss/deployed.json").write_text(json.dumps({"GptOss8k1kProd": {"context": ["config=examples/production-3p8d.yaml"]}}))
    assert cli.main(["status"]) == 1
    err = capsys.readouterr().err
    assert "no instance tagged gptoss:cluster=gptoss-8k1k runs in us-east-2. Deployed from this checkout: GptOss8k1kProd (gptoss status --stack GptOss8k1kProd)" in err


def test_a_deploy_kept_for_inspection_asks_no_node_to_replace_itself(checkout: Path, account: None, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """docs/node.md: deploy with --no-rollback, look at the failed node, then destroy. A failed node's
    health watch would otherwise ask its group for a new instance (which boots, fails again and takes
    the evidence with it): the deploy turns that off for this deploy and says so."""
    ran: list[tuple[str, list[str], list[str]]] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: ran.append((verb, context, extra)) or 0)
    assert cli.main(["deploy", *PROD, "--no-rollback", "--require-approval", "never"]) == 0
    (synth, deploy_call) = ran
    assert synth[1] == ["config=examples/production-3p8d.yaml", "healing.report_unhealthy=false", "gptoss:first-deploy=true"]
    assert deploy_call[1] == ["config=examples/production-3p8d.yaml", "healing.report_unhealthy=false"]
    assert deploy_call[2][2:] == ["--no-rollback", "--require-approval", "never"]
    assert "--no-rollback: a node that fails is kept as it failed for inspection; no node asks its group to replace it" in capsys.readouterr().err


def test_a_move_onto_another_capacity_block_is_deployed_with_surge_and_said_first(
    checkout: Path, account: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The spec names the next block (every group's target moves): the deploy says the move and its dates
    before anything changes, then deploys it synthesized with rollout.surge=on (a block's default is none)."""
    from cluster_ops import policy_update, rollout

    ran: list[tuple[str, list[str], list[str]]] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: ran.append((verb, context, extra)) or 0)
    monkeypatch.setattr(stack, "deployed_status", lambda cfg: "UPDATE_COMPLETE")
    plans = _planned(
        monkeypatch,
        lambda cfg: rollout.Rollout(kept=[], replaced=["decode-0"], batch={"decode-0": 1}, surge={"decode-0": cfg.rollout.surge == "on"}),
        lambda cfg: [("change", {})],
    )
    a, b = "cr-0aaaaaaaaaaaaaaa1", "cr-0bbbbbbbbbbbbbbb2"
    monkeypatch.setattr(policy_update, "capacity_moves", lambda before, after: {"Decode0Group": ((a,), (b,))})
    ec2 = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    s = Stubber(ec2)
    now = dt.datetime.now(dt.UTC)
    s.add_response("describe_capacity_reservations", {"CapacityReservations": [
        {"CapacityReservationId": a, "ReservationType": "capacity-block", "StartDate": now - dt.timedelta(days=1), "EndDate": now + dt.timedelta(days=1)},
        {"CapacityReservationId": b, "ReservationType": "capacity-block", "StartDate": now - dt.timedelta(hours=1), "EndDate": now + dt.timedelta(days=3)},
    ]}, {"CapacityReservationIds": [a, b]})  # fmt: skip
    s.activate()
    monkeypatch.setattr(common, "session", lambda cfg: Session(ec2=ec2, cloudformation=gates_took(37, rounds=2)))
    block = [*PROD, "-c", "capacity.type=capacity-block", "-c", f"capacity.reservation_id={b}"]
    assert cli.main(["deploy", *block, "--yes"]) == 0
    out = capsys.readouterr()
    assert [surge for surge, _ in plans] == ["auto"], "one plan, which re-synthesizes with surge"
    deploys = [c for v, c, _ in ran if v == "deploy"]
    assert deploys and all(c[-1] == "rollout.surge=on" for c in deploys), ran
    assert f"moving 1 node(s) from {a} to {b}: with surge, each replacement launched in the new capacity while its old instance serves" in out.out + out.err
    s.assert_no_pending_responses()


def test_a_deploy_that_turns_api_keys_on_for_a_deployed_cluster_says_so_and_asks(
    checkout: Path, account: None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A router cluster deployed before keys existed (no secret of keys in its template) gets them by default: its clients
    that send no key would be refused. The deploy says so and how to get there without that (auth=optional), and asks;
    with auth=optional, or when the secret is deployed already, it does not."""
    secret = {"ApiKeysSecretB83EF122": {"Type": "AWS::SecretsManager::Secret", "Properties": {"Name": "gptoss/gptoss-prod/api-keys"}}}
    other = {"Topic": {"Type": "AWS::SNS::Topic"}}
    prod = load_config({"config": "examples/production-3p8d.yaml"})
    assert deploy_plan.keys_turn_on(prod, other, other | secret)
    assert not deploy_plan.keys_turn_on(prod, other | secret, other | secret), "already on"
    optional = load_config({"config": "examples/production-3p8d.yaml", "serving.endpoint.auth": "optional"})
    assert not deploy_plan.keys_turn_on(optional, other, other | secret)
    ran: list[str] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: (verb == "deploy" and ran.append(cfg.stack_name)) or 0)
    monkeypatch.setattr(deploy_plan, "make", lambda cfg, context, workdir: deploy_plan.DeployPlan(cfg, context, workdir, None, keys_turn_on=True))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no terminal
    assert cli.main(["deploy", *PROD]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "API keys turn on with this deploy" in err and "deploy with -c serving.endpoint.auth=optional" in err
    assert "refusing to turn on API keys without confirmation (no terminal)" in err and ran == []
    tty = io.StringIO("keys\n")
    tty.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stdin", tty)
    assert cli.main(["deploy", *PROD]) == 0 and ran == ["GptOss8k1kProd"]
