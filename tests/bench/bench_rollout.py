"""`make bench-rollout`: what each kind of change does to a running fleet, from the same comparison
`gptoss deploy` runs before it deploys (cluster_ops/rollout.py): two synthesized assemblies, the
running one and the changed one, node by node; then the same change replayed by CloudFormation's
documented rules (tests/fakes/cloudformation.py), as `gptoss deploy` would deploy it (its surge
decision, its updates), with every node of a role taking NODE_MIN minutes to serve.

    rollout: <fleet>: <change>: <role> <B> batches, at most <K> of <N> out, minimum serving <role> <X>/<N>, <wait>
    replay: <fleet> <change> node <T> min: <STATE> in <H> h, <N> batches

The fleets: the default (1 prefill + 1 decode, toy proxy) and the production layout (3 + 8, vLLM's
router), with surge (On-Demand's default) and without (a reservation's), one lane and 25 %; and 56
decode nodes for the replay. The changes: a one-line edit of a node script, a new image, a decode
server flag, a router setting, one more decode node. No AWS call: the synth is offline.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clusterspec.names import decode_node

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STACK = "GptOss8k1kStack"
IMAGE = {"ami_id": "ami-0123456789abcdef0"}
FLEETS = {
    "default (1+1)": IMAGE,
    "production (3+8)": IMAGE | {"decode_instances": "8"},
    "production (3+8), surge off": IMAGE | {"decode_instances": "8", "rollout.surge": "off"},
    "production (3+8), surge off, max_unavailable 25%": IMAGE | {"decode_instances": "8", "rollout.surge": "off", "rollout.max_unavailable": "25%"},
    "production (3+8), software replace": IMAGE | {"decode_instances": "8", "rollout.software": "replace"},
}
# A node's restart in place (its servers reload the checkpoint from its NVMe and the graphs from its compile cache).
RESTART_MIN = 10
CHANGES: dict[str, dict[str, str]] = {
    "a node script (one line of gptoss-retry)": {},
    "the image": {"ami_id": "ami-0fedcba9876543210"},
    "a decode server flag (max_num_seqs)": {"serving.decode.max_num_seqs": "4"},
    "a router setting (health_check_timeout_s)": {"serving.proxy.router.health_check_timeout_s": "12"},
    "one more decode node": {"decode_instances": "+1"},
}
NODE_MIN = 50
# The replay's matrix (tests/stacks/test_replay.py replays and checks it): node times, and node k of the decode lane failing.
# A decode flag replaces instances only with rollout.software=replace: the matrix replays that path.
MATRIX_FLEETS = {"production (3+8), software replace": IMAGE | {"decode_instances": "8", "rollout.software": "replace"},
                 "56 decode, software replace": IMAGE | {"decode_instances": "56", "rollout.software": "replace"}}  # fmt: skip
MATRIX_MIN = (20, 50, 90)


@contextlib.contextmanager
def script_edited(change: str) -> Iterator[None]:
    """For the node-script change: gptoss-retry with one more line, while the change is synthesized."""
    from node_render.node_scripts import shipped_scripts

    if not change.startswith("a node script"):
        yield
        return
    scripts = shipped_scripts()  # cached: the synth ships the edited copy
    original = scripts["gptoss-retry"]
    scripts["gptoss-retry"] = original + "# a one-line edit\n"
    try:
        yield
    finally:
        scripts["gptoss-retry"] = original


def main() -> int:
    import aws_cdk as cdk

    from cluster_ops import in_place, replacements, rollout
    from clusterspec.loading import load_config
    from stacks.cluster_stack import GptOssClusterStack
    from tests.fakes import cloudformation as cf

    cdk_context = json.loads((ROOT / "cdk.json").read_text())["context"]
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:

        def synth(context: dict[str, str]) -> dict[str, Any]:
            out = Path(tempfile.mkdtemp(dir=tmp))
            app = cdk.App(context=cdk_context, outdir=str(out))
            GptOssClusterStack(app, STACK, config=load_config(context))
            directory = Path(app.synth().directory)
            cf.register_assembly(directory)
            return rollout.assembly_templates(directory, STACK)

        def replay_line(fleet: str, change: str, deployed: dict[str, Any], context: dict[str, str], minutes: int, fails: frozenset[str] = frozenset()) -> str:
            d = cf.replay_deploy(deployed, synth, context, {"prefill": minutes, "decode": minutes}, fails)
            o = d.change
            cfg = load_config(d.context)
            roles = {n.name: n.role for n in cfg.layout.nodes}
            batches = max((len(o.batches(role, roles)) for role in set(roles.values())), default=0)
            failing = f" ({sorted(fails)[0]} fails)" if fails else ""
            how = f"; {len(d.updates)} updates (the policy alone first: surge off)" if len(d.updates) > 1 else ""
            return f"replay: {fleet} {change}{failing} node {minutes} min: {o.state} in {o.ended / 3600:.1f} h, {batches} batches{how}"

        def in_place_replay(fleet: str, change: str, cfg: Any, deployed: dict[str, Any], context: dict[str, str], software: Any) -> str:
            """The in-place change through the roles' associations (tests/fakes/state_manager.py), each node RESTART_MIN."""
            from tests.fakes import state_manager

            roles: dict[str, list[str]] = {}
            for n in cfg.layout.nodes:
                roles.setdefault(n.role, []).append(n.name)
            assocs = state_manager.from_template(rollout.flatten_templates(synth(context)), roles)
            o = state_manager.replay(assocs, dict.fromkeys((n.name for n in cfg.layout.nodes), RESTART_MIN * 60), set(software.restarts))
            serving = ", ".join(f"{role} {o.min_serving(names)}/{len(names)}" for role, names in roles.items())
            batches = max((len(b) for b in o.batches.values()), default=0)
            return (f"replay: {fleet} {change} in place, node {RESTART_MIN} min: {o.state} in {o.ended / 3600:.1f} h, {batches} batches, "
                    f"min serving {serving}")  # fmt: skip

        started = time.monotonic()
        for fleet, base in FLEETS.items():
            deployed = synth(base)
            before = rollout.flatten_templates(deployed)
            for change, delta in CHANGES.items():
                context = dict(base)
                for k, v in delta.items():
                    context[k] = str(int(base.get(k, "1")) + 1) if v == "+1" else v
                with script_edited(change):
                    after = rollout.flatten_templates(synth(context))
                    r = rollout.compare(before, after)
                    replayed = replay_line(fleet, change, deployed, context, NODE_MIN) if r.replaced or r.launched else ""
                cfg = load_config(context)
                # Which kind of change each role's replacements are (gptoss diff's "why" lines).
                why = replacements.reasons(before, after)
                roles = {n.name: n.role for n in cfg.layout.nodes}
                extra = f" (launched: {', '.join(r.launched)})" if r.launched else ""
                for line in rollout.role_lines(cfg, r):
                    kinds = sorted({why[n][0] for n in r.replaced if n in why and roles.get(n) == line.split(":")[0]})
                    print(f"rollout: {fleet}: {change}: {line}; {' and '.join(kinds) or 'machine'}, in place: no{extra}")
                old, new = in_place.version_of(before), in_place.version_of(after)
                software = in_place.compare(old, new, cf.SOFTWARE[old], cf.SOFTWARE[new], r.kept) if old and new and old != new and r.kept else None
                restarting = software is not None and any(software.restarts.values())
                if software is not None and software.restarts and cfg.rollout.software == "in-place":
                    for line in in_place.lines(cfg, software)[1:]:
                        if line.startswith(("  prefill:", "  decode:", "  server:")):
                            print(f"rollout: {fleet}: {change}: {line.strip()}; software, in place: yes{extra}")
                    if restarting:
                        replayed = in_place_replay(fleet, change, cfg, deployed, context, software)
                if not r.replaced and not restarting:
                    print(f"rollout: {fleet}: {change}: no instance replaced, no unit restarted (run-time data){extra}")
                if replayed:
                    print(replayed, flush=True)
        change = "a decode server flag (max_num_seqs)"
        for fleet, base in MATRIX_FLEETS.items():
            deployed = synth(base)
            context = base | CHANGES[change]
            last = decode_node(int(base['decode_instances']) - 1)
            for minutes in MATRIX_MIN:
                for fails in (frozenset(), frozenset({"decode-0"}), frozenset({"decode-3"}), frozenset({last})):
                    print(replay_line(fleet, change, deployed, context, minutes, fails), flush=True)
        print(f"(synthesized and replayed offline in {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
