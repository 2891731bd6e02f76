"""Why a deploy replaces each node, said before it runs (cluster_ops/replacements.py): what in its launch
changed and which kind of change that is, read from two synthesized templates as `gptoss diff` reads
the deployed one and the new one. The expected files and settings are typed out from the spec (which
file carries which setting), not read back from the renderer."""

from __future__ import annotations

import json
import re
from typing import Any

from cluster_ops import replacements
from clusterspec.names import node_order

PROD = {"decode_instances": "8"}


def _why(synth_variant: Any, before: dict[str, str], after: dict[str, str]) -> dict[str, tuple[str, list[str]]]:
    return replacements.reasons(synth_variant(**before)["Resources"], synth_variant(**after)["Resources"])


def test_the_same_spec_replaces_nothing_and_says_nothing(synth_variant: Any) -> None:
    assert _why(synth_variant, {}, {}) == {}
    assert replacements.lines({}) == []


def test_a_decode_flag_is_a_software_change_of_the_decode_nodes_files(synth_variant: Any) -> None:
    """3 + 8: max_num_seqs is on the decode server's command line, in its unit (and in the benchmark unit of a
    node that runs one); every decode node is replaced for its files alone, no prefill node, and the line says
    what it costs."""
    why = _why(synth_variant, PROD, PROD | {"serving.decode.max_num_seqs": "4"})
    assert sorted(why) == [f"decode-{d}" for d in range(8)], why
    kinds = {kind for kind, _ in why.values()}
    assert kinds == {"software"}
    for node, (_, what) in why.items():
        assert len(what) == 1 and what[0].startswith("its files ") and "/etc/systemd/system/gptoss-decode.service" in what[0], (node, what)
        assert "the image" not in what and "the node scripts" not in what
    said = replacements.lines(why)
    assert all(line.startswith("  why decode-") for line in said) and "a software change" in said[0], said
    assert "it boots, stages the model and loads again" in said[0]


def test_a_new_image_is_a_machine_change_of_every_node_and_nothing_else(synth_variant: Any) -> None:
    base = PROD | {"ami_id": "ami-0aaaaaaaaaaaaaaa1"}
    why = _why(synth_variant, base, base | {"ami_id": "ami-0bbbbbbbbbbbbbbb2"})
    assert sorted(why, key=node_order) == [
        *(f"decode-{d}" for d in range(8)), *(f"prefill-{p}" for p in range(3))]  # fmt: skip
    assert {(kind, tuple(what)) for kind, what in why.values()} == {("machine", ("the image",))}
    assert replacements.lines(why) == ["  why decode-0..7, prefill-0..2: the image (a new machine)"]


def test_a_router_setting_replaces_nothing(synth_variant: Any) -> None:
    """The router's settings are run-time data (an SSM parameter the routers read), not a node's launch."""
    routed = PROD | {"serving.proxy.kind": "vllm-router"}
    assert _why(synth_variant, routed, routed | {"serving.proxy.router.health_check_timeout_s": "7"}) == {}


def test_a_new_node_script_is_a_software_change_named_as_such(synth_variant: Any) -> None:
    """What a script edit does to a node's launch: the scripts asset's sha256 (and its key) in every node's user
    data. The deployed template is the same spec with an older asset: its sha256 and key replaced by others."""
    after = synth_variant(**PROD)["Resources"]
    text = json.dumps(after)
    shas = set(re.findall(r"GPTOSS_SCRIPTS_SHA256=([0-9a-f]{64})", text))
    assert len(shas) == 1, shas
    (sha,) = shas
    before = json.loads(text.replace(sha, "0" * 64))
    why = replacements.reasons(before, after)
    assert sorted(why, key=node_order) == [
        *(f"decode-{d}" for d in range(8)), *(f"prefill-{p}" for p in range(3))]  # fmt: skip
    assert {(kind, tuple(what)) for kind, what in why.values()} == {("software", ("the node scripts",))}
