"""`make bench-rollout`: what each kind of change does to a running fleet, from the same comparison
`gptoss deploy` runs before it deploys (cluster_ops/rollout.py): two synthesized assemblies, the
running one and the changed one, node by node.

    rollout: <change>: <role> <B> batches, at most <K> of <N> out, minimum serving <role> <X>/<N>, <wait>

The fleets: the default (1 prefill + 1 decode, toy proxy) and the production layout (3 + 8, vLLM's
router), with surge (On-Demand's default) and without (a reservation's), one lane and 25 %. The changes: a one-line edit of a node script, a new image, a decode server flag, a
router setting, one more decode node. No AWS call: the synth is offline.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STACK = "GptOss8k1kStack"
FLEETS = {
    "default (1+1)": {"ami_id": "ami-0123456789abcdef0"},
    "production (3+8)": {"ami_id": "ami-0123456789abcdef0", "decode_instances": "8"},
    "production (3+8), surge off": {"ami_id": "ami-0123456789abcdef0", "decode_instances": "8", "rollout.surge": "off"},
    "production (3+8), surge off, max_unavailable 25%": {
        "ami_id": "ami-0123456789abcdef0", "decode_instances": "8", "rollout.surge": "off", "rollout.max_unavailable": "25%"},
}
CHANGES: dict[str, dict[str, str]] = {
    "a node script (one line of gptoss-retry)": {},
    "the image": {"ami_id": "ami-0fedcba9876543210"},
    "a decode server flag (max_num_seqs)": {"serving.decode.max_num_seqs": "4"},
    "a router setting (health_check_timeout_s)": {"serving.proxy.router.health_check_timeout_s": "12"},
    "one more decode node": {"decode_instances": "+1"},
}


def main() -> int:
    import aws_cdk as cdk

    from cluster_ops import rollout
    from clusterspec.loading import load_config
    from clusterspec.node_scripts import shipped_scripts
    from stacks.cluster_stack import GptOssClusterStack

    cdk_context = json.loads((ROOT / "cdk.json").read_text())["context"]
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:

        def synth(context: dict[str, str]) -> dict[str, object]:
            out = Path(tempfile.mkdtemp(dir=tmp))
            app = cdk.App(context=cdk_context, outdir=str(out))
            GptOssClusterStack(app, STACK, config=load_config(context))
            return rollout.synthesized(Path(app.synth().directory), STACK)

        started = time.monotonic()
        for fleet, base in FLEETS.items():
            before = synth(base)
            for change, delta in CHANGES.items():
                context = dict(base)
                for k, v in delta.items():
                    context[k] = str(int(base.get(k, "1")) + 1) if v == "+1" else v
                if change.startswith("a node script"):
                    scripts = shipped_scripts()  # cached: the synth below ships the edited copy
                    original = scripts["gptoss-retry"]
                    scripts["gptoss-retry"] = original + "# a one-line edit\n"
                    try:
                        after = synth(context)
                    finally:
                        scripts["gptoss-retry"] = original
                else:
                    after = synth(context)
                cfg = load_config(context)
                r = rollout.compare(before, after)
                lines = rollout.role_lines(cfg, r) or ["no instance replaced"]
                extra = f" (launched: {', '.join(r.launched)})" if r.launched else ""
                for line in lines:
                    print(f"rollout: {fleet}: {change}: {line}{extra}")
        print(f"(synthesized offline in {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
