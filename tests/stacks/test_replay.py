"""A change of a running fleet, replayed by CloudFormation's documented rules (tests/fakes/cloudformation.py).

moto runs no rolling update; the model does, from the synthesized templates alone, with each
node's own gptoss-signal deciding what it tells its gate and its group. For the 3+8 fleet and a
56-decode fleet (On-Demand: surge unless the deploy turns it off), with a node time of 20, 50 and
90 minutes, a decode server flag is changed: once with every node serving, once with node k of
the decode lane failing (k = 1, 4, the last). Every replay must end in UPDATE_COMPLETE or
UPDATE_ROLLBACK_COMPLETE, no node may fail for a deadline that started before its turn, and the
batches and times must be the ones `gptoss diff` prints for the same change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cluster_ops import rollout
from clusterspec.loading import load_config
from tests.conftest import ROOT, STACK
from tests.fakes import cloudformation as cf

# The software in the launch template (rollout.software=replace): the flag replaces the decode instances,
# the path this replay checks. The default applies it in place (test_in_place.py).
FLEETS = {"3+8": {"decode_instances": "8", "rollout.software": "replace"}, "56 decode": {"decode_instances": "56", "rollout.software": "replace"}}
CHANGE = {"serving.decode.max_num_seqs": "4"}
NODE_MIN = (20, 50, 90)
FAILING = (None, 1, 4, "last")


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> Callable[[dict[str, str]], dict[str, Any]]:
    """The stack's and its cells' templates for a parameter set, synthesized in-process (cached per set)."""
    import aws_cdk as cdk

    from stacks.cluster_stack import GptOssClusterStack

    cache: dict[str, dict[str, Any]] = {}

    def get(context: dict[str, str]) -> dict[str, Any]:
        key = json.dumps(context, sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp("assembly")
            app = cdk.App(context=json.loads((ROOT / "cdk.json").read_text())["context"], outdir=str(out))
            GptOssClusterStack(app, STACK, config=load_config(context))
            directory = Path(app.synth().directory)
            cf.register_assembly(directory)
            cache[key] = rollout.assembly_templates(directory, STACK)
        return cache[key]

    return get


def lane(cfg: Any, role: str, surge: bool) -> list[str]:
    """The first lane of a role, in order: the nodes whose replacements follow one another."""
    nodes = [n.name for n in cfg.layout.nodes if n.role == role]
    lanes = cfg.rollout.lanes(len(nodes), surge)
    return nodes[::lanes]


def minutes_said(line: str) -> float:
    """The role's time `gptoss diff` prints: '... about 400 min (8 x 50 min, ...)'."""
    m = re.search(r"about (\d+) min \(", line)
    assert m, line
    return float(m.group(1))


