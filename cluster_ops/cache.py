"""Save the compile caches of a running cluster to S3, one node of each role."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cluster_ops.remote import find_nodes, run_on_all
from clusterspec.config import ClusterConfig
from clusterspec.paths import BIN


class CacheError(RuntimeError):
    """The caches could not be saved."""


def save(
    cfg: ClusterConfig,
    ec2: Any,
    ssm: Any,
    *,
    timeout_s: float = 3600,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """Sync the NVMe caches of the first prefill and the first decode node to compile_cache_s3_uri."""
    if not cfg.compile_cache_s3_uri:
        raise CacheError("compile_cache_s3_uri is not set: set it (-c compile_cache_s3_uri=s3://bucket/prefix) and deploy")
    nodes = find_nodes(ec2, cfg.cluster_name)
    # Prefill and decode compile different graphs: one node of each role holds them all.
    chosen = {
        role: next((n.name for n in cfg.layout.nodes if n.role == role and n.name in nodes), None)
        for role in ("prefill", "decode")
    }
    missing = [role for role, name in chosen.items() if name is None]
    if missing:
        raise CacheError(f"no running {' or '.join(missing)} instance tagged gptoss:cluster={cfg.cluster_name}")
    by_id = {nodes[name].instance_id: name for name in chosen.values() if name}
    results = run_on_all(ssm, list(by_id), [f"{BIN}/gptoss-save-cache"], timeout_s=timeout_s, poll_s=10, sleep=sleep)
    out = {by_id[iid]: status for iid, (status, _) in results.items()}
    failed = {name: status for name, status in out.items() if status != "Success"}
    if failed:
        raise CacheError("saving the compile cache failed on " + ", ".join(f"{n} ({s})" for n, s in failed.items()))
    return out
