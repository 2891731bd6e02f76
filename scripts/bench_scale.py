#!/usr/bin/env python3
"""Measure how the stack grows with the fleet: synth time, resources, template bytes, user data.

Runs the pinned CDK CLI (`cdk synth`) for each fleet size and prints one row per size. A
benchmark, not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from clusterspec.config import ClusterConfig  # noqa: E402
from clusterspec.errors import SpecError  # noqa: E402
from clusterspec.limits import check, estimate  # noqa: E402


def synth(decode: int, outdir: Path) -> tuple[float, dict[str, object], int]:
    """One CLI synth; returns (seconds, template, template bytes)."""
    node_major = subprocess.run(["node", "-p", "process.versions.node.split('.')[0]"], capture_output=True, text=True).stdout.strip()
    env = {
        **os.environ,
        "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": node_major,
        "AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED": "true",
        "CDK_DISABLE_CLI_TELEMETRY": "true",
        "AWS_REGION": os.environ.get("AWS_REGION", "us-east-2"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    cmd = [str(ROOT / "node_modules/.bin/cdk"), "synth", "--no-notices", "--quiet", "-o", str(outdir), "-c", f"decode_instances={decode}"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    path = next(outdir.glob("*.template.json"))
    return elapsed, json.loads(path.read_text()), path.stat().st_size


def main() -> int:
    """Print one row per fleet size."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("sizes", nargs="*", type=int, default=[1, 8, 32, 50, 51], help="decode instances (default: up to the largest one stack holds, and one more)")
    args = p.parse_args()
    t = Table(title="Stack size by fleet (pinned CDK CLI, this machine)")
    for col in ("decode", "nodes", "replicas", "synth s", "resources", "outputs", "template bytes", "estimate", "largest user data"):
        t.add_column(col, justify="right")
    for n in args.sizes:
        cfg = ClusterConfig(decode_instances=n)
        try:
            check(cfg)
        except SpecError as e:
            # "decode_instances=N: <why> (CloudFormation allows ...). Fix: ..." -> <why>
            why = str(e).split(": ", 1)[-1].split(" (")[0]
            t.add_row(str(n), "-", "-", "refused", "-", "-", "-", "-", why)
            continue
        est = estimate(cfg)
        with tempfile.TemporaryDirectory() as d:
            secs, tpl, size = synth(n, Path(d))
        res = tpl["Resources"]  # type: ignore[index]
        t.add_row(
            str(n), str(est.nodes), str(len(cfg.layout.replicas)), f"{secs:.1f}", str(len(res)), str(len(tpl["Outputs"])),  # type: ignore[arg-type]
            f"{size:,}", f"{est.template_bytes:,}", f"{est.largest_user_data:,} B",
        )  # fmt: skip
    Console(width=140).print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
