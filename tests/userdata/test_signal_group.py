"""The surge's signal: gptoss-signal telling its own Auto Scaling group (CloudFormation's
SignalResource, a loopback fake validated against botocore's model, EC2 from moto)."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import real_aws_cli
from tests.userdata.test_signal import _amz, _ready_after

Shipped = Callable[[str], Path]


# ---- the surge's signal to the node's group -------------------------------------------------------


class _CloudFormation(http.server.BaseHTTPRequestHandler):
    """CloudFormation's query API on loopback (moto has no SignalResource, and no wait condition to
    describe): SignalResource, recorded and answered as CloudFormation does, in turn (the last answer
    from then on); DescribeStackResource of the node's gate, answered with `gate_status`."""

    calls: list[dict[str, str]]
    answers: list[tuple[int, str]]
    gate_status = "CREATE_IN_PROGRESS"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        import urllib.parse

        form = dict(urllib.parse.parse_qsl(self.rfile.read(int(self.headers["Content-Length"])).decode()))
        ns = "http://cloudformation.amazonaws.com/doc/2010-05-15/"
        if form.get("Action") == "DescribeStackResource":
            self.asked.append(form)
            detail = (f"<StackName>{form['StackName']}</StackName><LogicalResourceId>{form['LogicalResourceId']}</LogicalResourceId>"
                      "<ResourceType>AWS::CloudFormation::WaitCondition</ResourceType><LastUpdatedTimestamp>2026-12-01T00:00:00Z"
                      f"</LastUpdatedTimestamp><ResourceStatus>{self.gate_status}</ResourceStatus>")  # fmt: skip
            self._send(200, f'<DescribeStackResourceResponse xmlns="{ns}"><DescribeStackResourceResult><StackResourceDetail>{detail}'
                            "</StackResourceDetail></DescribeStackResourceResult><ResponseMetadata><RequestId>r</RequestId>"
                            "</ResponseMetadata></DescribeStackResourceResponse>")  # fmt: skip
            return
        self.calls.append(form)
        status, message = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if status == 200:
            body = f'<SignalResourceResponse xmlns="{ns}"><ResponseMetadata><RequestId>r</RequestId></ResponseMetadata></SignalResourceResponse>'
        else:
            body = (f'<ErrorResponse xmlns="{ns}"><Error><Type>Sender</Type><Code>ValidationError</Code><Message>{message}</Message>'
                    "</Error><RequestId>r</RequestId></ErrorResponse>")  # fmt: skip
        self._send(status, body)

    def _send(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def surge_node(signal_node: Any, moto_url: str, tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.CompletedProcess[str], list[dict[str, str]]]]]:
    """gptoss-signal of a surge rollout: the real AWS CLI, EC2's tags in moto, CloudFormation on loopback."""

    import boto3

    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"), timeout=10)
    ec2 = boto3.client("ec2", endpoint_url=moto_url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    instance = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    handler = type("C", (_CloudFormation,), {"calls": [], "answers": [(200, "")], "asked": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bindir = tmp_path / "awsbin"
    real_aws_cli(bindir)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "identity.env").write_text(f"GPTOSS_INSTANCE_ID={instance}\n")

    def run(*, tags: bool = True, answers: list[tuple[int, str]] | None = None, gate_status: str = "CREATE_IN_PROGRESS",
            **kw: Any) -> tuple[subprocess.CompletedProcess[str], list[dict[str, str]]]:  # fmt: skip
        handler.gate_status = gate_status
        if tags:
            ec2.create_tags(Resources=[instance], Tags=[{"Key": "aws:cloudformation:stack-name", "Value": "GptOss8k1kStack-DecodeCell0-ABC"},
                                                        {"Key": "aws:cloudformation:logical-id", "Value": "Decode0Group30BAA125"}])  # fmt: skip
        handler.answers = answers or [(200, "")]
        env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "AWS_ENDPOINT_URL_EC2": moto_url,
               "AWS_ENDPOINT_URL_CLOUDFORMATION": f"http://127.0.0.1:{server.server_address[1]}", "GPTOSS_RUN_DIR": str(run_dir),
               "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}  # fmt: skip
        return signal_node(extra_env=env, aws=True, **kw), handler.calls

    run.instance = instance  # type: ignore[attr-defined]
    run.asked = handler.asked  # type: ignore[attr-defined]
    yield run
    server.shutdown()


def test_a_surge_replacement_signals_its_own_group_with_the_gates_verdict_once(surge_node: Any, peers: Any) -> None:
    r, calls = surge_node()
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p["doc"]["Status"] for p in peers.puts] == ["SUCCESS"], "the deploy gate hears it first"
    assert calls == [{"Action": "SignalResource", "Version": "2010-05-15", "StackName": "GptOss8k1kStack-DecodeCell0-ABC",
                      "LogicalResourceId": "Decode0Group30BAA125", "UniqueId": surge_node.instance, "Status": "SUCCESS"}], calls  # fmt: skip
    assert "signalled SUCCESS to its group (GptOss8k1kStack-DecodeCell0-ABC/Decode0Group30BAA125)" in r.stdout
    again, calls = surge_node()
    assert again.returncode == 0 and len(calls) == 1, "a reboot signals neither the gate nor the group again"


def test_a_rollbacks_replacement_with_an_expired_handle_tells_its_group_success_once_it_serves(surge_node: Any, peers: Any) -> None:
    """A rollback re-applies the previous template: its replacement boots user data whose handle was made
    at the previous deploy (two days ago here, its URL long expired). It tells the handle nothing, and
    its group SUCCESS once it serves (a surge's rollback waits for it), with its own deadline."""
    _ready_after(peers, 2)
    r, calls = surge_node(query=_amz(signed_ago_s=48 * 3600), timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert peers.puts == [], "an expired handle is told nothing"
    assert [(c["Status"], c["UniqueId"]) for c in calls] == [("SUCCESS", surge_node.instance)], r.stdout
    assert "the deploy gate will not be told (its URL has expired)" in r.stdout


def test_a_replacement_whose_gate_was_answered_does_not_answer_it_again(surge_node: Any, peers: Any) -> None:
    """An unchanged node's replacement (its instance lost; a rollback's): CloudFormation has its gate
    CREATE_COMPLETE, answered by the instance before it. The replacement asks (its own stack, its gate's
    id from signal.env), PUTs nothing, and still tells its group."""
    query = _amz(signed_ago_s=3600)
    r, calls = surge_node(gate="Decode0Ready6c55a2a5ConditionB5F58AE7", gate_status="CREATE_COMPLETE", query=query)
    assert r.returncode == 0, r.stdout + r.stderr
    assert peers.puts == []
    assert [(a["StackName"], a["LogicalResourceId"]) for a in surge_node.asked] == [("GptOss8k1kStack-DecodeCell0-ABC", "Decode0Ready6c55a2a5ConditionB5F58AE7")]
    assert [c["Status"] for c in calls] == ["SUCCESS"]
    assert "CloudFormation has its wait condition answered already" in r.stdout
    again, calls = surge_node(gate="Decode0Ready6c55a2a5ConditionB5F58AE7", gate_status="CREATE_COMPLETE", query=query)
    assert peers.puts == [] and len(calls) == 1 and "already signalled (SUCCESS" in again.stdout, "a reboot: the verdict is kept, nothing again"


def test_the_instance_id_written_after_the_signal_started_is_the_one_it_signals(surge_node: Any, peers: Any, tmp_path: Path) -> None:
    """gptoss-signal starts at boot beside gptoss-identity, which writes the instance's id once the instance
    metadata answers: the id is read when the verdict is there, not when the script started."""
    identity = tmp_path / "run" / "identity.env"
    written = identity.read_text()
    identity.unlink()
    original = peers.do_POST

    def do_post(self: Any) -> None:
        identity.write_text(written)  # gptoss-identity, done while the node was still getting ready
        original(self)

    peers.do_POST = do_post
    r, calls = surge_node()
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(c["Status"], c["UniqueId"]) for c in calls] == [("SUCCESS", surge_node.instance)], r.stdout


def test_a_failed_node_tells_its_group_at_once_not_after_the_surge_timeout(surge_node: Any, peers: Any) -> None:
    r, calls = surge_node(units={"gptoss-proxy.service": "ActiveState=failed\nSubState=failed\nNRestarts=0"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert [c["Status"] for c in calls] == ["FAILURE"] and peers.puts[0]["doc"]["Status"] == "FAILURE"


def test_a_group_that_waits_for_no_signal_is_said_and_not_asked_again(surge_node: Any) -> None:
    """The first deploy (a creation, no rolling update): CloudFormation refuses the signal; the node says so."""
    refused = "Resource Decode0Group30BAA125 is in CREATE_COMPLETE state and cannot be signaled"
    r, calls = surge_node(answers=[(400, refused)])
    assert r.returncode == 0 and len(calls) == 1, r.stdout + r.stderr
    assert "waits for no signal (no rolling update in progress)" in r.stdout


def test_a_throttled_signal_is_sent_again(surge_node: Any) -> None:
    r, calls = surge_node(answers=[(400, "Rate exceeded"), (200, "")])
    assert r.returncode == 0 and [c["Status"] for c in calls] == ["SUCCESS", "SUCCESS"], r.stdout + r.stderr
    assert "attempt 1 to signal the group failed" in r.stdout and "signalled SUCCESS to its group" in r.stdout


def test_an_instance_no_stack_launched_signals_no_group(surge_node: Any) -> None:
    r, calls = surge_node(tags=False)
    assert r.returncode == 0 and calls == [], r.stdout + r.stderr
    assert "carries no aws:cloudformation tags" in r.stdout
