"""The deploy gate, the log group, the dashboard and the alarms, as the template provisions them."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from node_render import telemetry
from tests.conftest import Synth
from tests.stacks.template import of_type


def _user_data(resource: dict[str, Any]) -> str:
    """A node's launch template's user data as text, with each token shown as <Ref:id>."""
    join = resource["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]
    parts = join["Fn::Join"][1] if isinstance(join, dict) else [join]
    return "".join(p if isinstance(p, str) else f"<Ref:{p.get('Ref', json.dumps(p))}>" for p in parts)


def _templates(t: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return of_type(t, "AWS::EC2::LaunchTemplate")


def test_each_node_has_its_own_gate_that_waits_for_its_group_to_launch_its_instance(default_synth: Synth) -> None:
    t = default_synth.template
    holders = of_type(t, "AWS::AutoScaling::AutoScalingGroup")
    conditions = of_type(t, "AWS::CloudFormation::WaitCondition")
    # NetworkReady is a handle only as the nodes' one dependency on their network path.
    handles = {k: v for k, v in of_type(t, "AWS::CloudFormation::WaitConditionHandle").items() if k != "NetworkReady"}
    assert len(holders) == len(conditions) == len(handles) == 2
    waited_for = set()
    for c in conditions.values():
        p = c["Properties"]
        assert p["Count"] == 1 and p["Timeout"] == "24900", "every boot budget + staging + server start + margin, rounded up to 5 min"
        assert p["Handle"]["Ref"] in handles
        (holder,) = [d for d in c["DependsOn"] if d in holders]
        waited_for.add(holder)
        # The node's launch template (what any of its instances boots from) carries exactly its own gate's handle.
        template = t["Resources"][holders[holder]["Properties"]["LaunchTemplate"]["LaunchTemplateId"]["Ref"]]
        ud = _user_data(template)
        assert f"<Ref:{p['Handle']['Ref']}>" in ud
        assert [h for h in handles if f"<Ref:{h}>" in ud] == [p["Handle"]["Ref"]]
    assert waited_for == set(holders)


def test_the_gate_needs_no_iam_permission(default_synth: Synth) -> None:
    """The node signals through the handle's presigned URL; the role grants nothing of CloudFormation."""
    policies = json.dumps(of_type(default_synth.template, "AWS::IAM::Policy"))
    assert "cloudformation:" not in policies


def test_the_ready_timeout_is_the_operators(synth_variant: Callable[..., dict[str, Any]]) -> None:
    t = synth_variant(ready_timeout_s=30000)
    assert {c["Properties"]["Timeout"] for c in of_type(t, "AWS::CloudFormation::WaitCondition").values()} == {"30000"}


def test_without_the_gate_no_wait_condition_and_no_signal_unit(synth_variant: Callable[..., dict[str, Any]]) -> None:
    t = synth_variant(wait_for_ready=False)
    assert not of_type(t, "AWS::CloudFormation::WaitCondition")
    assert set(of_type(t, "AWS::CloudFormation::WaitConditionHandle")) == {"NetworkReady"}, "no gate's handle"
    for lt in _templates(t).values():
        assert "gptoss-signal" not in _user_data(lt)


def _gate_ids(t: dict[str, Any]) -> dict[str, str]:
    """Gate logical id by the node group it waits for."""
    out = {}
    for cid, c in of_type(t, "AWS::CloudFormation::WaitCondition").items():
        (holder,) = [d for d in c["DependsOn"] if t["Resources"][d]["Type"] == "AWS::AutoScaling::AutoScalingGroup"]
        out[holder] = cid
    return out


