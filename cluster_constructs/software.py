"""The fleet's software: one reproducible tarball (every node's files and the scripts they share) as a
CDK file asset, the SSM parameter that names the current version (every node reads it at boot) and,
with rollout.software=in-place, the State Manager document that applies a new one on a running node
(docs/design.md 'Changes')."""

from __future__ import annotations

import atexit
import hashlib
import shutil
import tempfile
from pathlib import Path

from aws_cdk import Fn, Stack, Tags
from aws_cdk import aws_s3_assets as s3_assets
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from clusterspec.config import ClusterConfig
from node_render.node_files import NodeRender
from node_render.paths import BIN, software_parameter
from node_render.userdata import SOFTWARE_ASSET, software_asset

# What a version is, as the document accepts it: the asset's s3:// URI and its sha256. The document's
# command line takes it as text: nothing else may reach the shell.
VERSION_PATTERN = r"^s3://[a-z0-9.-]+/[A-Za-z0-9._/-]+ [0-9a-f]{64}$"
# The apply's own steps around the node's restart: the fetch (its budget), the verdict's polls.
APPLY_MARGIN_S = 900


def apply_document(config: ClusterConfig) -> dict[str, object]:
    """The Command document State Manager runs on each node of a role: gptoss-apply with the version."""
    return {
        "schemaVersion": "2.2",
        "description": f"{config.cluster_name}: run a version of the fleet's software in place (gptoss-apply)",
        "parameters": {
            "Software": {
                "type": "String",
                "description": "The version: the software asset's s3:// URI and sha256",
                "allowedPattern": VERSION_PATTERN,
            },
            "TimeoutSeconds": {
                "type": "String",
                "description": "How long the node has to serve again",
                "allowedPattern": "^[0-9]{1,5}$",
            },
        },
        "mainSteps": [
            {
                "action": "aws:runShellScript",
                "name": "apply",
                "inputs": {
                    # Twice the node's bound and the fetch: a failed change also rolls back and is judged again.
                    "timeoutSeconds": 2 * config.rollout.apply_timeout_s + APPLY_MARGIN_S,
                    "runCommand": [f"{BIN}/gptoss-apply '{{{{ Software }}}}' '{{{{ TimeoutSeconds }}}}'"],
                },
            }
        ],
    }


class NodeSoftware(Construct):
    """The asset (in the CDK bootstrap bucket), its s3:// URI, the sha256 nodes check it against, the
    parameter every node reads at boot and, in place, the document State Manager runs."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig, renders: list[NodeRender]) -> None:
        super().__init__(scope, construct_id)
        data = software_asset(renders)
        self.sha256 = hashlib.sha256(data).hexdigest()
        # The CLI copies the file into the cloud assembly at synth; the folder goes at exit.
        folder = Path(tempfile.mkdtemp(prefix="gptoss-software-"))
        atexit.register(shutil.rmtree, folder, True)
        path = folder / SOFTWARE_ASSET
        path.write_bytes(data)
        self.asset = s3_assets.Asset(self, "Asset", path=str(path))
        self.uri = Fn.join("", ["s3://", self.asset.s3_bucket_name, "/", self.asset.s3_object_key])
        self.object_arn = self.asset.bucket.arn_for_objects(self.asset.s3_object_key)
        self.version = Fn.join(" ", [self.uri, self.sha256])
        self.in_place = config.rollout.software == "in-place"
        self.document: ssm.CfnDocument | None = None
        self.parameter_name = software_parameter(config.cluster_name)
        self.parameter = ssm.CfnParameter(
            self, "Version", name=self.parameter_name, type="String", value=self.version, tier="Standard",
            description=f"{config.cluster_name}: the software version every node runs (its s3:// URI and sha256; read at boot)",
        )  # fmt: skip
        # Untagged, as the router parameter (moto's CloudFormation fails on this type's Tags map).
        Tags.of(self.parameter).remove("gptoss:cluster")
        self.parameter_arn = Stack.of(self).format_arn(service="ssm", resource="parameter", resource_name=self.parameter_name.lstrip("/"))
        if not self.in_place:
            return
        self.document = ssm.CfnDocument(self, "Apply", document_type="Command", document_format="JSON", content=apply_document(config))

    @property
    def document_arn(self) -> str:
        assert self.document is not None
        return Stack.of(self).format_arn(service="ssm", resource="document", resource_name=self.document.ref)


# CloudFormation's bound on an association's WaitForSuccessTimeoutSeconds (two days).
ASSOCIATION_WAIT_MAX_S = 172800


def role_association(
    scope: Construct, construct_id: str, *, config: ClusterConfig, software: NodeSoftware, role: str, nodes: int
) -> ssm.CfnAssociation:
    """The State Manager association that runs the current version on every node of `role` (its instances
    by their tags: a replacement is one of them), at most rollout.max_unavailable at a time, stopping at
    the first node that fails (MaxErrors 0); the deploy waits for it. A new version changes its
    parameters, and State Manager runs it again at once; CloudFormation's rollback changes them back."""
    assert software.document is not None
    lanes = config.rollout.lanes(nodes, False)
    batches = -(-nodes // lanes)
    wait_s = min(batches * (2 * config.rollout.apply_timeout_s + APPLY_MARGIN_S), ASSOCIATION_WAIT_MAX_S)
    return ssm.CfnAssociation(
        scope,
        construct_id,
        name=software.document.ref,
        association_name=f"{config.cluster_name}-software-{role}",
        targets=[
            ssm.CfnAssociation.TargetProperty(key="tag:gptoss:cluster", values=[config.cluster_name]),
            ssm.CfnAssociation.TargetProperty(key="tag:gptoss:role", values=[role]),
        ],
        parameters={"Software": [software.version], "TimeoutSeconds": [str(config.rollout.apply_timeout_s)]},
        max_concurrency=str(lanes),
        max_errors="0",
        compliance_severity="HIGH",
        wait_for_success_timeout_seconds=wait_s,
    )
