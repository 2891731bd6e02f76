"""`gptoss bench` and `save-cache`: the benchmark unit started, waited for and read over SSM, sweeps,
the compile caches uploaded from one node of each role and promoted."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber

from cluster_ops import bench
from cluster_ops.status import collect
from clusterspec.loading import load_config
from node_render.render import render_cluster
from tests.cluster_ops.ops_helpers import (
    REGION,
    Session,
    _common,
    _load_cli,
    launch,
    node_report,
    stub_fleet,
    stub_ssm,
)

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
    # What gptoss-save-cache leaves in each node identity's own area (tests/userdata/test_compile_cache.py runs it for real).
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
