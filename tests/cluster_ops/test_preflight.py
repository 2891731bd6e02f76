"""`gptoss preflight`: the account against the plan (instance type, image, quotas with the surge's spare
instances, group quota, the S3 prefix list without egress), one line per check."""

from __future__ import annotations

from typing import Any

import boto3
import pytest

from cluster_ops import preflight
from clusterspec.loading import load_config
from tests.cluster_ops.ops_helpers import (
    REGION,
    TRN2,
    _common,
    _load_cli,
    _session,
    by_name,
    groups,
    quotas,
)


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




def test_preflight_command_prints_a_table_and_exits_non_zero_on_failure(aws: None, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    cli, common = _load_cli(), _common()
    monkeypatch.setattr(common, "session", lambda cfg: _session(quota=100))
    code = cli.main(["preflight", "--width", "250", "-c", "instance_type=trn2.48xlarge", "-c", 'serving={"shape": {"quantization": "bf16"}}'])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "vCPU quota" in out and "pass" in out