def test_a_software_change_renews_no_gate_and_a_machine_change_of_one_role_only_that_roles(synth_variant: Callable[..., dict[str, Any]]) -> None:
    """An update waits for the nodes whose instances it replaces. A server flag is software, applied in place
    (rollout.software=in-place, the default): no gate changes. The capacity one role launches into is its
    machine: only that role's gates are new. With rollout.software=replace, the flag renews the gates of the nodes
    whose own software carries it (the prefill node's), no other."""
    before = _gate_ids(synth_variant())
    assert _gate_ids(synth_variant(**{"serving.prefill.max_num_seqs": 2})) == before
    odcr = {"type": "odcr", "reservation_id": "cr-0123456789abcdef0"}
    base = _gate_ids(synth_variant(capacity=odcr))
    after = _gate_ids(synth_variant(capacity=odcr | {"roles": {"decode": {"reservation_id": "cr-0fedcba987654321f"}}}))
    assert base.keys() == after.keys()
    assert {i for i in base if base[i] != after[i]} == {i for i in base if i.startswith("Decode")}
    pinned = _gate_ids(synth_variant(rollout={"software": "replace"}))
    flagged = _gate_ids(synth_variant(rollout={"software": "replace"}, **{"serving.prefill.max_num_seqs": 2}))
    assert {i for i in pinned if pinned[i] != flagged[i]} == {i for i in pinned if i.startswith("Prefill")}


@pytest.mark.parametrize(
    ("context", "renewed"),
    [
        ({"root_volume_gb": 1024}, {"Prefill", "Decode"}),  # a new launch template version: new instances
        ({"detailed_monitoring": False}, {"Prefill", "Decode"}),
        ({"ami_id": "ami-0123456789abcdef0"}, {"Prefill", "Decode"}),  # a pinned image (or the one gptoss deploy resolved)
        ({"capacity": {"type": "odcr", "reservation_id": "cr-0123456789abcdef0", "roles": {"decode": {"reservation_id": "cr-0fedcba987654321f"}}}},
         {"Prefill", "Decode"}),
        ({"network": {"flow_logs": False}}, set()),  # leaves the instances alone: and their gates
        ({"observability": {"alarm_topic_arn": "arn:aws:sns:us-east-2:123456789012:oncall"}}, set()),
    ],
)
def test_a_change_that_replaces_an_instance_renews_its_gate_and_only_then(
    synth_variant: Callable[..., dict[str, Any]], context: dict[str, Any], renewed: set[str]
) -> None:
    """The gate sees what starts a new instance, not only what the node runs (an update must not
    report UPDATE_COMPLETE while replaced instances still stage and compile)."""
    before = _gate_ids(synth_variant())
    after = _gate_ids(synth_variant(**context))
    assert before.keys() == after.keys()
    assert {inst.split("0")[0] for inst in before if before[inst] != after[inst]} == renewed


def test_log_group_has_the_retention_and_the_role_writes_only_there(default_synth: Synth) -> None:
    t = default_synth.template
    (group,) = [v for k, v in of_type(t, "AWS::Logs::LogGroup").items() if "FlowLog" not in k]
    assert (group["Properties"]["LogGroupName"], group["Properties"]["RetentionInDays"]) == ("/gptoss/gptoss-8k1k", 30)
    statements = [
        s
        for p in of_type(t, "AWS::IAM::Policy").values()
        if "Prefill0Role" in json.dumps(p["Properties"]["Roles"])
        for s in p["Properties"]["PolicyDocument"]["Statement"]
    ] + [  # and the node's own role's inline policy (what only this node may do)
        s
        for k, r in of_type(t, "AWS::IAM::Role").items()
        if k.startswith("Prefill0Role")
        for p in r["Properties"].get("Policies", [])
        for s in p["PolicyDocument"]["Statement"]
    ]
    logs = {a: json.dumps(s["Resource"]) for s in statements for a in _list(s["Action"]) if str(a).startswith("logs:")}
    assert sorted(logs) == ["logs:CreateLogStream", "logs:PutLogEvents"]
    assert "log-group:/gptoss/gptoss-8k1k:*" in logs["logs:CreateLogStream"]
    assert "log-group:/gptoss/gptoss-8k1k:log-stream:prefill-0/*" in logs["logs:PutLogEvents"], "its own streams, no other node's"
    metrics = [s for s in statements if "cloudwatch:PutMetricData" in _list(s["Action"])]
    assert len(metrics) == 1
    assert metrics[0]["Condition"] == {"StringEquals": {"cloudwatch:namespace": "GptOss/gptoss-8k1k"}}, "the cluster's own namespace"


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else [v]


