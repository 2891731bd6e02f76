"""`gptoss status` and `wait-ready`: every unit of every node over SSM, each identity's instance and its
replacements, a summary naming the first thing to look at."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Any

import boto3
from botocore.stub import Stubber

from cluster_ops.status import collect, software_lines, wait_ready
from clusterspec.loading import load_config
from tests.cluster_ops.ops_helpers import (
    REGION,
    launch,
    node_report,
    stub_fleet,
)


def test_status_reports_every_unit_of_every_node(aws: None, tmp_path: Path, health_server: str) -> None:
    cfg = load_config({})
    ids = launch(cfg)
    ssm, stub = stub_fleet([[
        (ids["prefill-0"], node_report(cfg, "prefill-0", tmp_path, health_server, down={"gptoss-prefill@3.service"})),
        (ids["decode-0"], node_report(cfg, "decode-0", tmp_path, health_server)),
    ]])  # fmt: skip
    answered: list[str] = []
    status = collect(cfg, boto3.client("ec2", region_name=REGION), ssm, sleep=lambda s: None,
                     on_node=lambda node, st: answered.append(f"{node}:{st}"))  # fmt: skip
    assert answered == ["prefill-0:Success", "decode-0:Success"]
    stub.assert_no_pending_responses()
    # prefill-0: 5 boot units, 6 replicas, the proxy, its group health, the members' and the health watch's
    # timers, telemetry; decode-0: 5 boot units, the server, the health watch's timer, telemetry.
    assert len(status.units) == 16 + 8
    assert not status.ready
    assert status.failing == ["prefill-0: gptoss-prefill@3.service: retrying (restart 2) - last log: last line of gptoss-prefill@3.service"]


def test_status_shows_the_software_version_each_node_runs_and_a_change_in_progress(aws: None, tmp_path: Path, health_server: str) -> None:
    """rollout.software=in-place: decode-0 took the new version and restarts its server now (gptoss-apply); prefill-0
    still runs the previous one. Both said, from what each node's own gptoss-status printed."""
    cfg = load_config({})
    ids = launch(cfg)
    old, new = "a" * 64, "b" * 64
    ssm, _ = stub_fleet([[
        (ids["prefill-0"], node_report(cfg, "prefill-0", tmp_path, health_server, software=old)),
        (ids["decode-0"], node_report(cfg, "decode-0", tmp_path, health_server, software=new, applying=True)),
    ]])  # fmt: skip
    status = collect(cfg, boto3.client("ec2", region_name=REGION), ssm, sleep=lambda s: None)
    assert status.software == {"prefill-0": (old, False), "decode-0": (new, True)}
    assert software_lines(status) == [
        "software: decode-0 runs bbbbbbbbbbbb; prefill-0 runs aaaaaaaaaaaa (two versions: a change in progress, or a node that did not take the last one)",
        "software change in progress on decode-0: gptoss-apply restarts its changed units, and the node rejoins once it serves",
    ]


def test_wait_ready_returns_when_every_server_answers(aws: None, tmp_path: Path, health_server: str) -> None:
    cfg = load_config({})
    ids = launch(cfg)
    p_down = node_report(cfg, "prefill-0", tmp_path, health_server, down={"gptoss-proxy.service"})
    p_up = node_report(cfg, "prefill-0", tmp_path, health_server)
    d_up = node_report(cfg, "decode-0", tmp_path, health_server)
    ssm, stub = stub_fleet([[(ids["prefill-0"], p_down), (ids["decode-0"], d_up)], [(ids["prefill-0"], p_up), (ids["decode-0"], d_up)]])
    polls: list[float] = []
    now = [0.0]
    status = wait_ready(cfg, boto3.client("ec2", region_name=REGION), ssm, timeout_s=600, interval_s=60,
                        on_poll=lambda s, t: polls.append(t), sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])  # fmt: skip
    stub.assert_no_pending_responses()
    assert status.ready and polls == [0.0, 60.0]


