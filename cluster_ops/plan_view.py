"""How a plan reads: the 80-column summary, `plan --json`, every unit's detail, and the price table.

Presentation only: the plan comes from clusterspec (render_cluster), prices from cluster_ops.cost.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from typing import TYPE_CHECKING, Any

from cluster_ops import common
from cluster_ops.growth import fleet_growth
from clusterspec.cells import cells
from clusterspec.config import ClusterConfig
from clusterspec.names import decode_node
from node_render.haproxy import gate_summary
from node_render.node_files import NodeRender
from node_render.render import plan_json

if TYPE_CHECKING:
    from rich.console import Console


def _groups(renders: list[NodeRender]) -> list[tuple[str, list[NodeRender]]]:
    """Consecutive nodes that look alike in the summary, as 'decode-0..7'."""
    out: list[tuple[str, list[NodeRender]]] = []
    for r in renders:
        feeds = sorted({rep.decode_server for rep in r.node.replicas})
        key = (r.node.role, len(r.node.replicas), r.node.used_cores, len(r.services), len(feeds))
        if out and out[-1][1][-1].node.role == r.node.role and _key(out[-1][1][-1]) == key:
            out[-1][1].append(r)
        else:
            out.append((r.node.role, [r]))
    return out


def _key(r: NodeRender) -> tuple[Any, ...]:
    feeds = sorted({rep.decode_server for rep in r.node.replicas})
    return (r.node.role, len(r.node.replicas), r.node.used_cores, len(r.services), len(feeds))


def _span(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    return f"{names[0]}..{names[-1].rsplit('-', 1)[1]}"


def _feeds(rs: list[NodeRender], routed: bool) -> str:
    feeds = sorted({rep.decode_server for r in rs for rep in r.node.replicas})
    if not feeds:
        return "-"
    if routed:
        return "every decode"
    return decode_node(feeds[0]) if len(feeds) == 1 else f"{decode_node(feeds[0])}..{feeds[-1]}"


def control_plane(cfg: ClusterConfig) -> dict[str, float]:
    """What the fleet asks of itself and of AWS each second, from the spec: the routers' health
    checks (every router checks every server each interval), the members' reads (each proxy or
    router node asks EC2, and a router node SSM, every healing.members_poll_s) and the nodes'
    metrics (one PutMetricData per node per observability interval, up to 1,000 values each)."""
    layout, r = cfg.layout, cfg.serving.proxy.router
    routers = len(layout.proxies) if cfg.proxy_kind == "vllm-router" else 0
    servers = len(layout.replicas) + len(layout.decode_nodes)
    poll = cfg.healing.members_poll_s
    return {
        "routers": routers,
        "servers": servers if routers else 0,
        "health_checks_per_s": routers * servers / r.health_check_interval_s,
        "health_checks_per_server_per_s": routers / r.health_check_interval_s,
        "ec2_describe_instances_per_s": len(layout.proxies) / poll,
        "ssm_get_parameter_per_s": routers / poll,
        "put_metric_data_per_s": len(layout.nodes) / cfg.observability.interval_s,
    }


def control_plane_lines(cfg: ClusterConfig) -> list[str]:
    c = control_plane(cfg)
    lines = []
    if c["routers"]:
        lines.append(f"  control plane: {c['routers']:g} routers check {c['servers']:,.0f} servers: {c['health_checks_per_s']:,.0f} checks/s "
                     f"({c['health_checks_per_server_per_s']:g}/s a server)")  # fmt: skip
    if cfg.layout.proxies:
        n = len(cfg.layout.proxies)
        reads = f"EC2 {c['ec2_describe_instances_per_s']:.2f}" + (f" + SSM {c['ssm_get_parameter_per_s']:.2f}" if c["routers"] else "")
        lines.append(f"    AWS calls/s: members {reads} ({n} node{'s' if n != 1 else ''}), metrics {c['put_metric_data_per_s']:.2f}")
    return lines


def endpoint_access(cfg: ClusterConfig, *, short: bool = False) -> str:
    """Who may call the model and how (serving.endpoint): `plan`'s one line (short), or its --json's words."""
    e = cfg.serving.endpoint
    if short:
        parts = ["API keys, optional (auth=optional)" if e.auth == "optional" else "API keys (gptoss keys)" if cfg.endpoint_auth == "keys" else
                 "no key (serving.endpoint.auth=none)" if e.auth == "none" else f"no key: the {cfg.proxy_kind or 'single'} endpoint has no gate"]  # fmt: skip
    else:
        parts = [e.auth_reason(cfg.proxy_kind, cfg.cluster_name)]
    if cfg.load_balanced:
        parts.append(f"TLS on {e.tls_port}" if e.certificate_arn else "plain HTTP in the VPC")
    if e.allowed_principals:
        parts.append(f"PrivateLink for {len(e.allowed_principals)} principal{'s' * (len(e.allowed_principals) != 1)}")
    return "; ".join(parts)


def rollout_plan(cfg: ClusterConfig) -> dict[str, object]:
    """How a change that replaces every node of a role rolls: per role its lanes and batches, with or
    without surge, and the spare instances a surge runs beside the fleet (preflight counts them)."""
    roles: dict[str, int] = {}
    for node in cfg.layout.nodes:
        roles[node.role] = roles.get(node.role, 0) + 1
    per_role = {}
    for role, n in roles.items():
        lanes = cfg.rollout.lanes(n, cfg.surge)
        per_role[role] = {"nodes": n, "at_once": lanes, "batches": -(-n // lanes), "spare_instances": cfg.rollout.surge_room(n, cfg.surge)}
    return {"surge": cfg.surge, "roles": per_role}


def rollout_lines(cfg: ClusterConfig) -> list[str]:
    r = rollout_plan(cfg)
    roles: dict[str, dict[str, int]] = r["roles"]  # type: ignore[assignment]
    how = "surge, rollout.max_surge" if r["surge"] else "in place, rollout.max_unavailable"
    each = ", ".join(f"{role} {v['batches']} batch{'es' if v['batches'] != 1 else ''} of {v['at_once']}" for role, v in roles.items())
    spare = sum(v["spare_instances"] for v in roles.values())
    return [f"  a change of every node: {each}", f"    ({how}" + (f": {spare} spare instances while it rolls)" if spare else ")")]


def summary(cfg: ClusterConfig, renders: list[NodeRender]) -> str:
    """The plan in 80 columns: what is deployed, where the endpoint is, what bills."""
    from cluster_ops import cost

    layout = cfg.layout
    s = cfg.serving
    lines = [f"{cfg.stack_name}: recipe {cfg.recipe}, {cfg.availability_zone}"]
    if s.disaggregated:
        lines += [
            f"  {len(layout.nodes)} x {cfg.instance_type}: {len(layout.prefill_nodes)} prefill + {len(layout.decode_nodes)} decode",
            f"  {len(layout.replicas)} prefill replicas (TP{s.prefill.tensor_parallel}), {len(layout.decode_nodes)} decode "
            f"server{'s' if len(layout.decode_nodes) != 1 else ''} (TP{s.decode.tensor_parallel} DP{s.decode.data_parallel}), "
            f"{len(layout.proxies)} {'router' if cfg.proxy_kind == 'vllm-router' else 'prox'}"
            f"{('' if len(layout.proxies) == 1 else 's') if cfg.proxy_kind == 'vllm-router' else ('y' if len(layout.proxies) == 1 else 'ies')}",
        ]
    else:
        lines.append(f"  1 x {cfg.instance_type}: one server (TP{s.server.tensor_parallel})")
    port = s.proxy.port if s.disaggregated else s.server.port
    lines.append(
        f"  endpoint: internal NLB on :{port}" if cfg.load_balanced else f"  endpoint: {renders[0].node.name if not s.disaggregated else layout.proxies[0].node}:{port} (SSM port forward)"
    )
    if cfg.proxy_kind:
        names = [p.node for p in layout.proxies]
        what = f"vLLM router {s.proxy.router.version}" if cfg.proxy_kind == "vllm-router" else "the examples' toy proxy"
        lines.append(f"  proxy: {what} on {_span(names) if len(names) > 1 else names[0]}")
        lines.append(f"    why: {cfg.proxy_kind_reason} (serving.proxy.kind)")
        if cfg.proxy_kind == "vllm-router":
            g = gate_summary(s.proxy, s.shape.max_model_len)
            lines.append(f"    gate: HAProxy {g['haproxy']}, {g['retries']} retries before the first byte (500/502/504, no reply)")
            retried = f"retried up to {g['retried_bodies_up_to']:,} B" if g["retries"] else "never retried"
            lines.append(f"    bodies: {retried}, refused 413 over {g['body_cap']:,} B")
        lines.append(f"    callers: {endpoint_access(cfg, short=True)}")
        lines += control_plane_lines(cfg)
    lines += pin_lines(cfg)
    lines.append(f"  idle cores: {sum(n.idle_cores for n in layout.nodes)}")
    fleet_cells = cells(layout, cfg.cell_nodes)
    per_role = ", ".join(f"{role} {sum(1 for c in fleet_cells if c.role == role)}" for role in dict.fromkeys(c.role for c in fleet_cells))
    lines.append(f"  cells (nested stacks of up to {cfg.cell_nodes} nodes of a role): {len(fleet_cells)}: {per_role}")
    lines += rollout_lines(cfg)
    lines.append("")
    lines.append(f"  {'nodes':<20} {'role':<8} {'replicas':>8} {'cores':>7}  {'feeds':<16} {'servers':>7}")
    for role, rs in _groups(renders):
        n = rs[0].node
        reps = "-" if not n.replicas else f"{len(n.replicas)} each" if len(rs) > 1 else str(len(n.replicas))  # a decode node holds none
        lines.append(
            f"  {_span([r.node.name for r in rs]):<20} {role:<8} {reps:>8} {f'{n.used_cores}/{n.cores}':>7}  {_feeds(rs, cfg.proxy_kind == 'vllm-router'):<16} {len(rs[0].servers):>7}"
        )
    lines.append("")
    billable = [f"{i.count:g} x {i.name}" if i.unit == "hour" else f"{i.name} x {len(layout.nodes)}" for i in cost.items(cfg)]
    lines += textwrap.wrap("billed by the hour: " + billable[0], 78, initial_indent="  ", subsequent_indent="      ")
    for b in billable[1:]:
        lines += textwrap.wrap(b, 78, initial_indent="    ", subsequent_indent="      ")
    lines.append("  prices: --cost (AWS credentials)   every unit: --details, --node NAME, --json")
    lines.append("  what each line means: --explain")
    growth = fleet_growth(cfg)
    if growth:
        lines += textwrap.wrap(f"check the size: {growth}; gptoss deploy asks you to confirm it", 78, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


def pins(cfg: ClusterConfig) -> dict[str, str | None]:
    """What a node runs that is fetched at boot, and what pins it (None: unpinned)."""
    out: dict[str, str | None] = {
        "model": cfg.model.s3_uri if cfg.model.source == "s3" else cfg.serving.model_id,
        "model_revision": cfg.model.revision if cfg.model.source == "huggingface" else f"the copy in {cfg.model.s3_uri}",
    }
    if cfg.serving.disaggregated:
        out["examples"] = cfg.examples.s3_uri or f"{cfg.examples.repo_url}@{cfg.examples.ref}"
        out["examples_commit"] = f"the copy in {cfg.examples.s3_uri}" if cfg.examples.s3_uri else cfg.examples.pinned_commit
        out["nixl"] = cfg.nixl.version or "the image's"
    return out


def pin_lines(cfg: ClusterConfig) -> list[str]:
    """The summary's lines on what is pinned (wrapped at 80 columns)."""
    p = pins(cfg)
    if cfg.model.source == "s3":
        lines = [f"model: {p['model']} (the copy there)"]
    else:
        lines = [f"model: {p['model']} at {p['model_revision']}" if p["model_revision"] else f"model: {p['model']}, unpinned (set model.revision)"]
    if "examples" in p:
        if cfg.examples.s3_uri:
            lines.append(f"examples: {p['examples']} (the copy there)")
        else:
            commit = p["examples_commit"]
            lines.append(f"examples: {cfg.examples.ref} at {commit}" if commit else f"examples: {cfg.examples.ref}, commit unpinned (set examples.commit)")
        lines.append(f"NIXL: {cfg.nixl.version} (nixl.requirements, hash-checked)" if cfg.nixl.version else "NIXL: the image's")
    return [w for line in lines for w in textwrap.wrap(line, 78, initial_indent="  ", subsequent_indent="    ")]


