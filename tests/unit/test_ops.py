"""Operator commands against moto (EC2, SSM parameters) and botocore's Stubber where moto has no API."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber
from moto import mock_aws

from cluster_ops import bench, preflight
from cluster_ops.status import collect, wait_ready
from clusterspec.config import ClusterConfig
from clusterspec.loading import load_config
from node_render.node_health import health_file
from node_render.paths import USERDATA_DIR
from node_render.render import render_cluster

REGION = "us-east-2"
TRN2 = {"instance_type": "trn2.48xlarge", "serving": {"shape": {"quantization": "bf16"}}, "ami_ssm_parameter": "/test/dlami"}


class Session:
    """A boto3 session stand-in that hands out the given clients (moto-backed or stubbed)."""

    def __init__(self, **clients: Any) -> None:
        self.clients = clients

    def client(self, name: str, region_name: str | None = None) -> Any:
        return self.clients[name] if name in self.clients else boto3.client(name, region_name=region_name or REGION)


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)  # for this test only: nothing leaks into the next one
    with mock_aws():
        yield


def quotas(value: float, name: str = "Running On-Demand Trn instances") -> Any:
    client = boto3.client("service-quotas", region_name=REGION)
    stub = Stubber(client)
    stub.add_response(
        "list_service_quotas",
        {"Quotas": [{"QuotaName": name, "QuotaCode": "L-2C3B7624", "Value": value, "ServiceCode": "ec2"}]},
        {"ServiceCode": "ec2"},
    )
    stub.activate()
    return client


def groups(used: int = 12, most: int = 500, existing: list[str] | None = None, names: list[str] | None = None) -> Any:
    """Auto Scaling's account limits and the fleet's existing groups (Stubber: moto has no DescribeAccountLimits)."""
    client = boto3.client("autoscaling", region_name=REGION)
    stub = Stubber(client)
    stub.add_response("describe_account_limits", {"MaxNumberOfAutoScalingGroups": most, "NumberOfAutoScalingGroups": used,
                                                  "MaxNumberOfLaunchConfigurations": 200, "NumberOfLaunchConfigurations": 0})  # fmt: skip
    names = names or ["gptoss-8k1k-prefill-0", "gptoss-8k1k-decode-0"]
    for i in range(0, len(names), 50):
        chunk = names[i : i + 50]
        found = [{"AutoScalingGroupName": n, "MinSize": 1, "MaxSize": 2, "DesiredCapacity": 1, "DefaultCooldown": 300, "AvailabilityZones": ["us-east-2a"],
                  "HealthCheckType": "EC2", "CreatedTime": dt.datetime(2026, 12, 1, tzinfo=dt.UTC)} for n in chunk if n in (existing or [])]  # fmt: skip
        stub.add_response("describe_auto_scaling_groups", {"AutoScalingGroups": found}, {"AutoScalingGroupNames": chunk, "MaxRecords": 50})
    stub.activate()
    return client


def _session(quota: float = 768, **extra: Any) -> Session:
    ec2 = extra.pop("ec2", boto3.client("ec2", region_name=REGION))
    autoscaling = extra.pop("autoscaling", groups())
    return Session(ec2=ec2, ssm=boto3.client("ssm", region_name=REGION), autoscaling=autoscaling, **{"service-quotas": quotas(quota)}, **extra)


def by_name(checks: list[preflight.Check]) -> dict[str, preflight.Check]:
    return {c.name: c for c in checks}


# ---- preflight ---------------------------------------------------------------------------


def test_preflight_passes_when_the_account_matches(aws: None) -> None:
    boto3.client("ssm", region_name=REGION).put_parameter(Name="/test/dlami", Value="ami-12345678", Type="String")
    checks = preflight.run(load_config(TRN2), _session())
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert {"instance type offered", "network_cards", "efa_interfaces", "nvme_disks", "nvme_disk_gb", "vcpus", "Neuron DLAMI", "vCPU quota",
            "Auto Scaling groups"} == set(by_name(checks))  # fmt: skip


def test_preflight_names_the_table_value_to_set_on_a_mismatch(aws: None) -> None:
    boto3.client("ssm", region_name=REGION).put_parameter(Name="/test/dlami", Value="ami-12345678", Type="String")
    cfg = load_config(TRN2 | {"instance_overrides": {"network_cards": 8, "efa_interfaces": 8}})
    c = by_name(preflight.run(cfg, _session()))["network_cards"]
    assert not c.ok
    assert c.detail == "AWS reports 16, the stack table says 8"
    assert c.fix.startswith("set instance_overrides.network_cards=16")


def test_preflight_fails_for_an_unknown_type_a_missing_dlami_and_a_small_quota(aws: None) -> None:
    checks = by_name(preflight.run(load_config({}), _session(quota=192)))
    assert not checks["instance type offered"].ok and "trn3.48xlarge is not offered in us-east-2a" in checks["instance type offered"].detail
    assert not checks["hardware table"].ok
    dlami = checks["Neuron DLAMI"]
    assert not dlami.ok and "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id not found" in dlami.detail
    quota = checks["vCPU quota"]
    assert not quota.ok and quota.detail == (
        "Running On-Demand Trn instances: 192 vCPUs < 768 for 2 x trn3.48xlarge and 2 more while a change surges (1 decode, 1 prefill: "
        "each batch's replacements and the old instances still draining)"
    )


def test_the_vcpu_quota_counts_what_a_surge_runs_beside_the_fleet(aws: None) -> None:
    """3 + 8 on On-Demand surges one node of each role at a time, and the previous batch's old instance drains
    while the next batch launches: 11 + 2 + 2 = 15 instances of 192 vCPUs. Without surge: the fleet alone."""
    cfg = load_config({"decode_instances": "8"})
    short = preflight.check_quota(cfg, quotas(11 * 192))
    assert not short.ok and short.detail == (
        "Running On-Demand Trn instances: 2112 vCPUs < 2880 for 11 x trn3.48xlarge and 4 more while a change surges (2 decode, 2 prefill: "
        "each batch's replacements and the old instances still draining)"
    )
    assert short.fix == "request 2880 vCPUs (quota code L-2C3B7624) or lower decode_instances (or deploy changes with rollout.surge=off, which needs no instance beyond the fleet)"
    assert preflight.check_quota(cfg, quotas(2880)).ok
    # max_surge 4: decode 4 at once and 4 draining into the second batch; prefill's 3 all at once (one batch, nothing drains into another).
    wide = load_config({"decode_instances": "8", "rollout.max_surge": "4"})
    assert preflight.check_quota(wide, quotas(2880)).detail.endswith("for 11 x trn3.48xlarge and 11 more while a change surges (8 decode, 3 prefill: "
                                                                     "each batch's replacements and the old instances still draining)")  # fmt: skip
    off = preflight.check_quota(load_config({"decode_instances": "8", "rollout.surge": "off"}), quotas(11 * 192))
    assert off.ok and off.detail == "Running On-Demand Trn instances: 2112 vCPUs >= 2112 for 11 x trn3.48xlarge"


def test_the_auto_scaling_group_quota_holds_the_fleets_groups_beside_the_accounts_others() -> None:
    """One group per node: 200 decode instances are 275 groups; with 300 of the region's 500 in use, they do not fit.
    A fleet's own groups that exist already (a redeploy) are not counted twice."""
    big = load_config({"decode_instances": "200"})
    names = [f"gptoss-8k1k-{n.name}" for n in big.layout.nodes]
    refused = preflight.check_groups(big, groups(used=300, names=names))
    assert not refused.ok and refused.detail == "300 of 500 Auto Scaling groups in us-east-2 used; the fleet adds 275 (one per node, 0 exist)"
    assert refused.fix.startswith("request a quota of at least 575 Auto Scaling groups per region")
    redeploy = preflight.check_groups(big, groups(used=300, names=names, existing=names[:100]))
    assert redeploy.ok and redeploy.detail.endswith("the fleet adds 175 (one per node, 100 exist)")


