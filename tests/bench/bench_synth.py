#!/usr/bin/env python3
"""Synth speed: `cdk synth` of the stack at several fleet sizes against a minimal one-queue CDK app.

Like for like: every row states CDK's built-in CloudFormation validator setting (CDK_VALIDATION),
and each ratio divides by the minimal app run with the same setting. The project's app leaves the
validator off by default (cfn-lint, which the test gate runs on every template, checks the same);
the minimal app is run both ways. All cases run through the pinned CLI with the project's Node,
interleaved, ROUNDS times each; the script prints the medians of wall and CPU seconds (the CLI,
the Python app and its jsii runtime) and their ratios.

--breakdown adds rows for the default stack and the largest fleet with parts of synth switched
off (tests/bench/synth_without.py: the bundles' xz at preset 0, no cdk-nag, no jsii type checks, then
all three): what each part costs, and what the stack costs with none of them.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from clusterspec.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]
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


def synth(cwd: Path, outdir: Path, *context: str, env: dict[str, str] | None = None, app: str | None = None) -> tuple[float, float]:
    """(wall, cpu) seconds of one `cdk synth`, children included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    args = [str(CDK), "synth", "--no-notices", "--quiet", "-o", str(outdir), *(["--app", app] if app else []), *(a for c in context for a in ("-c", c))]
    r = subprocess.run(args, cwd=cwd, env=_env() | (env or {}), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"cdk synth failed in {cwd}:\n{r.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fleets", type=int, nargs="*", default=[8, 32, 56], help="decode instances of the larger rows (default: 8, 32 and 56, the issue's rows)")
    p.add_argument("--breakdown", action="store_true", help="add rows with the bundles' xz, cdk-nag and jsii's type checks switched off (what each costs)")
    args = p.parse_args()
    args.fleets = [(n, len(ClusterConfig(decode_instances=n).layout.nodes)) for n in args.fleets]
    work = Path(tempfile.mkdtemp(prefix="bench-synth-"))
    try:
        minimal = work / "minimal"
        minimal.mkdir()
        (minimal / "app.py").write_text(MINIMAL_APP)
        (minimal / "cdk.json").write_text(f'{{"app": "{sys.executable} app.py"}}\n')
        off, on = {"CDK_VALIDATION": "false"}, {"CDK_VALIDATION": "true"}
        # (label, directory, validator setting, context)
        cases: list[tuple[str, Path, dict[str, str], list[str]]] = [
            ("minimal one-queue app", minimal, off, []),
            ("GptOss8k1kStack (default, 2 nodes)", ROOT, off, []),
            *((f"{n} decode instances ({nodes} nodes)", ROOT, off, [f"decode_instances={n}"]) for n, nodes in args.fleets),
            ("minimal one-queue app", minimal, on, []),
            ("GptOss8k1kStack (default, 2 nodes)", ROOT, on, []),
        ]
        if args.breakdown:
            largest = max(args.fleets, default=None)
            for label, context in [("default", []), *([(f"{largest[0]} decode", [f"decode_instances={largest[0]}"])] if largest else [])]:
                for parts in ("xz", "nag", "typecheck", "xz,nag,typecheck"):
                    cases.append((f"{label} without {parts.replace(',', ', ')}", ROOT, off | {"GPTOSS_SYNTH_WITHOUT": parts}, context))
        results: list[list[tuple[float, float]]] = [[] for _ in cases]
        synth(minimal, work / "warm")  # the first run pays for caches of both
        synth(ROOT, work / "warm-app", env=off)
        for i in range(args.rounds):
            for n, (_, cwd, env, context) in enumerate(cases):
                variant = f"{sys.executable} {ROOT / 'tests' / 'bench' / 'synth_without.py'}" if "GPTOSS_SYNTH_WITHOUT" in env else None
                results[n].append(synth(cwd, work / f"out-{i}-{n}", *context, env=env, app=variant))
                if cwd == ROOT:
                    _check_variant(work / f"out-{i}-{n}", env.get("GPTOSS_SYNTH_WITHOUT", ""))
        base: dict[str, tuple[float, float]] = {}
        for (_, cwd, env, _), runs in zip(cases, results, strict=True):
            if cwd == minimal:
                base[env["CDK_VALIDATION"]] = (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        print(f"cdk synth, median of {args.rounds} rounds on {os.cpu_count()} cores (Node {_node()}); x = this case / the minimal app with the same validator setting:")
        print(f"  {'case':<38} {'validator':>9} {'wall s':>7} {'cpu s':>7} {'x wall':>7} {'x cpu':>7}")
        for (label, _, env, _), runs in zip(cases, results, strict=True):
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            bw, bc = base[env["CDK_VALIDATION"]]
            print(f"  {label:<38} {env['CDK_VALIDATION']:>9} {wall:7.2f} {cpu:7.2f} {wall / bw:7.2f} {cpu / bc:7.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _check_variant(outdir: Path, without: str) -> None:
    """A row measures what it says: cdk-nag ran (its report is written) exactly where it was not switched off."""
    nag_ran = (outdir / "validation-report.json").exists()
    if nag_ran == ("nag" in without.split(",")):
        raise SystemExit(f"bench-synth: in {outdir.name} cdk-nag {'ran' if nag_ran else 'did not run'} with GPTOSS_SYNTH_WITHOUT={without!r}")


def _node() -> str:
    return subprocess.run(["node", "--version"], capture_output=True, text=True, env=_env()).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
