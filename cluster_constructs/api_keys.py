"""The cluster's API keys: one Secrets Manager secret the router nodes read (gptoss-keys) and `gptoss keys` edits.

The stack creates gptoss/<cluster>/api-keys with one generated key ('initial', 48 characters) unless
the operator names a secret of their own (serving.endpoint.keys_secret_arn). CloudFormation deletes
its own secret with the stack, without a recovery window (its default for this resource), so the
cluster name can be deployed again at once; an operator's secret outlives the stack.
"""

from __future__ import annotations

import json

from aws_cdk import Acknowledgment, Aws, Validations
from aws_cdk import aws_secretsmanager as secretsmanager
from constructs import Construct

from clusterspec.config import ClusterConfig
from clusterspec.sections.endpoint import keys_secret_name

KEY_CHARS = 48


def keys_secret_resources(config: ClusterConfig) -> list[str]:
    """The IAM resources of the cluster's secret of keys: the operator's (full or partial ARN), else the stack's by its name."""
    arn = config.serving.endpoint.keys_secret_arn
    if arn:
        return [arn, f"{arn}-??????"]
    return [f"arn:{Aws.PARTITION}:secretsmanager:{config.region}:{Aws.ACCOUNT_ID}:secret:{keys_secret_name(config.cluster_name)}-??????"]


class ApiKeysSecret(Construct):
    """The stack's secret of API keys, with one generated key."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig) -> None:
        super().__init__(scope, construct_id)
        self.secret = secretsmanager.Secret(
            self,
            "Secret",
            secret_name=keys_secret_name(config.cluster_name),
            description=f"{config.cluster_name}: API keys of the model endpoint (gptoss keys; the router nodes keep only their sha256)",
            generate_secret_string=secretsmanager.SecretStringGenerator(
                secret_string_template=json.dumps({"keys": []}), generate_string_key="initial",
                password_length=KEY_CHARS, exclude_punctuation=True,
            ),
        )  # fmt: skip
        Validations.of(self).acknowledge(
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-SMG4",
                reason="API keys rotate by `gptoss keys rotate` (a new key beside the old one for a grace period, which its "
                "client must take up); a rotation Lambda would change a key under the clients that use it.",
            )
        )