def _dashboard_text(t: dict[str, Any]) -> str:
    ((_, dash),) = of_type(t, "AWS::CloudWatch::Dashboard").items()
    body = dash["Properties"]["DashboardBody"]
    parts = body["Fn::Join"][1] if isinstance(body, dict) else [body]
    return "".join(p if isinstance(p, str) else "<token>" for p in parts)


def _referenced(t: dict[str, Any]) -> set[str]:
    """Every metric of the project's namespace the dashboard and the alarms name."""
    text = _dashboard_text(t)
    names = set(re.findall(r'\{\\"GptOss/gptoss-8k1k\\",[^}]*\} MetricName=\\"(\w+)\\"', text))
    names |= set(re.findall(r'\["GptOss/gptoss-8k1k","(\w+)"', text))
    for a in of_type(t, "AWS::CloudWatch::Alarm").values():
        if a["Properties"].get("Namespace") == "GptOss/gptoss-8k1k":
            names.add(a["Properties"]["MetricName"])
        for q in a["Properties"].get("Metrics", []):
            if q.get("MetricStat", {}).get("Metric", {}).get("Namespace") == "GptOss/gptoss-8k1k":
                names.add(q["MetricStat"]["Metric"]["MetricName"])
    return names


def test_the_dashboard_and_alarms_name_only_metrics_the_nodes_publish(default_synth: Synth, fleet_synth: Synth) -> None:
    """A metric renamed on one side only fails here: the dashboard would show an empty graph."""
    router, block = {m.name for m in telemetry.ROUTER_METRICS}, {m.name for m in telemetry.BLOCK_METRICS}
    # Per API key: where the router's gate checks keys (the fleet's default), not behind the toy proxy.
    router |= {m.name for m in telemetry.KEY_METRICS}
    # On-Demand here: no node publishes a Capacity Block's clock (tests/stacks/test_fleet.py has a block's dashboard).
    every = {m.name for m in telemetry.ALL_METRICS} - block
    for synth, published in ((default_synth, every - router), (fleet_synth, every)):
        referenced = _referenced(synth.template)
        assert referenced <= published, referenced - published
        # ... and the dashboard shows every metric the nodes pay to publish (the router's where routers run).
        assert referenced == published, published - referenced


def test_the_dashboard_has_a_graph_per_role_and_the_load_balancer(
    default_synth: Synth, synth_variant: Callable[..., dict[str, Any]]
) -> None:
    text = _dashboard_text(default_synth.template)
    assert 'Role=\\"decode\\"' in text and 'Role=\\"prefill\\"' in text
    assert "AWS/NetworkELB" not in text  # one proxy: no load balancer
    assert '"AWS/NetworkELB","HealthyHostCount"' in _dashboard_text(synth_variant(decode_instances=8))
    single = _dashboard_text(synth_variant(recipe="gptoss-20b-single"))
    assert 'Role=\\"server\\"' in single and 'Role=\\"prefill\\"' not in single and "AWS/NetworkELB" not in single


NODES_3P8D = [*(f"prefill-{i}" for i in range(3)), *(f"decode-{i}" for i in range(8))]
FLEET_ALARMS_3P8D = {
    "gptoss-8k1k-ServersDown", "gptoss-8k1k-StagingFailing", "gptoss-8k1k-UnitsNotReady", "gptoss-8k1k-NlbUnhealthyHosts", "gptoss-8k1k-ReplacementHeld",
    "gptoss-8k1k-EndpointDown", "gptoss-8k1k-RouterErrors", "gptoss-8k1k-RouterCannotReachServers", "gptoss-8k1k-NodeReplaced",
    "gptoss-8k1k-NodeCannotBeReplaced",
}  # fmt: skip


