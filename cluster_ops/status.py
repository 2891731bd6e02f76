"""Readiness of every unit on every node, as each node reports it through SSM."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster_ops.remote import find_nodes, run_on_all
from clusterspec.config import ClusterConfig
from clusterspec.paths import BIN
from clusterspec.render import health_checks, render_cluster


@dataclass(frozen=True)
class UnitStatus:
    """One unit on one node: systemd's view, its health route, and what it waits for."""

    node: str
    unit: str
    state: str
    healthy: bool | None
    needs_health: bool
    sub: str = ""
    restarts: int = 0
    phase: str = ""
    last_log: str = ""

    @property
    def ready(self) -> bool:
        """Active, and answering its health route when it has one."""
        return self.state == "active" and (self.healthy is True or not self.needs_health)

    @property
    def problem(self) -> str:
        """Why the unit is not ready, in a few words ('' when it is)."""
        if self.ready:
            return ""
        if self.state == "active":
            return self.phase or "running, not answering its health route"
        # Between a failed attempt and the next: waiting to restart, or in gptoss-backoff (ExecStartPre)
        # before it. The node's StagingFailing metric counts the same states.
        if self.state == "activating" and (self.sub == "auto-restart" or (self.sub == "start-pre" and self.restarts > 0)):
            return f"retrying (restart {self.restarts})"
        if self.state in {"inactive", "failed"}:
            return f"NOT RUNNING ({self.state}{'/' + self.sub if self.sub else ''}): it should run"
        return self.state


@dataclass
class ClusterStatus:
    """What every node reported, against what the plan says it runs."""

    units: list[UnitStatus] = field(default_factory=list)
    missing_nodes: list[str] = field(default_factory=list)
    pending_nodes: dict[str, str] = field(default_factory=dict)  # node -> EC2's reason
    notes: list[str] = field(default_factory=list)  # e.g. how long a Capacity Block has left

    @property
    def ready(self) -> bool:
        """Every node present and running, and every unit ready."""
        return not self.missing_nodes and not self.pending_nodes and bool(self.units) and all(u.ready for u in self.units)

    @property
    def failing(self) -> list[str]:
        """`node: unit: why` for every unit that is not ready (with its last log line), and every missing node."""
        out = [f"{n}: no running instance" for n in self.missing_nodes]
        out += [f"{n}: instance pending" + (f" ({why})" if why else "") for n, why in self.pending_nodes.items()]
        out += [f"{u.node}: {u.unit}: {u.problem}" + (f" - last log: {u.last_log}" if u.last_log else "") for u in self.units if not u.ready]
        return out


def expected_units(cfg: ClusterConfig) -> dict[str, dict[str, bool]]:
    """Node -> unit -> has a health route, from the same rendering as the user data."""
    return {r.node.name: {unit: url is not None for unit, url, _ in health_checks(cfg, r)} for r in render_cluster(cfg)}


def collect(
    cfg: ClusterConfig,
    ec2: Any,
    ssm: Any,
    *,
    on_node: Callable[[str, str], None] = lambda node, status: None,
    sleep: Callable[[float], None] = time.sleep,
) -> ClusterStatus:
    """Ask every node at once (SSM Run Command) for its units' state and health."""
    expected = expected_units(cfg)
    nodes = find_nodes(ec2, cfg.cluster_name)
    status = ClusterStatus(missing_nodes=[n for n in expected if n not in nodes])
    # A pending instance cannot answer SSM yet: its reason is what there is to say.
    status.pending_nodes = {n: nodes[n].state_reason for n in expected if n in nodes and nodes[n].state == "pending"}
    present = [n for n in expected if n in nodes and n not in status.pending_nodes]
    if cfg.capacity.type == "capacity-block":
        from cluster_ops.capacity import block_clock

        status.notes = block_clock(cfg, ec2, [nodes[n].reservation_id for n in nodes if nodes[n].reservation_id])
    by_id = {nodes[n].instance_id: n for n in present}
    results = run_on_all(
        ssm, list(by_id), [f"{BIN}/gptoss-status"], timeout_s=60, sleep=sleep, on_done=lambda iid, st: on_node(by_id[iid], st)
    )
    for name in present:
        result, out = results[nodes[name].instance_id]
        reported: dict[str, dict[str, Any]] = {}
        if result == "Success":
            try:
                reported = {u["unit"]: u for u in json.loads(out)["units"]}
            except (ValueError, KeyError):
                reported = {}
        for unit, needs_health in expected[name].items():
            r = reported.get(unit)
            if r is None:
                state = "unreachable" if result != "Success" else "missing"
                status.units.append(UnitStatus(name, unit, state, None, needs_health))
                continue
            status.units.append(
                UnitStatus(
                    name, unit, r["state"], r["healthy"], needs_health, sub=r.get("sub", ""), restarts=int(r.get("restarts", 0)),
                    phase=r.get("phase", ""), last_log=r.get("last_log", ""),
                )
            )  # fmt: skip
    return status


def wait_ready(
    cfg: ClusterConfig,
    ec2: Any,
    ssm: Any,
    *,
    timeout_s: float,
    interval_s: float = 60,
    on_poll: Callable[[ClusterStatus, float], None] = lambda s, t: None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> ClusterStatus:
    """Poll until every unit is ready or the timeout passes; return the last status."""
    start = clock()
    while True:
        status = collect(cfg, ec2, ssm, sleep=sleep)
        elapsed = clock() - start
        on_poll(status, elapsed)
        if status.ready or elapsed >= timeout_s:
            return status
        sleep(min(interval_s, max(0.0, timeout_s - elapsed)))
