"""The healing section: what replaces a lost node and what a node reports of itself."""

from __future__ import annotations

from pydantic import Field

from clusterspec.base import Frozen


class HealingConfig(Frozen):
    """A node keeps its identity, not its instance: what replaces a lost one and what a node reports of itself.

    Each node identity (role, index, the replicas and ports it serves) is an Auto Scaling group
    of one instance: EC2's status checks and the node's own report (below) replace a failed
    instance with one of the same identity, in the same subnet, placement group and capacity.
    """

    members_poll_s: int = Field(
        30, ge=5, le=3600,
        description="How often a node re-reads the fleet's members (EC2, by the instances' identity tags): a replaced "
        "node's new address reaches a running router through its name in /etc/hosts, without a restart.",
    )  # fmt: skip
    report_unhealthy: bool = Field(
        True,
        description="A node that is up but cannot serve marks its own instance unhealthy, and its group replaces it: the "
        "node check failing after a reboot, Neuron execution errors past neuron_errors, a server in back-off longer than backoff_s.",
    )
    watch_interval_s: int = Field(
        60, ge=10, le=3600,
        description="How often a node's health watch checks whether it can serve (and reports itself when it cannot).",
    )  # fmt: skip
    backoff_s: int = Field(
        7200, ge=900, le=86400,
        description="A server restarting with back-off (crashing) for this long on a node that once served marks the node unhealthy.",
    )  # fmt: skip
    neuron_errors: int = Field(
        20, ge=1, le=100000,
        description="Neuron execution errors (neuron-monitor) in one check interval that mark the node unhealthy.",
    )  # fmt: skip
    neuron_error_intervals: int = Field(
        3, ge=1, le=60,
        description="How many consecutive telemetry intervals with neuron_errors or more mark the node unhealthy (one burst does not).",
    )  # fmt: skip
    check_grace_s: int = Field(
        120, ge=0, le=3600,
        description="How long a node check failed for a hardware cause (a device missing) marks the node unhealthy after; "
        "a configuration cause (no venv, NIXL) never does: a new instance would fail the same way.",
    )  # fmt: skip
    node_replacements: int = Field(
        2, ge=1, le=100,
        description="A node asks for no further replacement once its group has replaced this many instances within budget_window_s.",
    )  # fmt: skip
    fleet_replacements: int = Field(
        3, ge=1, le=10000,
        description="No node asks for a replacement once the cluster's groups have replaced this many instances within budget_window_s.",
    )  # fmt: skip
    budget_window_s: int = Field(
        21600, ge=600, le=7 * 86400,
        description="The window of the replacement budgets (Auto Scaling's own record of terminations).",
    )  # fmt: skip
    engine_hang_s: int = Field(
        600, ge=0, le=86400,
        description="A server whose engine holds requests and counts no prompt or generated token for this long, while its "
        "/health answers (the routers cannot tell), is killed by the node's collector and started again by systemd; "
        "0 turns it off. Read from vLLM's own /metrics each observability interval.",
    )  # fmt: skip
    grace_s: int = Field(
        900, ge=0, le=7200,
        description="The group's health-check grace period: EC2 status checks count from this long after a launch.",
    )  # fmt: skip