def plan_document(cfg: ClusterConfig, renders: list[NodeRender]) -> dict[str, Any]:
    """`plan --json`: everything the summary and the detail tables show."""
    from cluster_ops import cost

    layout = cfg.layout
    doc = json.loads(plan_json(renders))
    # A toy proxy's fixed groups; behind the router every replica feeds every decode server.
    routed = cfg.proxy_kind == "vllm-router"
    feeds: dict[str, list[str]] = {}
    for rep in [] if routed else layout.replicas:
        feeds.setdefault(decode_node(rep.decode_server), []).append(rep.unit.replace("gptoss-prefill@", f"{rep.node}:").removesuffix(".service"))
    every_decode = [n.name for n in layout.decode_nodes]
    for node in doc["nodes"]:
        r = next(r for r in renders if r.node.name == node["name"])
        node["cores"] = {"used": r.node.used_cores, "total": r.node.cores}
        node["feeds"] = (every_decode if r.node.replicas else []) if routed else sorted({decode_node(rep.decode_server) for rep in r.node.replicas})
    return {
        "stack": cfg.stack_name,
        "region": cfg.region,
        "availability_zone": cfg.availability_zone,
        "cluster_tag": {"gptoss:cluster": cfg.cluster_name},
        "recipe": cfg.recipe,
        "pins": pins(cfg),
        "instance_type": cfg.instance_type,
        "capacity": cfg.capacity.model_dump(exclude_defaults=True) or {"type": "on-demand"},
        "ami": {"id": cfg.ami_id} if cfg.ami_id else {"ssm_parameter": cfg.ami_ssm_parameter, "pinned": False},
        "totals": {
            "nodes": len(layout.nodes), "prefill_nodes": len(layout.prefill_nodes), "decode_nodes": len(layout.decode_nodes),
            "prefill_replicas": len(layout.replicas), "proxies": len(layout.proxies), "idle_cores": sum(n.idle_cores for n in layout.nodes),
        },
        "endpoint": {"auth": cfg.endpoint_auth, "why": endpoint_access(cfg), "tls": bool(cfg.serving.endpoint.certificate_arn),
                     "private_link": list(cfg.serving.endpoint.allowed_principals)},
        "proxy": {"kind": cfg.proxy_kind, "why": cfg.proxy_kind_reason, "nodes": [p.node for p in layout.proxies],
                  "health_path": cfg.proxy_health_path} | ({"gate": gate_summary(cfg.serving.proxy, cfg.serving.shape.max_model_len)} if cfg.proxy_kind == "vllm-router" else {}),
        "control_plane": control_plane(cfg),
        "rollout": rollout_plan(cfg),
        "load_balancer": {"internal_nlb": cfg.load_balanced, "port": cfg.serving.proxy.port if cfg.serving.disaggregated else cfg.serving.server.port},
        "feeds": feeds,
        "cells": [{"name": c.name, "role": c.role, "nodes": [n.name for n in c.nodes]} for c in cells(layout, cfg.cell_nodes)],
        "billable": [{"item": i.name, "count": i.count, "unit": i.unit, "note": i.note} for i in cost.items(cfg)],
        "nodes": doc["nodes"],
    }


