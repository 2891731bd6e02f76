"""Save the compile caches of a running cluster: each chosen node uploads to its own area, then
the operator promotes those uploads to the fleet's cache, which every node restores.

The promotion rule (README 'Security'): a node can write only its own area
(compile_cache_s3_uri/nodes/<role id>:<instance id>/, IAM's ${aws:userid}); the fleet's cache
(compile_cache_s3_uri/fleet/) is written here alone, with the operator's credentials, from the
uploads of the nodes the operator's command chose, and only the files their manifests list with
the sizes the manifests give. Nodes restore a file only when its sha256 matches fleet/manifest.json.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from cluster_ops.remote import find_nodes, run_on_all
from clusterspec.config import ClusterConfig
from clusterspec.paths import BIN, cache_fleet_uri, cache_nodes_uri


class CacheError(RuntimeError):
    """The caches could not be saved."""


def _split(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key.strip("/")


def _keys(s3: Any, bucket: str, prefix: str) -> list[str]:
    return [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix) for o in page.get("Contents", [])]


def node_area(s3: Any, cfg: ClusterConfig, instance_id: str) -> str:
    """The key prefix a node uploaded to: nodes/<role id>:<instance id>/ (the role id is IAM's, not ours to guess)."""
    assert cfg.compile_cache_s3_uri
    bucket, nodes = _split(cache_nodes_uri(cfg.compile_cache_s3_uri))
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{nodes}/", Delimiter="/")
    areas = [p["Prefix"] for page in pages for p in page.get("CommonPrefixes", []) if p["Prefix"].rstrip("/").endswith(f":{instance_id}")]
    if len(areas) != 1:
        raise CacheError(f"{instance_id} has {'no upload' if not areas else 'several uploads'} under s3://{bucket}/{nodes}/")
    return areas[0]


def promote(cfg: ClusterConfig, s3: Any, nodes: dict[str, str], *, now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> dict[str, Any]:
    """Make the uploads of `nodes` (name -> instance id) the fleet's compile cache; return its manifest."""
    assert cfg.compile_cache_s3_uri
    bucket, fleet = _split(cache_fleet_uri(cfg.compile_cache_s3_uri))
    merged: dict[str, dict[str, Any]] = {}
    source: dict[str, str] = {}
    provenance = {}
    for name, iid in sorted(nodes.items()):
        area = node_area(s3, cfg, iid)
        try:
            doc = json.loads(s3.get_object(Bucket=bucket, Key=f"{area}manifest.json")["Body"].read())
        except s3.exceptions.NoSuchKey:
            raise CacheError(f"{name}: its upload s3://{bucket}/{area} has no manifest.json (cut short?): run save-cache again") from None
        uploaded = {k.removeprefix(f"{area}files/"): k for k in _keys(s3, bucket, f"{area}files/")}
        for rel, entry in sorted(doc.get("files", {}).items()):
            parts = PurePosixPath(rel).parts
            if PurePosixPath(rel).is_absolute() or ".." in parts or not parts:
                raise CacheError(f"{name}: the manifest names {rel!r}, a path outside the cache")
            if rel not in uploaded:
                raise CacheError(f"{name}: {rel} is in its manifest but was not uploaded")
            size = s3.head_object(Bucket=bucket, Key=uploaded[rel])["ContentLength"]
            if size != entry.get("size"):
                raise CacheError(f"{name}: {rel} has {size} bytes in S3, its manifest says {entry.get('size')}")
            if rel in merged and merged[rel]["sha256"] != entry.get("sha256"):
                raise CacheError(f"{rel} differs between {source[rel]} and {name}: promote one of them (--node)")
            merged[rel] = {"sha256": entry["sha256"], "size": size}
            source.setdefault(rel, name)
        provenance[name] = {"instance_id": iid, "upload": f"s3://{bucket}/{area}", "files": len(doc.get("files", {}))}
    for rel, name in sorted(source.items()):
        area = node_area(s3, cfg, nodes[name])
        s3.copy({"Bucket": bucket, "Key": f"{area}files/{rel}"}, bucket, f"{fleet}/files/{rel}")
    manifest = {"files": merged, "promoted_from": provenance, "promoted_at": now().strftime("%Y-%m-%dT%H:%M:%SZ")}
    # The manifest last: until it is written, nodes restore the previous promotion.
    s3.put_object(Bucket=bucket, Key=f"{fleet}/manifest.json", Body=json.dumps(manifest, indent=1, sort_keys=True).encode())
    stale = [k for k in _keys(s3, bucket, f"{fleet}/files/") if k.removeprefix(f"{fleet}/files/") not in merged]
    for i in range(0, len(stale), 1000):
        s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in stale[i : i + 1000]]})
    return manifest


def save(
    cfg: ClusterConfig,
    ec2: Any,
    ssm: Any,
    s3: Any,
    *,
    only: list[str] | None = None,
    timeout_s: float = 3600,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Upload the caches of the first prefill and the first decode node (or `only` these), then promote them."""
    if not cfg.compile_cache_s3_uri:
        raise CacheError("compile_cache_s3_uri is not set: set it (-c compile_cache_s3_uri=s3://bucket/prefix) and deploy")
    nodes = find_nodes(ec2, cfg.cluster_name)
    if only:
        unknown = [n for n in only if n not in nodes]
        if unknown:
            raise CacheError(f"no running instance {', '.join(unknown)} tagged gptoss:cluster={cfg.cluster_name}")
        chosen = {n: n for n in only}
    else:
        # Prefill and decode compile different graphs: one node of each role holds them all.
        found = {
            role: next((n.name for n in cfg.layout.nodes if n.role == role and n.name in nodes), None)
            for role in ("prefill", "decode")
        }
        missing = [role for role, name in found.items() if name is None]
        if missing:
            raise CacheError(f"no running {' or '.join(missing)} instance tagged gptoss:cluster={cfg.cluster_name}")
        chosen = {name: name for name in found.values() if name}
    by_id = {nodes[name].instance_id: name for name in chosen}
    results = run_on_all(ssm, list(by_id), [f"{BIN}/gptoss-save-cache"], timeout_s=timeout_s, poll_s=10, sleep=sleep)
    failed = {by_id[iid]: status for iid, (status, _) in results.items() if status != "Success"}
    if failed:
        raise CacheError("uploading the compile cache failed on " + ", ".join(f"{n} ({s})" for n, s in failed.items()))
    return promote(cfg, s3, {name: iid for iid, name in by_id.items()})
