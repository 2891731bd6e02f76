"""vLLM's router for the nodes: the pinned wheel as a file asset."""

from __future__ import annotations

import hashlib
from pathlib import Path

from aws_cdk import AssetHashType, Stack, Tags
from aws_cdk import aws_s3_assets as s3_assets
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from clusterspec.config import ClusterConfig
from clusterspec.errors import SpecError
from node_render.command_lines import router_fleet
from node_render.paths import DEBS_DIR, WHEELS_DIR, package_object_key, router_object_key, router_parameter

# Parameter Store's Standard tier holds 4 KB; past that, Advanced (8 KB, charged per month).
STANDARD_PARAMETER_BYTES = 4096


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
        # Its hash is the pinned sha256 (a new wheel, a new key): the nodes find it by router_object_key, in the
        # bucket of the software asset, so no node's user data names it (a new wheel restarts the routers in place).
        self.asset = s3_assets.Asset(self, "Asset", path=str(path), asset_hash=r.sha256, asset_hash_type=AssetHashType.CUSTOM)
        if self.asset.s3_object_key != router_object_key(r.sha256):
            raise SpecError([f"serving.proxy.router: CDK keys the router wheel {self.asset.s3_object_key}, the nodes look for "
                             f"{router_object_key(r.sha256)}. Fix: use the pinned CDK (make setup), whose asset keys node_render.paths "
                             "router_object_key follows."])  # fmt: skip
        self.object_arns = [self.asset.bucket.arn_for_objects(self.asset.s3_object_key)]
        # The API gate's pinned packages (serving.proxy.gate.packages: nodes with no apt source), each by the same rules.
        for n, pkg in enumerate(config.serving.proxy.gate.packages):
            self.object_arns.append(_pinned_asset(self, f"Package{n}", DEBS_DIR / pkg.file, pkg.sha256, package_object_key(pkg.sha256),
                                                  field=f"serving.proxy.gate.packages[{n}]"))  # fmt: skip


def _pinned_asset(scope: Construct, construct_id: str, path: Path, sha256: str, key: str, *, field: str) -> str:
    """A file the spec pins by sha256, shipped as an asset keyed by it (the nodes derive the key): its object's ARN."""
    if not path.is_file():
        raise SpecError([f"{field}: {path.name} is not in {path.parent.name}/. Fix: download that exact package file (on an "
                         f"Ubuntu of the image's release: apt-get download <name>=<version>) into {path.parent.name}/, or remove it "
                         "from the list."])  # fmt: skip
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise SpecError([f"{field}.sha256: {path.parent.name}/{path.name} has sha256 {digest}, the spec pins {sha256}. Fix: put the "
                         "pinned file there, or pin the sha256 of the file you mean to ship."])  # fmt: skip
    asset = s3_assets.Asset(scope, construct_id, path=str(path), asset_hash=sha256, asset_hash_type=AssetHashType.CUSTOM)
    if asset.s3_object_key != key:
        raise SpecError([f"{field}: CDK keys {path.name} {asset.s3_object_key}, the nodes look for {key}. Fix: use the pinned CDK (make setup)."])
    return asset.bucket.arn_for_objects(asset.s3_object_key)


class RouterFleet(Construct):
    """The fleet's router settings and pool, one SSM parameter every router node reads at run time
    (gptoss-members): a router setting or a new member changes this, not a node's user data, and
    the routers restart one node at a time to take it."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig) -> None:
        super().__init__(scope, construct_id)
        proxy = next(p for p in config.layout.proxies if p.kind == "vllm-router")
        self.name = router_parameter(config.cluster_name)
        doc = router_fleet(config, proxy)
        self.parameter = ssm.CfnParameter(
            self, "Parameter", name=self.name, type="String", value=doc,
            tier="Standard" if len(doc.encode()) <= STANDARD_PARAMETER_BYTES else "Advanced",
            description=f"{config.cluster_name}: vLLM router settings and pool (gptoss-members reads it on every router node)",
        )  # fmt: skip
        # Untagged: moto's CloudFormation (the lifecycle tests' AWS) fails to create a parameter whose Tags
        # (a JSON map for this resource type) are set; the parameter costs nothing to attribute (Standard
        # tier; $0.05 a month past 4 KB), and its name carries the cluster's.
        Tags.of(self.parameter).remove("gptoss:cluster")
        self.arn = Stack.of(self).format_arn(service="ssm", resource="parameter", resource_name=self.name.lstrip("/"))
