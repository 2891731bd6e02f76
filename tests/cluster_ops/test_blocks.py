"""`gptoss blocks`: Capacity Block offerings that fit the planned fleet, extensions of the cluster's blocks,
and their purchase. moto has none of these EC2 APIs: every call goes through botocore's Stubber, which
checks each request and answer against EC2's service model (DescribeCapacityBlockOfferings,
PurchaseCapacityBlock, DescribeCapacityBlockExtensionOfferings, PurchaseCapacityBlockExtension and, for
status, DescribeCapacityReservations are stubbed)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from cluster_ops import capacity, cli, common
from clusterspec.loading import load_config

REGION = "us-east-2"
PROD = ["--config", "examples/production-3p8d.yaml"]
START = dt.datetime(2026, 12, 10, 11, 30, tzinfo=dt.UTC)
CR = "cr-0123456789abcdef0"


def offering(oid: str, count: int, start: dt.datetime, hours: int = 48, az: str = "us-east-2a") -> dict[str, Any]:
    return {"CapacityBlockOfferingId": oid, "InstanceType": "trn3.48xlarge", "AvailabilityZone": az, "InstanceCount": count,
            "StartDate": start, "EndDate": start + dt.timedelta(hours=hours), "CapacityBlockDurationHours": hours,
            "UpfrontFee": f"{count * hours * 40}.00", "CurrencyCode": "USD", "Tenancy": "default"}  # fmt: skip


@pytest.fixture
def ec2(monkeypatch: pytest.MonkeyPatch) -> Stubber:
    client = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(client)

    class Session:
        def client(self, name: str) -> Any:
            assert name == "ec2", name
            return client

    monkeypatch.setattr(common, "session", lambda cfg: Session())
    stub.activate()
    yield stub
    stub.deactivate()


def test_offerings_for_the_3p8d_fleet_are_listed_per_role_with_the_purchase_command(ec2: Stubber, capsys: pytest.CaptureFixture[str]) -> None:
    # The 3+8 fleet: one block of 3 for prefill, one of 8 for decode, as EC2 is asked for each (the second page of decode's too).
    ec2.add_response("describe_capacity_block_offerings", {"CapacityBlockOfferings": [offering("cbo-0aaaaaaaaaaaaaaa1", 3, START)]},
                     {"InstanceType": "trn3.48xlarge", "InstanceCount": 3, "CapacityDurationHours": 48})  # fmt: skip
    ec2.add_response("describe_capacity_block_offerings",
                     {"CapacityBlockOfferings": [offering("cbo-0bbbbbbbbbbbbbbb2", 8, START + dt.timedelta(days=1), az="us-east-2b")], "NextToken": "t"},
                     {"InstanceType": "trn3.48xlarge", "InstanceCount": 8, "CapacityDurationHours": 48})  # fmt: skip
    ec2.add_response("describe_capacity_block_offerings", {"CapacityBlockOfferings": [offering("cbo-0ccccccccccccccc3", 8, START)]},
                     {"InstanceType": "trn3.48xlarge", "InstanceCount": 8, "CapacityDurationHours": 48, "NextToken": "t"})  # fmt: skip
    assert cli.main(["blocks", *PROD, "--hours", "48"]) == 0
    out = capsys.readouterr().out
    ec2.assert_no_pending_responses()
    assert "prefill: 3 x trn3.48xlarge for 48 h: 1 offering(s)" in out and "decode: 8 x trn3.48xlarge for 48 h: 2 offering(s)" in out, out
    assert "2026-12-10 11:30 to 2026-12-12 11:30 UTC  us-east-2a  5760.00 USD upfront  cbo-0aaaaaaaaaaaaaaa1" in out
    # Soonest first; one in another AZ than the cluster's says so.
    decode = out[out.index("decode:"):]
    assert decode.index("cbo-0ccccccccccccccc3") < decode.index("cbo-0bbbbbbbbbbbbbbb2")
    assert "us-east-2b (not the cluster's us-east-2a: set availability_zone)" in decode
    assert ("buy: gptoss blocks --purchase cbo-0ccccccccccccccc3   (or aws ec2 purchase-capacity-block --region us-east-2 "
            "--capacity-block-offering-id cbo-0ccccccccccccccc3 --instance-platform Linux/UNIX)") in out  # fmt: skip


def test_one_block_for_the_whole_fleet_within_a_window(ec2: Stubber, capsys: pytest.CaptureFixture[str]) -> None:
    after, before = dt.datetime(2026, 12, 8, tzinfo=dt.UTC), dt.datetime(2026, 12, 20, tzinfo=dt.UTC)
    ec2.add_response("describe_capacity_block_offerings", {"CapacityBlockOfferings": []},
                     {"InstanceType": "trn3.48xlarge", "InstanceCount": 11, "CapacityDurationHours": 24, "StartDateRange": after, "EndDateRange": before})  # fmt: skip
    assert cli.main(["blocks", *PROD, "--whole", "--start-after", "2026-12-08", "--end-before", "2026-12-20"]) == 0
    out = capsys.readouterr().out
    assert "fleet: 11 x trn3.48xlarge for 24 h: 0 offering(s)" in out and "no offering fits" in out, out


def test_a_purchase_needs_an_offering_id_and_a_confirmation(ec2: Stubber, capsys: pytest.CaptureFixture[str]) -> None:
    # No terminal and no --yes: nothing is bought (the stubber would fail on any call).
    assert cli.main(["blocks", *PROD, "--purchase", "cbo-0aaaaaaaaaaaaaaa1"]) == 1
    err = capsys.readouterr().err
    assert "refusing to buy the Capacity Block offering cbo-0aaaaaaaaaaaaaaa1 without confirmation (no terminal)" in err and "--yes" in err, err
    ec2.add_response(
        "purchase_capacity_block",
        {"CapacityReservation": {"CapacityReservationId": CR},
         "CapacityBlocks": [{"CapacityBlockId": "cb-0123456789abcdef0", "AvailabilityZone": "us-east-2a", "CapacityReservationIds": [CR],
                             "StartDate": START, "EndDate": START + dt.timedelta(hours=48)}]},
        {"CapacityBlockOfferingId": "cbo-0aaaaaaaaaaaaaaa1", "InstancePlatform": "Linux/UNIX",
         "TagSpecifications": [{"ResourceType": "capacity-reservation", "Tags": [{"Key": "gptoss:cluster", "Value": "gptoss-prod"}]}]},
    )  # fmt: skip
    assert cli.main(["blocks", *PROD, "--purchase", "cbo-0aaaaaaaaaaaaaaa1", "--yes"]) == 0
    out = capsys.readouterr().out
    ec2.assert_no_pending_responses()
    assert "bought cb-0123456789abcdef0 in us-east-2a: 2026-12-10 11:30 to 2026-12-12 11:30 UTC" in out
    assert f"launch into it: -c capacity.type=capacity-block -c capacity.reservation_id={CR}" in out


def test_an_extension_of_the_clusters_block_is_offered_bought_and_then_shown_by_status(ec2: Stubber, capsys: pytest.CaptureFixture[str]) -> None:
    block = [*PROD, "-c", "capacity.type=capacity-block", "-c", f"capacity.reservation_id={CR}"]
    new_end = dt.datetime(2026, 12, 14, 11, 30, tzinfo=dt.UTC)
    ec2.add_response(
        "describe_capacity_block_extension_offerings",
        {"CapacityBlockExtensionOfferings": [{"CapacityBlockExtensionOfferingId": "cbeo-0123456789abcdef0", "InstanceType": "trn3.48xlarge",
                                              "InstanceCount": 11, "CapacityBlockExtensionStartDate": START, "CapacityBlockExtensionEndDate": new_end,
                                              "CapacityBlockExtensionDurationHours": 48, "UpfrontFee": "42240.00", "CurrencyCode": "USD"}]},
        {"CapacityReservationId": CR, "CapacityBlockExtensionDurationHours": 48},
    )  # fmt: skip
    assert cli.main(["blocks", *block, "--extend", "--hours", "48"]) == 0
    out = capsys.readouterr().out
    assert f"  {CR}  11 x trn3.48xlarge  to 2026-12-14 11:30 UTC  42240.00 USD  cbeo-0123456789abcdef0" in out, out
    assert f"buy: gptoss blocks --purchase-extension cbeo-0123456789abcdef0 --reservation {CR}" in out
    assert cli.main(["blocks", *block, "--purchase-extension", "cbeo-0123456789abcdef0"]) == 1, "no terminal, no --yes: refused"
    ec2.add_response(
        "purchase_capacity_block_extension",
        {"CapacityBlockExtensions": [{"CapacityReservationId": CR, "CapacityBlockExtensionStatus": "payment-pending",
                                      "CapacityBlockExtensionEndDate": new_end}]},
        {"CapacityBlockExtensionOfferingId": "cbeo-0123456789abcdef0", "CapacityReservationId": CR},
    )  # fmt: skip
    assert cli.main(["blocks", *block, "--purchase-extension", "cbeo-0123456789abcdef0", "--yes"]) == 0
    assert f"extended {CR}: payment-pending, new end 2026-12-14 11:30 UTC" in capsys.readouterr().out
    # EC2 then answers the block's new end date, which is what status counts down to (less its 30 minutes).
    cfg = load_config({"config": "examples/production-3p8d.yaml", "capacity.type": "capacity-block", "capacity.reservation_id": CR})
    ec2.add_response("describe_capacity_reservations", {"CapacityReservations": [{
        "CapacityReservationId": CR, "InstanceType": "trn3.48xlarge", "AvailabilityZone": "us-east-2a", "TotalInstanceCount": 11,
        "AvailableInstanceCount": 0, "State": "active", "ReservationType": "capacity-block", "StartDate": START, "EndDate": new_end}]},
        {"CapacityReservationIds": [CR]})  # fmt: skip
    (line,) = capacity.block_clock(cfg, common.session(cfg).client("ec2"), [CR], now=START + dt.timedelta(hours=1))
    assert line.startswith(f"Capacity Block {CR}: ") and "(2026-12-14 11:00 UTC)" in line, line


def test_extend_without_a_block_in_the_spec_says_what_to_set(ec2: Stubber, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["blocks", *PROD, "--extend"]) == 2
    assert "its spec names none (capacity.type=capacity-block" in capsys.readouterr().err