def test_alarms_notify_the_operators_topic(synth_variant: Callable[..., dict[str, Any]]) -> None:
    topic = "arn:aws:sns:us-east-2:123456789012:gptoss-pager"
    t = synth_variant(decode_instances=8, **{"observability.alarm_topic_arn": topic})
    alarms = of_type(t, "AWS::CloudWatch::Alarm")
    assert {a["Properties"]["AlarmName"] for a in alarms.values()} == FLEET_ALARMS_3P8D | {f"gptoss-8k1k-{n}-NodeSilent" for n in NODES_3P8D}
    assert not of_type(t, "AWS::SNS::Topic"), "the operator's topic, none of the stack's"
    for a in alarms.values():
        assert a["Properties"]["AlarmActions"] == [topic], a["Properties"]["AlarmName"]
        if not a["Properties"]["AlarmName"].endswith(("NodeReplaced", "NodeCannotBeReplaced")):  # an event: no "OK" to send after it
            assert a["Properties"]["OKActions"] == [topic]
    for g in of_type(t, "AWS::AutoScaling::AutoScalingGroup").values():
        (notify,) = g["Properties"]["NotificationConfigurations"]
        assert notify["TopicARN"] == topic
        assert notify["NotificationTypes"] == ["autoscaling:EC2_INSTANCE_LAUNCH", "autoscaling:EC2_INSTANCE_LAUNCH_ERROR",
                                               "autoscaling:EC2_INSTANCE_TERMINATE", "autoscaling:EC2_INSTANCE_TERMINATE_ERROR"]  # fmt: skip


def test_without_a_topic_the_stack_makes_one_says_how_to_subscribe_and_warns_while_nobody_is(
    default_synth: Synth, synth_variant: Callable[..., dict[str, Any]]
) -> None:
    t = default_synth.template
    ((topic_id, topic),) = of_type(t, "AWS::SNS::Topic").items()
    assert topic["Properties"]["TopicName"] == "gptoss-8k1k-alarms"
    (policy,) = of_type(t, "AWS::SNS::TopicPolicy").values()
    statements = {st["Sid"]: st for st in policy["Properties"]["PolicyDocument"]["Statement"]}
    assert statements["TlsOnly"]["Effect"] == "Deny" and statements["TlsOnly"]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert sorted(statements["AlarmsAndGroups"]["Principal"]["Service"]) == ["autoscaling.amazonaws.com", "cloudwatch.amazonaws.com"]
    # Every alarm and every group notifies it (the cells get it as a parameter of theirs).
    alarms = of_type(t, "AWS::CloudWatch::Alarm")
    assert {a["Properties"]["AlarmName"] for a in alarms.values()} == {
        "gptoss-8k1k-prefill-0-NodeSilent", "gptoss-8k1k-decode-0-NodeSilent", "gptoss-8k1k-ServersDown", "gptoss-8k1k-StagingFailing",
        "gptoss-8k1k-UnitsNotReady", "gptoss-8k1k-NodeReplaced", "gptoss-8k1k-NodeCannotBeReplaced", "gptoss-8k1k-ReplacementHeld",
    }, "a NodeSilent alarm per node, and the fleet's (no router, no load balancer in the tested layout)"  # fmt: skip
    for a in alarms.values():
        assert a["Properties"]["AlarmActions"] == [{"Ref": topic_id}], a["Properties"]["AlarmName"]
    for g in of_type(t, "AWS::AutoScaling::AutoScalingGroup").values():
        assert g["Properties"]["NotificationConfigurations"][0]["TopicARN"] == {"Ref": topic_id}
    outputs = t["Outputs"]
    subscribe = json.dumps(outputs["AlarmSubscribe"]["Value"])
    assert "aws sns subscribe --region us-east-2 --topic-arn " in subscribe and "--protocol email" in subscribe and topic_id in subscribe
    assert outputs["AlarmTopic"]["Value"] == {"Ref": topic_id}
    # The CLI says it at synth while nobody is subscribed.
    assert "gptoss:nobody-paged" in default_synth.result.stderr and "observability.alarm_emails" in default_synth.result.stderr
    # With addresses, each is subscribed (each confirms by mail) and nobody is warned.
    with_mail = synth_variant(**{"observability.alarm_emails": ["oncall@example.com", "sre@example.com"]})
    subs = sorted(s["Properties"]["Endpoint"] for s in of_type(with_mail, "AWS::SNS::Subscription").values())
    assert subs == ["oncall@example.com", "sre@example.com"]
    assert {s["Properties"]["Protocol"] for s in of_type(with_mail, "AWS::SNS::Subscription").values()} == {"email"}
    import aws_cdk as cdk
    from aws_cdk.assertions import Annotations, Match

    from clusterspec.loading import load_config
    from stacks.cluster_stack import GptOssClusterStack

    app = cdk.App()
    quiet = GptOssClusterStack(app, "A", config=load_config({"observability.alarm_emails": ["oncall@example.com"]}))
    Annotations.from_stack(quiet).has_no_warning("*", Match.string_like_regexp("nobody is subscribed"))


