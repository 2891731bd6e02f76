"""One log group, one dashboard and the alarms of the fleet, fed by every node's collector."""

from __future__ import annotations

import json
from typing import Any

from aws_cdk import Stack
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_events as events
from aws_cdk import aws_logs as logs
from constructs import Construct

from clusterspec import telemetry
from clusterspec.config import ClusterConfig


def _search(cfg: ClusterConfig, metric: str, role: str | None, dims: str, stat: str = "Average") -> dict[str, Any]:
    """A SEARCH over every node/server of the cluster: one widget line per server, any fleet size."""
    where = f'MetricName="{metric}" Cluster="{cfg.cluster_name}"' + (f' Role="{role}"' if role else "")
    return {"expression": f"SEARCH('{{{telemetry.NAMESPACE},{dims}}} {where}', '{stat}', {cfg.observability.interval_s})"}


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
                           f"{len(cfg.layout.nodes)} nodes. Logs: log group `{telemetry.log_group(cfg)}`, one stream per node and unit."},
        },
        _widget(
            "Fleet: units not ready (worst node), servers down, staging failing",
            [[telemetry.NAMESPACE, name, "Cluster", cfg.cluster_name] for name in ("UnitsNotReady", "ServersDown", "StagingFailing")],
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
    if cfg.proxy_kind == "vllm-router":
        # A SEARCH per metric (one line per router): the body stays the same size at any fleet size.
        for x, (title, names, stat) in enumerate((
            ("Routers: requests and errors per second", ("RouterRequestsPerSecond", "RouterErrorsPerSecond", "RouterRetriesPerSecond"), "Sum"),
            ("Routers: servers out of rotation, decode queue", ("RouterUnhealthyServers", "RouterPendingDecode"), "Maximum"),
            ("Routers: mean request time (ms)", ("RouterRequestMs",), "Average"),
        )):  # fmt: skip
            metrics = [[_search(cfg, n, None, "Cluster,Node,Role", stat) | {"id": f"r{x}{i}"}] for i, n in enumerate(names)]
            widgets.append(_widget(title, metrics, x=8 * x, y=y, stat=stat))
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


class FleetObservability(Construct):
    """Log group (retention set, removed with the stack), dashboard, alarms (the nodes' rights to publish: NodePolicy)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        load_balancer: tuple[str, str] | None,
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
        actions = [obs.alarm_topic_arn] if obs.alarm_topic_arn else None
        period = max(60, obs.interval_s)

        def alarm(name: str, metric: str, threshold: float, periods: int, description: str) -> cloudwatch.CfnAlarm:
            return cloudwatch.CfnAlarm(
                self, name, alarm_name=f"{config.cluster_name}-{name}", alarm_description=description,
                namespace=telemetry.NAMESPACE, metric_name=metric, dimensions=[cloudwatch.CfnAlarm.DimensionProperty(name="Cluster", value=config.cluster_name)],
                statistic="Maximum", period=period, evaluation_periods=periods, threshold=threshold,
                comparison_operator="GreaterThanOrEqualToThreshold", treat_missing_data="notBreaching", alarm_actions=actions, ok_actions=actions,
            )  # fmt: skip

        self.alarms = [
            alarm(
                "ServersDown",
                "ServersDown",
                1,
                3,
                "A server that answered earlier in its boot has stopped answering for 3 minutes.",
            ),
            alarm(
                "StagingFailing",
                "StagingFailing",
                1,
                15,
                "Staging (checkpoint, examples, caches) has been failing on a node for 15 minutes.",
            ),
        ]
        # A node identity's instance replaced (EC2's status check or the node's own report), or a
        # replacement its group could not launch (no capacity): EventBridge matches the group's
        # events, and an alarm watches how many the rule matched.
        prefixes = [{"prefix": f"{config.cluster_name}-{role}-"} for role in sorted({n.role for n in config.layout.nodes})]
        self.replaced = events.CfnRule(
            self, "NodeReplacedRule", description=f"{config.cluster_name}: a node's instance replaced after a failed health check",
            event_pattern={"source": ["aws.autoscaling"], "detail-type": ["EC2 Instance Terminate Successful"],
                           "detail": {"AutoScalingGroupName": prefixes, "Cause": [{"wildcard": "*health*check*"}]}},
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
            matched("NodeReplaced", self.replaced, "A node's instance failed a health check (EC2's, or the node's own report) and its group replaced it; "
                    "gptoss status shows why and how often."),
            matched("NodeCannotBeReplaced", self.unplaced, "A node's group could not launch an instance (no capacity in the AZ, the reservation "
                    "or the block, or a quota): the node is down until it can."),
        ]  # fmt: skip
        if config.proxy_kind == "vllm-router":
            self.alarms.append(
                alarm(
                    "RouterErrors",
                    "RouterErrorPercent",
                    ROUTER_ERROR_PERCENT,
                    3,
                    f"A router answered {ROUTER_ERROR_PERCENT}% or more of its requests with an error for 3 periods in a row "
                    "(servers dying faster than its health checks take them out, or none left to route to).",
                )
            )
        if load_balancer:
            tg, nlb = load_balancer
            dims = [{"Name": "TargetGroup", "Value": tg}, {"Name": "LoadBalancer", "Value": nlb}]

            def query(metric: str, qid: str) -> cloudwatch.CfnAlarm.MetricDataQueryProperty:
                return cloudwatch.CfnAlarm.MetricDataQueryProperty(
                    id=qid, return_data=False,
                    metric_stat=cloudwatch.CfnAlarm.MetricStatProperty(
                        metric=cloudwatch.CfnAlarm.MetricProperty(namespace="AWS/NetworkELB", metric_name=metric, dimensions=[
                            cloudwatch.CfnAlarm.DimensionProperty(name=d["Name"], value=d["Value"]) for d in dims]),
                        period=60, stat="Maximum"),
                )  # fmt: skip

            # A group out of rotation while others serve; a fleet still compiling (no healthy target yet) is not an alarm.
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

    @staticmethod
    def published_names() -> set[str]:
        """Every metric name a node's collector publishes (the catalog)."""
        return {m.name for m in telemetry.ALL_METRICS}

    def referenced_names(self) -> set[str]:
        """Every metric of the project's namespace the dashboard and the alarms refer to."""
        import re

        text = json.dumps(self.body)
        # SEARCH expressions of the project's namespace (json.dumps escapes their quotes).
        names = set(re.findall(r"\{" + telemetry.NAMESPACE + r',[^}]*\} MetricName=\\"(\w+)\\"', text))
        for w in self.body["widgets"]:
            for m in w.get("properties", {}).get("metrics", []):
                if isinstance(m, list) and m and m[0] == telemetry.NAMESPACE:
                    names.add(m[1])
        names |= {a.metric_name for a in self.alarms if a.metric_name and a.namespace == telemetry.NAMESPACE}
        return names