def _command_lines(argv: list[str], width: int) -> list[str]:
    """A command as a shell would take it, one option (with its value) per line, continued with \\."""
    parts: list[list[str]] = []
    for a in argv:
        if a.startswith("-") or not parts:
            parts.append([a])
        else:
            parts[-1].append(a)
    lines = [shlex.join(p) for p in parts]
    return [(line + " \\") if i < len(lines) - 1 else line for i, line in enumerate(lines)]


def detail_lists(renders: list[NodeRender], width: int) -> None:
    """Every unit's environment and command line, as text that fits `width` columns (a long JSON
    value breaks at its spaces, which JSON ignores)."""
    for r in renders:
        print(f"{r.node.name} ({r.node.role}, {r.instance_type})")
        for s in r.services:
            print(f"  {s.unit}" + (f" ({s.step} leg)" if s.step else ""))
            if s.environment:
                print("    environment:")
                for k, v in s.environment.items():
                    print(textwrap.fill(f"{k}={v}", width, initial_indent="      ", subsequent_indent="        ", break_on_hyphens=False))
            print("    command:")
            for i, line in enumerate(_command_lines(s.argv, width)):
                print(textwrap.fill(line, width, initial_indent="      " if i == 0 else "        ", subsequent_indent="          ",
                                    break_on_hyphens=False, break_long_words=False))  # fmt: skip
        print()


