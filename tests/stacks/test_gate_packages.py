"""The API gate's HAProxy for router nodes with no apt source (network.egress='none'): refused at plan without a
way to install it; the pinned package files shipped as assets that only the router nodes may read."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

import cluster_constructs.router
from clusterspec.errors import SpecError
from clusterspec.loading import load_config
from node_render.paths import HAPROXY_ENV, ROUTER_ENV
from node_render.render import render_cluster
from tests.stacks.least_privilege import assert_least_privilege
from tests.stacks.template import of_type

NO_EGRESS = {"network.egress": "none", "model.source": "s3", "model.s3_uri": "s3://models-bucket/gpt-oss-120b",
             "examples.s3_uri": "s3://models-bucket/vllm-neuron", "decode_instances": "2"}  # fmt: skip
HAPROXY = "haproxy_2.8.5-1ubuntu3.3_amd64.deb"
LUA = "liblua5.4-0_5.4.6-3build2_amd64.deb"
BYTES = {HAPROXY: b"haproxy package bytes", LUA: b"lua package bytes"}
PACKAGES = [{"file": f, "sha256": hashlib.sha256(b).hexdigest()} for f, b in BYTES.items()]


def test_a_router_fleet_without_egress_is_refused_at_plan_unless_its_haproxy_has_a_way_onto_the_nodes() -> None:
    with pytest.raises(SpecError) as refused:
        load_config(NO_EGRESS)
    msg = str(refused.value)
    assert "serving.proxy.gate.packages" in msg and "cannot reach an apt source to install HAProxy 2.8" in msg, msg
    assert "serving.proxy.gate.from_image=true" in msg and "network.egress='nat'" in msg, msg
    # Pinned packages, or an image said to carry it: accepted. The toy proxy's layout has no gate: no rule.
    assert load_config(NO_EGRESS | {"serving.proxy.gate.packages": PACKAGES}).serving.proxy.gate.packages[0].file == HAPROXY
    assert load_config(NO_EGRESS | {"serving.proxy.gate.from_image": "true"}).proxy_kind == "vllm-router"
    assert load_config(NO_EGRESS | {"decode_instances": "1"}).proxy_kind == "toy"


@pytest.mark.parametrize(
    "packages,why",
    [
        ([PACKAGES[1]], "holds no haproxy_2.8.* package (serving.proxy.gate.haproxy_version)"),
        ([{"file": "haproxy_2.6.12-1_amd64.deb", "sha256": "a" * 64}], "holds no haproxy_2.8.* package"),
        ([PACKAGES[0], PACKAGES[0]], f"='{HAPROXY}': is given twice"),
        ([{"file": "haproxy.tar.gz", "sha256": "a" * 64}], "file"),
        ([{"file": HAPROXY, "sha256": "not-a-sha"}], "sha256"),
    ],
)
def test_packages_that_cannot_be_the_pinned_haproxy_are_refused_naming_the_field(packages: list[dict[str, str]], why: str) -> None:
    with pytest.raises(SpecError) as refused:
        load_config(NO_EGRESS | {"serving.proxy.gate.packages": packages})
    assert "serving.proxy.gate.packages" in str(refused.value) and why in str(refused.value), str(refused.value)


def test_the_router_nodes_alone_may_read_the_shipped_packages_and_find_them_by_their_pinned_sha256(
    synth_variant: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for f, b in BYTES.items():
        (tmp_path / f).write_bytes(b)
    monkeypatch.setattr(cluster_constructs.router, "DEBS_DIR", tmp_path)
    context = NO_EGRESS | {"serving.proxy.gate.packages": PACKAGES}
    t = synth_variant(**context)
    cfg = load_config(context)
    # Every node's grants exactly its allowlist: decode-0 and decode-1 (the routers) read both packages, prefill-0 none.
    assert_least_privilege(t, cfg)
    policies = json.dumps({lid: r["Properties"] for lid, r in of_type(t, "AWS::IAM::Role").items()})
    keys = [hashlib.sha256(p["sha256"].encode()).hexdigest() + ".deb" for p in PACKAGES]
    assert all(k in policies for k in keys), keys
    # The nodes find each by KEY:SHA256:FILE in haproxy.env (not router.env: a new wheel restarts no gate).
    decode = next(r for r in render_cluster(cfg) if r.node.name == "decode-0")
    assert "HAPROXY" not in decode.files[ROUTER_ENV][0]
    env = decode.files[HAPROXY_ENV][0]
    assert f"GPTOSS_HAPROXY_PACKAGES='{keys[0]}:{PACKAGES[0]['sha256']}:{HAPROXY} {keys[1]}:{PACKAGES[1]['sha256']}:{LUA}'" in env, env


def test_a_package_missing_from_debs_or_not_the_pinned_file_fails_the_synth_naming_the_fix(
    synth_variant: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_constructs.router, "DEBS_DIR", tmp_path)
    context = NO_EGRESS | {"serving.proxy.gate.packages": PACKAGES[:1]}
    with pytest.raises(SpecError, match=re.escape(f"serving.proxy.gate.packages[0]: {HAPROXY} is not in {tmp_path.name}/. Fix: download")):
        synth_variant(**context)
    (tmp_path / HAPROXY).write_bytes(b"another file")
    with pytest.raises(SpecError, match=re.escape(f"serving.proxy.gate.packages[0].sha256: {tmp_path.name}/{HAPROXY} has sha256 "
                                                  f"{hashlib.sha256(b'another file').hexdigest()}, the spec pins {PACKAGES[0]['sha256']}")):  # fmt: skip
        synth_variant(**context)


def test_new_gate_packages_are_software_the_router_nodes_restart_their_gate_alone() -> None:
    """Another pinned HAProxy package (a security update of 2.8) for a router fleet without egress: no user data
    changes, and in place the router nodes restart gptoss-api (which installs it when the image lacks HAProxy),
    not their router; the prefill node takes nothing. Rendered, not synthesized."""
    from cluster_ops import in_place
    from node_render.userdata import software_asset, user_data

    old_cfg = load_config(NO_EGRESS | {"serving.proxy.gate.packages": PACKAGES})
    newer = [{"file": "haproxy_2.8.5-1ubuntu3.4_amd64.deb", "sha256": "cd" * 32}, PACKAGES[1]]
    new_cfg = load_config(NO_EGRESS | {"serving.proxy.gate.packages": newer})
    old_renders, new_renders = render_cluster(old_cfg), render_cluster(new_cfg)
    same = {"software_parameter": "/gptoss/p", "compile_cache_uri": "s3://cache"}
    for a, b in zip(old_renders, new_renders, strict=True):
        assert user_data(a, **same) == user_data(b, **same), a.node.name
    old_asset, new_asset = software_asset(old_renders), software_asset(new_renders)
    names = [r.node.name for r in old_renders]
    change = in_place.compare(hashlib.sha256(old_asset).hexdigest(), hashlib.sha256(new_asset).hexdigest(), old_asset, new_asset, names)
    assert change.restarts == {"decode-0": ["gptoss-api.service"], "decode-1": ["gptoss-api.service"]}
    assert change.same == ["prefill-0"]
