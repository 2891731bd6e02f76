"""Draw a fleet layout: instances, servers, proxies or routers, the load balancer and the KV links.

Labels come from the same spec as the template (ports, the load balancer's health check, which
node runs what). An SVG is self-contained: the icons are embedded, so the file can be mailed,
committed or opened anywhere.
"""

from __future__ import annotations

import base64
import re
from itertools import groupby
from pathlib import Path

from clusterspec.config import ClusterConfig


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


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
    if s.disaggregated:
        title = (f"{cfg.stack_name}: {len(layout.prefill_nodes)} prefill + {len(layout.decode_nodes)} decode {cfg.instance_type}, "
                 f"{len(layout.replicas)} TP{s.prefill.tensor_parallel} prefill replicas")  # fmt: skip
    else:
        title = f"{cfg.stack_name}: 1 {cfg.instance_type}, one TP{s.server.tensor_parallel} server ({cfg.recipe})"
    with Diagram(
        title,
        filename=str(path.with_suffix("")),
        outformat=fmt,
        show=False,
        # Top to bottom: requests enter at the top, the decode servers (and their proxies) form
        # one row, the prefill instances the row below, so a fleet grows sideways and the
        # picture of 3 + 8 reads on one screen.
        direction="TB",
        graph_attr={"fontsize": "20", "pad": "0.4", "nodesep": "1.0", "ranksep": "1.2"},
    ):
        if not s.disaggregated:
            (node,) = layout.nodes
            client = Client(f"client\n(SSM port forward :{s.server.port})")
            client >> Edge(color="gray40") >> ElasticInference(f"{node.name}\nserver TP{s.server.tensor_parallel} :{s.server.port}\n{s.model_id}")
        else:
            _draw_fleet(cfg, Client, Edge, Cluster, EC2Instance, ElasticInference, NLB)
    if fmt == "svg":
        _embed_images(path)
    return path


def _draw_fleet(cfg: ClusterConfig, Client, Edge, Cluster, EC2Instance, ElasticInference, NLB) -> None:  # type: ignore[no-untyped-def]
    layout = cfg.layout
    s = cfg.serving
    routed = cfg.proxy_kind == "vllm-router"
    front = "router" if routed else "proxy"
    client = Client(f"client\n(SSM port forward :{s.proxy.port})")
    port, path = cfg.endpoint_health_check
    entry = NLB(f"internal NLB :{s.proxy.port}\nhealth check :{port} {path}") if cfg.load_balanced else None
    if entry is not None:
        client >> entry
    # One icon per decode instance; a proxy or router on it is named in the label.
    targets: dict[int, object] = {}
    decode: dict[int, object] = {}
    for node in layout.decode_nodes:
        on_it = layout.proxies_on(node.name)
        decode[node.index] = ElasticInference(
            f"{node.name}\nTP{s.decode.tensor_parallel} DP{s.decode.data_parallel} :{s.decode.http_port}"
            + (f"\n+ {front} :{s.proxy.port}" if on_it else "")
        )
        for p in on_it:
            targets[p.decode_server] = decode[node.index]
    groups: dict[int, list[object]] = {}
    for node in layout.prefill_nodes:
        with Cluster(f"{node.name}  ({node.idle_cores} idle cores)"):
            for p in layout.proxies_on(node.name):
                targets[p.decode_server] = EC2Instance(f"{node.name}\n{front} :{s.proxy.port}")
            # Behind the router any replica feeds any decode server: one group per instance. The
            # toy proxy pairs fixed replicas with one decode server: one group per pair.
            runs = [list(node.replicas)] if routed else [list(g) for _, g in groupby(node.replicas, key=lambda r: r.decode_server)]
            for reps in runs:
                label = (f"{node.name} replicas {_span(reps[0].index, reps[-1].index)}\n"
                         f":{_span(reps[0].http_port, reps[-1].http_port)}  cores {reps[0].first_core}-{reps[-1].last_core}")  # fmt: skip
                icon = ElasticInference(label)
                for d in sorted({r.decode_server for r in reps}) if not routed else list(decode):
                    groups.setdefault(d, []).append(icon)
    for d, target in targets.items():
        (entry or client) >> Edge(color="gray40") >> target
        if not routed and target is not decode[d]:  # a toy proxy on a prefill instance: requests to both
            target >> Edge(color="darkgreen", style="dashed") >> decode[d]
            for g in groups.get(d, []):
                target >> Edge(color="darkgreen", style="dashed", constraint="false") >> g
    first = True
    for d, gs in groups.items():
        for g in gs:
            # Ranked from decode down to the replicas, drawn pointing up: the KV cache flows from
            # each prefill replica group to the decode servers it feeds.
            decode[d] << Edge(color="firebrick", style="bold", label="KV (NIXL/EFA)" if first else "") << g
            first = False


def _embed_images(path: Path) -> None:
    """Replace every icon Graphviz linked by file path with the image itself: each distinct icon
    once, as a data: URI in <defs>, and every use of it a <use> at its place."""
    svg = path.read_text()
    defs: dict[tuple[str, ...], str] = {}

    def inline(m: re.Match[str]) -> str:
        src, width, height, aspect, x, y = m.groups()
        key = (src, width, height, aspect)
        if key not in defs:
            file = Path(src)
            mime = {".png": "image/png", ".svg": "image/svg+xml"}.get(file.suffix.lower(), "image/jpeg")
            data = base64.b64encode(file.read_bytes()).decode()
            defs[key] = (f'<image id="icon{len(defs)}" xlink:href="data:{mime};base64,{data}" width="{width}" height="{height}" '
                         f'preserveAspectRatio="{aspect}"/>')  # fmt: skip
        return f'<use xlink:href="#icon{list(defs).index(key)}" x="{x}" y="{y}"/>'

    body = re.sub(
        r'<image xlink:href="(/[^"]+)" width="([^"]+)" height="([^"]+)" preserveAspectRatio="([^"]+)" x="([^"]+)" y="([^"]+)"/>', inline, svg
    )
    if defs:
        # The <defs> go right after the opening <svg ...> tag.
        body = re.sub(r"(<svg\b[^>]*>)", lambda m: m.group(1) + "\n<defs>\n" + "\n".join(defs.values()) + "\n</defs>", body, count=1)
    path.write_text(body)
