"""Fleet layout: which replica runs where, on which cores and ports, feeding which decode server."""

from __future__ import annotations

from typing import Literal

from clusterspec.base import Frozen
from clusterspec.errors import SpecError
from clusterspec.instance_types import InstanceType
from clusterspec.names import decode_node, node_name
from clusterspec.sections.proxy import ProxyKind
from clusterspec.sections.serving import Serving

Role = Literal["prefill", "decode", "server"]


class Replica(Frozen):
    """One TP prefill server."""

    node: str
    index: int
    global_index: int
    first_core: int
    last_core: int
    http_port: int
    side_channel_port: int
    side_channel_last: int
    decode_server: int

    @property
    def unit(self) -> str:
        """The systemd instance of the prefill template unit."""
        return f"gptoss-prefill@{self.index}.service"

    @property
    def visible_cores(self) -> str:
        """NEURON_VISIBLE_DEVICES value (`4i-(4i+3)`)."""
        return f"{self.first_core}-{self.last_core}"


class ProxyPlacement(Frozen):
    """One proxy or router: the node it runs on and the servers it routes to.

    A toy proxy routes to one decode server and its fixed group of replicas; a router to every
    replica and every decode server of the fleet.
    """

    node: str
    decode_server: int
    replicas: tuple[Replica, ...]
    decode_servers: tuple[int, ...]
    kind: ProxyKind = "toy"


class Node(Frozen):
    """One instance of the fleet."""

    name: str
    logical_id: str
    role: Role
    index: int
    replicas: tuple[Replica, ...] = ()
    cores: int
    used_cores: int

    @property
    def idle_cores(self) -> int:
        """Logical NeuronCores no server binds."""
        return self.cores - self.used_cores


class Layout(Frozen):
    """The computed fleet."""

    decode_instances: int
    prefill_per_decode: int
    replicas_per_prefill_instance: int
    prefill_capacity: int
    nodes: tuple[Node, ...]
    proxies: tuple[ProxyPlacement, ...]

    @property
    def prefill_nodes(self) -> tuple[Node, ...]:
        """Prefill instances, in order."""
        return tuple(n for n in self.nodes if n.role == "prefill")

    @property
    def decode_nodes(self) -> tuple[Node, ...]:
        """Decode instances, in order."""
        return tuple(n for n in self.nodes if n.role == "decode")

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """Every prefill replica of the fleet."""
        return tuple(r for n in self.prefill_nodes for r in n.replicas)

    @property
    def max_replicas_per_node(self) -> int:
        """The most replicas any prefill instance runs (sizes the security-group rules)."""
        return max((len(n.replicas) for n in self.prefill_nodes), default=0)

    @property
    def load_balanced(self) -> bool:
        """Several proxies: by default they stand behind one internal load balancer."""
        return len(self.proxies) > 1

    @property
    def endpoint_nodes(self) -> tuple[str, ...]:
        """The nodes clients reach: the proxies, or the one server of a single-instance recipe."""
        return tuple(dict.fromkeys(p.node for p in self.proxies)) or (self.nodes[0].name,)

    def proxies_on(self, name: str) -> tuple[ProxyPlacement, ...]:
        """Proxies that run on node `name`."""
        return tuple(p for p in self.proxies if p.node == name)


# The most instances one stack holds: the largest fleet whose plan and synth this project measures
# (docs/benchmarks.md: 1,000 decode instances of the reference's ratio are 1,375 instances). One
# rule for every way to ask for more (decode_instances, prefill_per_decode, few replicas per
# prefill instance), checked before a node is placed, so a refusal takes no longer than a plan.
MAX_NODES = 1400


