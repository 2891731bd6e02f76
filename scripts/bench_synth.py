#!/usr/bin/env python3
"""Synth speed: `cdk synth` of the default stack against a minimal one-queue CDK app, side by side.

Both run through the pinned CLI with the project's Node, alternately, ROUNDS times each; the
script prints wall and CPU seconds (the CLI, the Python app and its jsii runtime) and the
ratios of the medians. The app leaves CDK's built-in CloudFormation validator off (cfn-lint,
which the test gate runs on every template, checks the same); the last row turns it back on
(CDK_VALIDATION=true) to show what it costs.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CDK = ROOT / "node_modules" / ".bin" / "cdk"
MINIMAL_APP = '''import aws_cdk as cdk
from aws_cdk import aws_sqs as sqs

app = cdk.App()
stack = cdk.Stack(app, "MinimalStack")
sqs.Queue(stack, "Queue")
app.synth()
'''


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{ROOT / 'node_modules' / '.bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "AWS_REGION": "us-east-2",
        "CDK_DISABLE_CLI_TELEMETRY": "true",
        "AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED": "true",
    }


def synth(cwd: Path, outdir: Path, *context: str, env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall, cpu) seconds of one `cdk synth`, children included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    args = [str(CDK), "synth", "--no-notices", "--quiet", "-o", str(outdir), *(a for c in context for a in ("-c", c))]
    r = subprocess.run(args, cwd=cwd, env=_env() | (env or {}), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"cdk synth failed in {cwd}:\n{r.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-synth-"))
    try:
        minimal = work / "minimal"
        minimal.mkdir()
        (minimal / "app.py").write_text(MINIMAL_APP)
        (minimal / "cdk.json").write_text(f'{{"app": "{sys.executable} app.py"}}\n')
        cases: dict[str, tuple[Path, dict[str, str]]] = {
            "minimal one-queue app": (minimal, {}),
            "GptOss8k1kStack (default)": (ROOT, {}),
            "GptOss8k1kStack, CDK_VALIDATION=true": (ROOT, {"CDK_VALIDATION": "true"}),
        }
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        synth(minimal, work / "warm")  # the first run pays for caches of both
        for i in range(args.rounds):
            for n, (name, (cwd, extra)) in enumerate(cases.items()):
                results[name].append(synth(cwd, work / f"out-{i}-{n}", env=extra))
        base_wall = statistics.median(w for w, _ in results["minimal one-queue app"])
        base_cpu = statistics.median(c for _, c in results["minimal one-queue app"])
        print(f"cdk synth, median of {args.rounds} rounds on {os.cpu_count()} cores (Node {_node()}):")
        print(f"  {'case':<38} {'wall s':>7} {'cpu s':>7} {'x wall':>7} {'x cpu':>7}")
        for name, runs in results.items():
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            print(f"  {name:<38} {wall:7.2f} {cpu:7.2f} {wall / base_wall:7.2f} {cpu / base_cpu:7.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _node() -> str:
    return subprocess.run(["node", "--version"], capture_output=True, text=True, env=_env()).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
