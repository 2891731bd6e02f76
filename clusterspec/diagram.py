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
        direction="LR",
        graph_attr={"fontsize": "18", "pad": "0.4", "nodesep": "0.25", "ranksep": "1.2"},
    ):
        client = Client(f"client\n(SSM port forward :{s.proxy.port})")
        groups: dict[int, list[object]] = {}
        decode_nodes: dict[int, object] = {}
        proxies: dict[int, object] = {}
        for node in layout.prefill_nodes:
            with Cluster(f"{node.name}  ({node.idle_cores} idle cores)"):
                for d, group in groupby(node.replicas, key=lambda r: r.decode_server):
                    reps = list(group)
                    label = (
                        f"replicas {reps[0].index}-{reps[-1].index}\n"
                        f"HTTP {reps[0].http_port}-{reps[-1].http_port}\n"
                        f"cores {reps[0].first_core}-{reps[-1].last_core}"
                    )
                    groups.setdefault(d, []).append(ElasticInference(label))
                for p in layout.proxies_on(node.name):
                    proxies[p.decode_server] = EC2Instance(f"proxy :{s.proxy.port}")
        for node in layout.decode_nodes:
            with Cluster(node.name):
                decode_nodes[node.index] = ElasticInference(
                    f"decode TP{s.decode.tensor_parallel} DP{s.decode.data_parallel}\nHTTP {s.decode.http_port}"
                )
                for p in layout.proxies_on(node.name):
                    proxies[p.decode_server] = EC2Instance(f"proxy :{s.proxy.port}")
        # Only the KV flow (prefill -> decode) ranks the columns; request edges would fold
        # the picture back on itself, so they do not constrain the layout.
        free = {"constraint": "false"}
        if cfg.load_balanced:
            lb = NLB(f"internal NLB :{s.proxy.port}\nhealth {s.proxy.health_path}")
            client >> lb
            for proxy_node in proxies.values():
                lb >> Edge(color="gray40", **free) >> proxy_node
        else:
            client >> Edge(**free) >> proxies[0]
        first = True
        for d, proxy in proxies.items():
            for g in groups[d]:
                proxy >> Edge(color="darkgreen", label="prefill" if first else "", **free) >> g
                g >> Edge(color="firebrick", style="bold", label="KV over NIXL/EFA" if first else "") >> decode_nodes[d]
                first = False
            proxy >> Edge(color="darkgreen", style="dashed", **free) >> decode_nodes[d]
    return path
