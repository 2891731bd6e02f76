"""Bad input fails before anything is synthesized, naming the field, the value, the rule and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clusterspec.config import load_config
from clusterspec.errors import SpecError
from tests.conftest import CDK, ROOT, cli_env

BAD_INPUTS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("unknown key", {"decode_instance": "2"}, ["decode_instance='2'", "is not a known setting", "Fix: remove -c decode_instance"]),
    ("not a number", {"decode_instances": "many"}, ["decode_instances='many'", "valid integer", "Fix:"]),
    ("no decode server", {"decode_instances": "0"}, ["decode_instances=0", "at least one decode server", "Fix: set decode_instances >= 1"]),
    ("ratio below one", {"prefill_per_decode": "0"}, ["prefill_per_decode=0", "at least one prefill replica", "Fix:"]),
    ("too many replicas on an instance", {"replicas_per_prefill_instance": "17"}, ["replicas_per_prefill_instance=17", "1 to 16", "Fix:"]),
    ("root volume too small", {"root_volume_gb": "100"}, ["root_volume_gb=100", "at least 512 GB", "Fix: set root_volume_gb >= 512"]),
    ("AZ of another region", {"availability_zone": "eu-west-1a"}, ["availability_zone='eu-west-1a'", "must be a zone of region us-east-2", "Fix:"]),
    ("unknown instance type", {"instance_type": "p5.48xlarge"}, ["instance_type='p5.48xlarge'", "no hardware table entry", "Fix:"]),
    ("MXFP4 on Trn2", {"instance_type": "trn2.48xlarge"}, ["instance_type='trn2.48xlarge'", "only on Trainium3", "Fix:"]),
    (
        "decode batch above the partition cap",
        {"serving": {"decode": {"max_num_seqs": 16}}},
        ["serving.decode.max_num_seqs=16", "128*TP/EP = 8 for TP8 EP128", "Fix: set max_num_seqs <= 8"],
    ),
    (
        "EP is not TP x DP on decode",
        {"serving": {"decode": {"data_parallel": 8}}},
        ["serving.decode.ep_degree=128", "must equal TP x DP = 8 x 8 = 64", "Fix:"],
    ),
    (
        "port collision",
        {"serving": {"proxy": {"port": 8103}}},
        ["serving.prefill.http_port_base=8100", "collide with 8103-8103 (serving.proxy.port)", "Fix: move one of the two port bases"],
    ),
    (
        "side-channel range over the decode port",
        {"serving": {"decode": {"side_channel_port": 6500}}},
        ["collide", "side_channel", "Fix:"],
    ),
    (
        "env table sets a derived variable",
        {"serving": {"common_env": {"NEURON_LOGICAL_NC_CONFIG": {"value": "2", "reason": "x"}}}},
        ["serving.common_env=['NEURON_LOGICAL_NC_CONFIG']", "derived from typed fields", "Fix: remove them"],
    ),
    ("half an existing network", {"network": {"vpc_id": "vpc-0123456789abcdef0"}}, ["network.vpc_id='vpc-0123456789abcdef0'", "needs both vpc_id and subnet_id", "Fix:"]),
    ("S3 model without a location", {"model": {"source": "s3"}}, ["model.s3_uri=None", "needs the S3 location", "Fix: set model.s3_uri"]),
    ("no egress but Hugging Face", {"network": {"egress": "none"}}, ["model.source='huggingface'", "cannot reach Hugging Face", "Fix:"]),
    ("proxy open to the world", {"proxy_ingress_cidr": "0.0.0.0/0"}, ["proxy_ingress_cidr='0.0.0.0/0'", "refused", "Fix:"]),
    ("moving examples branch", {"examples": {"ref": "main"}}, ["examples.ref='main'", "moving branch", "Fix: pin a tag or a commit"]),
    ("both AMI sources", {"ami_id": "ami-0123456789abcdef0"}, ["ami_id='ami-0123456789abcdef0'", "exactly one of ami_ssm_parameter and ami_id", "Fix:"]),
    ("unknown nested key", {"serving": {"decode": {"max_num_seq": 8}}}, ["serving.decode.max_num_seq=8", "is not a known setting", "Fix:"]),
    (
        "replica cores do not divide the instance",
        {"serving": {"prefill": {"tensor_parallel": 3}}},
        ["serving.prefill.tensor_parallel=3", "must divide the 64 logical cores of trn3.48xlarge at LNC=2", "Fix:"],
    ),
    (
        "fleet beyond one stack",
        {"decode_instances": "70"},
        ["decode_instances=70: 97 instances in one stack need", "CloudFormation allows 1 MB", "Fix: keep one stack at or below", "several stacks"],
    ),
]


@pytest.mark.parametrize(("case", "context", "expected"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_field_value_rule_and_fix(case: str, context: dict[str, Any], expected: list[str]) -> None:
    with pytest.raises(SpecError) as err:
        load_config(context)
    message = str(err.value)
    for part in expected:
        assert part in message, f"{case}: {part!r} not in {message!r}"


def test_defaults_are_the_tested_two_node_layout() -> None:
    cfg = load_config({})
    layout = cfg.layout
    assert [(n.name, n.role, len(n.replicas)) for n in layout.nodes] == [("prefill-0", "prefill", 6), ("decode-0", "decode", 0)]
    assert cfg.instance_type == "trn3.48xlarge"
    assert [p.node for p in layout.proxies] == ["prefill-0"]


def test_config_file_and_context_merge_with_context_winning(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text("decode_instances: 2\ncluster_name: prod-a\nserving:\n  bench:\n    warmup_prompts: 640\n")
    cfg = load_config({"config": str(f), "decode_instances": "3"})
    assert (cfg.decode_instances, cfg.cluster_name, cfg.serving.bench.warmup_prompts) == (3, "prod-a", 640)


def test_missing_config_file_is_named() -> None:
    with pytest.raises(SpecError, match=r"config='nope.yaml': the config file does not exist"):
        load_config({"config": "nope.yaml"})


def test_app_exits_before_writing_a_template(tmp_path: Path) -> None:
    """`cdk synth` with a bad value fails with the message and leaves no template behind."""
    out = tmp_path / "cdk.out"
    r = subprocess.run(
        [str(CDK), "synth", "--no-notices", "-o", str(out), "-c", "decode_instances=0"],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    assert "decode_instances=0: a fleet needs at least one decode server. Fix: set decode_instances >= 1." in r.stderr
    assert not list(out.glob("*.template.json"))


def test_app_module_never_imports_boto3() -> None:
    """Synthesis is hermetic: the app's import graph has no AWS SDK."""
    code = "import sys, runpy; sys.argv=['app.py']; import app; print('boto3' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_valid(example: Path) -> None:
    cfg = load_config({"config": str(example)})
    assert cfg.layout.nodes


def test_the_largest_fleet_the_refusal_names_fits_and_one_more_does_not() -> None:
    import re

    with pytest.raises(SpecError) as err:
        load_config({"decode_instances": "100"})
    largest = int(re.search(r"at or below (\d+) decode instances", str(err.value)).group(1))  # type: ignore[union-attr]
    assert 60 <= largest < 100
    assert load_config({"decode_instances": str(largest)}).decode_instances == largest
    with pytest.raises(SpecError):
        load_config({"decode_instances": str(largest + 1)})