def test_preflight_without_egress_names_the_regions_s3_prefix_list_and_refuses_another(aws: None) -> None:
    boto3.client("ssm", region_name=REGION).put_parameter(Name="/test/dlami", Value="ami-12345678", Type="String")
    # What AWS (moto) says the region's S3 prefix list is: the value preflight must name.
    (pl,) = [p["PrefixListId"] for p in boto3.client("ec2", region_name=REGION).describe_managed_prefix_lists()["PrefixLists"]
             if p["PrefixListName"] == f"com.amazonaws.{REGION}.s3"]  # fmt: skip
    s3 = {"model": {"source": "s3", "s3_uri": "s3://models-bucket/gpt-oss-120b"}, "examples": {"s3_uri": "s3://models-bucket/vllm-neuron"}}
    open_ = by_name(preflight.run(load_config(TRN2 | s3 | {"network": {"egress": "none"}}), _session()))["S3 prefix list"]
    assert open_.ok and open_.warn and open_.fix == f"set network.s3_prefix_list_id={pl} to narrow it to S3"
    named = by_name(preflight.run(load_config(TRN2 | s3 | {"network": {"egress": "none", "s3_prefix_list_id": pl}}), _session()))["S3 prefix list"]
    assert named.ok and not named.warn and named.detail == f"HTTPS egress reaches com.amazonaws.{REGION}.s3 ({pl}) alone"
    other = by_name(preflight.run(load_config(TRN2 | s3 | {"network": {"egress": "none", "s3_prefix_list_id": "pl-0000000a"}}), _session()))["S3 prefix list"]
    assert not other.ok and other.fix == f"set network.s3_prefix_list_id={pl}"
    assert "S3 prefix list" not in by_name(preflight.run(load_config(TRN2), _session())), "with NAT egress HTTPS goes anywhere by design"


