"""The metrics every node publishes, in one catalog the node's collector and the dashboard share.

A node's collector (userdata/bin/gptoss-telemetry) reads the rendered telemetry.json: the
servers to scrape and which of these metrics to publish. The stack's dashboard and alarms
refer to the same names, and a test ties the two, so a renamed metric fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from clusterspec.config import ClusterConfig
from clusterspec.layout import Node

NAMESPACE_PREFIX = "GptOss"
# Published by gptoss-apply once per in-place change that restarted a unit (dims Cluster, Role): how long
# the node took to serve again. `gptoss diff`/`deploy` estimate the next change from it. Not the collector's.
RESTART_METRIC = "InPlaceRestartSeconds"


def namespace(cfg: ClusterConfig) -> str:
    """The cluster's own CloudWatch namespace: a node may publish only there (its policy's condition),
    so no node of another cluster in the account can write what this cluster's alarms read."""
    return f"{NAMESPACE_PREFIX}/{cfg.cluster_name}"


# The causes EC2 Auto Scaling gives when it takes an instance out of service after a failed health
# check, as its documentation words them: the node's own report (SetInstanceHealth, "a user
# health-check"), EC2's status checks ("an EC2 instance status checks failure"), and an instance EC2
# found stopped or terminated ("an EC2 health check indicating it has been terminated or stopped").
# A rolling update's or a scale-in's cause ("a difference between desired and actual capacity") is none.
REPLACED_CAUSES = (
    "taken out of service in response to a user health-check",
    "taken out of service in response to an EC2 instance status check",
    "taken out of service in response to an EC2 health check",
)


@dataclass(frozen=True)
class Metric:
    """One CloudWatch metric a node publishes."""

    name: str
    unit: str
    scope: str  # "server": dims Cluster/Node/Role/Server; "node" and "router": Cluster/Node/Role; "cluster": Cluster; "key": Cluster/Key
    source: str


SERVER_METRICS = (
    Metric("ServerUp", "Count", "server", "1 when the server answers its health route"),
    Metric("RequestsRunning", "Count", "server", "vllm:num_requests_running"),
    Metric("RequestsWaiting", "Count", "server", "vllm:num_requests_waiting"),
    Metric("KvCacheUsagePercent", "Percent", "server", "vllm:kv_cache_usage_perc (vllm:gpu_cache_usage_perc before 0.10)"),
    Metric("PromptTokensPerSecond", "Count/Second", "server", "rate of vllm:prompt_tokens_total"),
    Metric("GenerationTokensPerSecond", "Count/Second", "server", "rate of vllm:generation_tokens_total"),
    Metric("TimeToFirstTokenMs", "Milliseconds", "server", "mean of vllm:time_to_first_token_seconds over the interval"),
    Metric(
        "TimePerOutputTokenMs",
        "Milliseconds",
        "server",
        "mean of vllm:inter_token_latency_seconds (vllm:time_per_output_token_seconds before 0.11) over the interval",
    ),
)
NODE_METRICS = (
    Metric("NeuronCoreUtilizationPercent", "Percent", "node", "neuron-monitor: mean neuroncore_utilization of the cores in use"),
    Metric("NeuronDeviceMemoryUsedBytes", "Bytes", "node", "neuron-monitor: memory_used.neuron_runtime_used_bytes.neuron_device"),
    Metric("NeuronExecutionErrors", "Count", "node", "neuron-monitor: execution_stats.error_summary, summed"),
    Metric("EfaRxBytesPerSecond", "Bytes/Second", "node", "rate of /sys/class/infiniband/*/ports/*/hw_counters/rx_bytes"),
    Metric("EfaTxBytesPerSecond", "Bytes/Second", "node", "rate of /sys/class/infiniband/*/ports/*/hw_counters/tx_bytes"),
    Metric("NodeReporting", "Count", "node", "1 at every publish: the node's heartbeat (its NodeSilent alarm reads it missing as breaching)"),
)
# vLLM's router (proxy.kind=vllm-router): its Prometheus metrics, read on 127.0.0.1:metrics_port.
ROUTER_METRICS = (
    Metric("RouterRequestsPerSecond", "Count/Second", "router", "rate of vllm_router_pd_requests_total"),
    Metric("RouterErrorsPerSecond", "Count/Second", "router", "rate of vllm_router_pd_{prefill,decode,stream}_errors_total"),
    Metric("GateRetriesPerSecond", "Count/Second", "router", "requests the API gate (HAProxy) sent again through the router, per second"),
    Metric("RouterUnhealthyServers", "Count", "router", "servers whose vllm_router_worker_health is 0 (also by Cluster alone: the worst router)"),
    Metric("RouterPendingDecode", "Count", "router", "vllm_router_pd_pending_decode_requests (the decode queue)"),
    Metric("RouterRequestMs", "Milliseconds", "router", "mean of vllm_router_pd_request_duration_seconds over the interval"),
    Metric("RouterErrorPercent", "Percent", "cluster", "errors / requests over the interval, on the worst router"),
)
# Each API key's use of one router node (serving.endpoint.auth=keys): the gate's per-key table, over the interval.
KEY_METRICS = (
    Metric("KeyRequests", "Count", "key", "requests sent with the key (refused ones included), from the gate's per_key table"),
    Metric("KeyLimited", "Count", "key", "requests of the key answered 429 (over its rate or its concurrency)"),
    Metric("KeyServerErrors", "Count", "key", "requests of the key answered 5xx"),
    Metric("KeyBytesOut", "Bytes", "key", "bytes of the answers to the key's requests"),
)
CLUSTER_METRICS = (
    Metric("UnitsNotReady", "Count", "cluster", "units of the plan failed, starting, stopped or not answering (a oneshot that succeeded is done), on the worst node"),
    Metric("ServersDown", "Count", "cluster", "servers that answered earlier on this instance (a restart or a reboot remembers) and no longer do"),
    Metric("StagingFailing", "Count", "cluster", "1 while gptoss-stage.service or gptoss-nvme.service has failed or is retrying"),
    Metric("ReplacementHeld", "Count", "cluster", "1 while a node's health watch wants its instance replaced and a replacement budget says no"),
)
# A Capacity Block's clock (capacity.type=capacity-block): read from EC2 by each node, for the alarms before its end.
BLOCK_METRICS = (
    Metric("CapacityBlockHoursLeft", "Count", "cluster", "hours until EC2 starts reclaiming the node's Capacity Block (its end less 30 min)"),
)
ALL_METRICS = SERVER_METRICS + NODE_METRICS + ROUTER_METRICS + KEY_METRICS + CLUSTER_METRICS + BLOCK_METRICS


