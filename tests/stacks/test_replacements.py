"""Why a deploy replaces each node, said before it runs (cluster_ops/replacements.py): what in its launch
changed and which kind of change that is, read from two synthesized templates as `gptoss diff` reads
the deployed one and the new one. The expected files and settings are typed out from the spec (which
file carries which setting), not read back from the renderer."""

from __future__ import annotations

import base64
import json
from typing import Any

import yaml

from cluster_ops import replacements
from clusterspec.names import node_order
from node_render.userdata import bundle, parse_user_data

PROD = {"decode_instances": "8"}


def _why(synth_variant: Any, before: dict[str, str], after: dict[str, str]) -> dict[str, tuple[str, list[str]]]:
    return replacements.reasons(synth_variant(**before)["Resources"], synth_variant(**after)["Resources"])


def test_the_same_spec_replaces_nothing_and_says_nothing(synth_variant: Any) -> None:
    assert _why(synth_variant, {}, {}) == {}
    assert replacements.lines({}) == []


def test_a_decode_flag_replaces_nothing_in_place_and_the_decode_nodes_with_replace(synth_variant: Any) -> None:
    """3 + 8: max_num_seqs is on the decode server's command line, in its unit: software. In place (the default)
    no launch template changes; with rollout.software=replace the decode nodes' own software (its digest in
    their launch templates) changes, no prefill node's, and the line says what that costs."""
    assert _why(synth_variant, PROD, PROD | {"serving.decode.max_num_seqs": "4"}) == {}
    replace = PROD | {"rollout.software": "replace"}
    why = _why(synth_variant, replace, replace | {"serving.decode.max_num_seqs": "4"})
    assert sorted(why, key=node_order) == [f"decode-{d}" for d in range(8)]
    assert {(kind, tuple(what)) for kind, what in why.values()} == {("software", ("its software",))}
    assert replacements.lines(why) == ["  why decode-0..7: its software (a software change, applied with a new instance "
                                       "(rollout.software=replace): it boots, stages the model and loads again; "
                                       "rollout.software=in-place restarts the changed units instead)"]  # fmt: skip


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


def test_a_boot_script_is_a_machine_change_and_no_other_script_is(synth_variant: Any) -> None:
    """The boot's own scripts are in every node's user data (they run before the software is fetched): an edit of
    one is the machine, named by its path. The deployed template is the same spec with another gptoss-bootstrap."""
    after = synth_variant(**PROD)["Resources"]
    flat = {lid: res for lid, res in after.items()}
    before = json.loads(json.dumps(flat))
    for res in before.values():
        if res["Type"] == "AWS::EC2::LaunchTemplate":
            data = res["Properties"]["LaunchTemplateData"]
            text = replacements.user_data_text(data["UserData"])
            files, _values, doc = parse_user_data(text)
            assert "/opt/gptoss/bin/gptoss-bootstrap" in files and not any(p.endswith(".env") for p in files), sorted(files)
            doc["bootcmd"][0][3] = base64.b64encode(bundle(files | {"/opt/gptoss/bin/gptoss-bootstrap": ("#!/bin/sh\n", 0o755)})).decode()
            data["UserData"] = {"Fn::Base64": "#cloud-config\n" + yaml.safe_dump(doc, sort_keys=False, width=1 << 20)}
    why = replacements.reasons(before, after)
    assert sorted(why, key=node_order) == [*(f"decode-{d}" for d in range(8)), *(f"prefill-{p}" for p in range(3))]
    assert {kind for kind, _ in why.values()} == {"machine"}
    assert all(any(w == "its boot files /opt/gptoss/bin/gptoss-bootstrap" for w in what) for _, what in why.values()), why
