"""How long each boot step retries what can succeed later, and what the deploy gate must allow.

A boot step that fails once (S3 or the instance metadata slow to answer, a udev event that
lags under load, devices that appear late, a download cut half-way) is asked again with a
bounded back-off; only a failure that survives its budget reaches the deploy gate, which then
reports it (FAILURE, naming the unit and its error line) instead of rolling back a fleet for a
hiccup. The gate's own timeout must cover every budget end to end (ClusterConfig checks it).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from clusterspec.base import TEXT_MAX_CHARS

# gptoss-backoff's pauses before each automatic restart of a unit (staging, the servers):
# BACKOFF_BASE_S, doubling up to BACKOFF_MAX_S; systemd waits RESTART_SEC before each restart.
BACKOFF_BASE_S = 60
BACKOFF_MAX_S = 900
RESTART_SEC = 5
# gptoss-signal reports this long before the gate's timeout, so the reason arrives before
# CloudFormation's bare "timed out": longer than its longest blocking step (a test completion,
# 120 s, then a PUT of 30 s).
SIGNAL_MARGIN_S = 300


class BootConfig(BaseModel):
    """Each boot step's retry budget: attempts and the longest their attempts and pauses may take."""

    model_config = ConfigDict(frozen=True, extra="forbid", str_max_length=TEXT_MAX_CHARS)

    scripts_fetch_s: int = Field(
        600, ge=30, le=3600, description="gptoss-scripts: asks S3 for the node's scripts again (pauses doubling to 30 s) for this long."
    )
    identity_s: int = Field(600, ge=30, le=3600, description="gptoss-identity: asks the instance metadata (IMDSv2) again for this long.")
    nvme_attempts: int = Field(5, ge=1, le=20, description="gptoss-nvme: attempts to stripe, format and mount the instance store.")
    nvme_s: int = Field(600, ge=60, le=3600, description="gptoss-nvme: the longest its attempts and pauses (2, 4, 8, 16, 30 s) may take.")
    devices_s: int = Field(180, ge=10, le=3600, description="gptoss-node-check: how long it waits for the Neuron and EFA devices to appear.")
    stage_attempts: int = Field(
        3, ge=1, le=10,
        description="gptoss-stage: attempts (each up to stage_timeout_s, paused by the back-off) before the deploy gate reports staging failed.",
    )  # fmt: skip

    @property
    def stage_pauses_s(self) -> int:
        """What the back-off and systemd wait between the staging attempts, in all."""
        return sum(min(BACKOFF_BASE_S * 2**i, BACKOFF_MAX_S) + RESTART_SEC for i in range(self.stage_attempts - 1))

    @property
    def unit_caps_s(self) -> dict[str, int]:
        """Each boot unit's TimeoutStartSec: its retry budget, plus the one step it may be in when the budget ends."""
        return {
            "gptoss-scripts.service": self.scripts_fetch_s + 120,  # one S3 copy of the asset
            "gptoss-identity.service": self.identity_s + 60,  # one IMDS request
            "gptoss-nvme.service": self.nvme_s,  # gptoss-retry starts no attempt past it
            "gptoss-node-check.service": self.devices_s + 600,  # installing NIXL when the venv lacks it
        }

    def budget_s(self, stage_timeout_s: int) -> int:
        """The longest the boot steps may take before the servers start, end to end (every unit at its cap)."""
        return sum(self.unit_caps_s.values()) + stage_timeout_s + self.stage_pauses_s
