"""CloudFormation limits the stack and each of its cells must fit in, checked before anything is synthesized.

The parent stack holds what the nodes share; each cell (a nested stack, clusterspec.cells) holds
up to cell_nodes node identities of one role. Every template is limited on its own (1 MB, 500
resources), so a fleet of any size is one stack; each node's user data is limited to 16 KB.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clusterspec.cells import Cell, cells
from clusterspec.config import ClusterConfig
from clusterspec.errors import SpecError
from clusterspec.layout import Layout, Node
from node_render.paths import software_parameter
from node_render.render import render_node
from node_render.userdata import USER_DATA_LIMIT, Compress, bundle, bundle_bound, user_data

MAX_TEMPLATE_BYTES = 1_000_000  # CloudFormation: 1 MB for a template uploaded to S3
MAX_RESOURCES = 500
MAX_OUTPUTS = 200
# Measured on templates the CLI writes (tests/bench/bench_scale.py prints estimate and actual), rounded
# up: an estimate must not be smaller than its template.
# The parent: what the nodes share (network, security group, scripts, bucket, outputs), and one
# nested stack resource per cell (its template's URL and the parameters CDK passes it).
BASE_BYTES = 16_000
BASE_RESOURCES = 40
PER_RULE_BYTES = 400
LOAD_BALANCER_BYTES = 12_000
# serving.endpoint: the secret of API keys and its two outputs; a TLS listener and its output; an endpoint service,
# its permissions and two outputs (the warnings' metadata besides).
API_KEYS_BYTES, API_KEYS_RESOURCES, API_KEYS_OUTPUTS = 1_500, 1, 2
TLS_BYTES, TLS_RESOURCES, TLS_OUTPUTS = 1_200, 1, 1
PRIVATE_LINK_BYTES, PRIVATE_LINK_RESOURCES, PRIVATE_LINK_OUTPUTS = 1_500, 2, 2
KEYS_GRANT_BYTES = 400  # a router node's role: its read of the secret of keys, and its finding acknowledged
OBSERVABILITY_BYTES = 23_000  # log group, dashboard body, alarms (ReplacementHeld among them), the replacement rules
OBSERVABILITY_RESOURCES = 13
ALARM_TOPIC_BYTES = 3_000  # the stack's own alarm topic, its policy and its two outputs
ALARM_TOPIC_RESOURCES = 2
PER_EMAIL_BYTES = 400  # one e-mail subscription to it
PER_CELL_BYTES = 3_000
ROUTER_FLEET_BYTES = 500  # the routers' SSM parameter around its document (the document itself is counted as rendered)
IN_PLACE_BYTES = 2_600  # the software parameter and (rollout.software=in-place) the State Manager document
PER_ASSOCIATION_BYTES = 1_600  # ... and one association per role, with its DependsOn on the role's cells
# A cell: its parameters and shared policy, then per node its launch template (but its NICs), group,
# role, instance profile and gate, and one network interface per card.
CELL_BASE_BYTES = 6_000
CELL_BASE_RESOURCES = 1
PER_NODE_BYTES = 7_650  # its role: with the health watch's two Auto Scaling statements
PER_CARD_BYTES = 340
PER_GATE_BYTES = 900  # a node's wait condition and handle (deploy gate)
PER_SILENT_ALARM_BYTES = 1_350  # a node's NodeSilent alarm (in its cell's alarm stack, with its chain)
ALARM_CELL_BYTES = 1_500  # the parent's nested stack resource of a cell's NodeSilent alarms, its parameter and DependsOn
ALARM_STACK_BASE_BYTES = 600  # that stack's own template around its alarms (its parameter, CDK's metadata)
PER_NODE_RESOURCES = 4
PER_ROLLOUT_BYTES = 750  # a node's drain hook, its group's surge policy, a router node's two more reads
PER_DEPENDENCY_BYTES = 80  # one id in a DependsOn: an earlier group (a group's) or gate (a handle's) of its lane (the rollout's chain)
# Nodes of one shape differ only in digits; xz packs different digits into a few bytes more or
# less. Measured over the examples and recipes (tests/node_render/test_limits.py compares with every
# node rendered): under 16 bytes of user data. Twice that, per node.
SHAPE_SLACK = 32
BASE_OUTPUTS = 2
_DIGIT = re.compile(r"\d")
# As long as the URI CloudFormation fills in: the bootstrap bucket's name and the asset's key.
SCRIPTS_URI_PLACEHOLDER = "s3://cdk-hnb659fds-assets-123456789012-ap-southeast-4/" + "0" * 64 + ".xz"
# About as long as a wait condition handle's presigned URL.
SIGNAL_URL_PLACEHOLDER = "https://cloudformation-waitcondition-ap-southeast-4.s3.ap-southeast-4.amazonaws.com/" + "x" * 900


def _zero(text: str) -> str:
    return _DIGIT.sub("0", text)


@dataclass(frozen=True)
class TemplateSize:
    """Estimated size of one template: the parent stack or a cell."""

    name: str
    nodes: int
    resources: int
    template_bytes: int


@dataclass(frozen=True)
class StackSize:
    """Estimated size of the stack a config synthesizes: the parent's, each cell's, the largest user data."""

    nodes: int
    resources: int
    outputs: int
    template_bytes: int
    largest_user_data: int
    cells: tuple[TemplateSize, ...] = ()
    alarm_cells: tuple[TemplateSize, ...] = ()  # each cell's NodeSilent alarms, a stack of their own

    @property
    def templates(self) -> tuple[TemplateSize, ...]:
        """The parent, every cell and every cell's alarms."""
        return (TemplateSize("parent", 0, self.resources, self.template_bytes), *self.cells, *self.alarm_cells)


