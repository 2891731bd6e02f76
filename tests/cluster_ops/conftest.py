"""Fixtures of the operator-command tests: a checkout of the test's own, an account that answers, moto."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from moto import mock_aws

from cluster_ops import common, stack
from cluster_ops.commands import deploy
from tests.cluster_ops.cli_helpers import REGION


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


@pytest.fixture
def moto_aws() -> Iterator[None]:
    with mock_aws():
        yield


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)  # for this test only: nothing leaks into the next one
    with mock_aws():
        yield
