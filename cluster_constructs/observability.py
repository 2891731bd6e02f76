"""One log group, one dashboard and the alarms of the fleet, fed by every node's collector."""

from __future__ import annotations

from typing import Any

from aws_cdk import NestedStack, Stack
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_events as events
from aws_cdk import aws_logs as logs
from constructs import Construct

from clusterspec.cells import Cell
from clusterspec.config import ClusterConfig
from clusterspec.names import holder_name
from node_render import telemetry


def _search(cfg: ClusterConfig, metric: str, role: str | None, dims: str, stat: str = "Average") -> dict[str, Any]:
    """A SEARCH over every node/server of the cluster: one widget line per server, any fleet size."""
    where = f'MetricName="{metric}" Cluster="{cfg.cluster_name}"' + (f' Role="{role}"' if role else "")
    return {"expression": f"SEARCH('{{\"{telemetry.namespace(cfg)}\",{dims}}} {where}', '{stat}', {cfg.observability.interval_s})"}


def _widget(
    title: str, metrics: list[Any], *, x: int, y: int, width: int = 8, stat: str = "Average", **props: Any
) -> dict[str, Any]:
    return {
        "type": "metric",
        "x": x,
        "y": y,
        "width": width,
        "height": 6,
        "properties": {"title": title, "view": "timeSeries", "stat": stat, "metrics": metrics, "period": 60} | props,
    }


SERVER_GRAPHS = (
    ("ServerUp", "up (1) or down (0)"), ("TimeToFirstTokenMs", "time to first token (ms)"),
    ("TimePerOutputTokenMs", "time per output token (ms)"), ("GenerationTokensPerSecond", "generated tokens/s"),
    ("PromptTokensPerSecond", "prompt tokens/s"), ("RequestsRunning", "requests running"),
    ("RequestsWaiting", "requests waiting"), ("KvCacheUsagePercent", "KV cache used (%)"),
)  # fmt: skip
NODE_GRAPHS = (
    ("NeuronCoreUtilizationPercent", "NeuronCore utilization (%)"), ("NeuronDeviceMemoryUsedBytes", "Neuron device memory (bytes)"),
    ("NeuronExecutionErrors", "Neuron execution errors"), ("EfaRxBytesPerSecond", "EFA received (bytes/s)"),
    ("EfaTxBytesPerSecond", "EFA sent (bytes/s)"),
)  # fmt: skip