def test_observability_off_provisions_none_of_it(synth_variant: Callable[..., dict[str, Any]]) -> None:
    t = synth_variant(**{"observability.enabled": False})
    assert not of_type(t, "AWS::CloudWatch::Dashboard") and not of_type(t, "AWS::CloudWatch::Alarm")
    assert [k for k in of_type(t, "AWS::Logs::LogGroup") if "FlowLog" not in k] == []
    for lt in _templates(t).values():
        assert "gptoss-telemetry" not in _user_data(lt)
    assert "cloudwatch:PutMetricData" not in json.dumps(of_type(t, "AWS::IAM::Policy"))


# The causes EC2 Auto Scaling's documentation gives for an instance it took out of service
# ("View the reason for health check failures"; "Troubleshoot unhealthy instances"), and the cause of
# a redeploy's or a scale-in's termination, which is not a failure.
DOCUMENTED_REPLACEMENTS = (
    "At 2022-05-14T20:11:53Z an instance was taken out of service in response to a user health-check.",
    "At 2026-11-29T08:00:00Z an instance was taken out of service in response to an EC2 instance status checks failure.",
    "At 2026-11-29T09:00:00Z an instance was taken out of service in response to an EC2 health check indicating it has been terminated or stopped.",
)
NOT_A_REPLACEMENT = (
    "At 2026-11-28T08:00:00Z a user request update of AutoScalingGroup constraints to min: 1, max: 1, desired: 1 changing the desired capacity "
    "from 1 to 1. At 2026-11-28T08:00:05Z an instance was taken out of service in response to a difference between desired and actual capacity, "
    "shrinking the capacity from 1 to 0."
)


