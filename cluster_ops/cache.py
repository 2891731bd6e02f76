"""Save the compile caches of a running cluster: each chosen node uploads to its own area, then
the operator promotes those uploads to the fleet's cache, which every node restores.

The promotion rule (docs/design.md 'Security defaults'): a node can write only its own identity's area
(<cache>/nodes/<node>/: its role names that prefix alone), which its replacements restore; the
fleet's cache (<cache>/fleet/<toolchain key>/) is written here alone, with the operator's credentials, from the
uploads of the nodes the operator's command chose, and only the files their manifests list with
the sizes the manifests give. Nodes restore a file only when its sha256 matches the manifest.
Everything sits under the key of the toolchain that compiled it (instance type, compiler and tracing
libraries, as the node's gptoss-cache-manifest computes it): a node restores only its own key's.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from cluster_ops.remote import find_nodes, run_on_all
from clusterspec.config import ClusterConfig
from node_render.paths import BIN, cache_fleet_uri, cache_node_uri


class CacheError(RuntimeError):
    """The caches could not be saved."""


def _split(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key.strip("/")


def _keys(s3: Any, bucket: str, prefix: str) -> list[str]:
    return [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix) for o in page.get("Contents", [])]


def location(cfg: ClusterConfig, cfn: Any) -> str:
    """The compile cache's s3:// location: the configured one, or the stack's own bucket (asked of CloudFormation)."""
    if cfg.compile_cache_s3_uri:
        return cfg.compile_cache_s3_uri.rstrip("/")
    if not cfg.compile_cache_bucket:
        raise CacheError("this cluster has no compile cache (compile_cache_bucket=false and no compile_cache_s3_uri): set one and deploy")
    pages = cfn.get_paginator("list_stack_resources").paginate(StackName=cfg.stack_name)
    resources = [r for page in pages for r in page["StackResourceSummaries"]]
    buckets = [r["PhysicalResourceId"] for r in resources if r.get("ResourceType") == "AWS::S3::Bucket" and r["LogicalResourceId"].startswith("CompileCache")]
    if not buckets:
        raise CacheError(f"{cfg.stack_name} has no compile cache bucket (is it deployed?)")
    return f"s3://{buckets[0]}"


def _sha256_of(s3: Any, bucket: str, key: str) -> tuple[str, str]:
    """An object's sha256 (read through once) and its ETag."""
    obj = s3.get_object(Bucket=bucket, Key=key)
    h = hashlib.sha256()
    for chunk in iter(lambda: obj["Body"].read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest(), obj["ETag"]


def _latest_upload(s3: Any, bucket: str, node_area: str, name: str) -> str:
    """The prefix of a node identity's latest whole upload: <node area><toolchain key>/ whose manifest is newest."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=node_area)
    found = [o for page in pages for o in page.get("Contents", []) if o["Key"].removeprefix(node_area).count("/") == 1 and o["Key"].endswith("/manifest.json")]
    if not found:
        raise CacheError(f"{name}: s3://{bucket}/{node_area} holds no upload with a manifest.json (none yet, or one cut short): run save-cache again")
    return max(found, key=lambda o: (o["LastModified"], o["Key"]))["Key"].removesuffix("manifest.json")


def promote(cfg: ClusterConfig, s3: Any, uri: str, nodes: list[str], *, now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> dict[str, Any]:
    """Make the uploads of `nodes` (their own areas of the cache at `uri`) the fleet's compile cache; return its manifest."""
    bucket, _ = _split(uri)
    areas = {name: _latest_upload(s3, bucket, _split(cache_node_uri(uri, name))[1] + "/", name) for name in nodes}
    keys = {name: area.rstrip("/").rpartition("/")[2] for name, area in areas.items()}
    if len(set(keys.values())) > 1:
        raise CacheError("the chosen nodes run different toolchains (" + ", ".join(f"{n}: {k}" for n, k in sorted(keys.items()))
                         + "): graphs of one toolchain are promoted at a time; choose nodes of one image (--node)")  # fmt: skip
    key = next(iter(keys.values()))
    fleet = _split(cache_fleet_uri(uri, key))[1]
    merged: dict[str, dict[str, Any]] = {}
    source: dict[str, str] = {}
    etags: dict[str, str] = {}
    provenance = {}
    for name in sorted(nodes):
        area = areas[name]
        doc = json.loads(s3.get_object(Bucket=bucket, Key=f"{area}manifest.json")["Body"].read())
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
            # The content, not the node's word for it: what the fleet will load is read and hashed here,
            # and copied below only if it is still that object (its ETag), whatever the node does meanwhile.
            digest, etag = _sha256_of(s3, bucket, uploaded[rel])
            if digest != entry.get("sha256"):
                raise CacheError(f"{name}: {rel} in S3 has sha256 {digest[:12]}..., its manifest says {str(entry.get('sha256'))[:12]}...: "
                                 "the upload was changed after its manifest was made; nothing was promoted")  # fmt: skip
            if rel in merged and merged[rel]["sha256"] != digest:
                raise CacheError(f"{rel} differs between {source[rel]} and {name}: promote one of them (--node)")
            merged[rel] = {"sha256": digest, "size": size}
            if rel not in source:
                source[rel], etags[rel] = name, etag
        provenance[name] = {"upload": f"s3://{bucket}/{area}", "files": len(doc.get("files", {}))}
    for rel, name in sorted(source.items()):
        try:
            s3.copy({"Bucket": bucket, "Key": f"{areas[name]}files/{rel}"}, bucket, f"{fleet}/files/{rel}", ExtraArgs={"CopySourceIfMatch": etags[rel]})
        except s3.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "412"):
                raise
            raise CacheError(f"{name}: {rel} changed in S3 while it was promoted; nothing new is loaded (the fleet's manifest is "
                             "unchanged): run save-cache again") from None  # fmt: skip
    manifest = {"files": merged, "toolchain": key, "promoted_from": provenance, "promoted_at": now().strftime("%Y-%m-%dT%H:%M:%SZ")}
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
    cfn: Any,
    *,
    only: list[str] | None = None,
    timeout_s: float = 3600,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[str, dict[str, Any]]:
    """Upload the caches of the first prefill and the first decode node (or `only` these), then promote
    them; return the cache's location and the fleet's new manifest."""
    uri = location(cfg, cfn)
    nodes = find_nodes(ec2, cfg.cluster_name)
    if only:
        unknown = [n for n in only if n not in nodes]
        if unknown:
            raise CacheError(f"no running instance {', '.join(unknown)} tagged gptoss:cluster={cfg.cluster_name}")
        chosen = list(only)
    else:
        # Prefill and decode compile different graphs: one node of each role holds them all.
        found = {
            role: next((n.name for n in cfg.layout.nodes if n.role == role and n.name in nodes), None)
            for role in ("prefill", "decode")
        }
        missing = [role for role, name in found.items() if name is None]
        if missing:
            raise CacheError(f"no running {' or '.join(missing)} instance tagged gptoss:cluster={cfg.cluster_name}")
        chosen = [name for name in found.values() if name]
    by_id = {nodes[name].instance_id: name for name in chosen}
    results = run_on_all(ssm, list(by_id), [f"{BIN}/gptoss-save-cache"], timeout_s=timeout_s, poll_s=10, sleep=sleep)
    failed = {by_id[iid]: status for iid, (status, _) in results.items() if status != "Success"}
    if failed:
        raise CacheError("uploading the compile cache failed on " + ", ".join(f"{n} ({s})" for n, s in failed.items()))
    return uri, promote(cfg, s3, uri, chosen)
