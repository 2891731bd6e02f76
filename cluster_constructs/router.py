"""vLLM's router for the nodes: the pinned wheel as a file asset."""

from __future__ import annotations

import hashlib

from aws_cdk import Fn
from aws_cdk import aws_s3_assets as s3_assets
from constructs import Construct

from clusterspec.config import ClusterConfig
from clusterspec.errors import SpecError
from clusterspec.paths import WHEELS_DIR


class RouterWheel(Construct):
    """The wheel `make setup` fetched, checked against the spec's sha256, shipped once for every router node."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig) -> None:
        super().__init__(scope, construct_id)
        r = config.serving.proxy.router
        path = WHEELS_DIR / r.wheel
        if not path.is_file():
            raise SpecError([f"serving.proxy.router: the router wheel {r.wheel} is not in .wheels/. Fix: run `make setup` "
                             "(it downloads the pinned release and checks its sha256), or set serving.proxy.kind=toy."])  # fmt: skip
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != r.sha256:
            raise SpecError([f"serving.proxy.router.sha256: .wheels/{r.wheel} has sha256 {digest}, the spec pins {r.sha256}. "
                             "Fix: delete the file and run `make setup`, or pin the sha256 of the release you mean to run."])  # fmt: skip
        self.asset = s3_assets.Asset(self, "Asset", path=str(path))
        self.uri = Fn.join("", ["s3://", self.asset.s3_bucket_name, "/", self.asset.s3_object_key])
        self.object_arn = self.asset.bucket.arn_for_objects(self.asset.s3_object_key)
