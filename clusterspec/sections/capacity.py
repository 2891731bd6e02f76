"""The capacity section: On-Demand, a reservation (ODCR), or a Capacity Block for ML, per role."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from clusterspec.base import Frozen
from clusterspec.errors import rule_error

CR_ID = r"^cr-[0-9a-f]{8,17}$"
CR_GROUP_ARN = r"^arn:(aws[a-z-]*):resource-groups:([a-z0-9-]+):[0-9]{12}:group/[A-Za-z0-9_.-]{1,300}$"


class RoleCapacity(Frozen):
    """The reservation one role launches into, when it is not the section's."""

    reservation_id: str | None = Field(None, pattern=CR_ID)
    reservation_group_arn: str | None = Field(None, pattern=CR_GROUP_ARN)


class CapacityConfig(Frozen):
    """Where the instances' capacity comes from: On-Demand, a reservation (ODCR), or a Capacity Block for ML."""

    type: Literal["on-demand", "odcr", "capacity-block"] = Field(
        "on-demand",
        description="on-demand: whatever EC2 has. odcr: On-Demand Capacity Reservations. capacity-block: a Capacity Block "
        "for ML (launched with market type capacity-block, no placement group: the block places its instances together).",
    )
    reservation_id: str | None = Field(None, pattern=CR_ID, description="The reservation (cr-...) every role launches into.")
    reservation_group_arn: str | None = Field(
        None, pattern=CR_GROUP_ARN, description="Or a capacity-reservation resource group (odcr; UltraServer blocks)."
    )
    preference: Literal["targeted", "open"] = Field(
        "targeted",
        description="odcr: targeted launches into the reservation named; open uses any matching open reservation "
        "(reservation_id then only tells preflight which one to check).",
    )
    placement_group: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-]{1,255}$",
        description="odcr: the cluster placement group the reservation was made in; the nodes launch in it "
        "instead of a group of the stack's.",
    )
    roles: dict[Literal["prefill", "decode", "server"], RoleCapacity] = Field(
        default_factory=dict, description="Per-role reservation, over the section's (e.g. a block for decode, another for prefill)."
    )
    min_hours_left: float = Field(
        0, ge=0, le=24 * 182, description="capacity-block: preflight fails when the block has fewer usable hours left than this."
    )
    notify_hours_before: tuple[float, ...] = Field(
        (24, 2),
        description="capacity-block: the alarm topic hears this many hours before EC2 starts reclaiming the block's instances "
        "(its end less 30 minutes), one alarm each (BlockEnds<N>h): time to extend it (gptoss blocks --extend) or move.",
    )

    @model_validator(mode="after")
    def _notify(self) -> CapacityConfig:
        for h in self.notify_hours_before:
            if not 0.5 <= h <= 24 * 14:
                raise rule_error("capacity.notify_hours_before", h, "must be between 0.5 and 336 hours", "give hours in that range")
        if len(set(self.notify_hours_before)) != len(self.notify_hours_before):
            raise rule_error("capacity.notify_hours_before", list(self.notify_hours_before), "names an hour twice", "keep one of each")
        return self

    def target(self, role: str) -> tuple[str | None, str | None]:
        """(reservation id, group ARN) the role's instances launch into."""
        over = self.roles.get(role)  # type: ignore[call-overload]
        if over and (over.reservation_id or over.reservation_group_arn):
            return over.reservation_id, over.reservation_group_arn
        return self.reservation_id, self.reservation_group_arn

    @model_validator(mode="after")
    def _rules(self) -> CapacityConfig:
        given = [k for k in ("reservation_id", "reservation_group_arn", "placement_group") if getattr(self, k) is not None]
        if self.type == "on-demand":
            extra = given + (["roles"] if self.roles else [])
            if extra:
                raise rule_error(
                    f"capacity.{extra[0]}", getattr(self, extra[0]), "names a reservation, but capacity.type is on-demand",
                    "set capacity.type to odcr or capacity-block, or remove it",
                )  # fmt: skip
            return self
        if self.type == "capacity-block":
            if self.preference != "targeted":
                raise rule_error(
                    "capacity.preference", self.preference, "a Capacity Block is used only by launches that target it",
                    "remove capacity.preference (targeted)",
                )  # fmt: skip
            if self.placement_group:
                raise rule_error(
                    "capacity.placement_group", self.placement_group,
                    "a Capacity Block places its instances close together itself; a placement group of ours could conflict with it",
                    "remove capacity.placement_group",
                )  # fmt: skip
        if self.type == "odcr" and self.preference == "open":
            targets = [k for k in ("reservation_group_arn",) if getattr(self, k)] + (["roles"] if self.roles else [])
            if targets:
                raise rule_error(
                    f"capacity.{targets[0]}", getattr(self, targets[0]),
                    "preference open launches into any matching open reservation, never into a named target",
                    "set capacity.preference=targeted, or remove the target",
                )  # fmt: skip
            return self
        for role in ("prefill", "decode", "server", None):
            if role is not None and role not in self.roles:
                continue
            rid, group = self.target(role) if role else (self.reservation_id, self.reservation_group_arn)
            where = f"capacity.roles.{role}" if role else "capacity"
            if rid and group:
                raise rule_error(
                    f"{where}.reservation_group_arn", group, "a launch targets one reservation or one group, not both",
                    f"remove {where}.reservation_id or {where}.reservation_group_arn",
                )  # fmt: skip
        return self

    def check(self, *, roles: tuple[str, ...], recipe: str, region: str, partition: str | None) -> None:
        """The reservations name this stack's roles, region and partition, and every role has one when it must."""
        for role in self.roles:
            if role not in roles:
                raise rule_error(
                    f"capacity.roles.{role}", self.roles[role].model_dump(exclude_none=True),
                    f"recipe {recipe} has no {role} instances (its roles: {', '.join(roles)})",
                    f"use capacity.roles.{' or capacity.roles.'.join(roles)}",
                )  # fmt: skip
        groups = {"capacity": self.reservation_group_arn} | {f"capacity.roles.{r}": c.reservation_group_arn for r, c in self.roles.items()}
        for where, group in groups.items():
            m = re.fullmatch(CR_GROUP_ARN, group or "")
            if m and (m.group(1), m.group(2)) != (partition, region):
                raise rule_error(
                    f"{where}.reservation_group_arn", group, f"instances in {region} launch into reservations of {region}",
                    f"give a resource group of {region}",
                )  # fmt: skip
        if self.type == "on-demand" or (self.type == "odcr" and self.preference == "open"):
            return
        for name in roles:
            if self.target(name) == (None, None):
                kind = "a Capacity Block is used only by launches that name it" if self.type == "capacity-block" else (
                    "a targeted launch names its reservation")
                raise rule_error(
                    "capacity.reservation_id", None, f"{kind}, and the {name} instances have none",
                    f"set capacity.reservation_id=cr-... (or capacity.roles.{name}.reservation_id)"
                    + (", or capacity.preference=open to use any matching open reservation" if self.type == "odcr" else ""),
                )  # fmt: skip