def detail_tables(console: Console, renders: list[NodeRender]) -> None:
    for r in renders:
        t = common.table(title=f"{r.node.name} ({r.node.role}, {r.instance_type})", show_lines=True, expand=True)
        t.add_column("unit", overflow="fold")
        t.add_column("environment", overflow="fold")
        t.add_column("command line", overflow="fold")
        for s in r.services:
            env = "\n".join(f"{k}={v}" for k, v in s.environment.items())
            t.add_row(s.unit + (f"\n({s.step} leg)" if s.step else ""), env, shlex.join(s.argv))
        console.print(t)


def print_cost(cfg: ClusterConfig, rows: list[dict[str, Any]], console: Console) -> None:
    """The price table (cost.price_rows) with its total per hour and per day."""
    from cluster_ops import cost

    t = common.table(title=f"{cfg.stack_name}: billed by the hour in {cfg.region} (AWS Price List, On-Demand USD)")
    for col in ("item", "count", "unit price", "per hour", "note"):
        t.add_column(col, justify="right" if col in ("count", "unit price", "per hour") else "left")
    for r in rows:
        unit = "-" if r["usd_per_unit"] is None else f"${r['usd_per_unit']:,.4f}/{'h' if r['unit'] == 'hour' else 'GB-mo'}"
        t.add_row(r["item"], f"{r['count']:g}", unit, "-" if r["usd_per_hour"] is None else f"${r['usd_per_hour']:,.2f}", r["note"])
    known = [r["usd_per_hour"] for r in rows if r["usd_per_hour"] is not None]
    missing = [r["item"] for r in rows if r["usd_per_hour"] is None and not r["note"].startswith("paid up front")]
    t.caption = (f"total ${sum(known):,.2f} per hour, ${sum(known) * 24:,.0f} per day"
                 + (f" without {', '.join(missing)} (not in the Price List here)" if missing else "")
                 + "; also by use: " + "; ".join(cost.usage_priced(cfg)))  # fmt: skip
    console.print(t)


