"""Readiness of every unit on every node, as each node reports it through SSM."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster_ops.remote import find_nodes, run_on_all
from clusterspec.config import ClusterConfig
from clusterspec.names import node_order
from node_render.node_health import health_checks
from node_render.paths import BIN
from node_render.render import render_cluster
from node_render.telemetry import REPLACED_CAUSES


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


@dataclass(frozen=True)
class Identity:
    """A node identity: the instance that holds it now, and how often its group replaced one (and why)."""

    node: str
    instance_id: str = ""  # "" while no instance runs for it
    state: str = ""
    replaced: int = 0
    last_cause: str = ""  # the group's words for the latest replacement or failed launch
    last_at: str = ""
    reported: str = ""  # what the node said of itself when it asked to be replaced (gptoss-health-watch)
    private_ip: str = ""
    newer: tuple[str, ...] = ()  # a replacement launched beside the instance (a surge), not holding the name yet


@dataclass
class ClusterStatus:
    """What every node reported, against what the plan says it runs."""

    units: list[UnitStatus] = field(default_factory=list)
    missing_nodes: list[str] = field(default_factory=list)
    pending_nodes: dict[str, str] = field(default_factory=dict)  # node -> EC2's reason
    notes: list[str] = field(default_factory=list)  # e.g. how long a Capacity Block has left
    identities: list[Identity] = field(default_factory=list)
    no_report: dict[str, str] = field(default_factory=dict)  # node -> why it reported no unit (SSM's status, or no output)
    software: dict[str, tuple[str, bool]] = field(default_factory=dict)  # node -> (the software version it runs, applying one now)

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


# A group's activity that took its instance out of service because a health check failed (EC2's,
# or the node's own SetInstanceHealth): telemetry.REPLACED_CAUSES; or a launch that did not succeed.


def identities(
    cfg: ClusterConfig, nodes: dict[str, Any], autoscaling: Any | None, logs: Any | None = None
) -> list[Identity]:
    """Each node identity with its current instance, and from its group's activities (kept six weeks)
    how many times it was replaced after a failed health check, and the latest cause."""
    from clusterspec.names import holder_name

    out = []
    for n in cfg.layout.nodes:
        inst = nodes.get(n.name)
        replaced, cause, when, reported = 0, "", "", ""
        if autoscaling is not None:
            pages = autoscaling.get_paginator("describe_scaling_activities").paginate(AutoScalingGroupName=holder_name(cfg.cluster_name, n.name))
            activities = [a for page in pages for a in page.get("Activities", [])]
            terminated = [a for a in activities if a.get("Description", "").startswith("Terminating") and any(w in a.get("Cause", "") for w in REPLACED_CAUSES)]
            failed = [a for a in activities if a.get("StatusCode") == "Failed" and a.get("Description", "").startswith("Launching")]
            replaced = len(terminated)
            latest = max([*terminated, *failed], key=lambda a: a["StartTime"], default=None)
            if latest:
                cause = (latest.get("StatusMessage") if latest in failed else None) or latest.get("Cause", "")
                start = latest.get("StartTime")
                when = start.strftime("%Y-%m-%d %H:%M UTC") if hasattr(start, "strftime") else str(start or "")
            if terminated and logs is not None:
                reported = _self_report(cfg, logs, n.name)
        held = (inst.instance_id, inst.state, inst.private_ip, inst.newer) if inst else ("", "", "", ())
        out.append(Identity(n.name, held[0], held[1], replaced, cause, when, reported, private_ip=held[2], newer=held[3]))
    return out


# The node's health watch, as its lines read in the node's journal stream (gptoss-telemetry: `<unit>: <message>`).
WATCH_PREFIX = "gptoss-health-watch.service: "
# How far back the node's own last word is looked for, and how many pages of matches at most.
SELF_REPORT_DAYS, SELF_REPORT_PAGES = 7, 10


def _self_report(cfg: ClusterConfig, logs: Any, node: str) -> str:
    """The node's own last word before it asked to be replaced: its health watch's last `unhealthy: ` line in
    the node's journal stream (the last week's, a bounded number of pages of matches)."""
    import time

    from node_render import telemetry

    kw: dict[str, Any] = {"logGroupName": telemetry.log_group(cfg), "logStreamNames": [f"{node}/journal"],
                          "filterPattern": '"unhealthy: "', "startTime": int((time.time() - SELF_REPORT_DAYS * 86400) * 1000)}  # fmt: skip
    marked: list[str] = []
    try:
        for _ in range(SELF_REPORT_PAGES):
            page = logs.filter_log_events(**kw)
            marked += [e["message"] for e in page.get("events", []) if e["message"].startswith(WATCH_PREFIX) and "unhealthy: " in e["message"]]
            if not page.get("nextToken"):
                break
            kw["nextToken"] = page["nextToken"]
    except logs.exceptions.ResourceNotFoundException:
        pass
    if not marked:  # a node of an earlier release: its collector gave each unit a stream of its own
        try:
            events = logs.get_log_events(logGroupName=kw["logGroupName"], logStreamName=f"{node}/gptoss-health-watch.service", limit=20,
                                         startFromHead=False)["events"]  # fmt: skip
        except logs.exceptions.ResourceNotFoundException:
            return ""
        marked = [e["message"] for e in events if "unhealthy: " in e["message"]]
    return marked[-1].split("unhealthy: ", 1)[1] if marked else ""


def expected_units(cfg: ClusterConfig) -> dict[str, dict[str, bool]]:
    """Node -> unit -> has a health route, from the same rendering as the user data."""
    return {r.node.name: {unit: url is not None for unit, url, _ in health_checks(cfg, r)} for r in render_cluster(cfg)}


def collect(
    cfg: ClusterConfig,
    ec2: Any,
    ssm: Any,
    *,
    autoscaling: Any | None = None,
    logs: Any | None = None,
    on_node: Callable[[str, str], None] = lambda node, status: None,
    sleep: Callable[[float], None] = time.sleep,
) -> ClusterStatus:
    """Ask every node at once (SSM Run Command) for its units' state and health; with `autoscaling`,
    each node identity's current instance and replacements too."""
    expected = expected_units(cfg)
    nodes = find_nodes(ec2, cfg.cluster_name)
    status = ClusterStatus(missing_nodes=[n for n in expected if n not in nodes])
    status.identities = identities(cfg, nodes, autoscaling, logs)
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
                doc = json.loads(out)
                reported = {u["unit"]: u for u in doc["units"]}
                status.software[name] = (str(doc.get("software") or ""), bool(doc.get("applying")))
            except (ValueError, KeyError, TypeError, AttributeError):
                reported = {}
        if result != "Success":
            status.no_report[name] = f"SSM Run Command {result}"
        elif not reported:
            status.no_report[name] = "it ran gptoss-status and printed " + (f"no status ({out.strip()[:60]!r})" if out.strip() else "nothing")
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