def test_a_replaced_node_or_one_that_cannot_be_replaced_raises_an_alarm(default_synth: Synth, moto_url: str) -> None:
    """EventBridge matches the node groups' events (only this cluster's groups) with the causes AWS
    documents, tested by EventBridge's matcher as moto implements it (TestEventPattern); an alarm
    watches each rule."""
    import boto3

    t = default_synth.template
    rules = {k: v["Properties"] for k, v in of_type(t, "AWS::Events::Rule").items()}
    patterns = {json.dumps(r["EventPattern"]["detail-type"]): r["EventPattern"] for r in rules.values()}
    replaced = patterns['["EC2 Instance Terminate Successful"]']
    assert replaced["source"] == ["aws.autoscaling"]
    assert replaced["detail"]["AutoScalingGroupName"] == [{"prefix": "gptoss-8k1k-decode-"}, {"prefix": "gptoss-8k1k-prefill-"}]
    # The rule as the stack makes it, on moto's event bus, delivering to a queue: what arrives matched.
    # (moto has no TestEventPattern; its bus matches patterns, wildcards included, as it delivers.)
    def client(name: str) -> Any:
        return boto3.client(name, endpoint_url=moto_url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")

    events, sqs = client("events"), client("sqs")
    bus = f"replaced-{uuid.uuid4().hex[:8]}"
    events.create_event_bus(Name=bus)
    queue = sqs.create_queue(QueueName=bus)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_rule(Name="replaced", EventBusName=bus, EventPattern=json.dumps(replaced))
    events.put_targets(Rule="replaced", EventBusName=bus, Targets=[{"Id": "q", "Arn": arn}])

    def matches(group: str, cause: str) -> bool:
        detail = {"AutoScalingGroupName": group, "Cause": cause, "StatusCode": "InProgress"}
        events.put_events(Entries=[{"EventBusName": bus, "Source": "aws.autoscaling", "DetailType": "EC2 Instance Terminate Successful",
                                    "Detail": json.dumps(detail)}])  # fmt: skip
        got = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10, WaitTimeSeconds=0).get("Messages", [])
        for m in got:
            sqs.delete_message(QueueUrl=queue, ReceiptHandle=m["ReceiptHandle"])
        return any(json.loads(m["Body"])["detail"] == detail for m in got)

    for cause in DOCUMENTED_REPLACEMENTS:
        assert matches("gptoss-8k1k-decode-0", cause), cause
    assert not matches("gptoss-8k1k-decode-0", NOT_A_REPLACEMENT), "a redeploy's or a scale-in's termination is not a failure"
    assert not matches("other-cluster-decode-0", DOCUMENTED_REPLACEMENTS[0]), "another cluster's group"
    failed = patterns['["EC2 Instance Launch Unsuccessful"]']
    assert failed["detail"]["AutoScalingGroupName"] == replaced["detail"]["AutoScalingGroupName"]
    alarms = {a["Properties"]["AlarmName"]: a["Properties"] for a in of_type(t, "AWS::CloudWatch::Alarm").values()}
    for name, rule in (("gptoss-8k1k-NodeReplaced", "NodeReplacedRule"), ("gptoss-8k1k-NodeCannotBeReplaced", "NodeLaunchFailedRule")):
        a = alarms[name]
        assert (a["Namespace"], a["MetricName"], a["Statistic"], a["Threshold"]) == ("AWS/Events", "MatchedEvents", "Sum", 1)
        (dim,) = a["Dimensions"]
        assert dim["Name"] == "RuleName" and dim["Value"]["Ref"].startswith(f"Observability{rule}")
    # The groups' own metrics, for the dashboard's per-node "in service" graph.
    text = _dashboard_text(t)
    assert "AWS/AutoScaling" in text and "GroupInServiceInstances" in text
    for g in of_type(t, "AWS::AutoScaling::AutoScalingGroup").values():
        assert "GroupInServiceInstances" in g["Properties"]["MetricsCollection"][0]["Metrics"]


# Every alarm of the production layout, typed: what it watches, when it fires, and what it makes of
# missing data. A changed threshold, period count or statistic fails here, not only in a snapshot.
ALARMS_3P8D = {
    # name: (namespace, metric, statistic, period s, evaluation periods, threshold, comparison, missing data)
    "gptoss-8k1k-ServersDown": ("GptOss/gptoss-8k1k", "ServersDown", "Maximum", 60, 3, 1, "GreaterThanOrEqualToThreshold", "notBreaching"),
    "gptoss-8k1k-StagingFailing": ("GptOss/gptoss-8k1k", "StagingFailing", "Maximum", 60, 15, 1, "GreaterThanOrEqualToThreshold", "notBreaching"),
    # A held replacement pages at once: the node already waited out its own grace before asking.
    "gptoss-8k1k-ReplacementHeld": ("GptOss/gptoss-8k1k", "ReplacementHeld", "Maximum", 60, 1, 1, "GreaterThanOrEqualToThreshold", "notBreaching"),
    # 83 periods of 5 minutes: the deploy gate's 24900 s, longer than a node within its limits takes to serve.
    "gptoss-8k1k-UnitsNotReady": ("GptOss/gptoss-8k1k", "UnitsNotReady", "Maximum", 300, 83, 1, "GreaterThanOrEqualToThreshold", "notBreaching"),
    "gptoss-8k1k-NodeReplaced": ("AWS/Events", "MatchedEvents", "Sum", 60, 1, 1, "GreaterThanOrEqualToThreshold", "notBreaching"),
    "gptoss-8k1k-NodeCannotBeReplaced": ("AWS/Events", "MatchedEvents", "Sum", 60, 1, 1, "GreaterThanOrEqualToThreshold", "notBreaching"),
    "gptoss-8k1k-RouterErrors": ("GptOss/gptoss-8k1k", "RouterErrorPercent", "Maximum", 60, 3, 5, "GreaterThanOrEqualToThreshold", "notBreaching"),
    # No healthy proxy, or no data from the load balancer at all: the endpoint is down.
    "gptoss-8k1k-EndpointDown": ("AWS/NetworkELB", "HealthyHostCount", "Maximum", 60, 3, 1, "LessThanThreshold", "breaching"),
} | {
    # Each node's heartbeat: no sample for 27 minutes (a replacement's 15 minutes of launch and boot, and
    # its scripts' fetch budget of 600 + 120 s) is a node gone silent; missing data is the failure.
    f"gptoss-8k1k-{node}-NodeSilent": ("GptOss/gptoss-8k1k", "NodeReporting", "SampleCount", 60, 27, 1, "LessThanThreshold", "breaching")
    for node in NODES_3P8D
}


