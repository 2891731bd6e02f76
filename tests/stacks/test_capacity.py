"""Each capacity mode as the template launches it: market, reservation target, placement group."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import cfn_lint, nag_synth
from tests.stacks.template import groups, launch_templates, of_type

CR, CR2 = "cr-0123456789abcdef0", "cr-0fedcba9876543210"
GROUP = "arn:aws:resource-groups:us-east-2:123456789012:group/trn3-reservations"
MODES: dict[str, dict[str, Any]] = {
    "on-demand": {},
    "odcr": {"capacity": {"type": "odcr", "reservation_id": CR}},
    "odcr-group": {"capacity": {"type": "odcr", "reservation_group_arn": GROUP}},
    "odcr-open": {"capacity": {"type": "odcr", "preference": "open", "reservation_id": CR}},
    "odcr-in-placement-group": {"capacity": {"type": "odcr", "reservation_id": CR, "placement_group": "trn3-cpg"}},
    "capacity-block": {"capacity": {"type": "capacity-block", "reservation_id": CR}},
    "block-per-role": {"capacity": {"type": "capacity-block", "reservation_id": CR, "roles": {"decode": {"reservation_id": CR2}}}},
    "single-block": {"recipe": "gptoss-20b-single", "capacity": {"type": "capacity-block", "reservation_id": CR}},
}


@pytest.fixture(scope="module")
def capacity_synth(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return nag_synth(tmp_path_factory.mktemp("capacity.out"), MODES)


def _lt(synth: dict[str, Any], mode: str) -> dict[str, dict[str, Any]]:
    return launch_templates(synth["templates"][mode])


def _groups(synth: dict[str, Any], mode: str) -> dict[str, dict[str, Any]]:
    """Each node identity's group by role (the first node of each)."""
    out: dict[str, dict[str, Any]] = {}
    for node, g in sorted(groups(synth["templates"][mode]).items()):
        out.setdefault(node.split("-")[0], g)
    return out


def _placement_groups(t: dict[str, Any]) -> dict[str, Any]:
    return of_type(t, "AWS::EC2::PlacementGroup")


def test_on_demand_launches_without_reservation_in_a_placement_group_of_its_own(capacity_synth: dict[str, Any]) -> None:
    t = capacity_synth["templates"]["on-demand"]
    (pg,) = _placement_groups(t)
    for lt in _lt(capacity_synth, "on-demand").values():
        assert "CapacityReservationSpecification" not in lt and "InstanceMarketOptions" not in lt
        assert lt["Placement"] == {"GroupName": {"Ref": pg}}
    for g in _groups(capacity_synth, "on-demand").values():
        assert "CapacityReservationSpecification" not in g


def test_odcr_targets_the_reservation_or_the_group(capacity_synth: dict[str, Any]) -> None:
    """EC2 Auto Scaling targets a reservation from the group ("Target Capacity Reservations from your Auto
    Scaling group"): only there, so a replacement never lands outside it."""
    for mode, target in (("odcr", {"CapacityReservationIds": [CR]}), ("odcr-group", {"CapacityReservationResourceGroupArns": [GROUP]})):
        for g in _groups(capacity_synth, mode).values():
            assert g["CapacityReservationSpecification"] == {"CapacityReservationPreference": "capacity-reservations-only",
                                                             "CapacityReservationTarget": target}  # fmt: skip
        for lt in _lt(capacity_synth, mode).values():
            assert "CapacityReservationSpecification" not in lt and "InstanceMarketOptions" not in lt  # On-Demand pricing
            assert "GroupName" in lt["Placement"]
        assert len(_placement_groups(capacity_synth["templates"][mode])) == 1


def test_odcr_open_uses_any_matching_open_reservation(capacity_synth: dict[str, Any]) -> None:
    for lt in _lt(capacity_synth, "odcr-open").values():
        assert lt["CapacityReservationSpecification"] == {"CapacityReservationPreference": "open"}
    for g in _groups(capacity_synth, "odcr-open").values():
        assert "CapacityReservationSpecification" not in g, "the group's default: the template's preference"


def test_a_reservation_made_in_a_placement_group_is_used_from_that_group(capacity_synth: dict[str, Any]) -> None:
    t = capacity_synth["templates"]["odcr-in-placement-group"]
    assert _placement_groups(t) == {}, "the operator's group, not a second one of the stack's"
    for lt in _lt(capacity_synth, "odcr-in-placement-group").values():
        assert lt["Placement"] == {"GroupName": "trn3-cpg"}


def test_capacity_block_launches_with_its_market_type_and_no_placement_group(capacity_synth: dict[str, Any]) -> None:
    t = capacity_synth["templates"]["capacity-block"]
    assert _placement_groups(t) == {}, "a block places its instances together; EC2 needs no placement group"
    # "Set a market type on your launch template alongside a Capacity Reservation target on the group."
    for lt in _lt(capacity_synth, "capacity-block").values():
        assert lt["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
        assert "CapacityReservationSpecification" not in lt
        assert "Placement" not in lt
    for g in _groups(capacity_synth, "capacity-block").values():
        assert g["CapacityReservationSpecification"] == {"CapacityReservationPreference": "capacity-reservations-only",
                                                         "CapacityReservationTarget": {"CapacityReservationIds": [CR]}}  # fmt: skip
    single = next(iter(of_type(capacity_synth["templates"]["single-block"], "AWS::EC2::LaunchTemplate").values()))
    assert single["Properties"]["LaunchTemplateData"]["InstanceMarketOptions"] == {"MarketType": "capacity-block"}


def test_each_role_launches_into_its_own_block_when_given(capacity_synth: dict[str, Any]) -> None:
    gs = _groups(capacity_synth, "block-per-role")
    target = {role: g["CapacityReservationSpecification"]["CapacityReservationTarget"] for role, g in gs.items()}
    assert target == {"prefill": {"CapacityReservationIds": [CR]}, "decode": {"CapacityReservationIds": [CR2]}}


def test_every_capacity_mode_is_cdk_nag_and_cfn_lint_clean(capacity_synth: dict[str, Any]) -> None:
    (report,) = [r for r in capacity_synth["report"]["pluginReports"] if r["pluginName"] == "AwsSolutions"]
    assert report["conclusion"] == "success" and report["violations"] == []
    r = cfn_lint(list(capacity_synth["paths"].values()))
    assert r.returncode == 0, (r.stdout + r.stderr)[:4000]


def test_nodes_in_a_block_are_the_ones_the_gate_waits_for(capacity_synth: dict[str, Any]) -> None:
    """Nothing of the deploy gate changes with the capacity: every node still has its own."""
    t = capacity_synth["templates"]["capacity-block"]
    assert len(of_type(t, "AWS::CloudFormation::WaitCondition")) == len(of_type(t, "AWS::AutoScaling::AutoScalingGroup")) == 2



def test_every_capacity_mode_grants_the_node_exactly_the_allowlist(capacity_synth: dict[str, Any]) -> None:
    from clusterspec.loading import load_config
    from tests.stacks.least_privilege import assert_least_privilege

    for mode, t in capacity_synth["templates"].items():
        assert_least_privilege(t, load_config(MODES[mode]))
