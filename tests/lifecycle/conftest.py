"""The lifecycle tests' local AWS: one moto server per test module (tests/lifecycle/local_aws.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.lifecycle.local_aws import LocalAws, started


@pytest.fixture(scope="module")
def local_aws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAws]:
    """A moto server on loopback, bootstrapped for the CDK, with the test's AMI parameter and bucket."""
    with started(tmp_path_factory.mktemp("local-aws")) as aws:
        yield aws