# What each term of the summary means, once (`gptoss plan --explain`); each within 80 columns.
LEGEND = (
    ("replicas", "prefill vLLM servers (TP4 each); a decode node runs one decode server"),
    ("endpoint", "where clients connect: an internal NLB, or a node reached by SSM port forward"),
    ("proxy, why", "what routes a request to a prefill replica, then a decode server, and why"),
    ("gate", "HAProxy on each router node: passes only the OpenAI API, retries before the first byte"),
    ("bodies", "a request body up to this size is retried; over the cap it is refused 413"),
    ("callers", "who may call the model: API keys at the router's gate (or none, and why), TLS at the load balancer, PrivateLink"),
    ("control plane", "health checks: every router checks every server each interval"),
    ("AWS calls/s", "members: each proxy node lists its peers (EC2, SSM) every healing.members_poll_s;"
                    " metrics: PutMetricData, one per node per observability.interval_s"),
    ("model, examples", "what a node downloads, and whether it is pinned to a commit"),
    ("NIXL", "the KV-transfer library: the image's, or a pinned install (nixl.requirements)"),
    ("idle cores", "NeuronCores the layout leaves unused (0: every core serves)"),
    ("cells", "nested CloudFormation stacks, each holding up to that many nodes of one role"),
    ("a change of every node", "how a change that replaces every instance rolls: batches per role"),
    ("spare instances", "instances a surge runs beside the fleet while it rolls (preflight counts them)"),
    ("cores", "NeuronCores in use / on the instance"),
    ("feeds", "which decode servers a prefill node's replicas hand their KV caches to"),
    ("billed by the hour", "what costs money while the stack exists; --cost prices it"),
)


def legend(width: int = 78) -> str:
    """The summary's terms, one entry each, wrapped to the plan's 80 columns."""
    lines = ["terms:"]
    for term, meaning in LEGEND:
        lines += textwrap.wrap(f"{term}: {meaning}", width, initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines)