def test_every_alarm_watches_its_metric_with_its_threshold_periods_and_missing_data(fleet_synth: Synth) -> None:
    alarms = {a["Properties"]["AlarmName"]: a["Properties"] for a in of_type(fleet_synth.template, "AWS::CloudWatch::Alarm").values()}
    assert sorted(alarms) == sorted([*ALARMS_3P8D, "gptoss-8k1k-NlbUnhealthyHosts", "gptoss-8k1k-RouterCannotReachServers"])
    for name, (namespace, metric, statistic, period, periods, threshold, comparison, missing) in ALARMS_3P8D.items():
        a = alarms[name]
        got = (a["Namespace"], a["MetricName"], a["Statistic"], a["Period"], a["EvaluationPeriods"], a["Threshold"], a["ComparisonOperator"],
               a["TreatMissingData"])  # fmt: skip
        assert got == (namespace, metric, statistic, period, periods, threshold, comparison, missing), name
        assert "DatapointsToAlarm" not in a, f"{name}: every evaluated period breaches"
    for node in NODES_3P8D:
        dims = {d["Name"]: d["Value"] for d in alarms[f"gptoss-8k1k-{node}-NodeSilent"]["Dimensions"]}
        assert dims == {"Cluster": "gptoss-8k1k", "Node": node, "Role": node.split("-")[0]}, "the node's own heartbeat, as it publishes it"
    reach = alarms["gptoss-8k1k-RouterCannotReachServers"]
    queries = {q["Id"]: q for q in reach["Metrics"]}
    assert queries["unreachable"]["Expression"] == "IF(n == 0, r, 0)" and queries["unreachable"]["ReturnData"] is True
    assert {q: queries[q]["MetricStat"]["Metric"]["MetricName"] for q in ("r", "n")} == {"r": "RouterUnhealthyServers", "n": "UnitsNotReady"}
    assert (reach["EvaluationPeriods"], reach["Threshold"], reach["TreatMissingData"]) == (15, 1, "notBreaching")
    nlb = alarms["gptoss-8k1k-NlbUnhealthyHosts"]
    assert (nlb["EvaluationPeriods"], nlb["Threshold"], nlb["ComparisonOperator"], nlb["TreatMissingData"]) == (3, 1, "GreaterThanOrEqualToThreshold", "notBreaching")
    queries = {q["Id"]: q for q in nlb["Metrics"]}
    assert queries["partial"]["Expression"] == "IF(h >= 1, u, 0)" and queries["partial"]["ReturnData"] is True
    for qid, metric in (("u", "UnHealthyHostCount"), ("h", "HealthyHostCount")):
        stat = queries[qid]["MetricStat"]
        assert (stat["Metric"]["Namespace"], stat["Metric"]["MetricName"], stat["Period"], stat["Stat"]) == ("AWS/NetworkELB", metric, 60, "Maximum")
