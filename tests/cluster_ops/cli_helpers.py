"""What the operator-command tests share: the region, the CLI as installed, a session of given clients, Stubbers
of CloudFormation and of a failing call, an environment without credentials."""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.stub import Stubber

REGION = "us-east-2"
GPTOSS = Path(sys.executable).parent / "gptoss"
PROD = ["-c", "config=examples/production-3p8d.yaml"]


def no_credentials(tmp_path: Path) -> dict[str, str]:
    """An environment where boto3 finds no credentials and never asks the instance metadata service."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return env | {"HOME": str(tmp_path), "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                  "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": REGION}  # fmt: skip


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
