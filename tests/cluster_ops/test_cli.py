"""`gptoss`: the pinned image (pin-ami, a new one asked first, warnings at synth) and cost."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from cluster_ops import cli, common, cost, stack
from clusterspec.loading import load_config
from tests.cluster_ops.cli_helpers import REGION

# ---- the pinned image ---------------------------------------------------------------------


def test_pin_ami_records_the_image_and_the_config_uses_it(moto_aws: None, checkout: Path, capsys: Any) -> None:
    ec2 = boto3.client("ec2", region_name=REGION)
    ssm = boto3.client("ssm", region_name=REGION)
    first, second = [i["ImageId"] for i in ec2.describe_images(Owners=["amazon"])["Images"][:2]]
    ssm.put_parameter(Name="/test/dlami", Value=first, Type="String")
    args = ["-c", "ami_ssm_parameter=/test/dlami"]
    assert cli.main(["pin-ami", *args]) == 0
    assert f"pinned {first} (" in capsys.readouterr().out
    pin = json.loads((checkout / "cdk.context.json").read_text())["gptoss:pinned-ami:us-east-2"]
    assert pin["ami_id"] == first and pin["parameter"] == "/test/dlami" and pin["name"] and pin["created"]
    # Every command now uses the recorded image, not the parameter.
    assert cli.main(["plan", "--json", *args]) == 0
    assert json.loads(capsys.readouterr().out)["ami"] == {"id": first}
    # AWS publishes a new image: nothing moves until the operator asks.
    ssm.put_parameter(Name="/test/dlami", Value=second, Type="String", Overwrite=True)
    assert cli.main(["pin-ami", *args]) == 0
    assert f"already pinned: {first}" in capsys.readouterr().out
    assert cli.main(["pin-ami", "--upgrade", *args]) == 0
    out = capsys.readouterr().out
    assert f"pinned {second}" in out and f"was {first}" in out and "replaces every instance" in out
    # A config that names another parameter is not affected by this pin.
    assert load_config({"ami_ssm_parameter": "/other/param", "gptoss:pinned-ami:us-east-2": pin}).ami_id is None


def test_an_unpinned_deploy_passes_the_image_it_resolved_and_a_new_one_asks_first(
    moto_aws: None, checkout: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The deploy gate sees the image as a value of the synth: the parameter is resolved by the CLI,
    said, passed as ami_id and recorded; a newer image replaces every instance, so it asks."""
    ec2 = boto3.client("ec2", region_name=REGION)
    ssm = boto3.client("ssm", region_name=REGION)
    first, second = [i["ImageId"] for i in ec2.describe_images(Owners=["amazon"])["Images"][:2]]
    ssm.put_parameter(Name="/test/dlami", Value=first, Type="String")
    ran: list[list[str]] = []
    monkeypatch.setattr(stack, "cdk", lambda verb, cfg, context, extra: (verb == "deploy" and ran.append(context)) or 0)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no terminal
    args = ["deploy", "-c", "ami_ssm_parameter=/test/dlami"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert f"image {first} (" in err and "from /test/dlami, for this deploy; pin it to keep it: gptoss pin-ami" in err
    assert ran[-1][-2:] == [f"ami_id={first}", "ami_ssm_parameter=null"]
    assert common.deployed()["GptOss8k1kStack"]["image"] == first
    ssm.put_parameter(Name="/test/dlami", Value=second, Type="String", Overwrite=True)
    assert cli.main(args) == 1 and len(ran) == 1
    err = capsys.readouterr().err
    assert f"refusing to move to a new image without confirmation: {first} was deployed before: the new image replaces every instance" in err
    assert cli.main([*args, "--yes"]) == 0 and ran[-1][-2] == f"ami_id={second}"


def test_an_unpinned_stack_warns_at_synth_and_a_pinned_one_does_not() -> None:
    import aws_cdk as cdk
    from aws_cdk.assertions import Annotations, Match

    from stacks.cluster_stack import GptOssClusterStack

    app = cdk.App()
    unpinned = GptOssClusterStack(app, "A", config=load_config({}))
    pinned = GptOssClusterStack(app, "B", config=load_config({"ami_id": "ami-0123456789abcdef0", "ami_ssm_parameter": "null"}))
    said = "cdk deploy` of this template replaces every instance.*Deploy with gptoss deploy.*pin it: gptoss pin-ami"
    Annotations.from_stack(unpinned).has_warning("*", Match.string_like_regexp(said))
    Annotations.from_stack(pinned).has_no_warning("*", Match.string_like_regexp("pin-ami"))



def test_an_unpinned_model_and_examples_warn_at_synth_and_pinned_ones_do_not() -> None:
    """The checkpoint and the examples are fetched at boot: unset commits are said at synth, and in the plan."""
    import aws_cdk as cdk
    from aws_cdk.assertions import Annotations, Match

    from cluster_ops.plan_view import pin_lines
    from stacks.cluster_stack import GptOssClusterStack

    app = cdk.App()
    unpinned_cfg = load_config({})
    pinned_cfg = load_config({"model.revision": "1" * 40, "examples.commit": "2" * 40})
    unpinned = GptOssClusterStack(app, "A", config=unpinned_cfg)
    pinned = GptOssClusterStack(app, "B", config=pinned_cfg)
    Annotations.from_stack(unpinned).has_warning("*", Match.string_like_regexp("model.revision is unset: each node downloads openai/gpt-oss-120b as the Hub's main"))
    Annotations.from_stack(unpinned).has_warning("*", Match.string_like_regexp("examples.commit is unset: nodes take the commit tag release-2.33 points at"))
    Annotations.from_stack(pinned).has_no_warning("*", Match.string_like_regexp("is unset"))
    assert pin_lines(unpinned_cfg) == [
        "  model: openai/gpt-oss-120b, unpinned (set model.revision)",
        "  examples: release-2.33, commit unpinned (set examples.commit)",
        "  NIXL: the image's",
    ]
    assert pin_lines(pinned_cfg)[:2] == [f"  model: openai/gpt-oss-120b at {'1' * 40}", f"  examples: release-2.33 at {'2' * 40}"]


def test_without_egress_open_https_warns_at_synth_until_the_s3_prefix_list_is_named() -> None:
    import aws_cdk as cdk
    from aws_cdk.assertions import Annotations, Match

    from stacks.cluster_stack import GptOssClusterStack

    s3 = {"model.source": "s3", "model.s3_uri": "s3://models-bucket/gpt-oss-120b", "examples.s3_uri": "s3://models-bucket/vllm-neuron"}
    app = cdk.App()
    open_ = GptOssClusterStack(app, "A", config=load_config({"network.egress": "none", **s3}))
    narrow = GptOssClusterStack(app, "B", config=load_config({"network.egress": "none", "network.s3_prefix_list_id": "pl-7ba54012", **s3}))
    nat = GptOssClusterStack(app, "C", config=load_config({}))
    said = "network.s3_prefix_list_id is unset: the nodes' HTTPS egress is allowed to any address"
    Annotations.from_stack(open_).has_warning("*", Match.string_like_regexp(said))
    Annotations.from_stack(narrow).has_no_warning("*", Match.string_like_regexp("s3_prefix_list_id"))
    Annotations.from_stack(nat).has_no_warning("*", Match.string_like_regexp("s3_prefix_list_id"))


# ---- cost ----------------------------------------------------------------------------------


def price_list(unit: str, usd: str, *extra: tuple[str, str]) -> str:
    dims = {"d1": {"unit": unit, "pricePerUnit": {"USD": usd}}}
    dims.update({f"d{i + 2}": {"unit": u, "pricePerUnit": {"USD": p}} for i, (u, p) in enumerate(extra)})
    return json.dumps({"product": {}, "terms": {"OnDemand": {"t": {"priceDimensions": dims}}}})


def test_cost_prices_each_item_from_the_price_list(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    cfg = load_config({"decode_instances": "8"})
    pricing = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(pricing)
    for item, answer in zip(cost.items(cfg), [price_list("Hrs", "40.0"), price_list("GB-Mo", "0.08"),
                                              price_list("GB", "0.045", ("Hrs", "0.045")), price_list("LCU-Hrs", "0.006", ("Hrs", "0.0225"))], strict=True):  # fmt: skip
        stub.add_response("get_products", {"PriceList": [answer]},
                          {"ServiceCode": item.service, "Filters": [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in item.filters],
                           "MaxResults": 100})  # fmt: skip
    stub.activate()
    priced = {i.name: i for i in cost.priced(cfg, pricing)}
    assert priced["trn3.48xlarge (on-demand)"].per_hour == pytest.approx(440.0)
    assert priced["root volumes, gp3 512 GB"].per_hour == pytest.approx(11 * 512 * 0.08 / 730)
    assert priced["NAT gateway"].usd == 0.045 and priced["internal Network Load Balancer"].usd == 0.0225
    stub.assert_no_pending_responses()


def test_a_capacity_block_is_not_priced_by_the_hour() -> None:
    """A block is paid when bought: the Price List is not asked for its instances, the rest is priced."""
    cfg = load_config({"capacity": {"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"}})
    pricing = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(pricing)
    for item, answer in zip(cost.items(cfg)[1:], [price_list("GB-Mo", "0.08"), price_list("Hrs", "0.045")], strict=True):
        stub.add_response("get_products", {"PriceList": [answer]},
                          {"ServiceCode": item.service, "Filters": [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in item.filters],
                           "MaxResults": 100})  # fmt: skip
    stub.activate()
    instances, volumes, nat = cost.priced(cfg, pricing)
    assert (instances.usd, instances.note) == (None, "paid up front when the block was bought")
    assert volumes.usd == 0.08 and nat.usd == 0.045
    stub.assert_no_pending_responses()