def log_group(cfg: ClusterConfig) -> str:
    """The cluster's CloudWatch Logs group: one stream per node (`<node>/journal`, each line after its unit's name)."""
    return f"/gptoss/{cfg.cluster_name}"


def block_drain_s(cfg: ClusterConfig) -> int:
    """How long before EC2 reclaims a Capacity Block's instances their node drains (takes no new request): the
    router's request timeout for what runs, and a minute."""
    return cfg.serving.proxy.router.request_timeout_s + 60


def block_stop_s(cfg: ClusterConfig) -> int:
    """How long before EC2 reclaims a Capacity Block's instances their servers stop: the collector looks once an
    interval, so two intervals and a minute ahead (the routers elsewhere then have the minute to take them out)."""
    return 2 * cfg.observability.interval_s + 60


def node_config(cfg: ClusterConfig, node: Node, servers: list[dict[str, str]], units: list[str], router_metrics_url: str | None = None,
                gate_socket: str | None = None) -> str:  # fmt: skip
    """The collector's telemetry.json for one node (`router_metrics_url` and the API gate's `gate_socket` on a router's node)."""
    block = cfg.capacity.target(node.role)[0] if cfg.capacity.type == "capacity-block" else None
    doc = {
        "namespace": namespace(cfg),
        "region": cfg.region,
        "cluster": cfg.cluster_name,
        "node": node.name,
        "role": node.role,
        "interval_s": cfg.observability.interval_s,
        "hang_s": cfg.healing.engine_hang_s,
        "log_group": log_group(cfg),
        "servers": servers,
        "units": units,
        "efa": cfg.serving.disaggregated,
        "metrics": [m.name for m in ALL_METRICS if (router_metrics_url or m not in ROUTER_METRICS) and (block or m not in BLOCK_METRICS)
                    and ((router_metrics_url and cfg.endpoint_auth == "keys") or m not in KEY_METRICS)],
        "restart_metric": RESTART_METRIC,
    }
    if router_metrics_url:
        doc["router_metrics_url"] = router_metrics_url
    if gate_socket:
        doc["gate_socket"] = gate_socket
    if block:
        # Drained before EC2 reclaims it (block_drain_s).
        doc |= {"block": block, "block_drain_s": block_drain_s(cfg), "block_retry_after_s": 600,
                # Its servers stop before the reclaim, two of the collector's intervals and a minute ahead (it looks once an interval).
                "block_stop_s": block_stop_s(cfg)}
    # Compact: the user data of a router node is near its budget (python3 -m json.tool shows it indented).
    return json.dumps(doc, separators=(",", ":")) + "\n"
