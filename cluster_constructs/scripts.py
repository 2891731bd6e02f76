"""The node scripts every instance fetches: one reproducible tarball, shipped as a CDK file asset."""

from __future__ import annotations

import atexit
import hashlib
import shutil
import tempfile
from pathlib import Path

from aws_cdk import Fn
from aws_cdk import aws_s3_assets as s3_assets
from constructs import Construct

from node_render.node_files import NodeRender
from node_render.userdata import SCRIPTS_ASSET, scripts_asset


class NodeScripts(Construct):
    """The asset (in the CDK bootstrap bucket), its s3:// URI and the sha256 nodes check it against.

    The scripts are the same on every node; a node's user data carries only its own units and
    environment, so it stays far below EC2's 16 KB limit however much the tooling grows.
    """

    def __init__(self, scope: Construct, construct_id: str, *, renders: list[NodeRender]) -> None:
        super().__init__(scope, construct_id)
        data = scripts_asset(renders)
        self.sha256 = hashlib.sha256(data).hexdigest()
        # The CLI copies the file into the cloud assembly at synth; the folder goes at exit.
        folder = Path(tempfile.mkdtemp(prefix="gptoss-scripts-"))
        atexit.register(shutil.rmtree, folder, True)
        path = folder / SCRIPTS_ASSET
        path.write_bytes(data)
        self.asset = s3_assets.Asset(self, "Asset", path=str(path))
        self.uri = Fn.join("", ["s3://", self.asset.s3_bucket_name, "/", self.asset.s3_object_key])
        self.object_arn = self.asset.bucket.arn_for_objects(self.asset.s3_object_key)