def test_wait_ready_times_out_naming_missing_nodes_and_failing_units(aws: None, tmp_path: Path, health_server: str) -> None:
    cfg = load_config({})
    ids = launch(cfg, names=["prefill-0"])
    down = {"gptoss-prefill@0.service", "gptoss-proxy.service"}
    report = node_report(cfg, "prefill-0", tmp_path, health_server, down=down)
    ssm, _ = stub_fleet([[(ids["prefill-0"], report)]] * 3)
    now = [0.0]
    status = wait_ready(cfg, boto3.client("ec2", region_name=REGION), ssm, timeout_s=120, interval_s=60,
                        sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])  # fmt: skip
    assert not status.ready
    assert status.failing == [
        "decode-0: no running instance",
        "prefill-0: gptoss-prefill@0.service: retrying (restart 2) - last log: last line of gptoss-prefill@0.service",
        "prefill-0: gptoss-proxy.service: retrying (restart 2) - last log: last line of gptoss-proxy.service",
    ]


def test_status_shows_each_identitys_instance_its_replacements_and_why(aws: None, tmp_path: Path, health_server: str) -> None:
    """The group's activities (EC2 Auto Scaling keeps six weeks) count the health-check replacements; the
    node's own reason comes from its health watch's log stream, which outlives the instance."""

    from cluster_ops.status import identities

    cfg = load_config({})
    ids = launch(cfg)
    autoscaling = boto3.client("autoscaling", region_name=REGION)
    stub = Stubber(autoscaling)
    replaced = {"ActivityId": "a1", "AutoScalingGroupName": "gptoss-8k1k-prefill-0", "StatusCode": "Successful", "Progress": 100,
                "StartTime": dt.datetime(2026, 11, 30, 10, 0, tzinfo=dt.UTC), "Description": "Terminating EC2 instance: i-0aaaaaaaaaaaaaaaa",
                "Cause": "At 2026-11-30T10:00:00Z an instance was taken out of service in response to a user health-check."}  # fmt: skip
    impaired = replaced | {"ActivityId": "a2", "StartTime": dt.datetime(2026, 11, 29, 8, 0, tzinfo=dt.UTC), "Description": "Terminating EC2 instance: i-0bbbbbbbbbbbbbbbb",
                           "Cause": "At 2026-11-29T08:00:00Z an instance was taken out of service in response to an EC2 instance status checks failure."}  # fmt: skip
    rolling = replaced | {"ActivityId": "a3", "StartTime": dt.datetime(2026, 11, 28, 8, 0, tzinfo=dt.UTC), "Description": "Terminating EC2 instance: i-0ccccccccccccccccc",
                          "Cause": "At 2026-11-28T08:00:00Z a user request update of AutoScalingGroup constraints to min: 1, max: 1, desired: 1 changing the desired capacity from 1 to 1. At 2026-11-28T08:00:05Z an instance was taken out of service in response to a difference between desired and actual capacity, shrinking the capacity from 1 to 0."}  # fmt: skip
    no_room = {"ActivityId": "d1", "AutoScalingGroupName": "gptoss-8k1k-decode-0", "StatusCode": "Failed", "Progress": 100,
               "StartTime": dt.datetime(2026, 11, 30, 11, 0, tzinfo=dt.UTC), "Description": "Launching a new EC2 instance.  Status Reason: ...",
               "Cause": "At 2026-11-30T11:00:00Z an instance was started in response to a difference between desired and actual capacity.",
               "StatusMessage": "We currently do not have sufficient trn3.48xlarge capacity in the Availability Zone you requested (us-east-2a)."}  # fmt: skip
    stub.add_response("describe_scaling_activities", {"Activities": [replaced, impaired, rolling]}, {"AutoScalingGroupName": "gptoss-8k1k-prefill-0"})
    stub.add_response("describe_scaling_activities", {"Activities": [no_room]}, {"AutoScalingGroupName": "gptoss-8k1k-decode-0"})
    logs = boto3.client("logs", region_name=REGION)
    logs.create_log_group(logGroupName="/gptoss/gptoss-8k1k")
    # The node's journal stream as its collector ships it (each line after its unit's name): an older report, the
    # last one, then other units' lines after it (the status reads the watch's last word, not the stream's last line).
    logs.create_log_stream(logGroupName="/gptoss/gptoss-8k1k", logStreamName="prefill-0/journal")
    now = int(time.time() * 1000)
    logs.put_log_events(logGroupName="/gptoss/gptoss-8k1k", logStreamName="prefill-0/journal", logEvents=[
        {"timestamp": now - 3000, "message": "gptoss-health-watch.service: gptoss-health-watch: marked i-0bbbbbbbbbbbbbbbb (prefill-0) unhealthy: "
                                             "an older report"},
        {"timestamp": now - 2000, "message": "gptoss-health-watch.service: gptoss-health-watch: marked i-0aaaaaaaaaaaaaaaa (prefill-0) unhealthy: "
                                             "gptoss-node-check.service failed: gptoss-node-check: Neuron: 15 devices in /dev, the instance table says 16 (neuron_devices); "
                                             "its group replaces it with an instance of the same identity"},
        {"timestamp": now - 1000, "message": "gptoss-decode.service: a server's line that mentions unhealthy: not the watch's"},
        {"timestamp": now, "message": "init.scope: Stopping gptoss-decode.service..."}])  # fmt: skip
    from cluster_ops.remote import find_nodes

    with stub:
        got = {i.node: i for i in identities(cfg, find_nodes(boto3.client("ec2", region_name=REGION), cfg.cluster_name), autoscaling, logs)}
    stub.assert_no_pending_responses()
    assert got["prefill-0"].instance_id == ids["prefill-0"] and got["prefill-0"].replaced == 2, "the rolling update of a redeploy is not a failure"
    assert got["prefill-0"].last_cause.endswith("in response to a user health-check.") and got["prefill-0"].last_at == "2026-11-30 10:00 UTC"
    assert got["prefill-0"].reported.startswith("gptoss-node-check.service failed: gptoss-node-check: Neuron: 15 devices")
    assert (got["decode-0"].replaced, got["decode-0"].last_cause) == (0, no_room["StatusMessage"])