def summary(status: ClusterStatus, endpoint: str | None = None) -> list[str]:
    """The last lines of `gptoss status`: how much is ready, and the likeliest cause of what is not."""
    nodes = {u.node for u in status.units} | set(status.missing_nodes) | set(status.pending_nodes)
    ready_nodes = {n for n in nodes if n not in status.missing_nodes and n not in status.pending_nodes} - {u.node for u in status.units if not u.ready}
    ready = sum(u.ready for u in status.units)
    head = f"{'ready' if status.ready else 'not ready'}: {ready}/{len(status.units)} units ready, {len(ready_nodes)}/{len(nodes)} nodes serving"
    if status.ready:
        return [head]
    return [head, f"likely cause: {likely_cause(status, endpoint)}"]


def likely_cause(status: ClusterStatus, endpoint: str | None = None) -> str:
    """The first thing to look at, in the order a node comes up: its instance, SSM, its scripts, its units."""
    if status.missing_nodes:
        names = ", ".join(status.missing_nodes)
        return (f"{names}: no running instance. Its group launches a replacement, or cannot: the nodes table shows its latest "
                "failed launch (capacity, quota); gptoss preflight checks both")  # fmt: skip
    if status.pending_nodes:
        return f"{', '.join(status.pending_nodes)}: the instance is still starting; run status again in a minute"
    silent = {n: why for n, why in status.no_report.items() if "printed" in why}
    if silent:
        names = ", ".join(silent)
        if endpoint:
            return (f"{names}: Run Command succeeded with no output. {endpoint} (AWS_ENDPOINT_URL) runs no command on an "
                    "instance (moto answers every one with empty output): expected locally; on AWS this status comes from booted nodes")  # fmt: skip
        return (f"{names}: the node answered but printed no status: its scripts are not installed yet (gptoss-scripts fetches "
                "them at boot) or failed to install; the deploy gate's FAILURE reason in the stack events names why")  # fmt: skip
    if status.no_report:
        names = ", ".join(status.no_report)
        return (f"{names}: the SSM agent did not answer ({next(iter(status.no_report.values()))}): the instance is still booting, "
                "or cannot reach SSM (with egress none: the ssm, ssmmessages and ec2messages endpoints)")  # fmt: skip
    failed = [u for u in status.units if not u.ready and u.state in ("failed", "inactive")]
    if failed:
        u = failed[0]
        return f"{u.node}: {u.unit} {u.problem}" + (f" - last log: {u.last_log}" if u.last_log else "")
    waiting = [u for u in status.units if not u.ready]
    u = waiting[0]
    return (f"{u.node}: {u.unit}: {u.problem}" + (f" - last log: {u.last_log}" if u.last_log else "")
            + "; servers that compile take long at first boot (gptoss wait-ready waits, up to 6 h)")  # fmt: skip


def software_lines(status: ClusterStatus) -> list[str]:
    """Which software version each node runs (its first 12 hex digits), and the nodes applying one now
    (rollout.software=in-place: State Manager's association runs gptoss-apply on them)."""
    from cluster_ops.rollout import span

    by_version: dict[str, list[str]] = {}
    for node, (version, _) in status.software.items():
        by_version.setdefault(version[:12] or "none yet (its software is not installed)", []).append(node)
    if not by_version:
        return []
    said = "; ".join(f"{span(sorted(nodes, key=node_order))} run{'s' if len(nodes) == 1 else ''} {v}"
                     for v, nodes in sorted(by_version.items(), key=lambda kv: node_order(kv[1][0])))  # fmt: skip
    out = [f"software: {said}" + (" (two versions: a change in progress, or a node that did not take the last one)" if len(by_version) > 1 else "")]
    applying = sorted((n for n, (_, now) in status.software.items() if now), key=node_order)
    if applying:
        out.append(f"software change in progress on {span(applying)}: gptoss-apply restarts its changed units, and the node rejoins once it serves")
    return out
