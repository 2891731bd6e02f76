"""Draw a fleet layout as Graphviz DOT: instances in order, what runs on each, the request path
(client, load balancer, proxy or router, the prefill leg, the decode leg), the KV transfer, and a
legend.

Labels come from the same spec as the template (ports, the load balancer's health check, which
node runs what). The DOT text is a pure function of the config (no random ids, no icons), so
`dot` draws the same bytes every time: the pictures in docs/diagrams are regenerated and compared
by a test. Behind vLLM's router any prefill replica feeds any decode server: the two tiers are
joined by one edge each way, not one per pair. The toy proxy pairs fixed replica groups with one
decode server: each group gets its own edges.
"""

from __future__ import annotations

import subprocess
from itertools import groupby
from pathlib import Path

from clusterspec.config import ClusterConfig
from clusterspec.layout import Node, Replica

FONT = "DejaVu Sans"  # Debian's fonts-dejavu-core, which Graphviz's package pulls in
REQUEST, PREFILL, DECODE, KV = "gray35", "royalblue3", "darkgreen", "firebrick3"


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _q(text: str) -> str:
    """A DOT string: quoted, with line breaks as DOT's centred ones."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _node(name: str, label: str, **attrs: str) -> str:
    extra = "".join(f", {k}={v}" for k, v in attrs.items())
    return f"  {name} [label={_q(label)}{extra}];"


def _edge(a: str, b: str, **attrs: str) -> str:
    return f"  {a} -> {b} [{', '.join(f'{k}={v}' for k, v in attrs.items())}];"


def _in_order(names: list[str]) -> list[str]:
    """Keep nodes left to right in this order: one rank, and heavy invisible edges between neighbours
    (given at the top level: inside nested clusters Graphviz may lay the row out reversed)."""
    if len(names) < 2:
        return []
    return [f"  {{ rank=same; {'; '.join(names)}; }}", f"  {' -> '.join(names)} [style=invis, weight=10];"]


def _legend(cfg: ClusterConfig) -> list[str]:
    """What each colour of edge means: one box at the bottom, a line of each colour beside its meaning."""
    rows = [(REQUEST, "client requests"), (PREFILL, "prefill leg (max_tokens 1)")]
    if cfg.proxy_kind != "vllm-router":  # behind the router the decode leg stays among the decode instances
        rows.append((DECODE, "decode leg"))
    rows.append((KV, "KV cache, NIXL over EFA"))
    cells = "".join(f'<tr><td><font color="{c}">━━━━▶</font></td><td align="left">{text}</td></tr>' for c, text in rows)
    return [f'  legend [shape=box, style="rounded", color=gray70, label=<<table border="0" cellspacing="2"><tr><td colspan="2"><b>legend</b></td></tr>{cells}</table>>];',
            "  { rank=sink; legend; }"]  # fmt: skip


def dot_source(cfg: ClusterConfig) -> str:
    """The whole picture as DOT text (the same text for the same config)."""
    layout = cfg.layout
    s = cfg.serving
    if s.disaggregated:
        title = (f"{cfg.stack_name}: {len(layout.prefill_nodes)} prefill + {len(layout.decode_nodes)} decode {cfg.instance_type}, "
                 f"{len(layout.replicas)} TP{s.prefill.tensor_parallel} prefill replica{'' if len(layout.replicas) == 1 else 's'}, "
                 f"{'vLLM router' if cfg.proxy_kind == 'vllm-router' else 'toy proxy'} ({cfg.recipe})")  # fmt: skip
    else:
        title = f"{cfg.stack_name}: 1 {cfg.instance_type}, one TP{s.server.tensor_parallel} server ({cfg.recipe})"
    lines = [
        "digraph fleet {",
        f"  graph [label={_q(title)}, labelloc=t, fontsize=16, fontname={_q(FONT)}, rankdir=TB, newrank=true, compound=true,"
        " nodesep=0.25, ranksep=0.7, pad=0.3, dpi=96];",
        f"  node [shape=box, style=\"rounded,filled\", fillcolor=gray97, color=gray45, fontname={_q(FONT)}, fontsize=11, margin=\"0.15,0.08\"];",
        f"  edge [fontname={_q(FONT)}, fontsize=10, color={REQUEST}, fontcolor=gray25];",
    ]
    if not s.disaggregated:
        (node,) = layout.nodes
        lines.append(_node("client", f"client\n(SSM port forward :{s.server.port})", fillcolor="white"))
        lines.append(_node("server", f"{node.name}\nserver TP{s.server.tensor_parallel} :{s.server.port}\n{s.model_id}"))
        lines.append(_edge("client", "server", label=_q("requests")))
        return "\n".join([*lines, "}"]) + "\n"
    lines += _fleet(cfg)
    lines += _legend(cfg)
    return "\n".join([*lines, "}"]) + "\n"


def _fleet(cfg: ClusterConfig) -> list[str]:
    layout = cfg.layout
    s = cfg.serving
    routed = cfg.proxy_kind == "vllm-router"
    front = "router" if routed else "proxy"
    out = [_node("client", f"client\n(SSM port forward :{s.proxy.port})", fillcolor="white")]
    entry = "client"
    if cfg.load_balanced:
        port, path = cfg.endpoint_health_check
        out.append(_node("nlb", f"internal NLB :{s.proxy.port}\nhealth check :{port} {path}", fillcolor="aliceblue"))
        out.append(_edge("client", "nlb", label=_q("requests")))
        entry = "nlb"

    def decode_label(node: Node) -> str:
        on_it = layout.proxies_on(node.name)
        return (f"{node.name}\n" + "".join(f"{front} :{s.proxy.port}\n" for _ in on_it)
                + f"decode TP{s.decode.tensor_parallel} DP{s.decode.data_parallel} :{s.decode.http_port}")  # fmt: skip

    def group_label(node: Node, reps: list[Replica]) -> str:
        return (f"{node.name} replicas {_span(reps[0].index, reps[-1].index)}\n"
                f"TP{s.prefill.tensor_parallel} :{_span(reps[0].http_port, reps[-1].http_port)}, cores {reps[0].first_core}-{reps[-1].last_core}")  # fmt: skip

    decode = [f"d{n.index}" for n in layout.decode_nodes]
    out.append("  subgraph cluster_decode {")
    what = ": a router on each sends the prefill leg to any replica, then the decode leg to any decode server" if routed else ""
    out.append(f"    label={_q('decode instances' + what)}; style=\"rounded,dashed\"; color=gray60; fontsize=12;")
    out += [_node(f"d{n.index}", decode_label(n)) for n in layout.decode_nodes]
    out.append("  }")
    rows = _in_order(decode)
    # Prefill instances in order; behind the router one box per instance, behind the toy proxy one per fixed group.
    groups: list[tuple[str, int]] = []  # (box, decode server it feeds; -1: any)
    proxy_boxes: dict[int, str] = {}
    out.append("  subgraph cluster_prefill {")
    out.append(f"    label={_q('prefill instances')}; style=\"rounded,dashed\"; color=gray60; fontsize=12;")
    order: list[str] = []
    for node in layout.prefill_nodes:
        idle = f", {node.idle_cores} idle cores" if node.idle_cores else ""
        # One box per instance behind the router (it names the instance); a frame per instance around
        # the toy proxy's groups. (A frame around a single box also makes Graphviz reverse the row.)
        framed = not routed
        if framed:
            out.append(f"    subgraph cluster_p{node.index} {{ label={_q(node.name + idle)}; style=rounded; color=gray75; fontsize=11;")
        for p in layout.proxies_on(node.name):
            box = f"p{node.index}_proxy{p.decode_server}"
            proxy_boxes[p.decode_server] = box
            out.append("  " + _node(box, f"{node.name}\n{front} :{s.proxy.port}", fillcolor="aliceblue"))
            order.append(box)
        runs = [list(node.replicas)] if routed else [list(g) for _, g in groupby(node.replicas, key=lambda r: r.decode_server)]
        for i, reps in enumerate(runs):
            box = f"p{node.index}_g{i}"
            out.append("  " + _node(box, group_label(node, reps) + ("" if framed else idle.replace(", ", "\n"))))
            groups.append((box, -1 if routed else reps[0].decode_server))
            order.append(box)
        if framed:
            out.append("    }")
    out.append("  }")
    out += rows + _in_order(order)
    if routed:
        # One edge per leg between the tiers: every router reaches every server.
        out.append(_edge(entry, decode[len(decode) // 2], lhead="cluster_decode", label=_q("requests: any ready router")))
        middle = groups[len(groups) // 2][0]
        out.append(_edge(decode[len(decode) // 2], middle, ltail="cluster_decode", lhead="cluster_prefill", color=PREFILL,
                         label=_q("prefill leg, any replica")))  # fmt: skip
        out.append(_edge(decode[len(decode) // 2], middle, ltail="cluster_decode", lhead="cluster_prefill", color=KV, penwidth="2.5",
                         dir="back", label=_q("KV cache to the decode\nserver the router chose")))  # fmt: skip
        return out
    for d in range(len(layout.decode_nodes)):
        proxy = proxy_boxes.get(d, f"d{d}")  # the toy proxy of decode server d: on prefill-0 (one decode) or on decode-d
        if d == 0 or proxy != f"d{d}" or cfg.load_balanced:
            out.append(_edge(entry, proxy, label=_q("requests") if d == 0 else '""'))
        if proxy != f"d{d}":
            out.append(_edge(proxy, f"d{d}", color=DECODE, label=_q("decode leg")))
        for box, feeds in groups:
            if feeds == d:
                out.append(_edge(proxy, box, color=PREFILL, constraint="false" if proxy.startswith("d") else "true"))
                out.append(_edge(f"d{d}", box, color=KV, penwidth="2.5", dir="back"))
    return out


def draw(cfg: ClusterConfig, path: Path) -> Path:
    """Write the layout as PNG or SVG (by the file's extension) with Graphviz's dot."""
    fmt = path.suffix.lstrip(".").lower() or "png"
    if fmt not in ("png", "svg"):
        raise ValueError(f"--diagram {path}: draws .png or .svg. Fix: name a file ending in .png or .svg.")
    r = subprocess.run(["dot", f"-T{fmt}", "-o", str(path)], input=dot_source(cfg), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"dot failed ({r.returncode}): {r.stderr.strip()[:300]}")
    return path
