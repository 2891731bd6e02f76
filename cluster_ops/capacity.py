"""The capacity the fleet launches into, as EC2 reports it: preflight's reservation checks and
the block clock `status` shows.

One row per reservation the config names (a role's, the section's, or each reservation of a
resource group), checked for what makes a launch fail: it exists, is active (a scheduled block
shows when it starts), is for this instance type, Linux/UNIX and this AZ, was made in the
placement group the nodes launch in, and has as many instances available as the roles that
target it need. A Capacity Block also shows its end: EC2 begins to terminate its instances 30
minutes before, so a block that ends within the first compile is a warning, and one with fewer
usable hours than capacity.min_hours_left fails.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from clusterspec.config import ClusterConfig
from node_render.telemetry import block_drain_s, block_stop_s

# EC2 "begins to terminate any instances that are still running in the Capacity Block" 30
# minutes before the reservation ends (Capacity Blocks user guide).
RECLAIM_LEAD = dt.timedelta(minutes=30)
PLATFORM = "Linux/UNIX"  # the Neuron DLAMI


@dataclass(frozen=True)
class Row:
    """One reservation's verdict: 'pass', 'warn' or 'FAIL'."""

    reservation: str
    roles: str
    verdict: str
    detail: str
    fix: str = ""


def _hours(delta: dt.timedelta) -> str:
    total = int(delta.total_seconds() // 60)
    return f"{total // 60} h {total % 60:02d} min" if total >= 0 else "ended"


def _usable_until(cr: dict[str, Any]) -> dt.datetime | None:
    end = cr.get("EndDate")
    return end - RECLAIM_LEAD if end else None


def needs(cfg: ClusterConfig) -> dict[tuple[str | None, str | None], Counter[str]]:
    """Instances each target (reservation id, group ARN) must hold, by role: its nodes, and with surge
    what a rollout runs beside them (rollout.surge_room)."""
    out: dict[tuple[str | None, str | None], Counter[str]] = {}
    for node in cfg.layout.nodes:
        out.setdefault(cfg.capacity.target(node.role), Counter())[node.role] += 1
    for counts in out.values():
        for role, n in list(counts.items()):
            counts[role] += cfg.rollout.surge_room(n, cfg.surge)
    return out


def _group_reservations(rg: Any, arn: str) -> list[str]:
    ids = []
    for page in rg.get_paginator("list_group_resources").paginate(Group=arn):
        for item in page.get("Resources", page.get("ResourceIdentifiers", [])):
            ident = item.get("Identifier", item)
            if ident.get("ResourceType") == "AWS::EC2::CapacityReservation":
                ids.append(ident["ResourceArn"].rsplit("/", 1)[1])
    return ids


def _problems(cfg: ClusterConfig, cr: dict[str, Any], now: dt.datetime) -> tuple[list[str], list[str]]:
    """(failures, warnings) of one reservation, whatever asks for it."""
    cap = cfg.capacity
    fail, warn = [], []
    block = cr.get("ReservationType") == "capacity-block"
    if cap.type == "capacity-block" and not block:
        fail.append("is an On-Demand Capacity Reservation, not a Capacity Block (set capacity.type=odcr)")
    if cap.type == "odcr" and block:
        fail.append("is a Capacity Block (set capacity.type=capacity-block)")
    state = cr.get("State")
    if state == "scheduled":
        start = cr.get("StartDate")
        fail.append(f"scheduled: starts {start:%Y-%m-%d %H:%M} UTC, in {_hours(start - now)}" if start else "scheduled")
    elif state != "active":
        fail.append(f"state {state}")
    if cr.get("InstanceType") != cfg.instance_type:
        fail.append(f"for {cr.get('InstanceType')}, not {cfg.instance_type}")
    if cr.get("InstancePlatform", PLATFORM) != PLATFORM:
        fail.append(f"for {cr.get('InstancePlatform')}, not {PLATFORM} (the DLAMI)")
    if cr.get("AvailabilityZone") != cfg.availability_zone:
        fail.append(f"in {cr.get('AvailabilityZone')}, not {cfg.availability_zone}")
    if cap.type == "odcr" and cap.preference == "open" and cr.get("InstanceMatchCriteria") == "targeted":
        fail.append("accepts only launches that target it, and capacity.preference is open")
    pg = (cr.get("PlacementGroupArn") or "").rsplit("/", 1)[-1] or None
    if pg and pg != cap.placement_group:
        fail.append(f"was made in placement group {pg}: the nodes must launch in it (capacity.placement_group={pg})")
    until = _usable_until(cr)
    if block and until is not None and state in ("active", "scheduled"):
        left = until - now
        first_ready = dt.timedelta(seconds=cfg.gate_timeout_s)
        if left <= dt.timedelta(0):
            fail.append("its instances are being reclaimed (it ends within 30 min)")
        elif left < dt.timedelta(hours=cap.min_hours_left):
            fail.append(f"{_hours(left)} of use left, capacity.min_hours_left is {cap.min_hours_left:g} h")
        elif left < first_ready:
            warn.append(f"{_hours(left)} of use left: the first compile may take up to {_hours(first_ready)} (ready_timeout_s)")
    return fail, warn


def check(cfg: ClusterConfig, ec2: Any, rg: Any, *, now: dt.datetime | None = None) -> list[Row]:
    """One row per reservation the fleet launches into (none for on-demand without a reservation)."""
    now = now or dt.datetime.now(dt.UTC)
    cap = cfg.capacity
    rows: list[Row] = []
    for (rid, group), roles in needs(cfg).items():
        if rid is None and group is None:
            continue  # on-demand, or odcr open without a named reservation
        who = ", ".join(f"{n} {r}" for r, n in sorted(roles.items()))
        need = sum(roles.values())
        name = rid or str(group).rsplit("/", 1)[-1]
        try:
            ids = [rid] if rid else _group_reservations(rg, str(group))
            found = ec2.describe_capacity_reservations(CapacityReservationIds=ids)["CapacityReservations"] if ids else []
        except ClientError as e:
            code = e.response["Error"]["Code"]
            what = "does not exist in " + cfg.region if "NotFound" in code or "Malformed" in code else e.response["Error"]["Message"]
            rows.append(Row(name, who, "FAIL", what, "check capacity.reservation_id (aws ec2 describe-capacity-reservations)"))
            continue
        if not found:
            rows.append(Row(name, who, "FAIL", "the group holds no capacity reservation", "add the reservations to the group"))
            continue
        usable = []
        for cr in found:
            fail, warn = _problems(cfg, cr, now)
            if fail and rid:
                rows.append(Row(rid, who, "FAIL", "; ".join(fail), _fix(fail)))
            elif not fail:
                usable.append((cr, warn))
        if rid and not usable:
            continue
        have = sum(cr.get("AvailableInstanceCount", 0) for cr, _ in usable)
        warns = [w for _, ws in usable for w in ws]
        detail = f"{have} of {sum(cr.get('TotalInstanceCount', 0) for cr, _ in usable)} available, {need} needed"
        blocks = [cr for cr, _ in usable if cr.get("EndDate")]
        if blocks:
            end = min(cr["EndDate"] for cr in blocks)
            detail += f"; ends {end:%Y-%m-%d %H:%M} UTC (reclaimed from {end - RECLAIM_LEAD:%H:%M})"
        if group:
            detail += f"; {len(usable)} of {len(found)} reservations of the group match"
        if have < need:
            rows.append(Row(name, who, "FAIL", detail, f"free {need - have} instances of it, reserve more, or lower decode_instances"))
        else:
            rows.append(Row(name, who, "warn" if warns else "pass", "; ".join([detail, *warns]), ""))
    if cap.type == "odcr" and cap.preference == "open" and cap.reservation_id is None:
        rows.append(Row("(any open)", "all", "warn", "no reservation named: preflight cannot check one", "set capacity.reservation_id"))
    return rows


def _fix(problems: list[str]) -> str:
    text = " ".join(problems)
    if "scheduled" in text:
        return "deploy once the block has started (launches into a scheduled block fail)"
    if "placement group" in text:
        return "set capacity.placement_group to the reservation's group"
    if "capacity.type" in text:
        return "set capacity.type to the reservation's kind"
    return "use a reservation that matches, or set availability_zone/instance_type to the reservation's"


def block_clock(cfg: ClusterConfig, ec2: Any, reservation_ids: list[str], *, now: dt.datetime | None = None) -> list[str]:
    """For `status`: how long each Capacity Block the nodes run in (or the spec names) has left, one line each;
    for a block that has ended, which nodes went with it and how they come back."""
    now = now or dt.datetime.now(dt.UTC)
    roles: list[str] = [n.role for n in cfg.layout.nodes]
    by_block: dict[str, list[str]] = {}
    for role in dict.fromkeys(roles):
        rid, _ = cfg.capacity.target(role)
        if rid:
            by_block.setdefault(rid, []).append(role)
    ids = sorted(set(reservation_ids) | set(by_block))
    if not ids:
        return []
    lines = []
    for cr in ec2.describe_capacity_reservations(CapacityReservationIds=ids)["CapacityReservations"]:
        until = _usable_until(cr)
        if cr.get("ReservationType") != "capacity-block" or until is None:
            continue
        left = until - now
        rid = cr["CapacityReservationId"]
        if left <= dt.timedelta(0) or cr.get("State") in ("expired", "cancelled", "failed"):
            held = by_block.get(rid, [])
            nodes = f"the {', '.join(f'{roles.count(r)} {r}' for r in held)} nodes" if held else "the nodes"
            lines.append(f"Capacity Block {rid} ended {cr['EndDate']:%Y-%m-%d %H:%M} UTC (EC2 reclaimed its instances from "
                         f"{until:%H:%M} UTC): {nodes} it held went with it (not a failure; their groups' launches fail "
                         "until there is capacity again): `gptoss blocks` finds a block that fits, then deploy with "
                         "capacity.reservation_id")  # fmt: skip
            continue
        line = f"Capacity Block {rid}: {_hours(left)} left before EC2 reclaims its instances ({until:%Y-%m-%d %H:%M} UTC)"
        drain, stop = dt.timedelta(seconds=block_drain_s(cfg)), dt.timedelta(seconds=block_stop_s(cfg))
        if left <= drain:
            held = by_block.get(rid, [])
            nodes = f"its {', '.join(f'{roles.count(r)} {r}' for r in held)} nodes" if held else "its nodes"
            line += (f"; DRAINING for the block's end since {until - drain:%H:%M} UTC: {nodes} take no new request (the load "
                     f"balancer and the routers send them none; what they hold finishes), their servers stop at "
                     f"{until - stop:%H:%M} UTC, and nothing replaces them (healing holds to the end; not a failure)")  # fmt: skip
        if left < dt.timedelta(hours=2) and cfg.compile_cache_s3_uri:
            line += "; save the compile cache now: gptoss save-cache"
        lines.append(line)
    return lines


# EC2's launch errors that mean no room for one more instance (capacity, a reservation, a quota, the
# subnet's addresses), each with the words an Auto Scaling group's failed launch says it in when its
# message does not name the code (AWS: "Troubleshoot Amazon EC2 Auto Scaling: EC2 instance launch
# failures"). A first deploy that meets one is explained in one line (explain_launch_failure); a
# surge that meets one is deployed again without surge, which needs no extra instance.
NO_ROOM = {
    "InsufficientInstanceCapacity": "We currently do not have sufficient",
    "InsufficientCapacity": "insufficient capacity",
    "InsufficientReservedInstanceCapacity": "Insufficient capacity",
    "ReservationCapacityExceeded": "Capacity Reservation has reached its limit",
    "VcpuLimitExceeded": "You have requested more vCPU capacity than your current vCPU limit",
    "InstanceLimitExceeded": "Your quota allows for",
    "InsufficientFreeAddressesInSubnet": "There are not enough free addresses in subnet",
}
CAPACITY_CODES = (*NO_ROOM, *NO_ROOM.values())
QUOTA_CODES = ("VcpuLimitExceeded", "InstanceLimitExceeded", NO_ROOM["VcpuLimitExceeded"], NO_ROOM["InstanceLimitExceeded"])


def explain_launch_failure(cfg: ClusterConfig, events: list[dict[str, Any]]) -> str | None:
    """The first capacity failure of a stack operation, as one line naming the role and the fix."""
    for e in sorted(events, key=lambda e: e.get("Timestamp") or dt.datetime.min.replace(tzinfo=dt.UTC)):
        reason = e.get("ResourceStatusReason") or ""
        if e.get("ResourceStatus", "").endswith("FAILED") and any(c in reason for c in CAPACITY_CODES):
            logical = e.get("LogicalResourceId", "")
            role = next((r for r in ("Prefill", "Decode", "Server") if logical.startswith(r)), "")
            role = role.lower() or "a node"
            where = f"{cfg.instance_type} in {cfg.availability_zone}"
            if any(c in reason for c in QUOTA_CODES):
                fix = "request a larger On-Demand vCPU quota for the family (`gptoss preflight` names it and counts what the fleet needs)"
            elif cfg.capacity.type == "on-demand":
                fix = ("reserve capacity (capacity.type=odcr or capacity-block; `gptoss preflight` checks it), "
                       "try another availability_zone, or lower decode_instances")  # fmt: skip
            else:
                fix = "the reservation has fewer instances available than the fleet needs: run `gptoss preflight`"
            return (f"no capacity for {role} ({where}, {cfg.capacity.type}): EC2 said {reason.strip()[:200]!r}. "
                    f"The stack rolled back: nothing is left running or billing. Fix: {fix}.")  # fmt: skip
    return None