def _grid(widgets: list[dict[str, Any]], cfg: ClusterConfig, label: str, graphs: tuple[tuple[str, str], ...],
          role: str | None, dims: str, y: int) -> int:  # fmt: skip
    """One graph per metric, three to a row, each a SEARCH over every server or node; returns the next row."""
    for i, (metric, what) in enumerate(graphs):
        expr = _search(cfg, metric, role, dims) | {"id": f"m{i}"}
        widgets.append(_widget(f"{label}: {what}", [[expr]], x=(i % 3) * 8, y=y + (i // 3) * 6))
    return y + ((len(graphs) + 2) // 3) * 6


def dashboard_body(cfg: ClusterConfig, *, region: str, lb: tuple[str, str] | None) -> dict[str, Any]:
    """The dashboard's widgets (tokens for the load balancer's names are resolved by the stack)."""
    roles = (
        [("decode", "Decode servers"), ("prefill", "Prefill replicas")] if cfg.serving.disaggregated else [("server", "Server")]
    )
    widgets: list[dict[str, Any]] = [
        {
            "type": "text", "x": 0, "y": 0, "width": 24, "height": 2,
            "properties": {"markdown": f"# {cfg.cluster_name}: {cfg.recipe} on {cfg.instance_type}\n"
                           f"{len(cfg.layout.nodes)} nodes. Logs: log group `{telemetry.log_group(cfg)}`, stream `<node>/journal`."},
        },
        _widget(
            "Fleet: units not ready (worst node), servers down, staging failing, replacement held",
            [[telemetry.namespace(cfg), name, "Cluster", cfg.cluster_name] for name in ("UnitsNotReady", "ServersDown", "StagingFailing", "ReplacementHeld")],
            x=0, y=2, stat="Maximum",
        ),
    ]  # fmt: skip
    if lb:
        tg, nlb = lb
        widgets.append(
            _widget(
                "Load balancer: healthy and unhealthy proxies (group health)",
                [["AWS/NetworkELB", name, "TargetGroup", tg, "LoadBalancer", nlb] for name in ("HealthyHostCount", "UnHealthyHostCount")],
                x=8, y=2, stat="Minimum",
            )
        )  # fmt: skip
    # Each node identity's group: 1 in service, or 0 while its instance is replaced (or cannot be).
    groups = [f"{cfg.cluster_name}-{role}-" for role in sorted({n.role for n in cfg.layout.nodes})]
    where = " OR ".join(f'"{g}"' for g in groups)
    widgets.append(
        _widget(
            "Nodes: instances in service per node (0: being replaced, or no capacity)",
            [[{"expression": f"SEARCH('{{AWS/AutoScaling,AutoScalingGroupName}} MetricName=\"GroupInServiceInstances\" ({where})', 'Minimum', 60)", "id": "g"}]],
            x=16, y=2, stat="Minimum",
        )
    )  # fmt: skip
    y = 8
    if cfg.capacity.type == "capacity-block":
        # The block's clock, the lowest any node reads, against the alarms' thresholds.
        hours = [{"label": f"BlockEnds{h:g}h", "value": h} for h in cfg.capacity.notify_hours_before]
        widgets.append(_widget("Capacity Block: hours until EC2 reclaims its instances (end less 30 min)",
                               [[telemetry.namespace(cfg), "CapacityBlockHoursLeft", "Cluster", cfg.cluster_name]],
                               x=0, y=y, width=24, stat="Minimum", annotations={"horizontal": hours}))  # fmt: skip
        y += 6
    if cfg.proxy_kind == "vllm-router":
        # A SEARCH per metric (one line per router): the body stays the same size at any fleet size.
        for x, (title, names, stat) in enumerate((
            ("Routers: requests and errors per second", ("RouterRequestsPerSecond", "RouterErrorsPerSecond", "GateRetriesPerSecond"), "Sum"),
            ("Routers: servers out of rotation, decode queue", ("RouterUnhealthyServers", "RouterPendingDecode"), "Maximum"),
            ("Routers: mean request time (ms)", ("RouterRequestMs",), "Average"),
        )):  # fmt: skip
            metrics = [[_search(cfg, n, None, "Cluster,Node,Role", stat) | {"id": f"r{x}{i}"}] for i, n in enumerate(names)]
            widgets.append(_widget(title, metrics, x=8 * x, y=y, stat=stat))
        y += 6
    if cfg.proxy_kind == "vllm-router" and cfg.endpoint_auth == "keys":
        # Per API key, summed over the routers (a SEARCH: one line per key, however many keys).
        for x, (title, names) in enumerate((
            ("API keys: requests, refusals (429) and server errors per key", ("KeyRequests", "KeyLimited", "KeyServerErrors")),
            ("API keys: bytes answered per key", ("KeyBytesOut",)),
        )):  # fmt: skip
            metrics = [[_search(cfg, n, None, "Cluster,Key", "Sum") | {"id": f"k{x}{i}"}] for i, n in enumerate(names)]
            widgets.append(_widget(title, metrics, x=12 * x, y=y, width=12, stat="Sum"))
        y += 6
    for role, label in roles:
        y = _grid(widgets, cfg, label, SERVER_GRAPHS, role, "Cluster,Node,Role,Server", y)
    _grid(widgets, cfg, "Per node", NODE_GRAPHS, None, "Cluster,Node,Role", y)
    for w in widgets:
        w["properties"].setdefault("region", region)
    return {"widgets": widgets}


# A router's error share that is not a dead server's few seconds in flight (docs/benchmarks.md 'The endpoint under faults': one dead
# prefill replica of six costs about 2 % of one interval's requests, once).
ROUTER_ERROR_PERCENT = 5


def alarm_period_s(cfg: ClusterConfig) -> int:
    """An alarm period that holds at least one of a node's samples: its interval, rounded up to whole
    minutes (CloudWatch takes periods of 10 s, 30 s or a multiple of 60 s)."""
    return -(-cfg.observability.interval_s // 60) * 60


def periods(window_s: int, period_s: int) -> int:
    """How many periods cover a window (at least one)."""
    return max(1, -(-window_s // period_s))


def silent_window_s(cfg: ClusterConfig) -> int:
    """How long a node may publish nothing before its NodeSilent alarm fires: a replacement's launch
    and boot (15 minutes) plus its scripts' fetch budget (the collector starts once they are there)."""
    return 900 + cfg.boot.unit_caps_s["gptoss-scripts.service"]


# CloudWatch quotas: PutMetricAlarm, 3 transactions per second per Region. CloudFormation makes an
# alarm with one such call when the alarm's turn comes, and every resource with nothing left to wait
# for at once: the stack's alarms wait for one another in this many chains, so that at most this
# many are being made at any moment, whatever the fleet's size (hundreds of NodeSilent alarms at a
# first deploy otherwise, all when their nodes serve).
PUT_METRIC_ALARM_TPS = 3


def chain(alarms: list[cloudwatch.CfnAlarm], lanes: int = PUT_METRIC_ALARM_TPS) -> None:
    """Alarm i waits for alarm i - LANES: at most LANES of them are made at once."""
    for i in range(lanes, len(alarms)):
        alarms[i].add_resource_dependency(alarms[i - lanes])


def node_silent_alarm(scope: Construct, construct_id: str, *, config: ClusterConfig, node: str, role: str, topic: str) -> cloudwatch.CfnAlarm:
    """A node's heartbeat alarm: NodeReporting missing is the failure (a node that stopped reporting,
    or a replacement that never started to: its scripts could not be fetched, it never booted)."""
    period = alarm_period_s(config)
    window = silent_window_s(config)
    return cloudwatch.CfnAlarm(
        scope, construct_id, alarm_name=silent_alarm_name(config, node),
        alarm_description=f"{node} has published nothing for {window // 60} minutes: its instance is gone, hung or cut off, or a "
        "replacement never got its scripts. gptoss status shows the node; its group's activity says what happened.",
        namespace=telemetry.namespace(config), metric_name="NodeReporting",
        dimensions=[cloudwatch.CfnAlarm.DimensionProperty(name=k, value=v) for k, v in (("Cluster", config.cluster_name), ("Node", node), ("Role", role))],
        statistic="SampleCount", period=period, evaluation_periods=periods(window, period), threshold=1,
        comparison_operator="LessThanThreshold", treat_missing_data="breaching", alarm_actions=[topic], ok_actions=[topic],
    )  # fmt: skip


def silent_alarm_name(config: ClusterConfig, node: str) -> str:
    """A node's NodeSilent alarm, by the name of its group: <cluster>-<node>-NodeSilent."""
    return f"{holder_name(config.cluster_name, node)}-NodeSilent"


class NodeAlarms(NestedStack):
    """The NodeSilent alarms of one cell's nodes, in a nested stack of their own.

    Its stack waits for the cell (each alarm exists once its node has served: a first boot is the
    deploy gate's to judge) and for the alarms made before it (the fleet's, the earlier cells'), and
    its alarms wait for one another (chain): the whole stack's alarms are made PUT_METRIC_ALARM_TPS
    at a time. A cell's own alarms could not wait for another cell's: a nested stack's resources
    depend only on what is in it."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig, cell: Cell, topic: str) -> None:
        super().__init__(scope, construct_id, description=f"{config.cluster_name}: NodeSilent alarms of {', '.join(n.name for n in cell.nodes)}")
        chain([node_silent_alarm(self, f"{n.logical_id}Silent", config=config, node=n.name, role=n.role, topic=topic) for n in cell.nodes])


class FleetObservability(Construct):
    """Log group (retention set, removed with the stack), dashboard, alarms (the nodes' rights to publish: NodePolicy).

    The stack makes it after every cell, so its alarms exist once every node has served (the deploy
    gates): a first boot is the gate's to judge. Its alarms are made PUT_METRIC_ALARM_TPS at a time;
    each node's NodeSilent alarm is in its cell's NodeAlarms, made after these."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        load_balancer: tuple[str, str] | None,
        alarm_topic_arn: str,
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        obs = config.observability
        group = telemetry.log_group(config)
        # Encrypted at rest by CloudWatch Logs (always on); kept for the retention given, deleted with the stack.
        self.log_group = logs.CfnLogGroup(self, "Logs", log_group_name=group, retention_in_days=obs.log_retention_days)
        body = dashboard_body(config, region=stack.region, lb=load_balancer)
        self.body = body
        self.dashboard = cloudwatch.CfnDashboard(
            self, "Dashboard", dashboard_name=config.cluster_name, dashboard_body=stack.to_json_string(body)
        )
        actions = [alarm_topic_arn]
        period = alarm_period_s(config)
        cluster_dims = [cloudwatch.CfnAlarm.DimensionProperty(name="Cluster", value=config.cluster_name)]
        # Longer than a node within its own limits takes to serve (the deploy gate's wait): a node
        # replaced after the deploy that has not served by then never will without someone.
        boot_window = config.gate_timeout_s

        def alarm(name: str, metric: str, threshold: float, window_s: int, description: str, *, step: int = period) -> cloudwatch.CfnAlarm:
            return cloudwatch.CfnAlarm(
                self, name, alarm_name=f"{config.cluster_name}-{name}", alarm_description=description,
                namespace=telemetry.namespace(config), metric_name=metric, dimensions=cluster_dims,
                statistic="Maximum", period=step, evaluation_periods=periods(window_s, step), threshold=threshold,
                comparison_operator="GreaterThanOrEqualToThreshold", treat_missing_data="notBreaching", alarm_actions=actions, ok_actions=actions,
            )  # fmt: skip

        # Missing data is not breaching for these: a node that publishes nothing is its NodeSilent alarm's.
        self.alarms = [
            alarm("ServersDown", "ServersDown", 1, 3 * period,
                  "A server that answered on its instance (since its boot, a restart or a reboot) has stopped answering for 3 periods."),
            alarm("ReplacementHeld", "ReplacementHeld", 1, period,
                  "A node that cannot serve wants its instance replaced, and the node's or the fleet's replacement budget "
                  "(healing.node_replacements, fleet_replacements within budget_window_s) says no: it stays as it is until someone looks. "
                  "gptoss status and the node's gptoss-health-watch journal say why."),
            alarm("StagingFailing", "StagingFailing", 1, 15 * period,
                  "Staging (the instance store, checkpoint, examples, caches) has been failing on a node for 15 periods."),
            alarm("UnitsNotReady", "UnitsNotReady", 1, boot_window,
                  f"A node's units have not all been ready for {boot_window // 3600} h {boot_window % 3600 // 60} min, longer than a node "
                  "within its own limits takes to serve: a replacement that never serves, or a server that keeps failing. "
                  "gptoss status names the unit.", step=max(300, period)),
        ]  # fmt: skip
        # A Capacity Block's end is a planned event: the topic hears it notify_hours_before ahead of
        # EC2's reclaim (the nodes publish the hours left; the lowest of them counts).
        if config.capacity.type == "capacity-block" and config.observability.enabled:
            for hours in config.capacity.notify_hours_before:
                label = f"{hours:g}".replace(".", "_")
                self.alarms.append(cloudwatch.CfnAlarm(
                    self, f"BlockEnds{label}h", alarm_name=f"{config.cluster_name}-BlockEnds{label}h",
                    alarm_description=f"The Capacity Block the nodes run in has under {hours:g} h before EC2 starts reclaiming its "
                    "instances (its end less 30 min): extend it (gptoss blocks --extend) or deploy onto the next block.",
                    namespace=telemetry.namespace(config), metric_name="CapacityBlockHoursLeft", dimensions=cluster_dims,
                    statistic="Minimum", period=period, evaluation_periods=1, threshold=hours,
                    comparison_operator="LessThanThreshold", treat_missing_data="notBreaching", alarm_actions=actions,
                ))  # fmt: skip
        # A node identity's instance replaced after a failed health check (EC2's, or the node's own
        # report), or a replacement its group could not launch (no capacity): EventBridge matches the
        # groups' events, with the causes Auto Scaling documents, and an alarm counts the matches.
        prefixes = [{"prefix": f"{config.cluster_name}-{role}-"} for role in sorted({n.role for n in config.layout.nodes})]
        self.replaced = events.CfnRule(
            self, "NodeReplacedRule", description=f"{config.cluster_name}: a node's instance replaced after a failed health check",
            event_pattern={"source": ["aws.autoscaling"], "detail-type": ["EC2 Instance Terminate Successful"],
                           "detail": {"AutoScalingGroupName": prefixes, "Cause": [{"wildcard": f"*{c}*"} for c in telemetry.REPLACED_CAUSES]}},
        )  # fmt: skip
        self.unplaced = events.CfnRule(
            self, "NodeLaunchFailedRule", description=f"{config.cluster_name}: a node's group could not launch its instance",
            event_pattern={"source": ["aws.autoscaling"], "detail-type": ["EC2 Instance Launch Unsuccessful"], "detail": {"AutoScalingGroupName": prefixes}},
        )  # fmt: skip

        def matched(name: str, rule: events.CfnRule, description: str) -> cloudwatch.CfnAlarm:
            return cloudwatch.CfnAlarm(
                self, name, alarm_name=f"{config.cluster_name}-{name}", alarm_description=description,
                namespace="AWS/Events", metric_name="MatchedEvents", dimensions=[cloudwatch.CfnAlarm.DimensionProperty(name="RuleName", value=rule.ref)],
                statistic="Sum", period=60, evaluation_periods=1, threshold=1, comparison_operator="GreaterThanOrEqualToThreshold",
                treat_missing_data="notBreaching", alarm_actions=actions,
            )  # fmt: skip

        self.alarms += [
            matched("NodeReplaced", self.replaced, "A node's instance failed a health check (EC2's status checks, or the node's own report) "
                    "and its group replaced it; gptoss status shows why and how often."),
            matched("NodeCannotBeReplaced", self.unplaced, "A node's group could not launch an instance (no capacity in the AZ, the reservation "
                    "or the block, or a quota): the node is down until it can."),
        ]  # fmt: skip
        if config.proxy_kind == "vllm-router":
            self.alarms.append(
                alarm("RouterErrors", "RouterErrorPercent", ROUTER_ERROR_PERCENT, 3 * period,
                      f"A router answered {ROUTER_ERROR_PERCENT}% or more of its requests with an error for 3 periods in a row "
                      "(servers dying faster than its health checks take them out, or none left to route to).")
            )  # fmt: skip

            def cluster_metric(qid: str, metric: str) -> cloudwatch.CfnAlarm.MetricDataQueryProperty:
                return cloudwatch.CfnAlarm.MetricDataQueryProperty(
                    id=qid, return_data=False,
                    metric_stat=cloudwatch.CfnAlarm.MetricStatProperty(
                        metric=cloudwatch.CfnAlarm.MetricProperty(namespace=telemetry.namespace(config), metric_name=metric, dimensions=cluster_dims),
                        period=period, stat="Maximum"),
                )  # fmt: skip

            # A server every node says is ready that a router keeps out of rotation: the network between
            # them (a security group, a name that does not resolve), not a server still loading.
            self.alarms.append(
                cloudwatch.CfnAlarm(
                    self, "RouterCannotReachServers", alarm_name=f"{config.cluster_name}-RouterCannotReachServers",
                    alarm_description="A router has kept a server out of rotation for 15 periods while every node says all its units "
                    "are ready: the router cannot reach it (security group, name resolution, the server's port).",
                    metrics=[cluster_metric("r", "RouterUnhealthyServers"), cluster_metric("n", "UnitsNotReady"),
                             cloudwatch.CfnAlarm.MetricDataQueryProperty(id="unreachable", expression="IF(n == 0, r, 0)",
                                                                          label="servers out of rotation while every unit is ready", return_data=True)],
                    evaluation_periods=15, threshold=1, comparison_operator="GreaterThanOrEqualToThreshold", treat_missing_data="notBreaching",
                    alarm_actions=actions, ok_actions=actions,
                )
            )  # fmt: skip
        if load_balancer:
            tg, nlb = load_balancer
            dims = [{"Name": "TargetGroup", "Value": tg}, {"Name": "LoadBalancer", "Value": nlb}]

            def query(metric: str, qid: str, stat: str = "Maximum") -> cloudwatch.CfnAlarm.MetricDataQueryProperty:
                return cloudwatch.CfnAlarm.MetricDataQueryProperty(
                    id=qid, return_data=False,
                    metric_stat=cloudwatch.CfnAlarm.MetricStatProperty(
                        metric=cloudwatch.CfnAlarm.MetricProperty(namespace="AWS/NetworkELB", metric_name=metric, dimensions=[
                            cloudwatch.CfnAlarm.DimensionProperty(name=d["Name"], value=d["Value"]) for d in dims]),
                        period=60, stat=stat),
                )  # fmt: skip

            # A group out of rotation while others serve.
            self.alarms.append(
                cloudwatch.CfnAlarm(
                    self, "NlbUnhealthyHosts", alarm_name=f"{config.cluster_name}-NlbUnhealthyHosts",
                    alarm_description="A proxy's group (proxy, decode server, replicas) fails its health check while other groups serve.",
                    metrics=[query("UnHealthyHostCount", "u"), query("HealthyHostCount", "h"),
                             cloudwatch.CfnAlarm.MetricDataQueryProperty(id="partial", expression="IF(h >= 1, u, 0)", label="unhealthy while others serve", return_data=True)],
                    evaluation_periods=3, threshold=1, comparison_operator="GreaterThanOrEqualToThreshold", treat_missing_data="notBreaching",
                    alarm_actions=actions, ok_actions=actions,
                )
            )  # fmt: skip
            # No proxy healthy at all: the endpoint serves nobody. The load balancer's metric missing
            # (no target registered, or no data) is the same failure.
            self.alarms.append(
                cloudwatch.CfnAlarm(
                    self, "EndpointDown", alarm_name=f"{config.cluster_name}-EndpointDown",
                    alarm_description="No proxy behind the load balancer has passed its health check for 3 minutes: the endpoint serves nobody.",
                    namespace="AWS/NetworkELB", metric_name="HealthyHostCount",
                    dimensions=[cloudwatch.CfnAlarm.DimensionProperty(name=d["Name"], value=d["Value"]) for d in dims],
                    statistic="Maximum", period=60, evaluation_periods=3, threshold=1, comparison_operator="LessThanThreshold",
                    treat_missing_data="breaching", alarm_actions=actions, ok_actions=actions,
                )
            )  # fmt: skip
        chain(self.alarms)