def _load_cli() -> Any:
    from cluster_ops import cli

    return cli


def _common() -> Any:
    from cluster_ops import common

    return common


def test_preflight_command_prints_a_table_and_exits_non_zero_on_failure(aws: None, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    cli, common = _load_cli(), _common()
    monkeypatch.setattr(common, "session", lambda cfg: _session(quota=100))
    code = cli.main(["preflight", "--width", "250", "-c", "instance_type=trn2.48xlarge", "-c", 'serving={"shape": {"quantization": "bf16"}}'])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "vCPU quota" in out and "pass" in out


# ---- status and wait-ready ---------------------------------------------------------------


def launch(cfg: ClusterConfig, names: list[str] | None = None) -> dict[str, str]:
    """Run moto instances tagged as the stack tags them; node name -> instance id."""
    ec2 = boto3.client("ec2", region_name=REGION)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    out = {}
    for node in cfg.layout.nodes:
        if names is not None and node.name not in names:
            continue
        tags = [{"Key": "gptoss:cluster", "Value": cfg.cluster_name}, {"Key": "gptoss:role", "Value": node.role},
                {"Key": "gptoss:node", "Value": node.name}]  # fmt: skip
        inst = ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])
        out[node.name] = inst["Instances"][0]["InstanceId"]
    return out


def node_report(cfg: ClusterConfig, node: str, tmp_path: Path, server: str, down: frozenset[str] | set[str] = frozenset()) -> str:
    """What gptoss-status prints on a node: the real script, a fake systemctl, local health routes."""
    r = next(r for r in render_cluster(cfg) if r.node.name == node)
    lines = []
    for line in health_file(cfg, r).splitlines():
        unit, url, phase = line.split()
        if url != "-":
            # A unit that is down gets a port nothing listens on.
            url = f"{server if unit not in down else 'http://127.0.0.1:1'}/{url.rsplit('/', 1)[1]}"
        lines.append(f"{unit} {url} {phase}")
    hf = tmp_path / f"{node}.health"
    hf.write_text("\n".join(lines) + "\n")
    env_file = tmp_path / "cluster.env"
    env_file.write_text(f"GPTOSS_NODE={node}\n")
    systemctl = tmp_path / "systemctl"
    systemctl.write_text(
        '#!/usr/bin/env bash\nfor a; do unit=$a; done\n'
        'case " $DOWN " in *" $unit "*) echo ActiveState=activating; echo SubState=auto-restart; echo NRestarts=2;; '
        '*) echo ActiveState=active; echo SubState=running; echo NRestarts=0;; esac\n'
    )
    systemctl.chmod(0o755)
    journalctl = tmp_path / "journalctl"
    journalctl.write_text('#!/usr/bin/env bash\nu=${*: -1}; echo "last line of ${u#_SYSTEMD_UNIT=}"\n')
    journalctl.chmod(0o755)
    res = subprocess.run(
        [str(USERDATA_DIR / "bin" / "gptoss-status")],
        env={
            **os.environ,
            "GPTOSS_HEALTH_FILE": str(hf),
            "GPTOSS_CLUSTER_ENV": str(env_file),
            "GPTOSS_SYSTEMCTL": str(systemctl),
            "GPTOSS_JOURNALCTL": str(journalctl),
            "GPTOSS_RUN_DIR": str(tmp_path / "run"),
            "DOWN": " ".join(down),
        },
        capture_output=True,
        text=True,
        check=True,
    )
    json.loads(res.stdout)  # the script prints valid JSON
    return res.stdout


