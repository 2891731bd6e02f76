"""Draw a fleet layout: instances, replica groups, proxies, the load balancer and the KV links."""

from __future__ import annotations

from itertools import groupby
from pathlib import Path

from clusterspec.config import ClusterConfig


def draw(cfg: ClusterConfig, path: Path) -> Path:
    """Write a PNG or SVG (by extension) of the layout with the `diagrams` package and Graphviz."""
    from diagrams import Cluster, Diagram, Edge
    from diagrams.aws.compute import EC2Instance
    from diagrams.aws.ml import ElasticInference
    from diagrams.aws.network import NLB
    from diagrams.onprem.client import Client

    layout = cfg.layout
    s = cfg.serving
    fmt = path.suffix.lstrip(".") or "png"
    title = (
        f"{cfg.stack_name}: {len(layout.prefill_nodes)} prefill + {len(layout.decode_nodes)} decode "
        f"{cfg.instance_type}, {len(layout.replicas)} TP{s.prefill.tensor_parallel} prefill replicas"
    )
    with Diagram(
        title,
        filename=str(path.with_suffix("")),
        outformat=fmt,
        show=False,
        # Top to bottom: requests enter at the top, the decode servers (and their proxies) form
        # one row, the prefill instances the row below, so a fleet grows sideways and the
        # picture of 3 + 8 reads on one screen.
        direction="TB",
        graph_attr={"fontsize": "20", "pad": "0.4", "nodesep": "0.7", "ranksep": "1.0"},
    ):
        client = Client(f"client\n(SSM port forward :{s.proxy.port})")
        routed = cfg.proxy_kind == "vllm-router"
        # What the target group checks: the router's readiness, or the toy proxy's whole group (gptoss-group-health).
        health = f":{s.proxy.port} {cfg.proxy_health_path}" if routed else f":{s.proxy.group_health_port} /ready"
        entry = NLB(f"internal NLB :{s.proxy.port}\nhealth {health}") if cfg.load_balanced else None
        if entry is not None:
            client >> entry
        # One icon per decode instance; a proxy on it is named in the label.
        targets: dict[int, object] = {}
        decode: dict[int, object] = {}
        for node in layout.decode_nodes:
            proxied = bool(layout.proxies_on(node.name))
            decode[node.index] = ElasticInference(
                f"{node.name}\nTP{s.decode.tensor_parallel} DP{s.decode.data_parallel} :{s.decode.http_port}"
                + (f"\n+ {'router' if routed else 'proxy'} :{s.proxy.port}" if proxied else "")
            )
            for p in layout.proxies_on(node.name):
                targets[p.decode_server] = decode[node.index]
        groups: dict[int, list[object]] = {}
        for node in layout.prefill_nodes:
            with Cluster(f"{node.name}  ({node.idle_cores} idle cores)"):
                for p in layout.proxies_on(node.name):
                    targets[p.decode_server] = EC2Instance(f"{'router' if routed else 'proxy'} :{s.proxy.port}")
                for d, group in groupby(node.replicas, key=lambda r: r.decode_server):
                    reps = list(group)
                    label = (
                        f"replicas {reps[0].index}-{reps[-1].index}\n:{reps[0].http_port}-{reps[-1].http_port}\n"
                        f"cores {reps[0].first_core}-{reps[-1].last_core}"
                    )
                    groups.setdefault(d, []).append(ElasticInference(label))
        for d, target in targets.items():
            (entry or client) >> Edge(color="gray40") >> target
            if target is not decode[d]:  # a proxy of its own (on a prefill instance): requests to both
                target >> Edge(color="darkgreen", style="dashed") >> decode[d]
                for g in groups.get(d, []):
                    target >> Edge(color="darkgreen", style="dashed", constraint="false") >> g
        first = True
        for d, gs in groups.items():
            for g in gs:
                # Ranked from decode down to the replicas, drawn pointing up: the KV cache flows
                # from each prefill replica group to its decode server.
                decode[d] << Edge(color="firebrick", style="bold", label="KV (NIXL/EFA)" if first else "") << g
                first = False
    return path
