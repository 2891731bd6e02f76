"""CloudFormation limits a fleet must fit in one stack, checked before anything is synthesized."""

from __future__ import annotations

import re
from dataclasses import dataclass

from clusterspec.config import ClusterConfig
from clusterspec.errors import SpecError
from clusterspec.layout import Layout, Node
from clusterspec.render import render_node
from clusterspec.userdata import USER_DATA_LIMIT, user_data

MAX_TEMPLATE_BYTES = 1_000_000  # CloudFormation: 1 MB for a template uploaded to S3
MAX_RESOURCES = 500
MAX_OUTPUTS = 200
# Measured on templates the CLI writes (scripts/bench_scale.py prints estimate and actual):
# what a template holds besides the nodes' user data. Rounded up: the estimate must not be
# smaller than the template.
BASE_BYTES = 20_000
PER_NODE_BYTES = 8_500  # a node's launch template (but its NICs), group, role and instance profile, with their paths
PER_CARD_BYTES = 340  # one network interface of a node's launch template (measured: 327)
PER_NODE_RESOURCES = 4
OBSERVABILITY_RESOURCES = 10  # log group, dashboard, alarms, the replacement rules
PER_RULE_BYTES = 400
LOAD_BALANCER_BYTES = 6_000
PER_GATE_BYTES = 900  # a node's wait condition and handle (deploy gate)
OBSERVABILITY_BYTES = 16_000  # log group, dashboard body, alarms, publishing rights
BASE_RESOURCES = 40
# Nodes of one shape differ only in digits; xz packs different digits into a few bytes more or
# less. Measured over the examples and recipes (tests/unit/test_limits.py compares with every
# node rendered): under 16 bytes of user data. Twice that, per node.
SHAPE_SLACK = 32
_DIGIT = re.compile(r"\d")


def _zero(text: str) -> str:
    return _DIGIT.sub("0", text)
BASE_OUTPUTS = 2
# As long as the URI CloudFormation fills in: the bootstrap bucket's name and the asset's key.
SCRIPTS_URI_PLACEHOLDER = "s3://cdk-hnb659fds-assets-123456789012-ap-southeast-4/" + "0" * 64 + ".xz"
# About as long as a wait condition handle's presigned URL.
SIGNAL_URL_PLACEHOLDER = "https://cloudformation-waitcondition-ap-southeast-4.s3.ap-southeast-4.amazonaws.com/" + "x" * 900


@dataclass(frozen=True)
class StackSize:
    """Estimated size of the stack a config synthesizes."""

    nodes: int
    resources: int
    outputs: int
    template_bytes: int
    largest_user_data: int


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


def _user_data_bytes(cfg: ClusterConfig, layout: Layout, node: Node) -> int:
    r = render_node(cfg, layout, node)
    # In the template the gate's URL is a Ref of about 60 characters; on the instance it is the
    # presigned URL, which counts against EC2's 16 KB.
    return len(
        user_data(
            r,
            scripts_uri=SCRIPTS_URI_PLACEHOLDER,
            scripts_sha256="0" * 64,
            signal_url="x" * 60 if cfg.wait_for_ready else None,
            router_uri=SCRIPTS_URI_PLACEHOLDER,
            compile_cache_uri=SCRIPTS_URI_PLACEHOLDER,
        ).encode()
    )


def estimate(cfg: ClusterConfig) -> StackSize:
    """Size the stack from the exact user data of one node per shape (plus SHAPE_SLACK) and measured
    per-node overhead: linear in the fleet, with one render and one xz per shape, not per node."""
    layout = cfg.layout
    groups = shapes(layout)
    sizes = [_user_data_bytes(cfg, layout, group[-1]) + SHAPE_SLACK for group in groups]
    counts = [len(group) for group in groups]
    url_growth = len(SIGNAL_URL_PLACEHOLDER) - 60 if cfg.wait_for_ready else 0
    nodes = len(layout.nodes)
    sg_rules = layout.max_replicas_per_node + 5
    # The template holds user data as text; CloudFormation base64-encodes it at deploy time.
    return StackSize(
        nodes=nodes,
        # Each node identity: its launch template, group, role and instance profile, and its gate's two.
        resources=BASE_RESOURCES + nodes * (PER_NODE_RESOURCES + (2 if cfg.wait_for_ready else 0)) + sg_rules
        + (OBSERVABILITY_RESOURCES if cfg.observability.enabled else 0),
        outputs=BASE_OUTPUTS,
        template_bytes=BASE_BYTES
        + sum(size * count for size, count in zip(sizes, counts, strict=True))
        + (PER_NODE_BYTES + PER_CARD_BYTES * cfg.hardware.network_cards) * nodes
        + PER_RULE_BYTES * sg_rules
        + (PER_GATE_BYTES * nodes if cfg.wait_for_ready else 0)
        + (OBSERVABILITY_BYTES if cfg.observability.enabled else 0)
        + (LOAD_BALANCER_BYTES if cfg.load_balanced else 0),
        largest_user_data=max(sizes) + url_growth,
    )


def _over(size: StackSize) -> list[str]:
    over = []
    if size.outputs > MAX_OUTPUTS:
        over.append(f"{size.outputs} outputs (CloudFormation allows {MAX_OUTPUTS})")
    if size.resources > MAX_RESOURCES:
        over.append(f"about {size.resources} resources (CloudFormation allows {MAX_RESOURCES})")
    if size.template_bytes > MAX_TEMPLATE_BYTES:
        over.append(f"about {size.template_bytes / 1e6:.2f} MB of template (CloudFormation allows 1 MB)")
    return over


def largest_fleet(cfg: ClusterConfig) -> int:
    """The most decode instances one stack holds with the other parameters of `cfg`.

    A binary search over estimates (cheap: one render per node shape). Each decode instance is at
    least one node of PER_NODE_RESOURCES resources, so the resources limit bounds the search; the
    size per node is not a constant (a router's pool names every server), so no guess from one
    size is trusted.
    """
    lo, hi = 0, min(cfg.decode_instances - 1, (MAX_RESOURCES - BASE_RESOURCES) // PER_NODE_RESOURCES)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _over(estimate(cfg.model_copy(update={"decode_instances": mid}))):
            hi = mid - 1
        else:
            lo = mid
    return lo


def check(cfg: ClusterConfig) -> StackSize:
    """Fail with the field, the value, the limit and the fix when one stack or one node cannot hold it.

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
    if over:
        raise SpecError(
            [
                f"decode_instances={cfg.decode_instances}: {size.nodes} instances in one stack need "
                + " and ".join(over)
                + f". Fix: keep one stack at or below {largest_fleet(cfg)} decode instances and deploy a larger "
                "fleet as several stacks, each with its own stack_name and cluster_name."
            ]
        )
    return size
