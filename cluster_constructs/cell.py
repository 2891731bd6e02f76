"""A cell: one nested stack holding the node identities of one role (clusterspec.cells says which)."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import CfnParameter, NestedStack
from constructs import Construct

from cluster_constructs.gate import NodeReadyGate
from cluster_constructs.iam import CacheLocation, NodeIdentityRole, NodePolicy
from cluster_constructs.node import ClusterNode
from clusterspec.cells import Cell
from clusterspec.config import ClusterConfig
from node_render.node_files import NodeRender
from node_render.userdata import launch_inputs, node_version, user_data


@dataclass(frozen=True)
class Shared:
    """What the parent stack makes and every cell's nodes refer to (CDK passes each as a parameter)."""

    image_id: str
    subnet_id: str
    security_group_id: str
    placement_group: str | None
    scripts_arn: str
    # The parameter naming the current software version; in place, the document that applies one.
    software_parameter: str
    software_parameter_arn: str
    software_document_arn: str | None
    # The router wheel's and the API gate's pinned packages' objects (the stack's assets).
    router_arns: tuple[str, ...]
    router_fleet_arn: str | None
    cache: CacheLocation | None
    target_group_arn: str | None
    proxy_nodes: frozenset[str]
    alarm_topic_arn: str


class NodeCell(NestedStack):
    """The nodes of one cell, each with its role, launch template, group and deploy gate, and the
    cell's copy of the policy every node shares (attached here: a policy of the parent attached to
    roles of a cell would wait for the cell, whose gates wait for nodes that need the policy)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        cell: Cell,
        renders: dict[str, NodeRender],
        shared: Shared,
        chained: bool = True,
    ) -> None:
        # The image by a parameter of its own type (CDK passes other values as strings), so that
        # CloudFormation checks it is an image id, as the parent's DLAMI parameter is.
        super().__init__(
            scope, construct_id, description=f"{config.cluster_name}: {', '.join(n.name for n in cell.nodes)}", parameters={"ImageId": shared.image_id}
        )
        image_id = CfnParameter(self, "ImageId", type="AWS::EC2::Image::Id", description="The Neuron DLAMI every node boots").value_as_string
        # Its id names the cell: every logical id of a node or a cell is unique across the stack's templates.
        policy = NodePolicy(
            self, f"{construct_id}Policy", config=config, cache=shared.cache, scripts_arn=shared.scripts_arn,
            software_parameter_arn=shared.software_parameter_arn, software_document_arn=shared.software_document_arn,
        )  # fmt: skip
        # In place, a new software version changes no node's launch template or gate: State Manager applies it.
        # With replace, a node's own software is part of its launch: a change of it replaces exactly that node.
        replace = config.rollout.software == "replace"
        self.nodes: dict[str, ClusterNode] = {}
        gates: dict[str, NodeReadyGate] = {}
        for node in cell.nodes:
            render = renders[node.name]
            gate = (
                NodeReadyGate(
                    self,
                    f"{node.logical_id}Ready",
                    render=render,
                    software=node_version(render) if replace else "",
                    launch=launch_inputs(config, node.role),
                    timeout_s=config.gate_timeout_s,
                )
                if config.wait_for_ready
                else None
            )
            role = NodeIdentityRole(
                self,
                f"{node.logical_id}Role",
                config=config,
                node=node.name,
                shared=policy,
                cache=shared.cache,
                reads_members=bool(config.layout.proxies_on(node.name)),
                router_object_arns=shared.router_arns if "gptoss-install-router" in render.scripts else (),
                router_fleet_arn=shared.router_fleet_arn if "gptoss-install-router" in render.scripts else None,
            )
            holder = ClusterNode(
                self,
                node.logical_id,
                config=config,
                render=render,
                image_id=image_id,
                subnet_id=shared.subnet_id,
                security_group_id=shared.security_group_id,
                instance_profile_arn=role.profile.attr_arn,
                placement_group=shared.placement_group,
                user_data=user_data(
                    render,
                    software_parameter=shared.software_parameter,
                    software_digest=node_version(render) if replace else None,
                    signal_url=gate.url if gate else None,
                    gate_id=gate.condition_id if gate else None,
                    compile_cache_uri=shared.cache.uri if shared.cache else None,
                ),
                target_group_arns=[shared.target_group_arn] if shared.target_group_arn and node.name in shared.proxy_nodes else None,
                alarm_topic_arn=shared.alarm_topic_arn,
            )
            if gate:
                # The gate's clock starts when the group has launched the node's instance, not when the stack starts.
                gate.condition.add_resource_dependency(holder.group)
            self.nodes[node.name] = holder
            if gate:
                gates[node.name] = gate
        if chained:
            self._chain(config, cell, gates)

    def _chain(self, config: ClusterConfig, cell: Cell, gates: dict[str, NodeReadyGate]) -> None:
        """The rollout's lanes (docs/design.md 'Changes'). A role of n nodes has rollout.lanes(n) lanes,
        node i in lane i mod lanes, so at most that many of the role are replaced at once.

        A node's turn comes when every earlier node of its lane has served: its deploy gate's *handle*
        waits for their gates, so the handle (and the presigned URL it makes, valid 24 hours), the
        launch template version that carries the URL and the group's update all start at the node's
        turn, never when the stack's update starts (CloudFormation makes a resource with no
        dependency at once). Its group also waits for the earlier groups of its lane: a rollback
        re-applies the previous template, whose gates are long done, so only the groups' own order
        keeps the rollback to one node of a lane at a time. Every earlier node of the lane, not only
        the one before: a node the change leaves alone does not hold the lane, and the next changed
        one waits for the last changed one before it. The first deploy is not chained."""
        lanes = config.rollout.lanes(sum(1 for n in config.layout.nodes if n.role == cell.role), config.surge)
        for node in cell.nodes:
            group = self.nodes[node.name].group
            for before in cell.nodes:
                if before.index < node.index and (node.index - before.index) % lanes == 0:
                    group.add_resource_dependency(self.nodes[before.name].group)
                    if node.name in gates and before.name in gates:
                        gates[node.name].handle.add_resource_dependency(gates[before.name].condition)
