"""`gptoss`: what an operator sees. The cluster each command acts on, one line per AWS error,
destroy that asks, deploy that keeps CDK's approval, cost, and the pinned image."""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.stub import Stubber
from moto import mock_aws

from cluster_ops import cli, common, cost, deploy_plan, stack
from cluster_ops.commands import deploy, destroy
from clusterspec.loading import load_config
from tests.conftest import ROOT

REGION = "us-east-2"
GPTOSS = Path(sys.executable).parent / "gptoss"
PROD = ["-c", "config=examples/production-3p8d.yaml"]


def no_credentials(tmp_path: Path) -> dict[str, str]:
    """An environment where boto3 finds no credentials and never asks the instance metadata service."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return env | {"HOME": str(tmp_path), "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                  "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": REGION}  # fmt: skip


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout of our own: cdk.context.json and the deploy records go here."""
    monkeypatch.setattr(common, "checkout", lambda: tmp_path)
    return tmp_path


@pytest.fixture
def account(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials that work (the account is asked before a deploy or destroy) and an image the
    stack pins already (no DLAMI parameter to resolve)."""
    monkeypatch.setattr(common, "account", lambda cfg: "123456789012")
    monkeypatch.setattr(deploy, "resolve_image", lambda cfg, args, verb: [])
    monkeypatch.setattr(stack, "exists", lambda cfg: False)
    monkeypatch.setattr(stack, "deployed_status", lambda cfg: "CREATE_COMPLETE")  # destroy acts on a stack that exists


class Session:
    def __init__(self, **clients: Any) -> None:
        self.clients = clients

    def client(self, name: str, region_name: str | None = None) -> Any:
        """The given client; any other is one no call of the test reaches (it fails first on a given one)."""
        return self.clients.get(name)


def gates_took(minutes: float, rounds: int = 1) -> Any:
    """CloudFormation (Stubber) whose stack's one deploy gate took MINUTES at the last deploy, for ROUNDS previews."""
    cfn = boto3.client("cloudformation", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(cfn)
    t0 = dt.datetime(2026, 12, 3, 10, 0, tzinfo=dt.UTC)
    for _ in range(rounds):
        stub.add_response("list_stack_resources", {"StackResourceSummaries": []}, {"StackName": "GptOss8k1kProd"})
        stub.add_response("describe_stack_events", {"StackEvents": [
            {"StackId": "s", "EventId": f"e{i}", "StackName": "GptOss8k1kProd", "LogicalResourceId": "Decode3Ready", "ResourceType":
             "AWS::CloudFormation::WaitCondition", "ResourceStatus": state, "Timestamp": t0 + dt.timedelta(minutes=m)}
            for i, (state, m) in enumerate((("CREATE_COMPLETE", minutes), ("CREATE_IN_PROGRESS", 0)))]}, {"StackName": "GptOss8k1kProd"})  # fmt: skip
    stub.activate()
    return cfn


def failing(service: str, operation: str, code: str, message: str = "") -> Any:
    client = boto3.client(service, region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x",
                          config=Config(retries={"max_attempts": 1}))  # fmt: skip
    stub = Stubber(client)
    stub.add_client_error(operation, code, message or code)
    stub.activate()
    return client


@pytest.fixture
def moto_aws() -> Iterator[None]:
    with mock_aws():
        yield


# ---- one line for every AWS error -----------------------------------------------------------


AWS_COMMANDS = [["status"], ["wait-ready", "--timeout", "1"], ["bench"], ["preflight"], ["save-cache", "-c", "compile_cache_s3_uri=s3://gptoss-cache/n"],
                ["pin-ami"], ["deploy"], ["diff"], ["destroy", "--yes", *PROD]]  # fmt: skip


def _stack_line(command: list[str]) -> str:
    return ("stack GptOss8k1kProd · region us-east-2 · cluster tag gptoss:cluster=gptoss-prod" if "config=examples/production-3p8d.yaml" in command
            else "stack GptOss8k1kStack · region us-east-2 · cluster tag gptoss:cluster=gptoss-8k1k")  # fmt: skip


@pytest.mark.parametrize("command", AWS_COMMANDS, ids=[c[0] for c in AWS_COMMANDS])
def test_without_credentials_every_aws_command_says_so_in_one_line(command: list[str], tmp_path: Path) -> None:
    env = no_credentials(tmp_path) | {"GPTOSS_STATE_DIR": str(tmp_path / "state")}
    r = subprocess.run([str(GPTOSS), *command], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert lines[0] == _stack_line(command)
    assert lines[1:] == [f"gptoss {command[0]}: no AWS credentials found. Fix: configure credentials for the account "
                         "(aws configure, aws sso login, or AWS_PROFILE / AWS_ACCESS_KEY_ID), then run the command again."]  # fmt: skip
    assert "Traceback" not in r.stderr + r.stdout and r.stdout == "", "nothing else: no progress bar, no synth"
    assert not (tmp_path / "state" / "deployed.json").exists(), "nothing recorded"


@pytest.fixture(scope="module")
def html_500() -> Iterator[str]:
    """An endpoint that answers every request with an HTML error page and status 500 (a broken local
    endpoint, or a proxy in front of AWS)."""
    import http.server
    import threading

    class Broken(http.server.BaseHTTPRequestHandler):
        def _fail(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = b"<!doctype html>\n<html lang=en>\n<title>500 Internal Server Error</title>\n<h1>Internal Server Error</h1>\n"
            self.send_response(500)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = _fail

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.parametrize("command", AWS_COMMANDS, ids=[c[0] for c in AWS_COMMANDS])
def test_an_endpoint_answering_html_500_is_one_line_naming_it(command: list[str], html_500: str, tmp_path: Path) -> None:
    env = no_credentials(tmp_path) | {"AWS_ENDPOINT_URL": html_500, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                                      "AWS_MAX_ATTEMPTS": "2", "GPTOSS_STATE_DIR": str(tmp_path / "state")}  # fmt: skip
    r = subprocess.run([str(GPTOSS), *command], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert lines[0] == _stack_line(command) and len(lines) == 2, lines
    assert lines[1].startswith(f"gptoss {command[0]}: the endpoint {html_500} answered "), lines[1]
    assert f"Fix: check the service at {html_500} (AWS_ENDPOINT_URL)" in lines[1], lines[1]
    assert "<" not in lines[1] and "Traceback" not in r.stderr + r.stdout and r.stdout == ""


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("ExpiredToken", "gptoss status: the AWS credentials have expired (ExpiredToken). Fix: refresh them"),
        ("UnauthorizedOperation", "gptoss status: access denied: the caller may not ec2:DescribeInstances in us-east-2"),
        ("RequestLimitExceeded", "gptoss status: AWS throttled ec2:DescribeInstances after every retry (RequestLimitExceeded)"),
        ("InvalidClientTokenId", "gptoss status: AWS does not accept these credentials (InvalidClientTokenId"),
    ],
)
def test_expired_denied_and_throttled_are_one_line_naming_the_action(
    code: str, expected: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setattr(common, "session", lambda cfg: Session(ec2=failing("ec2", "describe_instances", code), ssm=None))
    assert cli.main(["status"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[1].startswith(expected), err
    if code == "UnauthorizedOperation":
        assert err[1].endswith("Fix: grant ec2:DescribeInstances to the role or user you run as.")


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
    assert "--stack GptOssNope: no stack of that name was deployed from this checkout (recorded: GptOss8k1kProd)" in capsys.readouterr().err


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


# ---- the pinned image ---------------------------------------------------------------------


def test_pin_ami_records_the_image_and_the_config_uses_it(moto_aws: None, checkout: Path, capsys: Any) -> None:
    ec2 = boto3.client("ec2", region_name=REGION)
    ssm = boto3.client("ssm", region_name=REGION)
    first, second = [i["ImageId"] for i in ec2.describe_images(Owners=["amazon"])["Images"][:2]]
    ssm.put_parameter(Name="/test/dlami", Value=first, Type="String")
    args = ["-c", "ami_ssm_parameter=/test/dlami"]
    assert cli.main(["pin-ami", *args]) == 0
    assert f"pinned {first} (" in capsys.readouterr().out
    pin = json.loads((checkout / "cdk.context.json").read_text())["gptoss:pinned-ami:us-east-2"]
    assert pin["ami_id"] == first and pin["parameter"] == "/test/dlami" and pin["name"] and pin["created"]
    # Every command now uses the recorded image, not the parameter.
    assert cli.main(["plan", "--json", *args]) == 0
    assert json.loads(capsys.readouterr().out)["ami"] == {"id": first}
    # AWS publishes a new image: nothing moves until the operator asks.
    ssm.put_parameter(Name="/test/dlami", Value=second, Type="String", Overwrite=True)
    assert cli.main(["pin-ami", *args]) == 0
    assert f"already pinned: {first}" in capsys.readouterr().out
    assert cli.main(["pin-ami", "--upgrade", *args]) == 0
    out = capsys.readouterr().out
    assert f"pinned {second}" in out and f"was {first}" in out and "replaces every instance" in out
    # A config that names another parameter is not affected by this pin.
    assert load_config({"ami_ssm_parameter": "/other/param", "gptoss:pinned-ami:us-east-2": pin}).ami_id is None


def test_an_unpinned_deploy_passes_the_image_it_resolved_and_a_new_one_asks_first(
    moto_aws: None, checkout: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The deploy gate sees the image as a value of the synth: the parameter is resolved by the CLI,
    said, passed as ami_id and recorded; a newer image replaces every instance, so it asks."""
    ec2 = boto3.client("ec2", region_name=REGION)
    ssm = boto3.client("ssm", region_name=REGION)
    first, second = [i["ImageId"] for i in ec2.describe_images(Owners=["amazon"])["Images"][:2]]
    ssm.put_parameter(Name="/test/dlami", Value=first, Type="String")
    ran: list[list[str]] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: (verb == "deploy" and ran.append(context)) or 0)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no terminal
    args = ["deploy", "-c", "ami_ssm_parameter=/test/dlami"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert f"image {first} (" in err and "from /test/dlami, for this deploy; pin it to keep it: gptoss pin-ami" in err
    assert ran[-1][-2:] == [f"ami_id={first}", "ami_ssm_parameter=null"]
    assert common.deployed()["GptOss8k1kStack"]["image"] == first
    ssm.put_parameter(Name="/test/dlami", Value=second, Type="String", Overwrite=True)
    assert cli.main(args) == 1 and len(ran) == 1
    err = capsys.readouterr().err
    assert f"refusing to move to a new image without confirmation: {first} was deployed before: the new image replaces every instance" in err
    assert cli.main([*args, "--yes"]) == 0 and ran[-1][-2] == f"ami_id={second}"


def test_an_unpinned_stack_warns_at_synth_and_a_pinned_one_does_not() -> None:
    import aws_cdk as cdk
    from aws_cdk.assertions import Annotations, Match

    from stacks.cluster_stack import GptOssClusterStack

    app = cdk.App()
    unpinned = GptOssClusterStack(app, "A", config=load_config({}))
    pinned = GptOssClusterStack(app, "B", config=load_config({"ami_id": "ami-0123456789abcdef0", "ami_ssm_parameter": "null"}))
    said = "cdk deploy` of this template replaces every instance.*Deploy with gptoss deploy.*pin it: gptoss pin-ami"
    Annotations.from_stack(unpinned).has_warning("*", Match.string_like_regexp(said))
    Annotations.from_stack(pinned).has_no_warning("*", Match.string_like_regexp("pin-ami"))



def test_an_unpinned_model_and_examples_warn_at_synth_and_pinned_ones_do_not() -> None:
    """The checkpoint and the examples are fetched at boot: unset commits are said at synth, and in the plan."""
    import aws_cdk as cdk
    from aws_cdk.assertions import Annotations, Match

    from cluster_ops.plan_view import pin_lines
    from stacks.cluster_stack import GptOssClusterStack

    app = cdk.App()
    unpinned_cfg = load_config({})
    pinned_cfg = load_config({"model.revision": "1" * 40, "examples.commit": "2" * 40})
    unpinned = GptOssClusterStack(app, "A", config=unpinned_cfg)
    pinned = GptOssClusterStack(app, "B", config=pinned_cfg)
    Annotations.from_stack(unpinned).has_warning("*", Match.string_like_regexp("model.revision is unset: each node downloads openai/gpt-oss-120b as the Hub's main"))
    Annotations.from_stack(unpinned).has_warning("*", Match.string_like_regexp("examples.commit is unset: nodes take the commit tag release-2.33 points at"))
    Annotations.from_stack(pinned).has_no_warning("*", Match.string_like_regexp("is unset"))
    assert pin_lines(unpinned_cfg) == [
        "  model: openai/gpt-oss-120b, unpinned (set model.revision)",
        "  examples: release-2.33, commit unpinned (set examples.commit)",
        "  NIXL: the image's",
    ]
    assert pin_lines(pinned_cfg)[:2] == [f"  model: openai/gpt-oss-120b at {'1' * 40}", f"  examples: release-2.33 at {'2' * 40}"]


def test_without_egress_open_https_warns_at_synth_until_the_s3_prefix_list_is_named() -> None:
    import aws_cdk as cdk
    from aws_cdk.assertions import Annotations, Match

    from stacks.cluster_stack import GptOssClusterStack

    s3 = {"model.source": "s3", "model.s3_uri": "s3://models-bucket/gpt-oss-120b", "examples.s3_uri": "s3://models-bucket/vllm-neuron"}
    app = cdk.App()
    open_ = GptOssClusterStack(app, "A", config=load_config({"network.egress": "none", **s3}))
    narrow = GptOssClusterStack(app, "B", config=load_config({"network.egress": "none", "network.s3_prefix_list_id": "pl-7ba54012", **s3}))
    nat = GptOssClusterStack(app, "C", config=load_config({}))
    said = "network.s3_prefix_list_id is unset: the nodes' HTTPS egress is allowed to any address"
    Annotations.from_stack(open_).has_warning("*", Match.string_like_regexp(said))
    Annotations.from_stack(narrow).has_no_warning("*", Match.string_like_regexp("s3_prefix_list_id"))
    Annotations.from_stack(nat).has_no_warning("*", Match.string_like_regexp("s3_prefix_list_id"))


# ---- cost ----------------------------------------------------------------------------------


def price_list(unit: str, usd: str, *extra: tuple[str, str]) -> str:
    dims = {"d1": {"unit": unit, "pricePerUnit": {"USD": usd}}}
    dims.update({f"d{i + 2}": {"unit": u, "pricePerUnit": {"USD": p}} for i, (u, p) in enumerate(extra)})
    return json.dumps({"product": {}, "terms": {"OnDemand": {"t": {"priceDimensions": dims}}}})


def test_cost_prices_each_item_from_the_price_list(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    cfg = load_config({"decode_instances": "8"})
    pricing = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(pricing)
    for item, answer in zip(cost.items(cfg), [price_list("Hrs", "40.0"), price_list("GB-Mo", "0.08"),
                                              price_list("GB", "0.045", ("Hrs", "0.045")), price_list("LCU-Hrs", "0.006", ("Hrs", "0.0225"))], strict=True):  # fmt: skip
        stub.add_response("get_products", {"PriceList": [answer]},
                          {"ServiceCode": item.service, "Filters": [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in item.filters],
                           "MaxResults": 100})  # fmt: skip
    stub.activate()
    priced = {i.name: i for i in cost.priced(cfg, pricing)}
    assert priced["trn3.48xlarge (on-demand)"].per_hour == pytest.approx(440.0)
    assert priced["root volumes, gp3 512 GB"].per_hour == pytest.approx(11 * 512 * 0.08 / 730)
    assert priced["NAT gateway"].usd == 0.045 and priced["internal Network Load Balancer"].usd == 0.0225
    stub.assert_no_pending_responses()


def test_a_capacity_block_is_not_priced_by_the_hour() -> None:
    """A block is paid when bought: the Price List is not asked for its instances, the rest is priced."""
    cfg = load_config({"capacity": {"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"}})
    pricing = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(pricing)
    for item, answer in zip(cost.items(cfg)[1:], [price_list("GB-Mo", "0.08"), price_list("Hrs", "0.045")], strict=True):
        stub.add_response("get_products", {"PriceList": [answer]},
                          {"ServiceCode": item.service, "Filters": [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in item.filters],
                           "MaxResults": 100})  # fmt: skip
    stub.activate()
    instances, volumes, nat = cost.priced(cfg, pricing)
    assert (instances.usd, instances.note) == (None, "paid up front when the block was bought")
    assert volumes.usd == 0.08 and nat.usd == 0.045
    stub.assert_no_pending_responses()


# ---- errors with a fix -----------------------------------------------------------------------


def test_destroy_of_a_stack_that_does_not_exist_says_there_is_nothing_to_destroy(moto_aws: None, checkout: Path, monkeypatch: pytest.MonkeyPatch,
                                                                               capsys: Any) -> None:  # fmt: skip
    ran: list[str] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: ran.append(verb) or 0)
    common.record(load_config({"decode_instances": "1"}), ["decode_instances=1"])  # a record of another cluster, deployed from here
    assert cli.main(["destroy", *PROD, "--yes"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("nothing to destroy: there is no stack GptOss8k1kProd in us-east-2 (account 123456789012). If you meant another cluster, "
                       "name it (deployed from this checkout: --stack GptOss8k1kStack).")  # fmt: skip
    assert ran == [], "cdk destroy never ran"


@pytest.mark.parametrize("command", [["status"], ["wait-ready", "--timeout", "3600"]])
def test_status_and_wait_ready_of_a_cluster_that_is_not_deployed_say_so_at_once(command: list[str], moto_aws: None, checkout: Path, capsys: Any) -> None:
    common.record(load_config({"decode_instances": "8"}), ["decode_instances=8"])
    started = __import__("time").monotonic()
    assert cli.main([*command, *PROD]) == 2
    assert __import__("time").monotonic() - started < 600, "no wait for a cluster that is not there"
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"gptoss {command[0]}: GptOss8k1kProd is not deployed in us-east-2: there is no such stack. Fix: name the cluster that is "
                       "deployed (from this checkout: --stack GptOss8k1kStack; or -c config=FILE with its parameters), or check the region (-c region=...).")  # fmt: skip


@pytest.mark.parametrize("command", [["pin-ami"], ["deploy", "--yes"]])
def test_a_dlami_parameter_the_region_does_not_have_is_one_line_with_the_fix(command: list[str], moto_aws: None, checkout: Path, capsys: Any) -> None:
    assert cli.main([*command, "-c", "ami_ssm_parameter=/aws/service/neuron/dlami/nope/latest/image_id"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"gptoss {command[0]}: no DLAMI parameter /aws/service/neuron/dlami/nope/latest/image_id in us-east-2: ")
    assert "Fix: check the region (-c region=...), set ami_ssm_parameter to a name" in err[-1] and err[-1].endswith("or pin an image: -c ami_id=ami-...")
    assert "Traceback" not in "\n".join(err)


def test_settings_another_choice_makes_irrelevant_are_said_after_the_target_line(capsys: Any) -> None:
    assert cli.main(["plan", "-c", "capacity.preference=open", "-c", "network.flow_logs=false", "-c", "network.flow_logs_traffic=ALL",
                     "-c", "serving.proxy.router.health_check_timeout_s=3", "-c", "ami_id=ami-0123456789abcdef0",
                     "-c", "acknowledge_unpinned_ami=true", "-c", "observability.alarm_topic_arn=arn:aws:sns:us-east-2:123456789012:pager",
                     "-c", 'observability.alarm_emails=["oncall@example.com"]']) == 0  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "stack GptOss8k1kStack · region us-east-2 · cluster tag gptoss:cluster=gptoss-8k1k",
        "note: capacity.preference='open' has no effect: capacity.type is on-demand",
        "note: network.flow_logs_traffic='ALL' has no effect: network.flow_logs is false",
        "note: observability.alarm_emails=['oncall@example.com'] has no effect: observability.alarm_topic_arn names your topic; subscribe to it",
        "note: serving.proxy.router has no effect: the endpoint is the toy proxy, not vLLM's router (serving.proxy.kind)",
        "note: acknowledge_unpinned_ami=true has no effect: the image is pinned (ami-0123456789abcdef0)",
    ]
    assert cli.main(["plan", "-c", "decode_instances=8", "-c", "serving.proxy.router.health_check_timeout_s=3"]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")] == [], "the recipe's own values are never noted"


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
