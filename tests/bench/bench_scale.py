#!/usr/bin/env python3
"""Measure how the stack grows with the fleet: synth time, resources, template bytes, user data.

Runs the pinned CDK CLI (`cdk synth`) for each fleet size and prints one row per size. A
benchmark, not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import lzma
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from clusterspec.config import ClusterConfig  # noqa: E402
from clusterspec.errors import SpecError  # noqa: E402
from node_render.limits import check, estimate  # noqa: E402
from node_render.render import render_node  # noqa: E402
from node_render.userdata import XZ_PRESET, tarball  # noqa: E402


def synth(decode: int, outdir: Path) -> tuple[float, dict[str, object], int, list[tuple[int, int]]]:
    """One CLI synth; returns (seconds, parent template, its bytes, (resources, bytes) of each cell)."""
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
    path = next(p for p in outdir.glob("*.template.json") if not p.name.endswith(".nested.template.json"))
    nested = [(len(json.loads(c.read_text())["Resources"]), c.stat().st_size) for c in outdir.glob("*.nested.template.json")]
    return elapsed, json.loads(path.read_text()), path.stat().st_size, nested


def plan_times(decode: int, rounds: int) -> tuple[float, float, str]:
    """Medians of `gptoss plan` for a fleet: (wall s, CPU s, what it printed: plan or refusal)."""
    walls, cpus, outcome = [], [], ""
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        r = subprocess.run([str(Path(sys.executable).parent / "gptoss"), "plan", "-c", f"decode_instances={decode}"], cwd=ROOT, capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if r.returncode not in (0, 2) or "Traceback" in r.stderr:
            raise RuntimeError(f"gptoss plan -c decode_instances={decode}: exit {r.returncode}\n{r.stderr[-2000:]}")
        outcome = "plan" if r.returncode == 0 else "refused"
    return statistics.median(walls), statistics.median(cpus), outcome


def xz_table() -> Table:
    """The bundle's compression, measured on the default layout's nodes: bytes and time per preset."""
    cfg = ClusterConfig(decode_instances=8)
    t = Table(title="A node's bundle by compression (8 decode instances' prefill-0 and decode-0; CPU ms per node, median of 9)")
    for col in ("node", "tarball B", "setting", "compressed B", "base64 B", "ms"):
        t.add_column(col, justify="right")
    for node in (cfg.layout.nodes[0], cfg.layout.decode_nodes[0]):
        raw = tarball(render_node(cfg, cfg.layout, node).files)
        settings: list[tuple[str, Callable[[bytes], bytes]]] = [("gzip -9", lambda b: gzip.compress(b, 9, mtime=0))]
        for label, preset in (("xz 1", 1), ("xz 6", 6), ("xz 9", 9), ("xz 9e", 9 | lzma.PRESET_EXTREME)):
            f = [{"id": lzma.FILTER_LZMA2, "preset": preset, "dict_size": 1 << 20}]
            settings.append((label + (" (used)" if preset == XZ_PRESET else ""), lambda b, f=f: lzma.compress(b, format=lzma.FORMAT_XZ, filters=f)))  # type: ignore[misc]
        for label, fn in settings:
            times = []
            for _ in range(9):
                t0 = time.process_time()
                out = fn(raw)
                times.append(time.process_time() - t0)
            t.add_row(node.name, f"{len(raw):,}", label, f"{len(out):,}", f"{len(base64.b64encode(out)):,}", f"{statistics.median(times) * 1000:.1f}")
    return t


def main() -> int:
    """Print one row per fleet size."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("sizes", nargs="*", type=int, default=[1, 8, 56, 57, 100, 200], help="decode instances to synthesize")
    p.add_argument("--plan-sizes", nargs="*", type=int, default=[1, 8, 56, 57, 100, 1000], help="decode instances to time `gptoss plan` at")
    p.add_argument("--rounds", type=int, default=3, help="runs of `gptoss plan` per size (medians)")
    args = p.parse_args()
    pt = Table(title=f"gptoss plan: median of {args.rounds} runs on {os.cpu_count()} cores (this machine)")
    for col in ("decode", "outcome", "wall s", "cpu s"):
        pt.add_column(col, justify="right")
    for n in args.plan_sizes:
        wall, cpu, outcome = plan_times(n, args.rounds)
        pt.add_row(str(n), outcome, f"{wall:.2f}", f"{cpu:.2f}")
    Console(width=140).print(pt)
    Console(width=140).print(xz_table())
    t = Table(title="Stack size by fleet: the parent and its cells (nested stacks), synthesized by the pinned CDK CLI on this machine")
    for col in ("decode", "nodes", "cells", "synth s", "parent resources", "parent bytes", "estimate", "largest cell bytes", "estimate",
                "largest user data"):  # fmt: skip
        t.add_column(col, justify="right")
    for n in args.sizes:
        cfg = ClusterConfig(decode_instances=n)
        try:
            check(cfg)
        except SpecError as e:
            # "decode_instances=N: <why> (CloudFormation allows ...). Fix: ..." -> <why>
            why = str(e).split(": ", 1)[-1].split(" (")[0]
            t.add_row(str(n), "-", "-", "refused", "-", "-", "-", "-", "-", why)
            continue
        est = estimate(cfg)
        with tempfile.TemporaryDirectory() as d:
            secs, tpl, size, nested = synth(n, Path(d))
        res = tpl["Resources"]  # type: ignore[index]
        t.add_row(
            str(n), str(est.nodes), str(len(nested)), f"{secs:.1f}", str(len(res)), f"{size:,}", f"{est.template_bytes:,}",  # type: ignore[arg-type]
            f"{max(b for _, b in nested):,}", f"{max(c.template_bytes for c in est.cells):,}", f"{est.largest_user_data:,} B",
        )  # fmt: skip
    Console(width=140).print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
