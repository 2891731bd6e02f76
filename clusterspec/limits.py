"""CloudFormation limits a fleet must fit in one stack, checked before anything is synthesized."""

from __future__ import annotations

from dataclasses import dataclass

from clusterspec.config import ClusterConfig
from clusterspec.errors import SpecError
from clusterspec.render import render_cluster
from clusterspec.userdata import USER_DATA_LIMIT, user_data

MAX_TEMPLATE_BYTES = 1_000_000  # CloudFormation: 1 MB for a template uploaded to S3
MAX_RESOURCES = 500
MAX_OUTPUTS = 200
# Measured on templates the CLI writes (scripts/bench_scale.py prints estimate and actual):
# what a template holds besides the nodes' user data. Rounded up: the estimate must not be
# smaller than the template.
BASE_BYTES = 40_000
PER_NODE_BYTES = 1_700
PER_RULE_BYTES = 400
LOAD_BALANCER_BYTES = 6_000
PER_GATE_BYTES = 900  # a node's wait condition and handle (deploy gate)
OBSERVABILITY_BYTES = 16_000  # log group, dashboard body, alarms, publishing rights
BASE_RESOURCES = 40
BASE_OUTPUTS = 2
IP_PLACEHOLDER = "10.255.255.254"
# As long as the URI CloudFormation fills in: the bootstrap bucket's name and the asset's key.
SCRIPTS_URI_PLACEHOLDER = "s3://cdk-hnb659fds-assets-123456789012-ap-southeast-4/" + "0" * 64 + ".xz"
# About as long as a wait condition handle's presigned URL.
# The members parameter's Fn::Join holds each node's "name=" part and a GetAtt of its PrivateIp.
MEMBER_BYTES = 140
SIGNAL_URL_PLACEHOLDER = "https://cloudformation-waitcondition-ap-southeast-4.s3.ap-southeast-4.amazonaws.com/" + "x" * 900


@dataclass(frozen=True)
class StackSize:
    """Estimated size of the stack a config synthesizes."""

    nodes: int
    resources: int
    outputs: int
    template_bytes: int
    largest_user_data: int


def estimate(cfg: ClusterConfig) -> StackSize:
    """Size the stack from the exact user data of every node plus measured per-node overhead."""
    renders = render_cluster(cfg)
    # In the template the gate's URL is a Ref of about 60 characters; on the instance it is the
    # presigned URL, which counts against EC2's 16 KB.
    sizes = [
        len(
            user_data(
                r,
                {p: IP_PLACEHOLDER for p in r.peers},
                scripts_uri=SCRIPTS_URI_PLACEHOLDER,
                scripts_sha256="0" * 64,
                signal_url="x" * 60 if cfg.wait_for_ready else None,
                router_uri=SCRIPTS_URI_PLACEHOLDER,
            ).encode()
        )
        for r in renders
    ]
    url_growth = len(SIGNAL_URL_PLACEHOLDER) - 60 if cfg.wait_for_ready else 0
    layout = cfg.layout
    nodes = len(renders)
    routed = cfg.proxy_kind == "vllm-router"
    sg_rules = layout.max_replicas_per_node + 5
    # The template holds user data as text; CloudFormation base64-encodes it at deploy time.
    return StackSize(
        nodes=nodes,
        resources=BASE_RESOURCES + nodes * (3 if cfg.wait_for_ready else 1) + sg_rules + (6 if cfg.observability.enabled else 0)
        + (1 if routed else 0),
        outputs=BASE_OUTPUTS + 2 * nodes + (1 if len(layout.proxies) > 1 and not cfg.load_balanced else 0),
        template_bytes=BASE_BYTES
        + sum(sizes)
        + PER_NODE_BYTES * nodes
        + PER_RULE_BYTES * sg_rules
        + (PER_GATE_BYTES * nodes if cfg.wait_for_ready else 0)
        + (OBSERVABILITY_BYTES if cfg.observability.enabled else 0)
        + (MEMBER_BYTES * nodes if routed else 0)
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


def largest_fleet(cfg: ClusterConfig, size: StackSize | None = None) -> int:
    """The most decode instances one stack holds with the other parameters of `cfg`."""
    size = size or estimate(cfg)
    # Size grows linearly with the fleet: guess from this size, then search near the guess.
    per_decode = size.nodes / cfg.decode_instances
    per_node = (size.template_bytes - BASE_BYTES) / size.nodes
    max_nodes = min((MAX_OUTPUTS - BASE_OUTPUTS) // 2, (MAX_TEMPLATE_BYTES - BASE_BYTES) / per_node)
    guess = int(max_nodes / per_decode)
    lo, hi = max(1, guess - 2), min(cfg.decode_instances, guess + 2)
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
                + f". Fix: keep one stack at or below {largest_fleet(cfg, size)} decode instances and deploy a larger "
                "fleet as several stacks, each with its own stack_name and cluster_name."
            ]
        )
    return size
