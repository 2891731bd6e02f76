"""Preflight's reservation checks, the block clock and the one-line capacity failure, against
EC2's and Resource Groups' real response shapes (botocore Stubber validates every call)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from cluster_ops import capacity, preflight
from clusterspec.loading import load_config

REGION = "us-east-2"
NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
CR, CR2 = "cr-0123456789abcdef0", "cr-0fedcba9876543210"
GROUP = "arn:aws:resource-groups:us-east-2:123456789012:group/trn3"


def reservation(rid: str = CR, **over: Any) -> dict[str, Any]:
    """A describe-capacity-reservations entry: an active ODCR for 2 trn3.48xlarge in us-east-2a."""
    return {
        "CapacityReservationId": rid, "InstanceType": "trn3.48xlarge", "InstancePlatform": "Linux/UNIX",
        "AvailabilityZone": "us-east-2a", "Tenancy": "default", "TotalInstanceCount": 2, "AvailableInstanceCount": 2,
        "State": "active", "InstanceMatchCriteria": "targeted", "ReservationType": "default",
    } | over  # fmt: skip


def block(rid: str = CR, hours_left: float = 72, **over: Any) -> dict[str, Any]:
    return reservation(rid, ReservationType="capacity-block", StartDate=NOW - dt.timedelta(hours=1),
                       EndDate=NOW + dt.timedelta(hours=hours_left), EndDateType="limited") | over  # fmt: skip


def stubbed(*described: tuple[list[str], list[dict[str, Any]] | str], group: list[str] | None = None) -> tuple[Any, Any]:
    """EC2 and Resource Groups clients answering describe-capacity-reservations (or an error code)."""
    ec2 = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    rg = boto3.client("resource-groups", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    s_ec2, s_rg = Stubber(ec2), Stubber(rg)
    if group is not None:
        s_rg.add_response(
            "list_group_resources",
            {"Resources": [{"Identifier": {"ResourceArn": f"arn:aws:ec2:us-east-2:123456789012:capacity-reservation/{i}",
                                           "ResourceType": "AWS::EC2::CapacityReservation"}} for i in group]},
            {"Group": GROUP},
        )  # fmt: skip
    for ids, answer in described:
        if isinstance(answer, str):
            s_ec2.add_client_error("describe_capacity_reservations", answer, f"The capacity reservation ID '{ids[0]}' does not exist")
        else:
            s_ec2.add_response("describe_capacity_reservations", {"CapacityReservations": answer}, {"CapacityReservationIds": ids})
    s_ec2.activate()
    s_rg.activate()
    return ec2, rg


def rows(context: dict[str, Any], ec2: Any, rg: Any) -> list[capacity.Row]:
    return capacity.check(load_config(context), ec2, rg, now=NOW)


ODCR = {"capacity": {"type": "odcr", "reservation_id": CR}}
BLOCK = {"capacity": {"type": "capacity-block", "reservation_id": CR}}


def test_all_good_reservation_passes_with_its_count() -> None:
    (row,) = rows(ODCR, *stubbed(([CR], [reservation()])))
    assert (row.reservation, row.roles, row.verdict) == (CR, "1 decode, 1 prefill", "pass")
    assert row.detail == "2 of 2 available, 2 needed"


def test_a_missing_reservation_fails_naming_it() -> None:
    (row,) = rows(ODCR, *stubbed(([CR], "InvalidCapacityReservationId.NotFound")))
    assert (row.verdict, row.detail) == ("FAIL", "does not exist in us-east-2")


@pytest.mark.parametrize(
    ("over", "problem"),
    [
        ({"InstanceType": "trn2.48xlarge"}, "for trn2.48xlarge, not trn3.48xlarge"),
        ({"AvailabilityZone": "us-east-2b"}, "in us-east-2b, not us-east-2a"),
        ({"InstancePlatform": "Windows"}, "for Windows, not Linux/UNIX (the DLAMI)"),
        ({"State": "expired"}, "state expired"),
        ({"PlacementGroupArn": "arn:aws:ec2:us-east-2:123456789012:placement-group/trn3-cpg"},
         "was made in placement group trn3-cpg: the nodes must launch in it (capacity.placement_group=trn3-cpg)"),
        ({"ReservationType": "capacity-block", "EndDate": NOW + dt.timedelta(days=3)}, "is a Capacity Block (set capacity.type=capacity-block)"),
    ],
)  # fmt: skip
def test_a_reservation_that_does_not_match_fails_with_the_reason(over: dict[str, Any], problem: str) -> None:
    (row,) = rows(ODCR, *stubbed(([CR], [reservation(**over)])))
    assert row.verdict == "FAIL" and row.detail == problem, row


def test_too_few_available_instances_fail_with_what_is_missing() -> None:
    (row,) = rows({**ODCR, "decode_instances": "8"}, *stubbed(([CR], [reservation(TotalInstanceCount=8, AvailableInstanceCount=7)])))
    assert row.verdict == "FAIL" and row.detail == "7 of 8 available, 11 needed"
    assert row.fix.startswith("free 4 instances of it")


def test_a_scheduled_block_fails_showing_when_it_starts() -> None:
    start = NOW + dt.timedelta(hours=5, minutes=30)
    (row,) = rows(BLOCK, *stubbed(([CR], [block(State="scheduled", StartDate=start)])))
    assert row.verdict == "FAIL"
    assert row.detail == "scheduled: starts 2026-11-30 17:30 UTC, in 5 h 30 min"
    assert "deploy once the block has started" in row.fix


def test_a_block_shows_its_end_and_passes_with_time_left() -> None:
    (row,) = rows(BLOCK, *stubbed(([CR], [block(hours_left=72)])))
    assert row.verdict == "pass"
    assert row.detail == "2 of 2 available, 2 needed; ends 2026-12-03 12:00 UTC (reclaimed from 11:30)"


def test_a_block_ending_within_the_first_compile_is_a_warning() -> None:
    (row,) = rows(BLOCK, *stubbed(([CR], [block(hours_left=4)])))
    assert row.verdict == "warn"
    assert "3 h 30 min of use left: the first compile may take up to 6 h 55 min (ready_timeout_s)" in row.detail


def test_a_block_with_fewer_hours_than_asked_fails() -> None:
    ctx = {"capacity": {"type": "capacity-block", "reservation_id": CR, "min_hours_left": 48}}
    (row,) = rows(ctx, *stubbed(([CR], [block(hours_left=24)])))
    assert row.verdict == "FAIL" and row.detail == "23 h 30 min of use left, capacity.min_hours_left is 48 h"


def test_a_block_in_its_last_half_hour_fails() -> None:
    (row,) = rows(BLOCK, *stubbed(([CR], [block(hours_left=0.25)])))
    assert row.verdict == "FAIL" and "being reclaimed" in row.detail


def test_an_odcr_given_as_a_capacity_block_fails() -> None:
    (row,) = rows(BLOCK, *stubbed(([CR], [reservation()])))
    assert row.verdict == "FAIL" and "is an On-Demand Capacity Reservation, not a Capacity Block" in row.detail


def test_each_role_is_checked_against_its_own_block() -> None:
    ctx = {"decode_instances": "8", "capacity": {"type": "capacity-block", "reservation_id": CR, "roles": {"decode": {"reservation_id": CR2}}}}
    prefill, decode = rows(ctx, *stubbed(([CR], [block(CR, TotalInstanceCount=3, AvailableInstanceCount=3)]),
                                         ([CR2], [block(CR2, TotalInstanceCount=8, AvailableInstanceCount=6)])))  # fmt: skip
    assert (prefill.reservation, prefill.roles, prefill.verdict) == (CR, "3 prefill", "pass")
    assert (decode.reservation, decode.roles, decode.verdict) == (CR2, "8 decode", "FAIL")
    assert decode.detail.startswith("6 of 8 available, 8 needed")


def test_a_group_counts_the_matching_reservations_it_holds() -> None:
    ctx = {"capacity": {"type": "odcr", "reservation_group_arn": GROUP}}
    ec2, rg = stubbed(([CR, CR2], [reservation(CR, AvailableInstanceCount=1), reservation(CR2, AvailabilityZone="us-east-2c")]), group=[CR, CR2])
    (row,) = rows(ctx, ec2, rg)
    assert (row.reservation, row.verdict) == ("trn3", "FAIL")
    assert row.detail == "1 of 2 available, 2 needed; 1 of 2 reservations of the group match"


def test_open_preference_needs_an_open_reservation() -> None:
    ctx = {"capacity": {"type": "odcr", "preference": "open", "reservation_id": CR}}
    (row,) = rows(ctx, *stubbed(([CR], [reservation(InstanceMatchCriteria="targeted")])))
    assert row.verdict == "FAIL" and "accepts only launches that target it" in row.detail
    (row,) = rows(ctx, *stubbed(([CR], [reservation(InstanceMatchCriteria="open")])))
    assert row.verdict == "pass"


def test_on_demand_checks_no_reservation() -> None:
    assert rows({}, *stubbed()) == []


def test_preflight_table_carries_the_capacity_rows() -> None:
    cfg = load_config(BLOCK)
    checks = preflight.check_capacity(cfg, *stubbed(([CR], [block(hours_left=4)])), now=NOW)
    assert [(c.name, c.ok, c.warn) for c in checks] == [(f"capacity {CR} (1 decode, 1 prefill)", True, True)]


def test_status_shows_the_time_a_block_has_left() -> None:
    cfg = load_config(BLOCK | {"compile_cache_s3_uri": "s3://gptoss-cache/neuron"})
    ec2, _ = stubbed(([CR], [block(hours_left=1.5)]))
    assert capacity.block_clock(cfg, ec2, [CR, CR], now=NOW) == [
        f"Capacity Block {CR}: 1 h 00 min left before EC2 reclaims its instances (2026-11-30 13:00 UTC); "
        "save the compile cache now: gptoss save-cache"
    ]


def test_status_says_a_blocks_nodes_are_draining_for_its_end_and_when_their_servers_stop() -> None:
    """Within the drain before the reclaim (the router's 1,800 s request timeout and a minute: 31 min), status says why
    the nodes take no new request, so that nobody mistakes the planned drain for an outage; 32 min before, it does not."""
    cfg = load_config(BLOCK)
    ec2, _ = stubbed(([CR], [block(hours_left=0.75)]))
    assert capacity.block_clock(cfg, ec2, [CR], now=NOW) == [
        f"Capacity Block {CR}: 0 h 15 min left before EC2 reclaims its instances (2026-11-30 12:15 UTC); DRAINING for the "
        "block's end since 11:44 UTC: its 1 prefill, 1 decode nodes take no new request (the load balancer and the routers "
        "send them none; what they hold finishes), their servers stop at 12:12 UTC, and nothing replaces them (healing holds "
        "to the end; not a failure)"
    ]
    ec2, _ = stubbed(([CR], [block(hours_left=1 + 2 / 60)]))
    assert "DRAINING" not in capacity.block_clock(cfg, ec2, [CR], now=NOW)[0]


def test_status_says_which_nodes_went_with_a_block_that_ended_and_how_they_come_back() -> None:
    """No node runs in the block any more (EC2 reclaimed them): the spec's block is asked about, and its end explains the gap."""
    cfg = load_config(BLOCK)
    ended = block(hours_left=-3, State="expired")
    ec2, _ = stubbed(([CR], [ended]))
    assert capacity.block_clock(cfg, ec2, [], now=NOW) == [
        f"Capacity Block {CR} ended 2026-11-30 09:00 UTC (EC2 reclaimed its instances from 08:30 UTC): the 1 prefill, 1 decode "
        "nodes it held went with it (not a failure; their groups' launches fail until there is capacity again): `gptoss blocks` "
        "finds a block that fits, then deploy with capacity.reservation_id"
    ]
    # Mixed capacity: only the role on the block is named.
    mixed = load_config({"capacity": {"type": "capacity-block", "roles": {"decode": {"reservation_id": CR}, "prefill": {"reservation_id": CR2}}}})
    ec2, _ = stubbed(([CR, CR2], [ended, block(CR2, hours_left=30)]))
    assert capacity.block_clock(mixed, ec2, [], now=NOW) == [
        f"Capacity Block {CR} ended 2026-11-30 09:00 UTC (EC2 reclaimed its instances from 08:30 UTC): the 1 decode nodes it held "
        "went with it (not a failure; their groups' launches fail until there is capacity again): `gptoss blocks` finds a block "
        "that fits, then deploy with capacity.reservation_id",
        f"Capacity Block {CR2}: 29 h 30 min left before EC2 reclaims its instances (2026-12-01 17:30 UTC)",
    ]


def test_a_capacity_failure_is_one_line_naming_the_role_and_the_fix() -> None:
    cfg = load_config({"decode_instances": "8"})
    events = [
        {"LogicalResourceId": "Prefill0Instance7BDA2628", "ResourceStatus": "CREATE_COMPLETE", "Timestamp": NOW},
        {"LogicalResourceId": "Decode3InstanceAB12CD34", "ResourceStatus": "CREATE_FAILED", "Timestamp": NOW + dt.timedelta(seconds=5),
         "ResourceStatusReason": "We currently do not have sufficient trn3.48xlarge capacity in the Availability Zone you requested "
                                 "(us-east-2a). (Service: Ec2, Status Code: 500, Request ID: x) (InsufficientInstanceCapacity)"},
        {"LogicalResourceId": "Decode4InstanceEF56AB78", "ResourceStatus": "CREATE_FAILED", "Timestamp": NOW + dt.timedelta(seconds=6),
         "ResourceStatusReason": "Resource creation cancelled"},
    ]  # fmt: skip
    line = capacity.explain_launch_failure(cfg, events)
    assert line is not None and "\n" not in line
    assert line.startswith("no capacity for decode (trn3.48xlarge in us-east-2a, on-demand)")
    assert "The stack rolled back: nothing is left running or billing." in line
    assert "capacity.type=odcr or capacity-block" in line and "another availability_zone" in line
    assert capacity.explain_launch_failure(cfg, events[:1] + events[2:]) is None


def test_status_names_a_pending_node_with_ec2s_reason_and_the_blocks_clock(tmp_path: Any, health_server: str) -> None:
    from cluster_ops.status import collect
    from tests.cluster_ops.ops_helpers import node_report, stub_fleet

    cfg = load_config(BLOCK)
    ec2 = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(ec2)

    def instance(iid: str, node: str, role: str, state: str, **extra: Any) -> dict[str, Any]:
        tags = [{"Key": "gptoss:cluster", "Value": cfg.cluster_name}, {"Key": "gptoss:node", "Value": node}, {"Key": "gptoss:role", "Value": role}]
        return {"InstanceId": iid, "State": {"Name": state}, "Tags": tags, "PrivateIpAddress": "10.42.0.5", "CapacityReservationId": CR} | extra

    stub.add_response("describe_instances", {"Reservations": [{"Instances": [
        instance("i-0aaaaaaaaaaaaaaa1", "prefill-0", "prefill", "running"),
        instance("i-0aaaaaaaaaaaaaaa2", "decode-0", "decode", "pending",
                 StateReason={"Code": "pending", "Message": "Capacity Block cr-0123456789abcdef0 has not started"}),
    ]}]})  # fmt: skip
    # status reads the clock: the block's dates are set from today's (10 h left).
    today = dt.datetime.now(dt.UTC)
    running = block(StartDate=today - dt.timedelta(hours=1), EndDate=today + dt.timedelta(hours=10))
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": [running]}, {"CapacityReservationIds": [CR]})
    stub.activate()
    ssm, _ = stub_fleet([[("i-0aaaaaaaaaaaaaaa1", node_report(cfg, "prefill-0", tmp_path, health_server))]])
    status = collect(cfg, ec2, ssm, sleep=lambda s: None)
    assert not status.ready
    assert status.failing == ["decode-0: instance pending (Capacity Block cr-0123456789abcdef0 has not started)"]
    assert len(status.notes) == 1 and status.notes[0].startswith(f"Capacity Block {CR}: ")
    assert "left before EC2 reclaims its instances" in status.notes[0]


# What an Auto Scaling group's failed launch says, per EC2 error a surge can meet when there is no room for
# one more instance, typed from AWS's words ("Troubleshoot Amazon EC2 Auto Scaling: EC2 instance launch
# failures"; the group's activity names the code first, or only says the words).
NO_ROOM_SAID = {
    "InsufficientInstanceCapacity": "We currently do not have sufficient trn3.48xlarge capacity in the Availability Zone you requested (us-east-2a). "
                                    "Our system will be working on provisioning additional capacity.",
    "InsufficientCapacity": "There is insufficient capacity to satisfy the request.",
    "InsufficientReservedInstanceCapacity": "Insufficient capacity in the Capacity Reservation to launch the instances.",
    "ReservationCapacityExceeded": "The Capacity Reservation has reached its limit of instances.",
    "VcpuLimitExceeded": "You have requested more vCPU capacity than your current vCPU limit of 2112 allows for the instance bucket that the "
                         "specified instance type belongs to. Please visit http://aws.amazon.com/contact-us/ec2-request to request an adjustment to this limit.",
    "InstanceLimitExceeded": "Your quota allows for 0 more running instance(s). You requested at least 1.",
    "InsufficientFreeAddressesInSubnet": "There are not enough free addresses in subnet 'subnet-0123456789abcdef0' to satisfy the requested number of instances.",
}  # fmt: skip


@pytest.mark.parametrize("code", sorted(NO_ROOM_SAID))
def test_every_no_room_error_of_a_surge_launch_sends_the_change_again_without_surge(code: str) -> None:
    """Each error the fallback claims (capacity, a reservation, a vCPU or instance quota, the subnet's addresses) is
    found in decode-3's own scaling activities since the deploy began, said with its code or in words only; a failure
    of another kind, or an older one, is not."""
    from cluster_ops import rollout

    assert set(NO_ROOM_SAID) == set(capacity.NO_ROOM), "every error the fallback names has its words here"
    cfg = load_config({"decode_instances": "8"})
    since = NOW - dt.timedelta(minutes=5)
    for said in (f"Could not launch On-Demand Instances. {code} - {NO_ROOM_SAID[code]} Launching EC2 instance failed.",
                 f"{NO_ROOM_SAID[code]} Launching EC2 instance failed."):  # fmt: skip
        autoscaling = boto3.client("autoscaling", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
        stub = Stubber(autoscaling)
        activity = {"ActivityId": "a", "AutoScalingGroupName": "gptoss-prod-decode-3", "Cause": "rolling update", "Progress": 100,
                    "Description": "Launching a new EC2 instance"}  # fmt: skip
        stub.add_response("describe_scaling_activities", {"Activities": [
            {**activity, "StartTime": NOW, "StatusCode": "Failed", "StatusMessage": "Invalid IAM Instance Profile name. Launching EC2 instance failed."},
            {**activity, "ActivityId": "b", "StartTime": since - dt.timedelta(hours=1), "StatusCode": "Failed", "StatusMessage": said},
        ]}, {"AutoScalingGroupName": "gptoss-8k1k-decode-3"})  # fmt: skip
        stub.add_response("describe_scaling_activities", {"Activities": [{**activity, "StartTime": NOW, "StatusCode": "Failed", "StatusMessage": said}]},
                          {"AutoScalingGroupName": "gptoss-8k1k-decode-3"})  # fmt: skip
        stub.activate()
        assert rollout.surge_found_no_capacity(cfg, autoscaling, ["decode-3"], since) == "", "not this kind, or before the deploy"
        assert rollout.surge_found_no_capacity(cfg, autoscaling, ["decode-3"], since) == f"decode-3: {said[:200]}"
        stub.assert_no_pending_responses()
