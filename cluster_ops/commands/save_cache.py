"""`gptoss save-cache`: upload chosen nodes' compile caches and promote them to the fleet's cache."""

from __future__ import annotations

import argparse
from typing import Any

from cluster_ops import common


def run(args: argparse.Namespace) -> int:
    """Upload the compile caches of one prefill and one decode node (or --node), then promote them to the fleet's cache."""
    from cluster_ops import cache
    from node_render.paths import cache_fleet_uri

    cfg = common.load(args)
    common.announce(cfg)
    session = common.session(cfg)
    try:
        uri, manifest = cache.save(
            cfg, session.client("ec2"), session.client("ssm"), session.client("s3"), session.client("cloudformation"), only=args.node
        )
    except cache.CacheError as e:
        raise common.CliError(f"save-cache failed: {e}", 1) from None
    print(f"promoted {len(manifest['files'])} files from {', '.join(sorted(manifest['promoted_from']))} to "
          f"{cache_fleet_uri(uri, manifest['toolchain'])}; nodes of this toolchain restore what its manifest verifies before compiling")  # fmt: skip
    return 0


def register(sub: Any) -> None:
    """Add the command to the parser."""
    sc = sub.add_parser("save-cache", help="upload the compile caches of chosen nodes and promote them to the fleet's cache (after the first compile)")
    common.add_target_arguments(sc)
    sc.add_argument("--node", action="append", help="promote this node's upload (repeatable; default: the first prefill and decode node)")
    sc.set_defaults(func=run)