@pytest.mark.parametrize("fleet", list(FLEETS))
@pytest.mark.parametrize("node_min", NODE_MIN)
def test_a_change_replayed_by_cloudformations_rules_completes_or_rolls_back_cleanly(
    templates: Callable[[dict[str, str]], dict[str, Any]], fleet: str, node_min: int
) -> None:
    base = FLEETS[fleet] | {"ami_id": "ami-0123456789abcdef0"}
    deployed = templates(base)
    changed = base | CHANGE
    for failing in FAILING:
        cfg = load_config(changed)
        d0 = cf.replay_deploy(deployed, templates, changed, {"prefill": node_min, "decode": node_min})
        surge = "rollout.surge" not in d0.context
        first_lane = lane(load_config(d0.context), "decode", surge)
        fails = frozenset() if failing is None else frozenset({first_lane[-1] if failing == "last" else first_lane[failing - 1]})
        d = cf.replay_deploy(deployed, templates, changed, {"prefill": node_min, "decode": node_min}, fails) if fails else d0
        o = d.change
        what = f"{fleet}, node {node_min} min, {'every node serves' if not fails else f'{sorted(fails)[0]} fails'}"
        # The deploy's own decision: surge while a node serves within the PauseTime (60 min, less 10).
        assert bool(d.surge_off) == (node_min > 50), (what, d.surge_off)
        if d.surge_off:
            # The policy change first, alone: no instance replaced, and the change's rollback uses it.
            assert [name for name, _ in d.updates] == ["policy", "change"], what
            policy = d.updates[0][1]
            assert policy.state == "UPDATE_COMPLETE" and policy.turns == {} and all(i.launched < 0 for i in policy.instances), what
        else:
            assert [name for name, _ in d.updates] == ["change"], what
        assert o.late == [], f"{what}: failed for a deadline that started before its turn: {o.late}"
        r = rollout.compare(d.before, d.after)
        roles = {n.name: n.role for n in cfg.layout.nodes}
        if not fails:
            assert o.state == "UPDATE_COMPLETE", f"{what}: {o.state}: {o.reasons}"
            lines = rollout.role_lines(load_config(d.context), r, ready_min=node_min)
            for role, line in zip([x.split(":")[0] for x in lines], lines, strict=True):
                expected = [sorted([n for n in r.replaced if r.batch[n] == b and roles[n] == role], key=lambda n: int(n.rpartition("-")[2]))
                            for b in sorted({r.batch[n] for n in r.replaced if roles[n] == role})]  # fmt: skip
                assert o.batches(role, roles) == expected, f"{what}: {role}'s batches"
                done = max(o.served[n] for n in r.replaced if roles[n] == role) - min(o.turns[n] for n in r.replaced if roles[n] == role)
                assert done / 60 == minutes_said(line) == len(expected) * node_min, f"{what}: {line}"
        else:
            assert o.state == "UPDATE_ROLLBACK_COMPLETE", f"{what}: {o.state}: {o.reasons}"
            (node,) = fails
            role, _, index = node.rpartition("-")
            # Its group (a surge's signal) or its gate (without surge) fails the update: that node's, no other.
            assert re.search(f"/{role.title()}{index}(Group|Ready)", o.reasons[0].split(": ", 1)[0]), f"{what}: {o.reasons}"
            # Every node the change reached is back on the previous version, its gate's URL long expired.
            reached = {n for n in o.turns}
            assert set(o.rollback_turns) == reached, what
        decode = [n.name for n in cfg.layout.nodes if n.role == "decode"]
        serving = o.min_serving("decode", decode, 0, o.failed_at if o.failed_at is not None else o.ended)
        back = f", rollback min serving decode {o.min_serving('decode', decode, o.failed_at, o.ended)}/{len(decode)}" if o.failed_at is not None else ""
        print(f"\nreplay: {fleet} a decode flag node {node_min} min{'' if not fails else f' ({sorted(fails)[0]} fails)'}: "
              f"{o.state} in {o.ended / 3600:.1f} h, {len(o.batches('decode', roles))} batches, min serving decode {serving}/{len(decode)}{back}"
              + (" (surge off)" if d.surge_off else ""))  # fmt: skip


def test_a_move_of_the_3p8d_fleet_from_block_a_to_block_b_replayed_keeps_every_role_whole(
    templates: Callable[[dict[str, str]], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The 3+8 fleet on Capacity Block A deployed with block B's id (nodes of 50 minutes): `gptoss deploy`'s own
    decision (a move surges), replayed by CloudFormation's rules: the update completes, every node is replaced,
    and no role ever serves with fewer than all its nodes (each replacement serves before its old instance goes)."""
    a = {"decode_instances": "8"} | {"ami_id": "ami-0123456789abcdef0", "capacity.type": "capacity-block", "capacity.reservation_id": "cr-0aaaaaaaaaaaaaaa1"}
    b = a | {"capacity.reservation_id": "cr-0bbbbbbbbbbbbbbb2"}
    d = cf.replay_deploy(templates(a), templates, b, {"prefill": 50, "decode": 50})
    assert d.context.get("rollout.surge") == "on" and not d.surge_off, d.context
    o = d.change
    assert o.state == "UPDATE_COMPLETE" and o.late == [], (o.state, o.reasons, o.late)
    cfg = load_config(b)
    roles = {n.name: n.role for n in cfg.layout.nodes}
    r = rollout.compare(d.before, d.after)
    assert sorted(r.replaced) == sorted(roles), r.replaced
    serving = {role: o.min_serving(role, [n for n, x in roles.items() if x == role], 0, o.ended) for role in ("prefill", "decode")}
    assert serving == {"prefill": 3, "decode": 8}, serving
    with capsys.disabled():
        print(f"\nreplay: 3+8 move from block A to block B, node 50 min: {o.state} in {o.ended / 3600:.1f} h, "
              f"{len(o.batches('decode', roles))} decode batches, min serving prefill {serving['prefill']}/3, decode {serving['decode']}/8 (surge)")  # fmt: skip
