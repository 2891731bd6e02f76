"""The observability section: logs, metrics, the dashboard and the alarms' topic."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from clusterspec.base import Frozen
from clusterspec.errors import rule_error

EMAIL = re.compile(r"[^@\s]{1,64}@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+")
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653)


class ObservabilityConfig(Frozen):
    """Logs and metrics of every node to CloudWatch, one dashboard and alarms for the fleet."""

    enabled: bool = Field(True, description="The node's collector, the log group, the dashboard and the alarms.")
    interval_s: int = Field(60, ge=10, le=3600, description="How often each node publishes its metrics and ships its logs.")
    log_retention_days: int = Field(30, description="Retention of the cluster's log group (a CloudWatch Logs value).")
    alarm_topic_arn: str | None = Field(
        None,
        pattern=r"^arn:aws[a-z-]*:sns:[a-z0-9-]+:[0-9]{12}:[A-Za-z0-9_-]{1,256}$",
        description="Your SNS topic the alarms and the groups' notifications go to; without one the stack makes its own (<cluster>-alarms).",
    )
    alarm_emails: tuple[str, ...] = Field(
        (), max_length=20, description="E-mail addresses the stack's own alarm topic is subscribed to (each confirms by mail)."
    )

    @field_validator("alarm_emails")
    @classmethod
    def _emails(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for email in v:
            if not EMAIL.fullmatch(email):
                raise rule_error("observability.alarm_emails", email, "is not an e-mail address", 'give addresses like "oncall@example.com"')
        if len(set(v)) != len(v):
            raise rule_error("observability.alarm_emails", list(v), "names an address twice", "give each address once")
        return v

    @field_validator("log_retention_days")
    @classmethod
    def _retention(cls, v: int) -> int:
        if v not in LOG_RETENTION_DAYS:
            raise rule_error(
                "observability.log_retention_days", v, "is not a retention CloudWatch Logs offers",
                f"use one of {', '.join(map(str, LOG_RETENTION_DAYS))}",
            )  # fmt: skip
        return v