def test_a_node_of_an_earlier_release_is_read_from_its_health_watchs_own_stream(aws: None) -> None:
    """Before the collector shipped a node's journal to one stream, each unit had its own: a replacement that happened then
    still shows the node's reason; a node that left no word shows none."""
    from cluster_ops.status import _self_report

    cfg = load_config({})
    logs = boto3.client("logs", region_name=REGION)
    logs.create_log_group(logGroupName="/gptoss/gptoss-8k1k")
    assert _self_report(cfg, logs, "decode-0") == ""
    logs.create_log_stream(logGroupName="/gptoss/gptoss-8k1k", logStreamName="decode-0/gptoss-health-watch.service")
    logs.put_log_events(logGroupName="/gptoss/gptoss-8k1k", logStreamName="decode-0/gptoss-health-watch.service", logEvents=[
        {"timestamp": int(time.time() * 1000), "message": "gptoss-health-watch: marked i-0dddddddddddddddd (decode-0) unhealthy: "
                                                          "gptoss-decode.service failed"}])  # fmt: skip
    assert _self_report(cfg, logs, "decode-0") == "gptoss-decode.service failed"


def test_status_names_each_nodes_instance_and_address_and_a_surges_replacement_beside_the_old_one(aws: None) -> None:
    """During a surge a node has two instances: status and the commands that act on a node take the
    old one, which serves and holds the name until its group lets it go, and show the replacement
    beside it; the address is the one a client in the VPC connects to again after a replacement."""
    from rich.console import Console

    from cluster_ops.commands.status import identity_table
    from cluster_ops.remote import find_nodes
    from cluster_ops.status import ClusterStatus, identities

    cfg = load_config({})
    ids = launch(cfg)
    ec2 = boto3.client("ec2", region_name=REGION)
    # moto's LaunchTime has whole seconds: the replacement launches in a later second than the old one, as on EC2.
    first = max(i["LaunchTime"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"])
    while dt.datetime.now(dt.UTC).replace(microsecond=0) <= first:
        time.sleep(0.05)
    new = launch(cfg, ["prefill-0"])["prefill-0"]
    ip = {i["InstanceId"]: i["PrivateIpAddress"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]}

    def table(client: Any) -> str:
        console = Console(width=250, record=True)
        console.print(identity_table(cfg, ClusterStatus(identities=identities(cfg, find_nodes(client, cfg.cluster_name), None))))
        return console.export_text()

    rows = table(ec2)
    assert f"prefill-0 │ {ids['prefill-0']} (running, {ip[ids['prefill-0']]}); its replacement beside it: {new} │" in rows
    assert f"decode-0  │ {ids['decode-0']} (running, {ip[ids['decode-0']]}) " in rows
    ec2.terminate_instances(InstanceIds=[ids["prefill-0"]])
    assert f"prefill-0 │ {new} (running, {ip[new]}) " in table(ec2)

    # EC2 promises no order: listed newest first, the old instance is still the node's.
    listed = [("i-0newer00000000001", dt.datetime(2026, 12, 4, 10, 30, tzinfo=dt.UTC)), ("i-0older00000000001", dt.datetime(2026, 12, 4, 9, 0, tzinfo=dt.UTC))]
    tags = [{"Key": "gptoss:cluster", "Value": cfg.cluster_name}, {"Key": "gptoss:node", "Value": "prefill-0"}, {"Key": "gptoss:role", "Value": "prefill"}]
    stubbed = boto3.client("ec2", region_name=REGION)
    with Stubber(stubbed) as stub:
        stub.add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": i, "LaunchTime": at, "State": {"Name": "running", "Code": 16},
                                                                                  "PrivateIpAddress": "10.0.0.9", "Tags": tags}]} for i, at in listed]})  # fmt: skip
        got = find_nodes(stubbed, cfg.cluster_name)
    assert (got["prefill-0"].instance_id, got["prefill-0"].newer) == ("i-0older00000000001", ("i-0newer00000000001",))


