"""`gptoss`: one line for every AWS error (no credentials, an endpoint's HTML 500, expired, denied, throttled),
and errors that say their fix."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster_ops import cli, common, stack
from clusterspec.loading import load_config
from tests.cluster_ops.cli_helpers import GPTOSS, PROD, Session, failing, no_credentials
from tests.conftest import ROOT, gptoss_in_process

# ---- one line for every AWS error -----------------------------------------------------------


AWS_COMMANDS = [["status"], ["wait-ready", "--timeout", "1"], ["bench"], ["preflight"], ["save-cache", "-c", "compile_cache_s3_uri=s3://gptoss-cache/n"],
                ["pin-ami"], ["deploy"], ["diff"], ["destroy", "--yes", *PROD], ["keys", "list", *PROD]]  # fmt: skip


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
    # In this process (the installed entry point's own process is the no-credentials test's, above).
    r = gptoss_in_process(*command, env=env)
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