def node_shape(layout: Layout, node: Node) -> tuple[object, ...]:
    """What a node's user data depends on, with every digit made 0: nodes of one shape render the
    same files up to the digits of their names, ports and indices (same count of digits), so
    their user data has the same length up to what xz makes of those digits (SHAPE_SLACK)."""
    # A toy proxy names the nodes of its group (one or two); a router names every node, the same for all.
    proxies = tuple(
        (p.kind, len(p.replicas), len(p.decode_servers), _zero(str(p.decode_server)),
         tuple(sorted(_zero(n) for n in {r.node for r in p.replicas})) if p.kind == "toy" else ())
        for p in layout.proxies_on(node.name)
    )  # fmt: skip
    return (node.index == 0, _zero(node.model_dump_json()), proxies)


def shapes(layout: Layout) -> list[list[Node]]:
    """The fleet's nodes grouped by shape, in fleet order."""
    groups: dict[tuple[object, ...], list[Node]] = {}
    for n in layout.nodes:
        groups.setdefault(node_shape(layout, n), []).append(n)
    return list(groups.values())


def _user_data_bytes(cfg: ClusterConfig, layout: Layout, node: Node, *, compress: Compress = bundle) -> int:
    """A node's user data as EC2 counts it: exact with the shipped compression (`bundle`)."""
    r = render_node(cfg, layout, node)
    replace = cfg.rollout.software == "replace"
    # In the template the gate's URL is a Ref of about 60 characters; on the instance it is the
    # presigned URL, which counts against EC2's 16 KB.
    return len(
        user_data(
            r,
            software_parameter=software_parameter(cfg.cluster_name),
            software_digest="0" * 64 if replace else None,
            signal_url="x" * 60 if cfg.wait_for_ready else None,
            gate_id="x" * 48 if cfg.wait_for_ready else None,
            compile_cache_uri=SCRIPTS_URI_PLACEHOLDER,
            compress=compress,
        ).encode()
    )


def _router_fleet_bytes(cfg: ClusterConfig) -> int:
    """The routers' settings and pool in the parent (one SSM parameter), or 0 without vLLM's router."""
    from node_render.command_lines import router_fleet

    proxy = next((p for p in cfg.layout.proxies if p.kind == "vllm-router"), None)
    return ROUTER_FLEET_BYTES + len(router_fleet(cfg, proxy).encode()) if proxy else 0


