"""Where the cluster's alarms and its groups' notifications go when the operator names no topic.

A cluster that pages no one is a cluster nobody hears fail: without observability.alarm_topic_arn
the stack makes a topic of its own, subscribes observability.alarm_emails to it, and says how to
subscribe (the AlarmSubscribe output, `gptoss plan`, a synth warning while nobody is subscribed).
"""

from __future__ import annotations

from aws_cdk import Acknowledgment, Annotations, Validations
from aws_cdk import aws_iam as iam
from aws_cdk import aws_sns as sns
from constructs import Construct

from clusterspec.config import ClusterConfig


class AlarmTopic(Construct):
    """The stack's own alarm topic: SSL only, the operators' e-mail subscriptions."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig) -> None:
        super().__init__(scope, construct_id)
        self.topic = sns.CfnTopic(self, "Topic", topic_name=f"{config.cluster_name}-alarms", display_name=f"gpt-oss cluster {config.cluster_name}")
        self.arn = self.topic.ref
        # Only over TLS (cdk-nag AwsSolutions-SNS3).
        sns.CfnTopicPolicy(
            self,
            "Policy",
            topics=[self.topic.ref],
            policy_document=iam.PolicyDocument(
                statements=[
                    iam.PolicyStatement(
                        sid="TlsOnly",
                        effect=iam.Effect.DENY,
                        principals=[iam.AnyPrincipal()],
                        actions=["sns:Publish"],
                        resources=[self.topic.ref],
                        conditions={"Bool": {"aws:SecureTransport": "false"}},
                    ),
                    iam.PolicyStatement(
                        sid="AlarmsAndGroups",
                        principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com"), iam.ServicePrincipal("autoscaling.amazonaws.com")],
                        actions=["sns:Publish"],
                        resources=[self.topic.ref],
                    ),
                ]
            ),
        )
        for i, email in enumerate(config.observability.alarm_emails):
            sns.CfnSubscription(self, f"Email{i}", topic_arn=self.topic.ref, protocol="email", endpoint=email)
        if not config.observability.alarm_emails:
            Annotations.of(self).add_warning_v2(
                "gptoss:nobody-paged",
                f"the alarms go to the stack's topic {config.cluster_name}-alarms, which nobody is subscribed to: add "
                "-c 'observability.alarm_emails=[\"you@example.com\"]', subscribe after the deploy (the AlarmSubscribe output), "
                "or name your own topic with observability.alarm_topic_arn.",
            )
        Validations.of(self.topic).acknowledge(
            Acknowledgment(
                id="AwsSolutions::AwsSolutions-SNS2",
                reason="CloudWatch alarms and Auto Scaling notifications publish to an encrypted topic only with a customer managed "
                "key whose policy grants them; the messages carry alarm, node and instance names, no data. An operator who needs "
                "encryption at rest names an encrypted topic of theirs (observability.alarm_topic_arn).",
            )
        )