def fleet_too_large(decode_instances: int, prefill_per_decode: int, replicas_per_prefill_instance: int | None, per_node: int) -> str:
    """The refusal of a fleet over MAX_NODES: how many instances it asked for, and the largest that fits."""

    def size(d: int) -> int:
        return d - (-d * prefill_per_decode // per_node)  # whole instances, exact for any size

    lo, hi = 0, MAX_NODES
    while lo < hi:  # the most decode instances with these ratios within MAX_NODES
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= MAX_NODES else (lo, mid - 1)
    prefill = size(decode_instances) - decode_instances
    per = replicas_per_prefill_instance if replicas_per_prefill_instance is not None else "fill"
    if lo:  # the decode count is what is too large for these ratios
        head = f"decode_instances={decode_instances:,}: with prefill_per_decode={prefill_per_decode:,} and replicas_per_prefill_instance={per}"
        fits = f"at most {lo:,} decode instances with these ratios"
    else:  # not even one decode server's prefill fits
        head = f"prefill_per_decode={prefill_per_decode:,}: with decode_instances={decode_instances:,} and replicas_per_prefill_instance={per}"
        fits = "fewer prefill replicas per decode server, or more replicas per prefill instance"
    return (
        f"{head} ({per_node} per instance) the fleet is {decode_instances:,} decode + {prefill:,} prefill = {size(decode_instances):,} "
        f"instances; one stack holds at most {MAX_NODES:,}. Fix: {fits}, or several stacks, each with its own stack_name and cluster_name."
    )


def compute_layout(
    *,
    decode_instances: int,
    prefill_per_decode: int,
    instance_type: InstanceType,
    serving: Serving,
    replicas_per_prefill_instance: int | None = None,
    proxy_kind: ProxyKind = "toy",
) -> Layout:
    """Place prefill replicas and decode servers on instances from the prefill:decode ratio."""
    if not serving.disaggregated:
        return _single_layout(decode_instances=decode_instances, instance_type=instance_type, serving=serving)
    pre, dec = serving.prefill, serving.decode
    errors: list[str] = []
    if decode_instances < 1:
        errors.append(
            f"decode_instances={decode_instances}: a fleet needs at least one decode server. "
            "Fix: set decode_instances >= 1."
        )
    if prefill_per_decode < 1:
        errors.append(
            f"prefill_per_decode={prefill_per_decode}: each decode server needs at least one prefill replica. "
            "Fix: set prefill_per_decode >= 1 (the tested ratio is 6)."
        )
    prefill_cores = instance_type.logical_cores(pre.lnc)
    per_replica = pre.tensor_parallel
    if prefill_cores % per_replica:
        errors.append(
            f"serving.prefill.tensor_parallel={per_replica}: cores per replica must divide the "
            f"{prefill_cores} logical cores of {instance_type.name} at LNC={pre.lnc}. "
            "Fix: choose a tensor_parallel that divides it (the tested value is 4)."
        )
    decode_cores = instance_type.logical_cores(dec.lnc)
    if dec.tensor_parallel * dec.data_parallel > decode_cores:
        errors.append(
            f"serving.decode.data_parallel={dec.data_parallel}: TP{dec.tensor_parallel} x DP{dec.data_parallel} "
            f"needs {dec.tensor_parallel * dec.data_parallel} logical cores, {instance_type.name} has "
            f"{decode_cores} at LNC={dec.lnc}. Fix: lower data_parallel or tensor_parallel."
        )
    if serving.shape.quantization == "mxfp4" and not instance_type.mxfp4:
        errors.append(
            f"instance_type={instance_type.name!r}: the MXFP4 path of the tested configuration runs only on "
            "Trainium3. Fix: use a trn3 instance type, or set serving.shape.quantization to 'bf16' "
            "(an untested profile)."
        )
    if prefill_per_decode > dec.capacity:
        errors.append(
            f"prefill_per_decode={prefill_per_decode:,}: a decode server holds at most {dec.capacity} sequences at a time "
            f"(max_num_seqs {dec.max_num_seqs} x DP{dec.data_parallel}), so more prefill replicas per decode server than "
            f"that could never all hand it a request. Fix: set prefill_per_decode <= {dec.capacity}."
        )
    capacity = prefill_cores // per_replica if per_replica else 0
    per_node = replicas_per_prefill_instance or capacity
    if replicas_per_prefill_instance is not None and not 1 <= replicas_per_prefill_instance <= capacity:
        errors.append(
            f"replicas_per_prefill_instance={replicas_per_prefill_instance}: an instance holds 1 to {capacity} "
            f"TP{per_replica} replicas ({prefill_cores} logical cores / {per_replica}). "
            f"Fix: set it between 1 and {capacity}, or leave it unset to fill each instance."
        )
    if errors:
        raise SpecError(errors)

    total = decode_instances * prefill_per_decode
    prefill_count = -(-total // per_node)
    if decode_instances + prefill_count > MAX_NODES:
        raise SpecError([fleet_too_large(decode_instances, prefill_per_decode, replicas_per_prefill_instance, per_node)])
    by_node: dict[int, list[Replica]] = {i: [] for i in range(prefill_count)}
    for g in range(total):
        node_index, local = divmod(g, per_node)
        first, last = pre.cores(local)
        sc_first, sc_last = pre.side_channel_range(local)
        by_node[node_index].append(
            Replica(
                node=node_name("prefill", node_index),
                index=local,
                global_index=g,
                first_core=first,
                last_core=last,
                http_port=pre.http_port(local),
                side_channel_port=sc_first,
                side_channel_last=sc_last,
                decode_server=g // prefill_per_decode,
            )
        )
    nodes = [
        Node(
            name=node_name("prefill", i),
            logical_id=f"Prefill{i}",
            role="prefill",
            index=i,
            replicas=tuple(reps),
            cores=prefill_cores,
            used_cores=len(reps) * per_replica,
        )
        for i, reps in by_node.items()
    ]
    nodes += [
        Node(
            name=decode_node(d),
            logical_id=f"Decode{d}",
            role="decode",
            index=d,
            cores=decode_cores,
            used_cores=dec.tensor_parallel * dec.data_parallel,
        )
        for d in range(decode_instances)
    ]
    all_replicas = [r for reps in by_node.values() for r in reps]
    groups: dict[int, list[Replica]] = {d: [] for d in range(decode_instances)}
    for r in all_replicas:
        groups[r.decode_server].append(r)
    # The toy proxy with one decode server: the tested placement, on prefill node A. Otherwise one
    # proxy on each decode node, or a router on each of the first max_routers, so losing a node loses one endpoint, not all (and a
    # router outlives the loss of any prefill node it routes to). A toy proxy routes to its own
    # group; a router to every server of the fleet.
    every_decode = tuple(range(decode_instances))
    proxies = tuple(
        ProxyPlacement(
            node=node_name("prefill", 0) if decode_instances == 1 and proxy_kind == "toy" else decode_node(d),
            decode_server=d,
            replicas=tuple(all_replicas) if proxy_kind == "vllm-router" else tuple(groups[d]),
            decode_servers=every_decode if proxy_kind == "vllm-router" else (d,),
            kind=proxy_kind,
        )
        # Routers on the first max_routers decode nodes only (toy proxies: one per decode server, each its group's).
        for d in range(decode_instances if proxy_kind == "toy" else min(decode_instances, serving.proxy.router.max_routers))
    )
    return Layout(
        decode_instances=decode_instances,
        prefill_per_decode=prefill_per_decode,
        replicas_per_prefill_instance=per_node,
        prefill_capacity=capacity,
        nodes=tuple(nodes),
        proxies=proxies,
    )


def _single_layout(*, decode_instances: int, instance_type: InstanceType, serving: Serving) -> Layout:
    """One instance running one server (a single-instance recipe)."""
    srv = serving.server
    cores = instance_type.logical_cores(srv.lnc)
    errors = []
    if decode_instances != 1:
        errors.append(
            f"decode_instances={decode_instances}: the {serving.recipe} recipe runs one server on one instance. "
            "Fix: leave decode_instances at 1, or use a DI recipe (gptoss-120b-di, gptoss-20b-di) for a fleet."
        )
    if srv.tensor_parallel > cores:
        errors.append(
            f"serving.server.tensor_parallel={srv.tensor_parallel}: {instance_type.name} has {cores} logical cores at "
            f"LNC={srv.lnc}. Fix: lower tensor_parallel."
        )
    if serving.shape.quantization == "mxfp4" and not instance_type.mxfp4:
        errors.append(
            f"instance_type={instance_type.name!r}: MXFP4 runs only on Trainium3. Fix: leave serving.shape.quantization "
            "unset (the backend picks BF16 on Trn2) or use a trn3 instance type."
        )
    if errors:
        raise SpecError(errors)
    node = Node(name=node_name("server", 0), logical_id="Server0", role="server", index=0, cores=cores, used_cores=srv.tensor_parallel)
    return Layout(
        decode_instances=1, prefill_per_decode=0, replicas_per_prefill_instance=0, prefill_capacity=0, nodes=(node,), proxies=()
    )
