"""The rollout section: how a change that replaces instances goes through a running fleet.

CloudFormation does it (docs/design.md 'Changes'): each node's group of one rolls its instance,
and the groups of a role are chained in lanes, so that at most max_unavailable nodes of a role
are being replaced at once and a node's replacement starts only after the one before it in its
lane serves (its deploy gate). With surge, the replacement is launched and serving before its
predecessor is terminated.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from clusterspec.base import Frozen
from clusterspec.errors import rule_error

# CloudFormation's limit on a rolling update's PauseTime, which is the surge signal's timeout.
PAUSE_MAX_S = 3600
# The context key `gptoss deploy` sets for a stack that does not exist yet: the synth leaves the
# rollout's chain out, so a first deploy launches every node at once.
FIRST_DEPLOY_CONTEXT = "gptoss:first-deploy"
PERCENT = re.compile(r"^([1-9][0-9]?|100)%$")


class RolloutConfig(Frozen):
    """Replacing the instances of a running fleet: how many at a time, and whether a replacement comes first."""

    max_unavailable: int | str = Field(
        1,
        description="Without surge, the most nodes of one role replaced at once: a count (>= 1) or a percentage of the "
        "role's nodes ('25%', rounded down, at least 1). The next node of a lane starts after the previous one serves.",
    )
    max_surge: int | str = Field(
        1,
        description="With surge, the most replacements of one role launched at once beside the instances they replace: a "
        "count (>= 1) or a percentage of the role's nodes ('10%', rounded up). A role of n nodes rolls in "
        "ceil(n / max_surge) batches; each batch needs that many spare instances (gptoss preflight counts them).",
    )
    surge: Literal["auto", "on", "off"] = Field(
        "auto",
        description="on: a replacement is launched and serving before the instance it replaces is terminated (the node's "
        "group grows to two for the while); off: terminate, then launch. auto: on for On-Demand capacity, off for a "
        "reservation or a Capacity Block (sized to the fleet: no room for a second instance), and off with wait_for_ready "
        "false (nothing would say when a replacement serves).",
    )
    surge_timeout_s: int = Field(
        PAUSE_MAX_S, ge=300, le=PAUSE_MAX_S,
        description="With surge, how long a replacement has to serve (its signal to its group's rolling update; "
        "CloudFormation allows at most one hour). A replacement that takes longer (a new image whose compile cache is "
        "cold) fails, is terminated, and the update rolls back: deploy such a change with surge off.",
    )  # fmt: skip
    drain_s: int = Field(
        90, ge=30, le=3600,
        description="How long an instance being terminated keeps running (a termination lifecycle hook): its requests "
        "finish and the routers move its name to its replacement before it goes.",
    )  # fmt: skip

    software: Literal["in-place", "replace"] = Field(
        "in-place",
        description="How a change of a node's software (its scripts, units, server flags and environment, the telemetry "
        "and health settings) reaches a running fleet. in-place: each node fetches the new version and restarts only the "
        "units whose files changed, at most max_unavailable nodes of a role at a time (a State Manager association the "
        "deploy waits for); its instance, NVMe, checkpoint and compile cache stay. replace: the software is part of the "
        "launch template, and a change replaces every node's instance (the rollout above).",
    )
    apply_timeout_s: int = Field(
        1800, ge=120, le=43200,
        description="in-place: how long one node has to serve again after its units restart (the servers reload the "
        "checkpoint from its NVMe and the compiled graphs from its cache). A node that does not is rolled back on the node "
        "to the version it ran, and the change stops there.",
    )  # fmt: skip

    @field_validator("max_unavailable", "max_surge", mode="before")
    @classmethod
    def _count_or_percent(cls, v: object, info: ValidationInfo) -> int | str:
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v.strip())
        if isinstance(v, bool) or not ((isinstance(v, int) and v >= 1) or (isinstance(v, str) and PERCENT.match(v))):
            name = f"rollout.{info.field_name}"
            raise rule_error(
                name, v, "is a count of nodes (1 or more) or a percentage of a role's nodes (1% to 100%)",
                f"set {name}=1 (the default), a larger count, or a percentage such as 25%",
            )  # fmt: skip
        return v

    def check(self, *, wait_for_ready: bool, members_poll_s: int) -> None:
        """The rules that involve other sections: the deploy gate (surge) and the members' poll (drain)."""
        if self.surge == "on" and not wait_for_ready:
            raise rule_error(
                "rollout.surge", "on", "a surge terminates the old instance when its replacement says it serves, which the deploy "
                "gate's checks say (wait_for_ready false turns them off)", "set wait_for_ready=true, or rollout.surge=off",
            )  # fmt: skip
        if self.drain_s < 2 * members_poll_s + 10:
            raise rule_error(
                "rollout.drain_s", self.drain_s,
                f"an instance being terminated must run until every router has read the members twice (2 x healing.members_poll_s "
                f"{members_poll_s} s + 10 s), or its name points at nothing for up to a poll",
                f"set rollout.drain_s to {2 * members_poll_s + 10} or more, or lower healing.members_poll_s",
            )  # fmt: skip

    def lanes(self, nodes: int, surge: bool) -> int:
        """The lanes of a role of NODES: how many of its nodes are replaced at once. With SURGE, max_surge
        (a percentage rounded up: replacements come before anything goes); without, max_unavailable (a
        percentage rounded down: that many are out). At least 1, at most the role's nodes."""
        limit = self.max_surge if surge else self.max_unavailable
        if isinstance(limit, int):
            return max(1, min(limit, nodes))
        share = nodes * int(limit[:-1])
        return max(1, min(nodes, -(-share // 100) if surge else share // 100))

    def surge_room(self, nodes: int, surge: bool) -> int:
        """How many instances more than a role of NODES a rollout may run at once: with SURGE, a batch's
        replacements beside the instances they replace, and the previous batch's old instances still in
        their drain hook (CloudFormation does not wait for it) when there is a next batch; none without."""
        if not surge:
            return 0
        lanes = self.lanes(nodes, surge)
        return lanes + min(max(nodes - lanes, 0), lanes)

    def surges(self, capacity_type: str, gated: bool = True) -> bool:
        """Whether a replacement comes before its predecessor goes: for a fleet of this capacity,
        whose nodes report that they serve (GATED: the deploy gate's checks are what the surge's
        signal says; without them nothing would say when the replacement serves)."""
        return gated and (self.surge == "on" or (self.surge == "auto" and capacity_type == "on-demand"))
