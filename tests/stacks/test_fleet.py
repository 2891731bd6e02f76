"""The production layout synthesized: `cdk synth GptOss8k1kStack -c decode_instances=8`."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from clusterspec.loading import load_config
from node_render.limits import estimate
from node_render.render import render_cluster
from node_render.userdata import node_files_in, node_software, parse_user_data, user_data
from tests.conftest import Synth
from tests.stacks.template import ingress_rules, normalized, of_type, one


def _user_data(res: dict[str, Any]) -> str:
    """A node's launch template's user data, each token as <signal>, <cache> or <bucket>."""
    joined = res["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]
    parts = joined["Fn::Join"][1] if isinstance(joined, dict) else [joined]
    return "".join(
        p
        if isinstance(p, str)
        else "<" + ("signal" if "Ready" in p["Ref"] else "cache") + ">" if "Ref" in p else "<bucket>"
        for p in parts
    )


def test_eleven_node_identities_three_prefill_eight_decode(fleet_synth: Synth) -> None:
    holders = of_type(fleet_synth.template, "AWS::AutoScaling::AutoScalingGroup")
    roles = sorted({t["Key"]: t["Value"] for t in v["Properties"]["Tags"]}["gptoss:role"] for v in holders.values())
    assert roles == ["decode"] * 8 + ["prefill"] * 3


def test_each_full_prefill_instance_runs_sixteen_replicas(fleet_synth: Synth) -> None:
    software = fleet_synth.software()
    for lid, res in of_type(fleet_synth.template, "AWS::EC2::LaunchTemplate").items():
        node = next(t["Value"] for t in res["Properties"]["LaunchTemplateData"]["TagSpecifications"][0]["Tags"] if t["Key"] == "gptoss:node")
        files = node_files_in(software, node)
        target = files.get("/etc/systemd/system/gptoss-prefill.target")
        if lid.startswith("Prefill"):
            assert target is not None
            wants = re.search(r"^Wants=(.*)$", target[0], re.M).group(1).split()  # type: ignore[union-attr]
            assert wants == [f"gptoss-prefill@{i}.service" for i in range(16)]
            assert sorted(p for p in files if re.search(r"prefill@\d+\.env$", p)) == sorted(
                f"/etc/gptoss/prefill@{i}.env" for i in range(16)
            )
        else:
            assert target is None and "/etc/systemd/system/gptoss-decode.service" in files
            assert "/etc/systemd/system/gptoss-proxy.service" in files, "each decode node runs its own proxy"


def test_security_group_covers_all_sixteen_replicas(fleet_synth: Synth) -> None:
    rules = {r for r in ingress_rules(fleet_synth.template) if r[3] == "self"}
    assert ("tcp", 8100, 8115, "self") in rules
    assert {("tcp", 5559 + 100 * i, 5562 + 100 * i, "self") for i in range(16)} <= rules
    assert ("tcp", 8759, 8886, "self") in rules


def test_one_internal_endpoint_over_every_proxy(fleet_synth: Synth) -> None:
    t = fleet_synth.template
    lb_id, lb = one(t, "AWS::ElasticLoadBalancingV2::LoadBalancer")
    assert lb["Properties"]["Scheme"] == "internal" and lb["Properties"]["Type"] == "network"
    _, listener = one(t, "AWS::ElasticLoadBalancingV2::Listener")
    assert listener["Properties"]["Port"] == 8000
    # The router may take 1,800 s on one request (request_timeout_s): the NLB must not cut it at its 350 s default.
    assert listener["Properties"]["ListenerAttributes"] == [{"Key": "tcp.idle_timeout.seconds", "Value": "1830"}]
    _, tg = one(t, "AWS::ElasticLoadBalancingV2::TargetGroup")
    p = tg["Properties"]
    # The check is the router's readiness (one prefill and one decode server answer), on its own port.
    assert (p["HealthCheckProtocol"], p["HealthCheckPort"], p["HealthCheckPath"], p["Port"]) == ("HTTP", "8000", "/readiness", 8000)
    attrs = {a["Key"]: a["Value"] for a in p["TargetGroupAttributes"]}
    assert attrs["preserve_client_ip.enabled"] == "false", "the port forward from a proxy node would hairpin"
    # A router going lame-duck before a restart answers /readiness 503: its target turns unhealthy, and its open
    # connections must drain (not be reset, the NLB's default) for the request timeout, as on a deregistration.
    assert attrs["target_health_state.unhealthy.connection_termination.enabled"] == "false"
    assert attrs["target_health_state.unhealthy.draining_interval_seconds"] == "1800"
    assert attrs["deregistration_delay.timeout_seconds"] == "1800"
    rules = ingress_rules(t)
    lb_groups = {r[3] for r in rules if "ProxyEndpointGroup" in r[3]}
    assert {(r[1], r[2]) for r in rules if r[3] in lb_groups} == {(8000, 8000)}
    assert "Targets" not in p, "no fixed instance: each proxy node's group registers its current one"
    tg_id = next(iter(of_type(t, "AWS::ElasticLoadBalancingV2::TargetGroup")))
    registered = sorted(lid for lid, g in of_type(t, "AWS::AutoScaling::AutoScalingGroup").items() if {"Ref": tg_id} in g["Properties"].get("TargetGroupARNs", []))
    assert len(registered) == 8 and all(x.startswith("Decode") for x in registered), registered
    out = t["Outputs"]
    assert lb_id in json.dumps(out["ProxyUrl"]) and lb_id in json.dumps(out["ProxyPortForward"])
    assert "AWS-StartPortForwardingSessionToRemoteHost" in json.dumps(out["ProxyPortForward"])


def test_every_node_runs_what_the_plan_shows(fleet_synth: Synth) -> None:
    renders = {r.node.logical_id: r for r in render_cluster(load_config({"decode_instances": "8"}))}
    software = fleet_synth.software()
    # The version every node reads at boot: the asset the stack ships, by its key and its sha256.
    (param,) = [p["Properties"] for p in fleet_synth.resources("AWS::SSM::Parameter").values() if p["Properties"]["Name"].endswith("/software")]
    assert param["Name"] == "/gptoss/gptoss-8k1k/software"
    uri_parts, sha = param["Value"]["Fn::Join"][1][0]["Fn::Join"][1], param["Value"]["Fn::Join"][1][1]
    assert sha == hashlib.sha256(software).hexdigest() and uri_parts[-1].endswith(".xz") and uri_parts[0] == "s3://"
    for lid, res in of_type(fleet_synth.template, "AWS::EC2::LaunchTemplate").items():
        r = next(v for k, v in renders.items() if lid.startswith(k + "Template"))
        text = _user_data(res)
        assert "GPTOSS_SCRIPTS_" not in text and "GPTOSS_SIGNAL_URL=<signal>" in text
        # The router's wheel is software (router.env, in the asset): no node's user data names it, so a new wheel
        # changes no launch template.
        assert "GPTOSS_ROUTER" not in text and ".whl" not in text
        # The node asks CloudFormation about its own deploy gate (was it answered?) by this id: its own wait condition.
        gate = re.search(r"'GPTOSS_GATE=(\w+)'", text).group(1)  # type: ignore[union-attr]
        assert gate.startswith(f"{r.node.logical_id}Ready") and fleet_synth.template["Resources"][gate]["Type"] == "AWS::CloudFormation::WaitCondition"
        assert text == user_data(r, software_parameter="/gptoss/gptoss-8k1k/software", signal_url="<signal>", gate_id=gate,
                                 compile_cache_uri="s3://<cache>")  # fmt: skip
        # Everything else the node runs is in the software asset, exactly as the plan renders it.
        assert node_files_in(software, r.node.name) == node_software(r), r.node.name
        assert set(r.files) == set(node_software(r)) | set(parse_user_data(text)[0]), "each file in the user data or the asset"


def test_config_file_gives_the_same_stack_as_context(fleet_synth: Synth, synth_variant: Any, tmp_path: Path) -> None:
    f = tmp_path / "production.yaml"
    f.write_text("decode_instances: 8\n")
    from_file = synth_variant(config=str(f))
    assert normalized(from_file)["Resources"] == normalized(fleet_synth.template)["Resources"]


def test_size_estimate_is_conservative_and_close_for_the_stack_and_every_cell(default_synth: Synth, fleet_synth: Synth) -> None:
    for s, ctx in ((default_synth, {}), (fleet_synth, {"decode_instances": "8"})):
        e = estimate(load_config(ctx))
        actual = s.template_path.stat().st_size
        assert actual <= e.template_bytes <= actual * 1.25, ("parent", actual, e.template_bytes)
        assert len(s.parent["Resources"]) <= e.resources
        assert len(s.parent["Outputs"]) == e.outputs
        by_cell = {c.name: c for c in (*e.cells, *e.alarm_cells)}
        assert len(s.nested_paths) == len(by_cell) and len(e.alarm_cells) == len(e.cells), "each cell and its NodeSilent alarms"
        for lid, path in s.nested_paths.items():
            cell = by_cell[next(name for name in by_cell if lid.startswith(f"{name}NestedStack"))]
            actual = path.stat().st_size
            assert actual <= cell.template_bytes <= actual * 1.2, (cell.name, actual, cell.template_bytes)
            assert len(json.loads(path.read_text())["Resources"]) <= cell.resources + 1  # and CDK's metadata resource


def test_a_capacity_blocks_end_pages_the_alarm_topic_before_ec2_reclaims_it_and_on_demand_has_no_such_alarm(synth_variant: Any) -> None:
    """capacity.type=capacity-block: one alarm per notify_hours_before (24 h and 2 h by default) on the lowest
    CapacityBlockHoursLeft any node publishes, to the alarm topic; the nodes may read the block's end date.
    On-Demand: neither."""
    block = synth_variant(**{"config": "examples/production-3p8d.yaml", "capacity.type": "capacity-block",
                             "capacity.reservation_id": "cr-0123456789abcdef0"})  # fmt: skip
    alarms = {a["Properties"]["AlarmName"]: a["Properties"] for a in of_type(block, "AWS::CloudWatch::Alarm").values()}
    ends = {k: v for k, v in alarms.items() if "BlockEnds" in k}
    assert sorted(ends) == ["gptoss-prod-BlockEnds24h", "gptoss-prod-BlockEnds2h"], sorted(alarms)
    for name, hours in (("gptoss-prod-BlockEnds24h", 24), ("gptoss-prod-BlockEnds2h", 2)):
        a = ends[name]
        assert (a["MetricName"], a["Statistic"], a["ComparisonOperator"], a["Threshold"], a["TreatMissingData"]) == (
            "CapacityBlockHoursLeft", "Minimum", "LessThanThreshold", hours, "notBreaching")  # fmt: skip
        assert a["AlarmActions"], "the alarm topic hears it"
    assert "CapacityBlockHoursLeft" in json.dumps(of_type(block, "AWS::CloudWatch::Dashboard")), "the dashboard shows the block's clock"
    policies = json.dumps([p for p in of_type(block, "AWS::IAM::Policy").values()])
    assert "ec2:DescribeCapacityReservations" in policies
    on_demand = synth_variant(config="examples/production-3p8d.yaml")
    assert not [a for a in of_type(on_demand, "AWS::CloudWatch::Alarm").values() if "BlockEnds" in a["Properties"]["AlarmName"]]
    assert "ec2:DescribeCapacityReservations" not in json.dumps(list(of_type(on_demand, "AWS::IAM::Policy").values()))
