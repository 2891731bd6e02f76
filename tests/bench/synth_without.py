#!/usr/bin/env python3
"""The app with parts of its synth switched off: what each part costs (`bench_synth.py --breakdown`).

A measuring aid, never a way to deploy: what it synthesizes is not what ships (the bundles are
compressed at xz preset 0, cdk-nag does not run). GPTOSS_SYNTH_WITHOUT names the parts, comma
separated:

- xz: every node's bundle at xz preset 0 instead of 9|EXTREME (about 1 ms a node instead of 15 to 20).
- nag: cdk-nag's AwsSolutions rules are not added (acknowledgments are still recorded).
- typecheck: jsii's Python-side type checks (typeguard) of every call are skipped, as `python -O` does.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"xz", "nag", "typecheck"}


def main() -> None:
    without = {p for p in os.environ.get("GPTOSS_SYNTH_WITHOUT", "").split(",") if p}
    if unknown := without - PARTS:
        raise SystemExit(f"GPTOSS_SYNTH_WITHOUT: unknown part(s) {sorted(unknown)}; known: {sorted(PARTS)}")
    os.environ.setdefault("CDK_VALIDATION", "false")  # as app.py does, before aws_cdk starts its runtime
    sys.path.insert(0, str(ROOT))
    if "typecheck" in without:
        import jsii._type_checking as type_checking

        type_checking._resolved_check = lambda **_: None  # check_type calls this once resolved
    if "xz" in without:
        import functools
        import lzma

        import node_render.userdata as userdata

        @functools.lru_cache(maxsize=1024)
        def cheapest(raw: bytes) -> bytes:
            return lzma.compress(raw, format=lzma.FORMAT_XZ, filters=[{"id": lzma.FILTER_LZMA2, "preset": 0}])

        userdata._xz = cheapest  # bundle() looks it up at each call
    if "nag" in without:
        import aws_cdk

        aws_cdk.Validations.add_plugins = lambda self, *plugins: None  # type: ignore[method-assign]
    sys.argv = [str(ROOT / "app.py")]
    runpy.run_path(str(ROOT / "app.py"), run_name="__main__")


if __name__ == "__main__":
    main()
