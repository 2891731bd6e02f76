"""The serving cluster stack: it only wires the components together."""

from __future__ import annotations

from aws_cdk import (
    Acknowledgment,
    Annotations,
    CfnParameter,
    CfnWaitConditionHandle,
    Environment,
    NestedStack,
    Stack,
    Tags,
    Validations,
)
from aws_cdk import aws_ec2 as ec2
from constructs import Construct

from cluster_constructs.alarm_topic import AlarmTopic
from cluster_constructs.api_keys import ApiKeysSecret
from cluster_constructs.cell import NodeCell, Shared
from cluster_constructs.compile_cache import CompileCacheBucket
from cluster_constructs.iam import CacheLocation
from cluster_constructs.load_balancer import ProxyLoadBalancer
from cluster_constructs.network import ClusterNetwork
from cluster_constructs.observability import FleetObservability, NodeAlarms
from cluster_constructs.outputs import ClusterOutputs
from cluster_constructs.router import RouterFleet, RouterWheel
from cluster_constructs.security_group import ClusterSecurityGroup
from cluster_constructs.software import NodeSoftware, role_association
from clusterspec.cells import cells
from clusterspec.config import ClusterConfig, interface_endpoints
from clusterspec.sections.rollout import FIRST_DEPLOY_CONTEXT
from node_render.command_lines import model_name
from node_render.render import render_cluster


