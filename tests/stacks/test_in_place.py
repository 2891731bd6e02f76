"""A software change applied in place (rollout.software=in-place, the default; docs/design.md 'Changes').

Each case synthesizes two assemblies, as `gptoss deploy` synthesizes the new one, and compares them: the
launch templates (which replace instances when they change), the software parameter and the State
Manager associations (which apply a new version in place), and what `gptoss diff` says each node
restarts. The expected units are typed out from where the spec puts each setting (the decode server's
flags on its unit's command line, the prefill replicas' on theirs, the collector's script), not read
back from the renderer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from cluster_ops import in_place, rollout
from clusterspec.loading import load_config
from tests.conftest import ROOT, STACK

PROD = {"decode_instances": "8"}
PREFILL_UNITS = [f"gptoss-prefill@{i}.service" for i in range(16)]


@contextlib.contextmanager
def script_edited(name: str) -> Iterator[None]:
    """A node script with one more line, while a change is synthesized."""
    from node_render.node_scripts import shipped_scripts

    scripts = shipped_scripts()  # cached: the synth ships the edited copy
    original = scripts[name]
    scripts[name] = original + "# a one-line edit\n"
    try:
        yield
    finally:
        scripts[name] = original


@pytest.fixture(scope="module")
def assembly(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """The cloud assembly of a parameter set, synthesized in-process (cached per set and edited script)."""
    import aws_cdk as cdk

    from stacks.cluster_stack import GptOssClusterStack

    cache: dict[str, Path] = {}

    def get(edit: str = "", **context: str) -> Path:
        key = json.dumps([edit, context], sort_keys=True)
        if key not in cache:
            out = tmp_path_factory.mktemp("assembly")
            app = cdk.App(context=json.loads((ROOT / "cdk.json").read_text())["context"], outdir=str(out))
            with script_edited(edit) if edit else contextlib.nullcontext():
                GptOssClusterStack(app, STACK, config=load_config(context))
                cache[key] = Path(app.synth().directory)
        return cache[key]

    return get


def _flat(path: Path) -> dict[str, Any]:
    return rollout.synthesized(path, STACK)


def _of(flat: dict[str, Any], rtype: str) -> dict[str, Any]:
    return {lid: res for lid, res in flat.items() if res["Type"] == rtype}


def _restarts(assembly: Callable[..., Path], before: dict[str, Any], after: dict[str, Any]) -> in_place.InPlace:
    """What `gptoss diff` says each running node restarts, both assets read from their assemblies."""
    a, b = assembly(**before), assembly(**after)
    old, new = in_place.version_of(_flat(a)), in_place.version_of(_flat(b))
    assert old and new and old != new, "a new software version"
    r = rollout.compare(_flat(a), _flat(b))
    return in_place.compare(old, new, in_place.assembly_software(a, old), in_place.assembly_software(b, new), r.kept)


@pytest.mark.parametrize(
    ("change", "context"),
    [
        ("a node script (one line of gptoss-retry)", {"edit": "gptoss-retry"}),
        ("a decode server flag (max_num_seqs)", {"serving.decode.max_num_seqs": "4"}),
        ("a router setting (health_check_timeout_s)", {"serving.proxy.kind": "vllm-router", "serving.proxy.router.health_check_timeout_s": "12"}),
    ],
)
def test_a_software_change_leaves_all_eleven_launch_templates_byte_identical(assembly: Callable[..., Path], change: str, context: dict[str, str]) -> None:
    base = PROD | ({"serving.proxy.kind": "vllm-router"} if "serving.proxy.kind" in context else {})
    before, after = _flat(assembly(**base)), _flat(assembly(**(base | context)))
    templates = {k: _of(v, "AWS::EC2::LaunchTemplate") for k, v in (("before", before), ("after", after))}
    assert len(templates["before"]) == 11 and templates["after"] == templates["before"], change
    assert _of(after, "AWS::CloudFormation::WaitCondition").keys() == _of(before, "AWS::CloudFormation::WaitCondition").keys(), "no new gate"
    r = rollout.compare(before, after)
    assert (r.replaced, r.launched, r.removed, len(r.kept)) == ([], [], [], 11), change


def test_a_new_image_changes_all_eleven_launch_templates(assembly: Callable[..., Path]) -> None:
    base = PROD | {"ami_id": "ami-0aaaaaaaaaaaaaaa1"}
    before, after = _flat(assembly(**base)), _flat(assembly(**(base | {"ami_id": "ami-0bbbbbbbbbbbbbbb2"})))
    old, new = _of(before, "AWS::EC2::LaunchTemplate"), _of(after, "AWS::EC2::LaunchTemplate")
    assert len(old) == 11 and all(old[lid] != new[lid] for lid in old)
    assert in_place.version_of(before) == in_place.version_of(after), "the software is the same"


def test_a_decode_flag_restarts_only_the_decode_servers(assembly: Callable[..., Path]) -> None:
    """max_num_seqs is on the decode server's command line (its unit). The prefill nodes' files are the same."""
    change = _restarts(assembly, PROD, PROD | {"serving.decode.max_num_seqs": "4"})
    assert change.restarts == {f"decode-{d}": ["gptoss-decode.service"] for d in range(8)}
    assert change.same == ["prefill-0", "prefill-1", "prefill-2"]
    lines = in_place.lines(load_config(PROD), change)
    assert lines[1:] == [
        "  decode-0..7: restart gptoss-decode.service",
        "  decode: 8 batches of at most 1, minimum serving decode 7/8, about 8 x a node's restart (not measured yet; each at most 30 min)",
        "  same software, nothing restarted: prefill-0..2",
    ]
    assert lines[0].startswith(f"software {change.old[:12]} -> {change.new[:12]}, in place (no instance replaced)")


def test_a_prefill_flag_restarts_the_sixteen_replicas_of_each_prefill_node(assembly: Callable[..., Path]) -> None:
    change = _restarts(assembly, PROD, PROD | {"serving.prefill.max_num_seqs": "2"})
    assert change.restarts == {f"prefill-{p}": PREFILL_UNITS for p in range(3)}
    assert change.same == [f"decode-{d}" for d in range(8)]


def test_deploy_asks_before_servers_restart_in_place_and_not_for_the_collector_alone(assembly: Callable[..., Path]) -> None:
    """gptoss deploy asks (the count, or --yes) before a change that restarts serving nodes' servers, as before one
    that takes instances away; a change of the collector alone restarts no server and is not asked about."""
    from cluster_ops import common

    flag = _restarts(assembly, PROD, PROD | {"serving.decode.max_num_seqs": "4"})
    kept = rollout.Rollout(kept=[n.name for n in load_config(PROD).layout.nodes])
    with pytest.raises(common.CliError) as refused:
        rollout.confirm(load_config(PROD), kept, yes=False, restarting=in_place.serving_restarts(flag))
    assert str(refused.value).startswith("refusing to deploy without confirmation: 8 serving nodes of GptOss8k1kStack restart their "
                                         "servers in place. Nothing was deployed.")  # fmt: skip
    rollout.confirm(load_config(PROD), kept, yes=True, restarting=in_place.serving_restarts(flag))
    collector = _restarts(assembly, PROD, {"edit": "gptoss-telemetry", **PROD})
    assert in_place.serving_restarts(collector) == []
    rollout.confirm(load_config(PROD), kept, yes=False, restarting=in_place.serving_restarts(collector))


def test_a_new_router_wheel_is_software_the_router_nodes_restart_their_router_alone() -> None:
    """A new wheel (another release, its own sha256) for 3 + 8 behind vLLM's router: every node's user data is the
    same (no launch template changes: the wheel is found by its key in the software asset's bucket, which only
    router.env names), and in place the router nodes restart gptoss-proxy (lame-duck first), nothing else; the
    prefill nodes take nothing. Rendered, not synthesized: a synth needs the wheel file itself."""
    from node_render.paths import router_object_key
    from node_render.render import render_cluster
    from node_render.userdata import software_asset, user_data

    base = PROD | {"serving.proxy.kind": "vllm-router"}
    new = base | {"serving.proxy.router.version": "0.1.18", "serving.proxy.router.wheel": "vllm_router-0.1.18-cp38-abi3-manylinux_2_28_x86_64.whl",
                  "serving.proxy.router.sha256": "ab" * 32}  # fmt: skip
    old_renders, new_renders = render_cluster(load_config(base)), render_cluster(load_config(new))
    for a, b in zip(old_renders, new_renders, strict=True):
        same = {"software_parameter": "/gptoss/p", "compile_cache_uri": "s3://cache"}
        assert user_data(a, **same) == user_data(b, **same), a.node.name
    old_asset, new_asset = software_asset(old_renders), software_asset(new_renders)
    names = [r.node.name for r in old_renders]
    change = in_place.compare(hashlib.sha256(old_asset).hexdigest(), hashlib.sha256(new_asset).hexdigest(), old_asset, new_asset, names)
    assert change.restarts == {f"decode-{d}": ["gptoss-proxy.service"] for d in range(8)}
    assert change.same == ["prefill-0", "prefill-1", "prefill-2"]
    router_env = in_place.node_tree(new_asset, "decode-0")["/etc/gptoss/router.env"][0]
    assert f"GPTOSS_ROUTER_KEY={router_object_key('ab' * 32)}" in router_env and router_object_key("ab" * 32).endswith(".whl")


def test_a_collector_script_restarts_no_server(assembly: Callable[..., Path]) -> None:
    """gptoss-telemetry is the node's metrics and logs collector: its edit restarts it, never a server, a router or
    a proxy (nor the deploy gate's verdict, whose script names the collector: once per instance)."""
    change = _restarts(assembly, PROD, {"edit": "gptoss-telemetry", **PROD})
    assert change.restarts == {n: ["gptoss-telemetry.service"] for n in
                               [*(f"decode-{d}" for d in range(8)), *(f"prefill-{p}" for p in range(3))]}  # fmt: skip
    assert "minimum serving decode 8/8" in in_place.lines(load_config(PROD), change)[-1]


def test_each_role_has_an_association_at_its_lanes_rate_stopping_at_the_first_failure(assembly: Callable[..., Path]) -> None:
    """3 + 8 with max_unavailable 25 %: decode 2 at a time (8 x 25 %), prefill 1 (rounded down, at least 1);
    MaxErrors 0; targets by the cluster's and the role's tags (a replacement is one of them); the version is the
    parameter's; each waits for its role's cells (its nodes served), the second role for the first."""
    ctx = PROD | {"rollout.max_unavailable": "25%"}
    flat = _flat(assembly(**ctx))
    (param,) = [p for p in _of(flat, "AWS::SSM::Parameter").values() if p["Properties"]["Name"] == "/gptoss/gptoss-8k1k/software"]
    assocs = {a["Properties"]["AssociationName"]: a for a in _of(flat, "AWS::SSM::Association").values()}
    assert sorted(assocs) == ["gptoss-8k1k-software-decode", "gptoss-8k1k-software-prefill"]
    for role, rate in (("prefill", "1"), ("decode", "2")):
        p = assocs[f"gptoss-8k1k-software-{role}"]["Properties"]
        assert (p["MaxConcurrency"], p["MaxErrors"]) == (rate, "0")
        assert p["Targets"] == [{"Key": "tag:gptoss:cluster", "Values": ["gptoss-8k1k"]}, {"Key": "tag:gptoss:role", "Values": [role]}]
        assert p["Parameters"] == {"Software": [param["Properties"]["Value"]], "TimeoutSeconds": ["1800"]}
    deps = {name: a["DependsOn"] for name, a in assocs.items()}
    assert any(d.startswith("PrefillCell0") for d in deps["gptoss-8k1k-software-prefill"])
    assert any(d.startswith("SoftwarePrefill") for d in deps["gptoss-8k1k-software-decode"])
    # Two batches of 2 x 30 min and the fetch for prefill's 3 nodes (1 at a time): 3 x (3600 + 900) s.
    assert assocs["gptoss-8k1k-software-prefill"]["Properties"]["WaitForSuccessTimeoutSeconds"] == 3 * 4500
    assert assocs["gptoss-8k1k-software-decode"]["Properties"]["WaitForSuccessTimeoutSeconds"] == 4 * 4500
    (doc,) = _of(flat, "AWS::SSM::Document").values()
    step = doc["Properties"]["Content"]["mainSteps"][0]
    assert step["inputs"]["runCommand"] == ["/opt/gptoss/bin/gptoss-apply '{{ Software }}' '{{ TimeoutSeconds }}'"]
    assert doc["Properties"]["Content"]["parameters"]["Software"]["allowedPattern"] == r"^s3://[a-z0-9.-]+/[A-Za-z0-9._/-]+ [0-9a-f]{64}$"


def test_replace_puts_each_nodes_own_software_in_its_launch_template_and_makes_no_association(assembly: Callable[..., Path]) -> None:
    """rollout.software=replace: a decode flag gives the decode nodes, and only them, a new launch template (their
    own software's digest is in it); the version every node boots is still the parameter's; nothing in place."""
    pinned = PROD | {"rollout.software": "replace"}
    before, after = _flat(assembly(**pinned)), _flat(assembly(**(pinned | {"serving.decode.max_num_seqs": "4"})))
    assert not _of(after, "AWS::SSM::Association") and not _of(after, "AWS::SSM::Document")
    assert in_place.version_of(after) not in (None, in_place.version_of(before))
    r = rollout.compare(before, after)
    assert (r.replaced, r.kept) == ([f"decode-{d}" for d in range(8)], ["prefill-0", "prefill-1", "prefill-2"])


def test_the_deployed_version_is_read_where_its_parameter_says_and_checked(moto_url: str, assembly: Callable[..., Path]) -> None:
    """gptoss diff reads the deployed asset from S3 (moto here) at the URI the parameter names, and trusts it only
    when its sha256 is the version."""
    data = in_place.assembly_software(assembly(**PROD), in_place.version_of(_flat(assembly(**PROD))) or "")
    sha = hashlib.sha256(data).hexdigest()
    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-2")
    s3 = session.client("s3", endpoint_url=moto_url)
    ssm = session.client("ssm", endpoint_url=moto_url)
    s3.create_bucket(Bucket="assets-in-place", CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    s3.put_object(Bucket="assets-in-place", Key=f"{sha}.xz", Body=data)

    class Endpoints:
        region_name = "us-east-2"

        def client(self, name: str) -> Any:
            return {"s3": s3, "ssm": ssm}[name]

    ssm.put_parameter(Name="/gptoss/in-place-test/software", Value=f"s3://assets-in-place/{sha}.xz {sha}", Type="String", Overwrite=True)
    assert in_place.deployed_software(Endpoints(), "/gptoss/in-place-test/software", sha) == (data, "")
    s3.put_object(Bucket="assets-in-place", Key=f"{sha}.xz", Body=data + b"x")
    assert in_place.deployed_software(Endpoints(), "/gptoss/in-place-test/software", sha) == (None, f"the object at s3://assets-in-place/{sha}.xz is not version {sha[:12]}")
    got, why = in_place.deployed_software(Endpoints(), "/gptoss/in-place-test/nothing", sha)
    assert got is None and "ParameterNotFound" in why


def test_the_estimate_is_the_longest_restart_measured_in_place_per_role(moto_url: str, assembly: Callable[..., Path]) -> None:
    """gptoss-apply publishes how long its node took to serve again (InPlaceRestartSeconds, by cluster and role; moto's
    CloudWatch here): the next decode change is estimated from the longest decode restart of the last 30 days; a
    point older than that, another cluster's or another role's does not count."""
    import datetime as dt

    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-2")
    cloudwatch = session.client("cloudwatch", endpoint_url=moto_url)
    now = dt.datetime.now(dt.UTC)

    def put(cluster: str, role: str, seconds: float, days_ago: float) -> None:
        cloudwatch.put_metric_data(Namespace=f"GptOss/{cluster}", MetricData=[{
            "MetricName": "InPlaceRestartSeconds", "Value": seconds, "Unit": "Seconds", "Timestamp": now - dt.timedelta(days=days_ago),
            "Dimensions": [{"Name": "Cluster", "Value": cluster}, {"Name": "Role", "Value": role}]}])  # fmt: skip

    cfg = load_config(PROD | {"cluster_name": "measured-restarts"})
    put("measured-restarts", "decode", 420, 2)
    put("measured-restarts", "decode", 540, 9)  # the longest of the last 30 days: 9 min
    put("measured-restarts", "decode", 3000, 45)  # too old
    put("measured-restarts-other", "prefill", 3000, 1)  # another cluster's
    put("measured-restarts", "prefill", 60, 1)

    class Endpoints:
        region_name = "us-east-2"

        def client(self, name: str) -> Any:
            return {"cloudwatch": cloudwatch}[name]

    assert in_place.measured_restarts(Endpoints(), cfg, now) == {"decode": 540.0, "prefill": 60.0}
    change = _restarts(assembly, PROD, PROD | {"serving.decode.max_num_seqs": "4"})
    change.measured = {"decode": 540.0, "prefill": 60.0}
    assert in_place.lines(cfg, change)[2] == ("  decode: 8 batches of at most 1, minimum serving decode 7/8, about 72 min: 8 x a node's "
                                              "restart (9 min, the longest restart of a decode node in place in the last 30 days)")  # fmt: skip

    class Refused:
        region_name = "us-east-2"

        def client(self, name: str) -> Any:
            raise RuntimeError("AccessDenied")

    assert in_place.measured_restarts(Refused(), cfg, now) == {}, "advice: no estimate, no failure"


# ---- the change replayed by State Manager's and CloudFormation's documented rules (tests/fakes/state_manager.py) ----

RESTART_S = 600  # a node's restart, as the replay assumes it (its servers reload from its NVMe and its compile cache)


def _replay(assembly: Callable[..., Path], base: dict[str, str], fails: frozenset[str] = frozenset(), restart_s: float = RESTART_S) -> Any:
    from tests.fakes import state_manager

    change = _restarts(assembly, base, base | {"serving.decode.max_num_seqs": "4"})
    cfg = load_config(base)
    roles: dict[str, list[str]] = {}
    for n in cfg.layout.nodes:
        roles.setdefault(n.role, []).append(n.name)
    associations = state_manager.from_template(_flat(assembly(**(base | {"serving.decode.max_num_seqs": "4"}))), roles)
    assert [a.role for a in associations] == ["prefill", "decode"], "the roles one after the other, as their DependsOn says"
    return state_manager.replay(associations, dict.fromkeys((n.name for n in cfg.layout.nodes), restart_s), set(change.restarts), fails)


def test_a_decode_flag_replayed_in_place_restarts_one_decode_node_at_a_time_and_completes(assembly: Callable[..., Path]) -> None:
    o = _replay(assembly, PROD)
    decode = [f"decode-{d}" for d in range(8)]
    assert (o.state, o.batches["decode"], o.batches["prefill"]) == ("UPDATE_COMPLETE", [[n] for n in decode], [])
    assert o.min_serving(decode) == 7 and o.ended == 8 * RESTART_S
    print(f"\nreplay in place: 3+8 a decode flag, each node {RESTART_S // 60} min to serve again: {o.state} in {o.ended / 3600:.1f} h, "
          f"{len(o.batches['decode'])} batches, min serving decode {o.min_serving(decode)}/8, no instance replaced")  # fmt: skip


def test_a_node_that_does_not_serve_again_stops_the_change_and_cloudformation_rolls_the_others_back(assembly: Callable[..., Path]) -> None:
    """decode-3 fails its restart: it goes back by itself; State Manager starts no other node (MaxErrors 0); the
    update fails and its rollback runs the previous version again on decode-0..2, one at a time. decode-4..7
    never restart. At most one decode node is out at any time."""
    o = _replay(assembly, PROD, fails=frozenset({"decode-3"}))
    decode = [f"decode-{d}" for d in range(8)]
    assert o.state == "UPDATE_ROLLBACK_COMPLETE" and o.reason.startswith("decode: decode-3 did not serve again within 1800 s")
    assert o.reached == ["decode-0", "decode-1", "decode-2", "decode-3"] and o.rolled_back == ["decode-0", "decode-1", "decode-2"]
    assert not {n for n, _, _ in o.out} & {"decode-4", "decode-5", "decode-6", "decode-7"}
    assert o.min_serving(decode) == 7
    print(f"\nreplay in place: 3+8 a decode flag, decode-3 fails: {o.state} in {o.ended / 3600:.1f} h, min serving decode "
          f"{o.min_serving(decode)}/8; rolled back in place: {', '.join(o.rolled_back)}")  # fmt: skip


def test_max_unavailable_25_percent_restarts_two_decode_nodes_at_a_time(assembly: Callable[..., Path]) -> None:
    o = _replay(assembly, PROD | {"rollout.max_unavailable": "25%"})
    decode = [f"decode-{d}" for d in range(8)]
    assert o.batches["decode"] == [[f"decode-{i}", f"decode-{i + 1}"] for i in range(0, 8, 2)] and o.min_serving(decode) == 6
    assert (o.state, o.ended) == ("UPDATE_COMPLETE", 4 * RESTART_S)


def test_the_associations_wait_holds_every_node_that_serves_within_its_own_bound(assembly: Callable[..., Path]) -> None:
    """The template's WaitForSuccessTimeoutSeconds is long enough for the slowest change that can succeed: every node
    taking just under rollout.apply_timeout_s."""
    assert _replay(assembly, PROD, restart_s=1799).state == "UPDATE_COMPLETE"
