"""The deploy gate: `cdk deploy` ends when every node serves, or fails naming what broke."""

from __future__ import annotations

from aws_cdk import CfnWaitCondition, CfnWaitConditionHandle, Stack
from constructs import Construct

from node_render.node_files import NodeRender
from node_render.userdata import node_digest


class NodeReadyGate(Construct):
    """A wait condition for one node, signalled by the node's gptoss-signal with a reason.

    The node PUTs to the handle's presigned URL (no IAM permission; through the S3 gateway
    endpoint when there is no egress). The logical ids carry a digest of what the node is launched
    from (node_digest): an update that replaces the node's instance makes a new gate the update
    waits for; one that leaves the instance alone (a software change applied in place) leaves
    its gate alone.
    """

    def __init__(
        self, scope: Construct, construct_id: str, *, render: NodeRender, software: str, launch: str, timeout_s: int
    ) -> None:
        super().__init__(scope, f"{construct_id}{node_digest(render, software, launch)}")
        self.handle = CfnWaitConditionHandle(self, "Handle")
        self.condition = CfnWaitCondition(self, "Condition", handle=self.handle.ref, timeout=str(timeout_s), count=1)

    @property
    def url(self) -> str:
        """The handle's presigned URL (a token until deploy)."""
        return self.handle.ref

    @property
    def condition_id(self) -> str:
        """The wait condition's logical id in its stack: the node asks CloudFormation whether it was answered."""
        return Stack.of(self).get_logical_id(self.condition)