class GptOssClusterStack(Stack):
    """A Trn3 gpt-oss-120b serving cluster: network, EFA nodes, their bootstrap and outputs."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig) -> None:
        super().__init__(
            scope,
            construct_id,
            env=Environment(region=config.region),
            description=f"{model_name(config)} on {config.instance_type}: "
            + (
                f"{config.decode_instances} decode server(s), {len(config.layout.replicas)} prefill replicas (vLLM Neuron, disaggregated)"
                if config.serving.disaggregated
                else f"one server (vLLM Neuron, recipe {config.recipe})"
            ),
        )
        layout = config.layout
        Tags.of(self).add("gptoss:cluster", config.cluster_name)

        network = ClusterNetwork(self, "Network", config=config)
        security = ClusterSecurityGroup(self, "SecurityGroup", config=config, layout=layout, vpc=network.vpc)
        if config.network.wants_ssm_endpoints:
            # Without a route out, the collector reaches CloudWatch through endpoints too.
            network.add_interface_endpoints(interface_endpoints(config), security_group_id=security.group.security_group_id)
        placement = _placement_group(self, config)
        if config.ami_ssm_parameter:
            # CloudFormation resolves an SSM-typed parameter at every deploy: once AWS publishes a
            # new DLAMI, a one-flag redeploy replaces every instance (instance store, compiles).
            Annotations.of(self).add_warning_v2(
                "gptoss:unpinned-ami",
                f"the image resolves from {config.ami_ssm_parameter} at every deploy: after a new DLAMI a `cdk deploy` of "
                "this template replaces every instance, and the deploy gate cannot wait for them (it sees only what "
                "the synth knew). Deploy with gptoss deploy (it resolves the image first, asks, and gates it), or "
                "pin it: gptoss pin-ami (records it in cdk.context.json). To keep it moving on purpose: "
                "-c acknowledge_unpinned_ami=true.",
            )
            if config.acknowledge_unpinned_ami:
                Annotations.of(self).acknowledge_warning("gptoss:unpinned-ami", "the operator keeps the image unpinned (acknowledge_unpinned_ami)")
        if config.network.egress == "none" and not config.network.s3_prefix_list_id:
            Annotations.of(self).add_warning_v2(
                "gptoss:https-egress-open",
                "network.s3_prefix_list_id is unset: the nodes' HTTPS egress is allowed to any address (no route leads "
                "anywhere but to S3 and the endpoints). Narrow it to S3: gptoss preflight names the region's prefix list; "
                "-c network.s3_prefix_list_id=pl-...",
            )
        if config.model.source == "huggingface" and config.model.revision is None:
            Annotations.of(self).add_warning_v2(
                "gptoss:unpinned-model",
                f"model.revision is unset: each node downloads {config.serving.model_id} as the Hub's main is on the day it "
                "boots, so a node replaced after an upstream change serves another checkpoint than its peers. Pin it: "
                "-c model.revision=<40-character commit id>.",
            )
        if config.serving.disaggregated and config.examples.s3_uri is None and config.examples.pinned_commit is None:
            Annotations.of(self).add_warning_v2(
                "gptoss:unpinned-examples",
                f"examples.commit is unset: nodes take the commit tag {config.examples.ref} points at on the day they boot. "
                "Pin it: -c examples.commit=<git rev-parse the tag>, and a node refuses a tag that moved.",
            )
        image_id = config.ami_id or CfnParameter(
            self,
            "NeuronDlamiAmi",
            type="AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>",
            default=config.ami_ssm_parameter,
            description="SSM parameter of the Neuron DLAMI (resolved at deploy time, not at synth)",
        ).value_as_string

        # One resource that stands for the nodes' network path (routes, NAT, endpoints): each node
        # depends on it alone, which keeps the template small at any fleet size (a handle costs nothing).
        network_ready = CfnWaitConditionHandle(self, "NetworkReady")
        for resource in network.path:
            network_ready.node.add_dependency(resource)
        renders = render_cluster(config)
        software = NodeSoftware(self, "NodeSoftware", config=config, renders=renders)
        router = RouterWheel(self, "RouterWheel", config=config) if config.proxy_kind == "vllm-router" else None
        # The routers' settings and pool, read at run time: a new one replaces no instance.
        router_fleet = RouterFleet(self, "RouterFleet", config=config) if router else None
        cache = _compile_cache(self, config)
        if config.network.egress == "none":
            buckets = [software.asset.s3_bucket_name] + ([router.asset.s3_bucket_name] if router else [])
            locations = [cache.uri if cache else None, config.model.s3_uri, config.examples.s3_uri, config.results_s3_uri]
            buckets += sorted({u.removeprefix("s3://").partition("/")[0] for u in locations if u})
            network.restrict_endpoints(buckets=buckets)
        if config.endpoint_auth == "keys" and not config.serving.endpoint.keys_secret_arn:
            ApiKeysSecret(self, "ApiKeys", config=config)
        proxy_names = list(layout.endpoint_nodes)
        balancer = None
        if config.load_balanced:
            balancer = ProxyLoadBalancer(
                self,
                "ProxyEndpoint",
                config=config,
                vpc=network.vpc,
                subnet_id=network.subnet_id,
                route_table_id=network.route_table_id,
                cluster_group=security.group,
            )
        # Every alarm and every group's notification goes to a topic: the operator's, else the stack's own.
        own_topic = None if config.observability.alarm_topic_arn else AlarmTopic(self, "Alarms", config=config)
        alarm_topic_arn = config.observability.alarm_topic_arn or own_topic.arn  # type: ignore[union-attr]
        shared = Shared(
            image_id=image_id,
            subnet_id=network.subnet_id,
            security_group_id=security.group.security_group_id,
            placement_group=placement,
            scripts_arn=software.object_arn,
            software_parameter=software.parameter_name,
            software_parameter_arn=software.parameter_arn,
            software_document_arn=software.document_arn if software.in_place else None,
            router_arns=tuple(router.object_arns) if router else (),
            router_fleet_arn=router_fleet.arn if router_fleet else None,
            cache=cache,
            target_group_arn=balancer.target_group.target_group_arn if balancer else None,
            proxy_nodes=frozenset(proxy_names),
            alarm_topic_arn=alarm_topic_arn,
        )
        by_name = {r.node.name: r for r in renders}
        # Every node identity in a cell (a nested stack) of its role: any fleet is one stack name, and a
        # fleet that grows never moves a node from one nested stack to another (clusterspec.cells).
        self.cells: dict[str, NodeCell] = {}
        self.alarm_cells: dict[str, NestedStack] = {}  # each cell's NodeSilent alarms
        # The rollout's lanes order the groups of a role (docs/design.md 'Changes'); a first deploy
        # launches every node at once: `gptoss deploy` says so (context gptoss:first-deploy=true)
        # when the stack does not exist yet.
        chained = str(self.node.try_get_context(FIRST_DEPLOY_CONTEXT)).lower() != "true"
        last_of_role: dict[str, NodeCell] = {}
        for cell in cells(layout, config.cell_nodes):
            nested = NodeCell(self, cell.name, config=config, cell=cell, renders=by_name, shared=shared, chained=chained)
            self.cells[cell.name] = nested
            # A first boot must not race its network: routes, NAT and endpoints exist before the groups launch.
            nested.node.add_dependency(network_ready)
            if chained and cell.role in last_of_role:
                # A role's next cell rolls after its previous one: its lanes continue there.
                nested.node.add_dependency(last_of_role[cell.role])
            last_of_role[cell.role] = nested
        if software.in_place:
            # A new software version reaches each role's running nodes in place, one role after the
            # other, each after the role's nodes have served (docs/design.md 'Changes').
            previous_role: Construct | None = None
            for role in dict.fromkeys(n.role for n in layout.nodes):
                apply = role_association(
                    self, f"Software{role.title()}", config=config, software=software, role=role,
                    nodes=sum(1 for n in layout.nodes if n.role == role),
                )  # fmt: skip
                for cell in cells(layout, config.cell_nodes):
                    if cell.role == role:
                        apply.node.add_dependency(self.cells[cell.name])
                if previous_role is not None:
                    apply.node.add_dependency(previous_role)
                previous_role = apply
        ClusterOutputs(
            self, "Outputs", config=config, proxy_nodes=proxy_names, endpoint_dns=balancer.dns_name if balancer else None,
            own_alarm_topic=own_topic.arn if own_topic else None,
            endpoint_service=balancer.service.vpc_endpoint_service_name if balancer and balancer.service else None,
        )  # fmt: skip
        if config.observability.enabled:
            fleet = FleetObservability(
                self,
                "Observability",
                config=config,
                load_balancer=(balancer.target_group.target_group_full_name, balancer.nlb.load_balancer_full_name)
                if balancer
                else None,
                alarm_topic_arn=alarm_topic_arn,
            )
            # The fleet's alarms from the moment every node has served (each cell's gates passed): a
            # first boot still compiling is the deploy gate's to judge, not an alarm.
            for nested in self.cells.values():
                fleet.node.add_dependency(nested)
            # Then each cell's NodeSilent alarms, a cell after the other: the stack's alarms are made
            # PUT_METRIC_ALARM_TPS at a time (CloudWatch's rate), at any fleet size.
            previous: Construct = fleet
            for cell in cells(layout, config.cell_nodes):
                alarms = NodeAlarms(self, f"{cell.name}Alarms", config=config, cell=cell, topic=alarm_topic_arn)
                alarms.node.add_dependency(self.cells[cell.name])
                alarms.node.add_dependency(previous)
                self.alarm_cells[cell.name] = previous = alarms

        if not config.termination_protection:
            Validations.of(self).acknowledge(
                Acknowledgment(
                    id="AwsSolutions::AwsSolutions-EC29",
                    reason="Termination protection is off by default so `cdk destroy` tears the cluster down; "
                    "set termination_protection=true for a long-lived production cluster.",
                )
            )
        if config.instance_type.startswith("trn3"):
            Validations.of(self).acknowledge(
                Acknowledgment(
                    id="CloudFormation-Validate::E3628",
                    reason=f"{config.instance_type} is newer than the CloudFormation schema the validator ships; "
                    "preflight checks that the type is offered in the AZ.",
                )
            )


def _compile_cache(stack: Stack, config: ClusterConfig) -> CacheLocation | None:
    """Where the nodes save and restore compile caches: the configured location, or a bucket of the stack's."""
    if config.compile_cache_s3_uri:
        uri = config.compile_cache_s3_uri.rstrip("/")
        return CacheLocation(uri=uri, nag=uri)
    if config.compile_cache_bucket:
        return CompileCacheBucket(stack, "CompileCache", config=config).location
    return None


def _placement_group(stack: Stack, config: ClusterConfig) -> str | None:
    """The cluster placement group the EFA peers launch in, by name (docs/design.md 'Capacity').

    A single server needs none. A Capacity Block places its instances together itself (EC2:
    "there is no need to use a cluster placement group with a Capacity Block"): none. A
    reservation made in a cluster placement group is used only from that group: the operator's
    group (capacity.placement_group). Otherwise, a group of the stack's.
    """
    if not config.serving.disaggregated or config.capacity.type == "capacity-block":
        return None
    if config.capacity.placement_group or config.network.placement_group:
        return config.capacity.placement_group or config.network.placement_group
    return ec2.CfnPlacementGroup(stack, "PlacementGroup", strategy="cluster").ref