def estimate(cfg: ClusterConfig) -> StackSize:
    """Size the stack and its cells from the user data of one node per shape (plus SHAPE_SLACK) and
    measured per-node overhead: linear in the fleet, one render and one xz per shape, not per node.

    The user data is compressed with bundle_bound: a little larger than what ships, in a third of
    the time. (A refusal must not wait for the whole fleet's render: the fleet is sized first.)
    """
    layout = cfg.layout
    size_of: dict[str, int] = {}
    for group in shapes(layout):
        size = _user_data_bytes(cfg, layout, group[-1], compress=bundle_bound) + SHAPE_SLACK
        size_of |= {n.name: size for n in group}
    url_growth = len(SIGNAL_URL_PLACEHOLDER) - 60 if cfg.wait_for_ready else 0
    gate_bytes, gate_resources = (PER_GATE_BYTES, 2) if cfg.wait_for_ready else (0, 0)
    obs = cfg.observability
    per_node = PER_NODE_BYTES + PER_CARD_BYTES * cfg.hardware.network_cards + gate_bytes + PER_ROLLOUT_BYTES
    lanes: dict[str, int] = {role: cfg.rollout.lanes(sum(1 for n in layout.nodes if n.role == role), cfg.surge) for role in {n.role for n in layout.nodes}}
    # Each node's group waits for every earlier group of its lane in the cell, and its gate's handle for their gates.
    chained = 2 if cfg.wait_for_ready else 1

    def chain_bytes(c: Cell) -> int:
        """The rollout's chain in a cell: each node waits for every earlier node of its lane there."""
        per_lane = lanes[str(c.role)]
        return chained * PER_DEPENDENCY_BYTES * sum(p // per_lane for p in range(len(c.nodes)))

    keys = cfg.endpoint_auth == "keys"
    # The template holds user data as text; CloudFormation base64-encodes it at deploy time.
    cell_sizes = tuple(
        TemplateSize(
            c.name, len(c.nodes), CELL_BASE_RESOURCES + len(c.nodes) * (PER_NODE_RESOURCES + gate_resources),
            CELL_BASE_BYTES + sum(size_of[n.name] + per_node for n in c.nodes) + chain_bytes(c)
            + (KEYS_GRANT_BYTES * sum(1 for n in c.nodes if any(p.kind == "vllm-router" for p in layout.proxies_on(n.name))) if keys else 0),
        )
        for c in cells(layout, cfg.cell_nodes)
    )  # fmt: skip
    # Each cell's NodeSilent alarms are a stack of their own (cluster_constructs.observability.NodeAlarms).
    alarm_cells = tuple(
        TemplateSize(f"{c.name}Alarms", len(c.nodes), len(c.nodes), ALARM_STACK_BASE_BYTES + PER_SILENT_ALARM_BYTES * len(c.nodes))
        for c in cells(layout, cfg.cell_nodes)
    ) if obs.enabled else ()  # fmt: skip
    sg_rules = layout.max_replicas_per_node + 5
    own_topic = obs.alarm_topic_arn is None
    roles = len({n.role for n in layout.nodes})
    in_place = cfg.rollout.software == "in-place"
    e = cfg.serving.endpoint
    endpoint = [(API_KEYS_BYTES, API_KEYS_RESOURCES, API_KEYS_OUTPUTS)] if cfg.endpoint_auth == "keys" and not e.keys_secret_arn else []
    endpoint += [(0, 0, API_KEYS_OUTPUTS)] if cfg.endpoint_auth == "keys" and e.keys_secret_arn else []
    endpoint += [(TLS_BYTES, TLS_RESOURCES, TLS_OUTPUTS - (0 if e.plain_port else 1))] if e.certificate_arn else []
    endpoint += [(PRIVATE_LINK_BYTES, PRIVATE_LINK_RESOURCES, PRIVATE_LINK_OUTPUTS)] if e.allowed_principals else []
    return StackSize(
        nodes=len(layout.nodes),
        resources=BASE_RESOURCES + len(cell_sizes) + len(alarm_cells) + sg_rules + (OBSERVABILITY_RESOURCES if obs.enabled else 0)
        + ((ALARM_TOPIC_RESOURCES + len(obs.alarm_emails)) if own_topic else 0) + 1 + ((1 + roles) if in_place else 0)
        + sum(r for _, r, _ in endpoint),
        outputs=BASE_OUTPUTS + (2 if own_topic else 0) + sum(o for _, _, o in endpoint),
        template_bytes=BASE_BYTES
        + PER_CELL_BYTES * len(cell_sizes)
        + ALARM_CELL_BYTES * len(alarm_cells)
        + PER_RULE_BYTES * sg_rules
        + (OBSERVABILITY_BYTES if obs.enabled else 0)
        + ((ALARM_TOPIC_BYTES + PER_EMAIL_BYTES * len(obs.alarm_emails)) if own_topic else 0)
        + (LOAD_BALANCER_BYTES if cfg.load_balanced else 0)
        + IN_PLACE_BYTES + (PER_ASSOCIATION_BYTES * roles if in_place else 0)
        + _router_fleet_bytes(cfg)
        + sum(b for b, _, _ in endpoint),
        largest_user_data=max(size_of.values()) + url_growth,
        cells=cell_sizes,
        alarm_cells=alarm_cells,
    )


def _over(size: StackSize) -> list[str]:
    over = []
    if size.outputs > MAX_OUTPUTS:
        over.append(f"{size.outputs} outputs (CloudFormation allows {MAX_OUTPUTS})")
    for t in size.templates:
        what = "the stack" if t.name == "parent" else f"cell {t.name} ({t.nodes} nodes)"
        if t.resources > MAX_RESOURCES:
            over.append(f"{what}: about {t.resources} resources (CloudFormation allows {MAX_RESOURCES})")
        if t.template_bytes > MAX_TEMPLATE_BYTES:
            over.append(f"{what}: about {t.template_bytes / 1e6:.2f} MB of template (CloudFormation allows 1 MB)")
    return over


def largest_fleet(cfg: ClusterConfig) -> int:
    """The most decode instances one stack holds with the other parameters of `cfg`.

    A binary search over estimates (cheap: one render per node shape). Each decode instance adds
    at least one node to a cell and, every cell_nodes nodes, a cell to the parent: the parent's
    resources bound the search.
    """
    lo, hi = 0, min(cfg.decode_instances - 1, (MAX_RESOURCES - BASE_RESOURCES) * cfg.cell_nodes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _over(estimate(cfg.model_copy(update={"decode_instances": mid}))):
            hi = mid - 1
        else:
            lo = mid
    return lo


def check(cfg: ClusterConfig) -> StackSize:
    """Fail with the field, the value, the limit and the fix when the stack, a cell or a node cannot hold it.

    Run by `plan` and by the app before anything is synthesized (limits are a property of the
    rendered cluster, so they are checked after rendering, not inside the config model).
    """
    try:
        size = estimate(cfg)
    except SpecError:
        raise
    except ValueError as e:  # a value the renderer cannot carry into a unit or env file
        raise SpecError([f"{e}. Fix: remove the quote, backslash or newline from that setting."]) from None
    if size.largest_user_data > USER_DATA_LIMIT:
        raise SpecError(
            [
                f"replicas_per_prefill_instance={cfg.replicas_per_prefill_instance}: a node's user data would be "
                f"{size.largest_user_data:,} bytes; EC2 allows {USER_DATA_LIMIT:,}. Fix: fewer replicas per prefill "
                "instance, or shorter env tables and extra flags."
            ]
        )
    over = _over(size)
    cell_over = [o for o in over if o.startswith("cell ")]
    if cell_over:
        raise SpecError([f"cell_nodes={cfg.cell_nodes}: " + " and ".join(cell_over) + ". Fix: lower cell_nodes (each cell then holds fewer nodes)."])
    if over:
        raise SpecError(
            [
                f"decode_instances={cfg.decode_instances}: {size.nodes} instances in {len(size.cells)} cells need "
                + " and ".join(over)
                + f". Fix: keep one stack at or below {largest_fleet(cfg)} decode instances, or raise cell_nodes "
                "(fewer, larger cells), or deploy a larger fleet as several stacks, each with its own stack_name and cluster_name."
            ]
        )
    return size