def test_destroy_counts_a_surges_replacement_among_the_instances_it_terminates(aws: None) -> None:
    from cluster_ops.commands.destroy import what_goes

    cfg = load_config({})
    launch(cfg)
    launch(cfg, ["prefill-0"])  # launched beside the old one
    assert what_goes(cfg).endswith("; running now: 3 instances tagged gptoss:cluster=gptoss-8k1k")


# ---- status ends with a summary and the likeliest cause ---------------------------------------


def test_status_summary_names_the_first_thing_to_look_at() -> None:
    from cluster_ops.status import ClusterStatus, UnitStatus, summary

    def unit(node: str, name: str, state: str = "active", healthy: bool | None = True, **kw: Any) -> UnitStatus:
        return UnitStatus(node, name, state, healthy, healthy is not None, **kw)

    ready = ClusterStatus(units=[unit("prefill-0", "gptoss-prefill@0.service"), unit("decode-0", "gptoss-decode.service")])
    assert summary(ready) == ["ready: 2/2 units ready, 2/2 nodes serving"]
    failed = ClusterStatus(units=[unit("prefill-0", "gptoss-prefill@0.service"),
                                  unit("decode-0", "gptoss-node-check.service", "failed", None, last_log="Neuron: 15 devices in /dev"),
                                  unit("decode-0", "gptoss-decode.service", "inactive", False)])  # fmt: skip
    head, cause = summary(failed)
    assert head == "not ready: 1/3 units ready, 1/2 nodes serving"
    assert cause == "likely cause: decode-0: gptoss-node-check.service NOT RUNNING (failed): it should run - last log: Neuron: 15 devices in /dev"
    gone = ClusterStatus(units=[unit("prefill-0", "gptoss-prefill@0.service")], missing_nodes=["decode-0"])
    assert summary(gone)[1].startswith("likely cause: decode-0: no running instance. Its group launches a replacement, or cannot")
    silent = ClusterStatus(units=[unit("prefill-0", "gptoss-stage.service", "missing", None)],
                           no_report={"prefill-0": "it ran gptoss-status and printed nothing"})  # fmt: skip
    assert "its scripts are not installed yet" in summary(silent)[1]
    assert "(AWS_ENDPOINT_URL) runs no command on an instance" in summary(silent, "http://localhost:5005")[1]
    unreachable = ClusterStatus(units=[unit("prefill-0", "gptoss-stage.service", "unreachable", None)],
                                no_report={"prefill-0": "SSM Run Command Undeliverable"})  # fmt: skip
    assert summary(unreachable)[1].startswith("likely cause: prefill-0: the SSM agent did not answer (SSM Run Command Undeliverable)")
    compiling = ClusterStatus(units=[unit("prefill-0", "gptoss-prefill@0.service", "active", False, phase="compiling (42 min)")])
    assert summary(compiling)[1] == ("likely cause: prefill-0: gptoss-prefill@0.service: compiling (42 min); servers that compile take long "
                                     "at first boot (gptoss wait-ready waits, up to 6 h)")  # fmt: skip