def stub_ssm(outputs: list[tuple[str, str]]) -> tuple[Any, Stubber]:
    """An SSM client answering one send_command/get_command_invocation pair per (instance, stdout)."""
    ssm = boto3.client("ssm", region_name=REGION)
    stub = Stubber(ssm)
    for i, (iid, out) in enumerate(outputs):
        stub.add_response("send_command", {"Command": {"CommandId": str(uuid.UUID(int=i))}},
                          {"InstanceIds": [iid], "DocumentName": "AWS-RunShellScript", "Parameters": ANY, "TimeoutSeconds": ANY})  # fmt: skip
        stub.add_response("get_command_invocation", {"Status": "Success", "StandardOutputContent": out},
                          {"CommandId": str(uuid.UUID(int=i)), "InstanceId": iid})  # fmt: skip
    stub.activate()
    return ssm, stub


def stub_fleet(
    polls: list[list[tuple[str, str] | tuple[str, str, str]]], command: str = "/opt/gptoss/bin/gptoss-status"
) -> tuple[Any, Stubber]:
    """An SSM client answering, per poll, one send_command to all instances and one invocation each.

    A poll entry is (instance id, stdout) or (instance id, stdout, status); status defaults to Success.
    """
    ssm = boto3.client("ssm", region_name=REGION)
    stub = Stubber(ssm)
    for n, poll in enumerate(polls):
        cmd = str(uuid.UUID(int=1000 + n))
        stub.add_response("send_command", {"Command": {"CommandId": cmd}},
                          {"InstanceIds": [entry[0] for entry in poll], "DocumentName": "AWS-RunShellScript",
                           "Parameters": {"commands": [command]}, "TimeoutSeconds": ANY})  # fmt: skip
        for iid, out, *status in poll:
            stub.add_response("get_command_invocation", {"Status": status[0] if status else "Success", "StandardOutputContent": out},
                              {"CommandId": cmd, "InstanceId": iid})  # fmt: skip
    stub.activate()
    return ssm, stub


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


# ---- bench -------------------------------------------------------------------------------

RESULT = {"median_tpot_ms": 9.8, "p99_tpot_ms": 12.1, "output_throughput": 12000.5, "total_token_throughput": 108000.0,
          "mean_ttft_ms": 850.0, "p99_ttft_ms": 2100.0}  # fmt: skip


def test_bench_starts_the_unit_waits_and_reads_the_metrics(aws: None) -> None:
    cfg = load_config({})
    ids = launch(cfg)
    iid = ids["prefill-0"]
    ssm, stub = stub_ssm([(iid, ""), (iid, "active\n\n"), (iid, "inactive\nsuccess\n"), (iid, json.dumps(RESULT))])
    states: list[str] = []
    metrics = bench.run(cfg, boto3.client("ec2", region_name=REGION), ssm, poll_s=1, sleep=lambda s: None,
                        on_poll=lambda st, t: states.append(st))  # fmt: skip
    stub.assert_no_pending_responses()
    assert metrics == RESULT
    assert states == ["active", "inactive"]


def test_bench_reports_a_failed_run(aws: None) -> None:
    cfg = load_config({})
    iid = launch(cfg)["prefill-0"]
    ssm, _ = stub_ssm([(iid, ""), (iid, "failed\nexit-code\n")])
    with pytest.raises(bench.BenchError, match=r"gptoss-bench\.service ended with exit-code"):
        bench.run(cfg, boto3.client("ec2", region_name=REGION), ssm, poll_s=1, sleep=lambda s: None)


def test_bench_runs_only_on_a_proxy_node(aws: None) -> None:
    with pytest.raises(bench.BenchError, match=r"node='decode-0': the benchmark runs on a proxy node \(prefill-0\)"):
        bench.run(load_config({}), boto3.client("ec2", region_name=REGION), boto3.client("ssm", region_name=REGION), node="decode-0")


def test_wait_ready_command_exits_1_naming_the_failing_units(
    aws: None, tmp_path: Path, health_server: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    cfg = load_config({})
    ids = launch(cfg)
    report_p = node_report(cfg, "prefill-0", tmp_path, health_server)
    report_d = node_report(cfg, "decode-0", tmp_path, health_server, down={"gptoss-decode.service"})
    ssm, _ = stub_fleet([[(ids["prefill-0"], report_p), (ids["decode-0"], report_d)]])
    cli, common = _load_cli(), _common()
    monkeypatch.setattr(common, "session", lambda c: Session(ec2=boto3.client("ec2", region_name=REGION), ssm=ssm))
    code = cli.main(["wait-ready", "--timeout", "0", "--interval", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "not ready after 0s:" in err and "decode-0: gptoss-decode.service: retrying (restart 2)" in err


def test_bench_command_prints_the_key_metrics(aws: None, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    cfg = load_config({})
    iid = launch(cfg)["prefill-0"]
    ssm, _ = stub_ssm([(iid, ""), (iid, "inactive\nsuccess\n"), (iid, json.dumps(RESULT))])
    cli, common = _load_cli(), _common()
    monkeypatch.setattr(common, "session", lambda c: Session(ec2=boto3.client("ec2", region_name=REGION), ssm=ssm))
    monkeypatch.setattr(common, "console", lambda args: __import__("rich.console").console.Console(width=200))
    assert cli.main(["bench", "--interval", "0"]) == 0
    out = capsys.readouterr().out
    for label, value in (("median TPOT (ms)", "9.80"), ("p99 TPOT (ms)", "12.10"), ("output throughput (tok/s)", "12,000.50"),
                         ("total token throughput (tok/s)", "108,000.00"), ("mean TTFT (ms)", "850.00"), ("p99 TTFT (ms)", "2,100.00")):  # fmt: skip
        assert re.search(rf"{re.escape(label)}\s*│\s*{re.escape(value)}", out), (label, out)


def test_run_on_all_batches_fifty_instances_per_command() -> None:
    from cluster_ops.remote import run_on_all

    ids = [f"i-{n:017x}" for n in range(51)]
    ssm = boto3.client("ssm", region_name=REGION)
    stub = Stubber(ssm)
    for batch, n in ((ids[:50], 1), (ids[50:], 2)):
        stub.add_response("send_command", {"Command": {"CommandId": str(uuid.UUID(int=n))}},
                          {"InstanceIds": batch, "DocumentName": "AWS-RunShellScript", "Parameters": ANY, "TimeoutSeconds": ANY})  # fmt: skip
    for i, iid in enumerate(ids):
        stub.add_response("get_command_invocation", {"Status": "Success", "StandardOutputContent": iid},
                          {"CommandId": str(uuid.UUID(int=1 if i < 50 else 2)), "InstanceId": iid})  # fmt: skip
    stub.activate()
    results = run_on_all(ssm, ids, ["true"], sleep=lambda s: None)
    stub.assert_no_pending_responses()
    assert results == {iid: ("Success", iid) for iid in ids}


def test_a_node_whose_command_fails_is_reported_unreachable(aws: None) -> None:
    cfg = load_config({})
    ids = launch(cfg)
    ssm, _ = stub_fleet([[(ids["prefill-0"], "", "Failed"), (ids["decode-0"], '{"node": "decode-0", "units": []}')]])
    status = collect(cfg, boto3.client("ec2", region_name=REGION), ssm, sleep=lambda s: None)
    states = {(u.node, u.unit): u.state for u in status.units}
    assert states[("prefill-0", "gptoss-proxy.service")] == "unreachable"
    assert states[("decode-0", "gptoss-decode.service")] == "missing"
    assert not status.ready


def test_status_command_prints_every_unit_and_exits_0_when_ready(
    aws: None, tmp_path: Path, health_server: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    cfg = load_config({})
    ids = launch(cfg)
    ssm, _ = stub_fleet([[(ids["prefill-0"], node_report(cfg, "prefill-0", tmp_path, health_server)),
                          (ids["decode-0"], node_report(cfg, "decode-0", tmp_path, health_server))]])  # fmt: skip
    cli, common = _load_cli(), _common()
    monkeypatch.setattr(common, "session", lambda c: Session(ec2=boto3.client("ec2", region_name=REGION), ssm=ssm))
    monkeypatch.setattr(common, "console", lambda args: __import__("rich.console").console.Console(width=200))
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert out.count("active") == 16 + 8 and "gptoss-prefill@5.service" in out and "gptoss-decode.service" in out


def test_save_cache_uploads_from_one_node_of_each_role_then_promotes_their_uploads(aws: None) -> None:
    from cluster_ops import cache

    cfg = load_config({"decode_instances": "2", "compile_cache_s3_uri": "s3://bucket/neuron-cache"})
    ids = launch(cfg)
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket="bucket", CreateBucketConfiguration={"LocationConstraint": REGION})
    # What gptoss-save-cache leaves in each node identity's own area (tests/unit/test_compile_cache.py runs it for real).
    for name, data in (("prefill-0", b"prefill graph"), ("decode-0", b"decode graph"), ("decode-1", b"other")):
        area = f"neuron-cache/nodes/{name}/trn3.48xlarge-0123456789abcdef/"
        s3.put_object(Bucket="bucket", Key=f"{area}files/{name}.neff", Body=data)
        doc = {"files": {f"{name}.neff": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}}
        s3.put_object(Bucket="bucket", Key=f"{area}manifest.json", Body=json.dumps(doc).encode())
    ssm, stub = stub_fleet([[(ids["prefill-0"], ""), (ids["decode-0"], "")]], command="/opt/gptoss/bin/gptoss-save-cache")
    uri, manifest = cache.save(cfg, boto3.client("ec2", region_name=REGION), ssm, s3, boto3.client("cloudformation", region_name=REGION),
                               sleep=lambda s: None)  # fmt: skip
    stub.assert_no_pending_responses()
    assert uri == "s3://bucket/neuron-cache"
    assert sorted(manifest["files"]) == ["decode-0.neff", "prefill-0.neff"], "decode-1 was not chosen"
    assert {n: p["upload"] for n, p in manifest["promoted_from"].items()} == {
        n: f"s3://bucket/neuron-cache/nodes/{n}/trn3.48xlarge-0123456789abcdef/" for n in ("prefill-0", "decode-0")}  # fmt: skip
    fleet = "neuron-cache/fleet/trn3.48xlarge-0123456789abcdef"
    assert s3.get_object(Bucket="bucket", Key=f"{fleet}/files/decode-0.neff")["Body"].read() == b"decode graph"
    assert json.loads(s3.get_object(Bucket="bucket", Key=f"{fleet}/manifest.json")["Body"].read()) == manifest


def test_save_cache_refuses_two_uploads_that_disagree(aws: None) -> None:
    from cluster_ops import cache

    cfg = load_config({"decode_instances": "2", "compile_cache_s3_uri": "s3://bucket/neuron-cache"})
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket="bucket", CreateBucketConfiguration={"LocationConstraint": REGION})
    for name, data in (("decode-0", b"one"), ("decode-1", b"two")):
        area = f"neuron-cache/nodes/{name}/trn3.48xlarge-0123456789abcdef/"
        s3.put_object(Bucket="bucket", Key=f"{area}files/same.neff", Body=data)
        doc = {"files": {"same.neff": {"sha256": hashlib.sha256(data).hexdigest(), "size": 3}}}
        s3.put_object(Bucket="bucket", Key=f"{area}manifest.json", Body=json.dumps(doc).encode())
    with pytest.raises(cache.CacheError, match=r"same\.neff differs between decode-0 and decode-1"):
        cache.promote(cfg, s3, "s3://bucket/neuron-cache", ["decode-0", "decode-1"])


def test_save_cache_finds_the_stacks_own_bucket_or_says_there_is_no_cache(aws: None) -> None:
    from cluster_ops import cache

    cfn = boto3.client("cloudformation", region_name=REGION)
    template = {"Resources": {"CompileCacheBucket1A2B3C4D": {"Type": "AWS::S3::Bucket"}}}
    cfn.create_stack(StackName="GptOss8k1kStack", TemplateBody=json.dumps(template))
    (bucket,) = [r["PhysicalResourceId"] for r in cfn.describe_stack_resources(StackName="GptOss8k1kStack")["StackResources"]]
    assert cache.location(load_config({}), cfn) == f"s3://{bucket}"
    with pytest.raises(cache.CacheError, match="this cluster has no compile cache"):
        cache.location(load_config({"compile_cache_bucket": "false"}), cfn)


def test_the_cache_script_ships_only_with_a_cache_location() -> None:
    def scripts(ctx: dict[str, str]) -> set[str]:
        return set().union(*(r.scripts for r in render_cluster(load_config(ctx))))

    assert "gptoss-save-cache" not in scripts({"compile_cache_bucket": "false"})
    assert "gptoss-save-cache" in scripts({"compile_cache_s3_uri": "s3://bucket/neuron-cache"})
    assert "gptoss-save-cache" in scripts({}), "by default the stack makes the compile cache's bucket"


def test_status_shows_each_identitys_instance_its_replacements_and_why(aws: None, tmp_path: Path, health_server: str) -> None:
    """The group's activities (EC2 Auto Scaling keeps six weeks) count the health-check replacements; the
    node's own reason comes from its health watch's log stream, which outlives the instance."""
    from botocore.stub import Stubber

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
    logs.create_log_stream(logGroupName="/gptoss/gptoss-8k1k", logStreamName="prefill-0/gptoss-health-watch.service")
    logs.put_log_events(logGroupName="/gptoss/gptoss-8k1k", logStreamName="prefill-0/gptoss-health-watch.service", logEvents=[
        {"timestamp": int(time.time() * 1000), "message": "gptoss-health-watch: marked i-0aaaaaaaaaaaaaaaa (prefill-0) unhealthy: "
                                                "gptoss-node-check.service failed: gptoss-node-check: Neuron: 15 devices in /dev, the instance table says 16 (neuron_devices); "
                                                "its group replaces it with an instance of the same identity"}])  # fmt: skip
    from cluster_ops.remote import find_nodes

    with stub:
        got = {i.node: i for i in identities(cfg, find_nodes(boto3.client("ec2", region_name=REGION), cfg.cluster_name), autoscaling, logs)}
    stub.assert_no_pending_responses()
    assert got["prefill-0"].instance_id == ids["prefill-0"] and got["prefill-0"].replaced == 2, "the rolling update of a redeploy is not a failure"
    assert got["prefill-0"].last_cause.endswith("in response to a user health-check.") and got["prefill-0"].last_at == "2026-11-30 10:00 UTC"
    assert got["prefill-0"].reported.startswith("gptoss-node-check.service failed: gptoss-node-check: Neuron: 15 devices")
    assert (got["decode-0"].replaced, got["decode-0"].last_cause) == (0, no_room["StatusMessage"])


def test_status_names_each_nodes_instance_and_address_and_a_surges_replacement_beside_the_old_one(aws: None) -> None:
    """During a surge a node has two instances: status and the commands that act on a node take the
    old one, which serves and holds the name until its group lets it go, and show the replacement
    beside it; the address is the one a client in the VPC connects to again after a replacement."""
    from botocore.stub import Stubber
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


def test_bench_stops_the_benchmark_at_its_timeout_and_shows_its_progress(aws: None) -> None:
    cfg = load_config({})
    iid = launch(cfg)["prefill-0"]
    # start, then two polls (still running, its last log line the benchmark's progress), then the stop.
    ssm, stub = stub_ssm([(iid, ""), (iid, "active\n\n 40%|████      | 2/5 [00:10<00:15]\n"), (iid, "active\n\n 80%|████████  | 4/5\n"), (iid, "")])
    seen: list[str] = []
    with pytest.raises(bench.BenchError, match=r"gptoss-bench\.service still active after 2s \(--timeout\): stopped it"):
        bench.run(cfg, boto3.client("ec2", region_name=REGION), ssm, poll_s=1, timeout_s=2, sleep=lambda s: None,
                  on_poll=lambda state, t: seen.append(state))  # fmt: skip
    assert seen == ["active · 40%|████      | 2/5 [00:10<00:15]", "active · 80%|████████  | 4/5"]
    stub.assert_no_pending_responses()


# ---- bench --sweep --------------------------------------------------------------------------------


def test_bench_sweep_runs_every_leg_in_one_unit_and_saves_each_result_named_by_layout_and_image(aws: None, tmp_path: Path) -> None:
    """The legs the sweep starts on the proxy node (the reference's benchmark at each load, with the
    layout and image as --metadata), and the files it copies back, named so runs of another layout
    or image never mix: what gptoss size then reads."""
    from cluster_ops.sizing import parse
    from tests.fakes.bench_runs import Model, result

    cfg = load_config({"decode_instances": "8"})
    iid = launch(cfg, ["decode-0"])["decode-0"]
    image = boto3.client("ec2", region_name=REGION).describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["ImageId"]
    tag = f"gptoss-120b-8k1k-48p8d-{image}"
    names = [f"{tag}-c{c}.json" for c in (8, 64)] + [f"{tag}-r24.json"]
    docs = [result(Model(), leg="endpoint", prefill_replicas=48, decode_servers=8, concurrency=8, image=image),
            result(Model(), leg="endpoint", prefill_replicas=48, decode_servers=8, concurrency=64, image=image),
            result(Model(), leg="endpoint", prefill_replicas=48, decode_servers=8, rate=24.0, image=image)]  # fmt: skip
    ssm, stub = stub_ssm([(iid, ""), (iid, "inactive\ndone\n3\n"), *[(iid, json.dumps(d)) for d in docs]])
    sent: list[str] = []
    ssm.meta.events.register("provide-client-params.ssm.SendCommand", lambda params, **kw: sent.append(params["Parameters"]["commands"][0]))
    written = bench.sweep(cfg, boto3.client("ec2", region_name=REGION), ssm, out=tmp_path / "out", concurrencies=[8, 64], rates=[24.0],
                          sleep=lambda s: None)  # fmt: skip
    stub.assert_no_pending_responses()
    assert [p.name for p in written] == names
    start = sent[0]
    assert "systemd-run --unit=gptoss-bench-sweep --property=User=root --property=EnvironmentFile=/etc/gptoss/bench.env -- bash -c" in start
    for leg, concurrency in (("c8", "--max-concurrency 8 --num-prompts 80"), ("c64", "--max-concurrency 64 --num-prompts 640")):
        assert concurrency in start and f"--result-filename {tag}-{leg}.json" in start
    assert "vllm bench serve --request-rate 24 --backend vllm" in start and "--result-filename " + f"{tag}-r24.json" in start
    assert start.count("--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99") == 3
    assert start.count(f"--metadata gptoss_recipe=gptoss-120b-8k1k gptoss_instance_type=trn3.48xlarge gptoss_image={image} "
                       "gptoss_prefill_replicas=48 gptoss_decode_servers=8 gptoss_leg=endpoint") == 3  # fmt: skip
    assert sent[2:] == [f"cat /root/gpt-oss-120b-8k1k-results/sweep/{n}" for n in names]
    runs = [parse(str(p), p.read_text()) for p in written]
    assert {(r.prefill_replicas, r.decode_servers, r.image) for r in runs} == {(48, 8, image)}
