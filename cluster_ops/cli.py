"""gptoss: the operator's commands for a gpt-oss cluster on Trainium.

Every command acts on the cluster its parameters name (`-c KEY=VALUE`, `--config FILE`, or
`--stack NAME` of a stack deployed from this checkout) and says which in its first line
(stack, region, cluster tag). Commands that talk to AWS turn every AWS error into one line
and exit 2; invalid parameters exit 2 with the field, value, rule and fix.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterspec.cells import cells
from clusterspec.config import ClusterConfig
from clusterspec.errors import SpecError
from clusterspec.loading import load_config
from clusterspec.render import NodeRender, plan_json, render_cluster

if TYPE_CHECKING:  # rich is imported where a table is printed: `plan` prints none (80 ms of its start)
    from rich.console import Console
    from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
CDK = ROOT / "node_modules" / ".bin" / "cdk"
_REGION = ""  # the region of the config loaded, for error messages
DEPLOYED = "deployed.json"  # stacks deployed from this checkout, with the parameters they were deployed with


class CliError(Exception):
    """A condition the operator must act on: printed as one line, exit code attached."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# ---- which cluster ------------------------------------------------------------------------


def _checkout() -> Path:
    """Where cdk.json, cdk.context.json and the deploy records are: the current directory if it
    holds the app, else this installation's checkout."""
    return Path.cwd() if (Path.cwd() / "cdk.json").exists() else ROOT


def _state() -> Path:
    """The checkout's records (.gptoss/, ignored by git); GPTOSS_STATE_DIR elsewhere."""
    return Path(os.environ.get("GPTOSS_STATE_DIR") or _checkout() / ".gptoss")


def deployed() -> dict[str, dict[str, Any]]:
    """Stacks deployed from this checkout: name -> {"context": [...], "region": ...}."""
    path = _state() / DEPLOYED
    try:
        return dict(json.loads(path.read_text())) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def _record(cfg: ClusterConfig, context: list[str], *, remove: bool = False, image: str | None = None) -> None:
    path = _state() / DEPLOYED
    doc = deployed()
    if remove:
        doc.pop(cfg.stack_name, None)
    else:
        doc[cfg.stack_name] = {"context": context, "region": cfg.region, "cluster": cfg.cluster_name} | ({"image": image} if image else {})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _context_args(args: argparse.Namespace) -> list[str]:
    """The parameters as `-c KEY=VALUE` strings (what cdk receives too)."""
    items = list(args.context or [])
    if getattr(args, "stack", None):
        record = deployed().get(args.stack)
        if record is None:
            from clusterspec.recipes import RECIPES

            by_stack = {r.stack_name: r.name for r in RECIPES.values()}
            if args.stack not in by_stack:
                known = ", ".join(sorted(deployed())) or "none recorded"
                raise SpecError([f"--stack {args.stack}: no stack of that name was deployed from this checkout (recorded: {known}). "
                                 "Fix: name its parameters instead (-c config=FILE or -c KEY=VALUE)."])  # fmt: skip
            items = [f"recipe={by_stack[args.stack]}", *items]
        else:
            items = [*record["context"], *items]
    if getattr(args, "config", None):
        items.append(f"config={args.config}")
    for name in ("decode_instances", "prefill_per_decode", "replicas_per_prefill_instance", "instance_type"):
        value = getattr(args, name, None)
        if value is not None:
            items.append(f"{name}={value}")
    return items


def _context(items: list[str]) -> dict[str, Any]:
    ctx: dict[str, Any] = {}
    path = _checkout() / "cdk.context.json"
    if path.exists():  # what the CDK reads too: the pinned image among them
        try:
            ctx.update({k: v for k, v in json.loads(path.read_text()).items() if k.startswith("gptoss:")})
        except ValueError:
            raise SpecError([f"{path}: is not valid JSON. Fix: correct it, or delete it and run gptoss pin-ami again."]) from None
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError([f"-c {item!r}: context must be KEY=VALUE. Fix: e.g. -c decode_instances=8."])
        if key.startswith("aws:"):  # the CDK CLI refuses these before the app runs
            raise SpecError([f"-c {key}: keys that start with 'aws:' are the CDK's own and the CDK CLI refuses them. Fix: remove -c {key}."])
        ctx[key] = value
    return ctx


def load(args: argparse.Namespace) -> ClusterConfig:
    """Validate the same parameters `cdk synth` takes, and the limits of one stack."""
    from clusterspec import limits

    global _REGION
    cfg = load_config(_context(_context_args(args)))
    limits.check(cfg)
    _REGION = cfg.region
    return cfg


def target_line(cfg: ClusterConfig) -> str:
    """The first line of every command: what it acts on."""
    return f"stack {cfg.stack_name} · region {cfg.region} · cluster tag gptoss:cluster={cfg.cluster_name}"


def _announce(cfg: ClusterConfig) -> None:
    print(target_line(cfg), file=sys.stderr, flush=True)


def _session(cfg: ClusterConfig) -> Any:
    import boto3

    return boto3.Session(region_name=cfg.region)


def _console(args: argparse.Namespace) -> Console:
    """Tables fit 80 columns (or a narrower terminal); --wide uses the terminal's width (at least
    160); --width N exactly N."""
    from rich.console import Console

    if getattr(args, "width", None):
        return Console(width=args.width)
    terminal = Console().width
    return Console(width=max(terminal, 160) if getattr(args, "wide", False) else min(terminal, 80))


def _table(**kwargs: Any) -> Table:
    from rich.table import Table

    return Table(**kwargs)


# ---- plan ---------------------------------------------------------------------------------


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
    return f"decode-{feeds[0]}" if len(feeds) == 1 else f"decode-{feeds[0]}..{feeds[-1]}"


# A deploy asks before it bills this many times the fleet the user can be expected to have in mind.
GROWTH_FACTOR = 4
GROWTH_MIN_NODES = 8


def fleet_growth(cfg: ClusterConfig) -> str | None:
    """Why this fleet may be bigger than meant, or None: at least GROWTH_FACTOR times (and
    GROWTH_MIN_NODES instances) the fleet last deployed under this stack name from this checkout,
    or, on a first deploy, the recipe's own fleet for the same decode_instances and instance type
    (so prefill_per_decode=1000 or a replicas_per_prefill_instance of 1 is caught, the 3 + 8
    layout asked with decode_instances=8 is not)."""
    nodes = len(cfg.layout.nodes)
    if nodes < GROWTH_MIN_NODES:
        return None
    record = deployed().get(cfg.stack_name)
    try:
        if record is not None:
            before = len(load_config(_context(list(record["context"]))).layout.nodes)
            than = f"the {before} instance{'s' * (before != 1)} last deployed as {cfg.stack_name} from this checkout"
        else:
            base = load_config({"recipe": cfg.recipe, "decode_instances": cfg.decode_instances, "instance_type": cfg.instance_type})
            before = len(base.layout.nodes)
            than = (f"the {cfg.recipe} recipe's {before} for decode_instances={cfg.decode_instances} "
                    f"(prefill_per_decode={cfg.prefill_per_decode}, replicas_per_prefill_instance={cfg.replicas_per_prefill_instance or 'fill'})")  # fmt: skip
    except (SpecError, ValueError, KeyError, TypeError):
        return None  # no baseline to compare with: nothing to say
    if nodes < GROWTH_FACTOR * before:
        return None
    return f"{nodes} x {cfg.instance_type} is {nodes / before:.0f}x {than}"


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
    lines.append(f"  idle cores: {sum(n.idle_cores for n in layout.nodes)}")
    fleet_cells = cells(layout, cfg.cell_nodes)
    per_role = ", ".join(f"{role} {sum(1 for c in fleet_cells if c.role == role)}" for role in dict.fromkeys(c.role for c in fleet_cells))
    lines.append(f"  cells (nested stacks of up to {cfg.cell_nodes} nodes of a role): {len(fleet_cells)}: {per_role}")
    lines.append("")
    lines.append(f"  {'nodes':<20} {'role':<8} {'replicas':>8} {'cores':>7}  {'feeds':<16} {'servers':>7}")
    for role, rs in _groups(renders):
        n = rs[0].node
        reps = f"{len(n.replicas)} each" if len(rs) > 1 and n.replicas else str(len(n.replicas))
        lines.append(
            f"  {_span([r.node.name for r in rs]):<20} {role:<8} {reps:>8} {f'{n.used_cores}/{n.cores}':>7}  {_feeds(rs, cfg.proxy_kind == 'vllm-router'):<16} {len(rs[0].servers):>7}"
        )
    lines.append("")
    billable = [f"{i.count:g} x {i.name}" if i.unit == "hour" else f"{i.name} x {len(layout.nodes)}" for i in cost.items(cfg)]
    import textwrap

    lines += textwrap.wrap("billed by the hour: " + billable[0], 78, initial_indent="  ", subsequent_indent="      ")
    for b in billable[1:]:
        lines += textwrap.wrap(b, 78, initial_indent="    ", subsequent_indent="      ")
    lines.append("  prices: --cost (AWS credentials)   every unit: --details, --node NAME, --json")
    growth = fleet_growth(cfg)
    if growth:
        lines += textwrap.wrap(f"check the size: {growth}; gptoss deploy asks you to confirm it", 78, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


def plan_document(cfg: ClusterConfig, renders: list[NodeRender]) -> dict[str, Any]:
    """`plan --json`: everything the summary and the detail tables show."""
    from cluster_ops import cost

    layout = cfg.layout
    doc = json.loads(plan_json(renders))
    # A toy proxy's fixed groups; behind the router every replica feeds every decode server.
    routed = cfg.proxy_kind == "vllm-router"
    feeds: dict[str, list[str]] = {}
    for rep in [] if routed else layout.replicas:
        feeds.setdefault(f"decode-{rep.decode_server}", []).append(rep.unit.replace("gptoss-prefill@", f"{rep.node}:").removesuffix(".service"))
    every_decode = [n.name for n in layout.decode_nodes]
    for node in doc["nodes"]:
        r = next(r for r in renders if r.node.name == node["name"])
        node["cores"] = {"used": r.node.used_cores, "total": r.node.cores}
        node["feeds"] = (every_decode if r.node.replicas else []) if routed else sorted({f"decode-{rep.decode_server}" for rep in r.node.replicas})
    return {
        "stack": cfg.stack_name,
        "region": cfg.region,
        "availability_zone": cfg.availability_zone,
        "cluster_tag": {"gptoss:cluster": cfg.cluster_name},
        "recipe": cfg.recipe,
        "instance_type": cfg.instance_type,
        "capacity": cfg.capacity.model_dump(exclude_defaults=True) or {"type": "on-demand"},
        "ami": {"id": cfg.ami_id} if cfg.ami_id else {"ssm_parameter": cfg.ami_ssm_parameter, "pinned": False},
        "totals": {
            "nodes": len(layout.nodes), "prefill_nodes": len(layout.prefill_nodes), "decode_nodes": len(layout.decode_nodes),
            "prefill_replicas": len(layout.replicas), "proxies": len(layout.proxies), "idle_cores": sum(n.idle_cores for n in layout.nodes),
        },
        "proxy": {"kind": cfg.proxy_kind, "why": cfg.proxy_kind_reason, "nodes": [p.node for p in layout.proxies],
                  "health_path": cfg.proxy_health_path},
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


def _detail_lists(renders: list[NodeRender], width: int) -> None:
    """Every unit's environment and command line, as text that fits `width` columns (a long JSON
    value breaks at its spaces, which JSON ignores)."""
    import textwrap

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


def _detail_tables(console: Console, renders: list[NodeRender]) -> None:
    for r in renders:
        t = _table(title=f"{r.node.name} ({r.node.role}, {r.instance_type})", show_lines=True, expand=True)
        t.add_column("unit", overflow="fold")
        t.add_column("environment", overflow="fold")
        t.add_column("command line", overflow="fold")
        for s in r.services:
            env = "\n".join(f"{k}={v}" for k, v in s.environment.items())
            t.add_row(s.unit + (f"\n({s.step} leg)" if s.step else ""), env, shlex.join(s.argv))
        console.print(t)


def cmd_plan(args: argparse.Namespace) -> int:
    """What runs where: a summary; with --details or --node, each unit's environment and command line."""
    cfg = load(args)
    _announce(cfg)
    renders = render_cluster(cfg)
    if args.node:
        chosen = [r for r in renders if r.node.name == args.node]
        if not chosen:
            raise SpecError([f"--node {args.node}: no such node in {cfg.stack_name}. Fix: one of {', '.join(r.node.name for r in renders)}."])
        renders_shown = chosen
    else:
        renders_shown = renders
    if args.json:
        doc = plan_document(cfg, renders)
        if args.node:
            doc["nodes"] = [n for n in doc["nodes"] if n["name"] == args.node]
        if args.cost:
            doc["cost"] = _cost_rows(cfg)
        print(json.dumps(doc, indent=2))
        return 0
    if args.details or args.node:
        console = _console(args)
        if args.wide or args.width:
            _detail_tables(console, renders_shown)
        else:
            _detail_lists(renders_shown, console.width)
    else:
        print(summary(cfg, renders))
    if args.cost:
        _print_cost(cfg, _console(args))
    if args.diagram:
        from clusterspec.diagram import draw

        print(f"diagram written to {draw(cfg, Path(args.diagram))}")
    return 0


def _cost_rows(cfg: ClusterConfig) -> list[dict[str, Any]]:
    from cluster_ops import cost

    pricing = _session(cfg).client("pricing", region_name="us-east-1")  # the Price List API's endpoint
    return [{"item": i.name, "count": i.count, "unit": i.unit, "usd_per_unit": i.usd, "usd_per_hour": i.per_hour, "note": i.note}
            for i in cost.priced(cfg, pricing)]  # fmt: skip


def _print_cost(cfg: ClusterConfig, console: Console) -> None:
    from cluster_ops import cost

    rows = _cost_rows(cfg)
    t = _table(title=f"{cfg.stack_name}: billed by the hour in {cfg.region} (AWS Price List, On-Demand USD)")
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


# ---- commands that need AWS ------------------------------------------------------------------


def cmd_recipes(args: argparse.Namespace) -> int:
    """List the documented deployments: name, reference, what each deploys, its stack."""
    from clusterspec.recipes import DEFAULT_RECIPE, RECIPES

    if args.json:
        print(json.dumps([{"name": r.name, "reference": r.reference, "deploys": r.deploys, "stack_name": r.stack_name,
                           "default": r.name == DEFAULT_RECIPE} for r in RECIPES.values()], indent=2))  # fmt: skip
        return 0
    t = _table(title="recipes (-c recipe=NAME)", show_lines=True)
    for col in ("recipe", "reference", "deploys", "stack"):
        t.add_column(col, overflow="fold")
    for r in RECIPES.values():
        t.add_row(r.name + (" (default)" if r.name == DEFAULT_RECIPE else ""), r.reference, r.deploys, r.stack_name)
    _console(args).print(t)
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    """Check the account against what the stack assumes; non-zero when any check fails."""
    from cluster_ops import preflight

    cfg = load(args)
    _announce(cfg)
    checks = preflight.run(cfg, _session(cfg))
    t = _table(title=f"preflight: {cfg.stack_name} ({len(cfg.layout.nodes)} x {cfg.instance_type} in {cfg.availability_zone})")
    for col in ("check", "result", "detail", "fix"):
        t.add_column(col, overflow="fold")
    for c in checks:
        t.add_row(c.name, "[red]FAIL[/]" if not c.ok else "[yellow]warn[/]" if c.warn else "[green]pass[/]", c.detail, c.fix)
    _console(args).print(t)
    if not cfg.ami_id:
        print(f"note: the image resolves from {cfg.ami_ssm_parameter} at every deploy; pin it: gptoss pin-ami", file=sys.stderr)
    if args.cost:
        _print_cost(cfg, _console(args))
    return 0 if all(c.ok for c in checks) else 1


def _status_table(cfg: ClusterConfig, status: Any) -> Table:
    t = _table(title=f"{cfg.stack_name}: cluster status")
    for col in ("node", "unit", "state", "health"):
        t.add_column(col)
    silent = getattr(status, "no_report", {})
    for node, why in silent.items():
        count = sum(u.node == node for u in status.units)
        t.add_row(node, f"all {count} units", "[red]no report[/]", why)
    for u in status.units:
        if u.node in silent:
            continue
        health = "-" if not u.needs_health else ("[green]ok[/]" if u.healthy else "[red]no answer[/]")
        state = f"[green]{u.state}[/]" if u.state == "active" else f"[yellow]{u.state}[/]"
        t.add_row(u.node, u.unit, state, health)
    for n in status.missing_nodes:
        t.add_row(n, "-", "[red]no running instance[/]", "-")
    for n, why in status.pending_nodes.items():
        t.add_row(n, "-", f"[yellow]instance pending[/] {why}", "-")
    if status.notes:
        t.caption = "\n".join(status.notes)
    return t


def _identity_table(cfg: ClusterConfig, status: Any) -> Table:
    """Each node identity: the instance that holds it now, and its replacements (its group's count and cause)."""
    t = _table(title=f"{cfg.stack_name}: nodes (each an Auto Scaling group of one)")
    for col in ("node", "instance", "replaced", "latest replacement or failed launch"):
        t.add_column(col, overflow="fold")
    for i in status.identities:
        instance = f"{i.instance_id} ({i.state})" if i.instance_id else "[red]none running[/]"
        why = " ".join(filter(None, [i.last_at, i.last_cause, f"- the node said: {i.reported}" if i.reported else ""])) or "-"
        t.add_row(i.node, instance, str(i.replaced), why)
    return t


def _no_instances_hint(cfg: ClusterConfig, status: Any) -> bool:
    """When nothing of this cluster runs, say so and which stacks this checkout did deploy."""
    if status.units or status.pending_nodes:
        return False
    others = {k: v for k, v in deployed().items() if k != cfg.stack_name}
    hint = "; ".join(f"{k} (gptoss status --stack {k})" for k in sorted(others))
    print(f"no instance tagged gptoss:cluster={cfg.cluster_name} runs in {cfg.region}"
          + (f". Deployed from this checkout: {hint}" if hint else ""), file=sys.stderr)  # fmt: skip
    return True


def cmd_status(args: argparse.Namespace) -> int:
    """Report every unit's state and health on every node; 0 when all are ready."""
    from rich.progress import BarColumn, Progress, TextColumn

    from cluster_ops.status import collect

    cfg = load(args)
    _announce(cfg)
    session = _session(cfg)
    console = _console(args)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} nodes"),
                  console=console, transient=True, disable=not console.is_terminal) as progress:  # fmt: skip
        task = progress.add_task("asking every node (SSM Run Command)", total=len(cfg.layout.nodes))
        status = collect(cfg, session.client("ec2"), session.client("ssm"), autoscaling=session.client("autoscaling"),
                         logs=session.client("logs") if cfg.observability.enabled else None,
                         on_node=lambda node, st: progress.update(task, advance=1, description=f"{node}: {st}"))  # fmt: skip
    console.print(_identity_table(cfg, status))
    console.print(_status_table(cfg, status))
    if not _no_instances_hint(cfg, status):
        from cluster_ops.status import summary

        for line in summary(status, os.environ.get("AWS_ENDPOINT_URL")):
            console.print(line, highlight=False, soft_wrap=True)
    return 0 if status.ready else 1


def cmd_wait_ready(args: argparse.Namespace) -> int:
    """Wait until every server answers; on timeout exit 1 naming the failing units."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from cluster_ops.status import wait_ready

    cfg = load(args)
    _announce(cfg)
    session = _session(cfg)
    _account(cfg)  # no credentials: one line before anything is shown
    console = _console(args)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                  TimeElapsedColumn(), console=console, disable=not console.is_terminal) as progress:  # fmt: skip
        task = progress.add_task("waiting for the cluster: asking every node", total=None, count="")

        def on_poll(status: Any, elapsed: float) -> None:
            ready = sum(u.ready for u in status.units)
            total = len(status.units) + len(status.missing_nodes) + len(status.pending_nodes)
            waiting = list(status.failing)[:2]
            progress.update(task, total=total, completed=ready, count=f"{ready}/{total} units ready",
                            description=("waiting: " + "; ".join(waiting) if waiting else "all ready")[:60])  # fmt: skip

        status = wait_ready(cfg, session.client("ec2"), session.client("ssm"), timeout_s=args.timeout, interval_s=args.interval,
                            on_poll=on_poll)  # fmt: skip
    if status.ready:
        console.print(f"[green]ready[/]: {len(status.units)} units on {len(cfg.layout.nodes)} nodes")
        return 0
    console.print(_status_table(cfg, status))
    print(f"not ready after {args.timeout:.0f}s:\n" + "\n".join(f"  - {f}" for f in status.failing), file=sys.stderr)
    return 1


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the reference's benchmark on a proxy node and print its key metrics."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from cluster_ops import bench

    cfg = load(args)
    _announce(cfg)
    session = _session(cfg)
    _account(cfg)  # no credentials: one line before anything is shown
    console = _console(args)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task("gptoss-bench.service: starting", total=None)
        try:
            metrics = bench.run(cfg, session.client("ec2"), session.client("ssm"), node=args.node, poll_s=args.interval,
                                timeout_s=args.timeout,
                                on_poll=lambda state, t: progress.update(task, description=f"gptoss-bench.service: {state}"[:100]))  # fmt: skip
        except bench.BenchError as e:
            raise CliError(f"bench failed: {e}", 1) from None
    t = _table(title=f"{cfg.serving.bench.result_file} (measured leg, {cfg.serving.bench.measured_prompts} prompts)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key, label in bench.METRICS:
        value = metrics.get(key)
        t.add_row(label, "-" if value is None else f"{value:,.2f}")
    console.print(t)
    return 0


def cmd_save_cache(args: argparse.Namespace) -> int:
    """Upload the compile caches of one prefill and one decode node (or --node), then promote them to the fleet's cache."""
    from cluster_ops import cache
    from clusterspec.paths import cache_fleet_uri

    cfg = load(args)
    _announce(cfg)
    session = _session(cfg)
    try:
        uri, manifest = cache.save(
            cfg, session.client("ec2"), session.client("ssm"), session.client("s3"), session.client("cloudformation"), only=args.node
        )
    except cache.CacheError as e:
        raise CliError(f"save-cache failed: {e}", 1) from None
    print(f"promoted {len(manifest['files'])} files from {', '.join(sorted(manifest['promoted_from']))} to "
          f"{cache_fleet_uri(uri)}; nodes restore what its manifest verifies before compiling")  # fmt: skip
    return 0


def cmd_pin_ami(args: argparse.Namespace) -> int:
    """Resolve the DLAMI parameter once and record the image in cdk.context.json."""
    from cluster_ops import ami
    from clusterspec.loading import pin_key

    ctx = _context(_context_args(args))
    current = load_config(ctx)
    _announce(current)
    ctx.pop(pin_key(current.region), None)
    cfg = load_config(ctx)
    if cfg.ami_id:
        print(f"ami_id is given in the parameters ({cfg.ami_id}): it is pinned already")
        return 0
    if current.ami_id and not args.upgrade:
        print(f"already pinned: {current.ami_id}. To move to the image {cfg.ami_ssm_parameter} names today: "
              "gptoss pin-ami --upgrade, review, commit cdk.context.json, deploy")  # fmt: skip
        return 0
    session = _session(cfg)
    pin = ami.resolve(cfg, session.client("ssm"), session.client("ec2"))
    path = _checkout() / "cdk.context.json"
    previous = ami.write(path, cfg.region, pin)
    print(f"pinned {pin['ami_id']} ({pin['name']}, created {pin['created']}) from {pin['parameter']} in {path.name}")
    if previous and previous.get("ami_id") != pin["ami_id"]:
        print(f"was {previous.get('ami_id')} ({previous.get('name')}): the next deploy replaces every instance "
              "(instance store and compiled graphs lost; save-cache first)")  # fmt: skip
    return 0


# ---- deploy and destroy -------------------------------------------------------------------


def _cdk(verb: str, cfg: ClusterConfig, context: list[str], extra: list[str]) -> int:
    """Run the pinned CDK CLI on exactly this stack, with these parameters."""
    if not CDK.exists():
        raise CliError(f"the CDK CLI is not installed ({CDK}). Fix: make setup")
    cmd = [str(CDK), verb, cfg.stack_name, "--no-notices", *(a for c in context for a in ("-c", c)), *extra]
    print("$ " + shlex.join(["cdk", *cmd[1:]]), file=sys.stderr, flush=True)
    env = {**os.environ, "PATH": f"{ROOT / 'node_modules' / '.bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.setdefault("AWS_REGION", cfg.region)
    env.setdefault("CDK_DISABLE_CLI_TELEMETRY", "true")
    return subprocess.run(cmd, cwd=_checkout(), env=env).returncode


def _operation_events(cfn: Any, stack: str) -> list[dict[str, Any]]:
    """Every event of a stack's latest operation (all pages), newest first, up to its 'User Initiated' start."""
    out = []
    for page in cfn.get_paginator("describe_stack_events").paginate(StackName=stack):
        for e in page["StackEvents"]:
            out.append(e)
            if e.get("ResourceType") == "AWS::CloudFormation::Stack" and e.get("PhysicalResourceId") == e.get("StackId") \
                    and e.get("ResourceStatusReason") == "User Initiated":  # fmt: skip
                return out
    return out


def _failure_line(cfg: ClusterConfig) -> str | None:
    """Why the stack's last operation failed, from its events and its cells' (capacity first), or None."""
    from cluster_ops.capacity import explain_launch_failure

    try:
        cfn = _session(cfg).client("cloudformation")
        events = _operation_events(cfn, cfg.stack_name)
        # A cell (nested stack) that failed says only "Embedded stack ... was not successfully created":
        # its own events hold the reason (a node's gate, a group that could not launch).
        for e in list(events):
            if e.get("ResourceType") == "AWS::CloudFormation::Stack" and e.get("ResourceStatus", "").endswith("FAILED") \
                    and e.get("PhysicalResourceId") not in ("", e.get("StackId")):  # fmt: skip
                events = _operation_events(cfn, e["PhysicalResourceId"]) + events
    except Exception:  # the deploy's own error stands; this is a best effort
        return None
    line = explain_launch_failure(cfg, events)
    if line:
        return line
    generic = ("cancelled", "Embedded stack", "The following resource(s) failed")
    failed = [e for e in events if e.get("ResourceStatus", "").endswith("FAILED") and not any(g in (e.get("ResourceStatusReason") or "") for g in generic)]
    if failed:
        e = failed[-1]  # the earliest: what failed first
        return f"{e['LogicalResourceId']}: {e['ResourceStatus']}: {(e.get('ResourceStatusReason') or '').strip()[:300]}"
    return None


def _account(cfg: ClusterConfig) -> str:
    """The account the credentials act in, asked before anything is synthesized (no credentials: one line, exit 2)."""
    return str(_session(cfg).client("sts").get_caller_identity()["Account"])


def _resolve_image(cfg: ClusterConfig, args: argparse.Namespace, verb: str) -> list[str]:
    """For a stack whose image is not pinned: the image the DLAMI parameter names now, passed to the
    synth as ami_id, so the deploy gate of every node sees a new image as the change it is (a
    parameter CloudFormation resolves would replace the instances behind the gate's back). A new
    image since this checkout's last deploy replaces every instance: it is said, and a deploy asks."""
    from cluster_ops import ami

    if cfg.ami_id:
        return []
    session = _session(cfg)
    image = ami.resolve(cfg, session.client("ssm"), session.client("ec2"))
    print(f"image {image['ami_id']} ({image['name'] or 'no name'}, created {image['created'] or '?'}) from {cfg.ami_ssm_parameter}, "
          "for this deploy; pin it to keep it: gptoss pin-ami", file=sys.stderr)  # fmt: skip
    before = deployed().get(cfg.stack_name, {}).get("image")
    if verb == "deploy" and before and before != image["ami_id"] and not args.yes:
        what = f"{before} was deployed before: the new image replaces every instance of {cfg.stack_name} (instance store and compiled graphs with them)"
        if not sys.stdin.isatty():
            raise CliError(f"refusing to move to a new image without confirmation: {what}. Nothing was deployed. "
                           "Fix: gptoss pin-ami to keep the image you have, or pass --yes to move.", 1)  # fmt: skip
        answer = input(f"{what}. Type the new image id to deploy it: ").strip()
        if answer != image["ami_id"]:
            raise CliError(f"not confirmed ({answer!r} is not {image['ami_id']}): nothing was deployed.", 1)
    return [f"ami_id={image['ami_id']}", "ami_ssm_parameter=null"]


def cmd_deploy(args: argparse.Namespace, extra: list[str]) -> int:
    """`cdk deploy` of the named stack (CDK's approval prompt kept); a failure explained in one line."""
    from cluster_ops import cost

    cfg = load(args)
    _announce(cfg)
    account = _account(cfg)
    print(f"account {account}", file=sys.stderr)
    billable = ", ".join(f"{i.count:g} x {i.name}" if i.unit == "hour" else i.name for i in cost.items(cfg))
    print(f"billed by the hour once deployed: {billable} (prices: gptoss plan --cost)", file=sys.stderr)
    growth = fleet_growth(cfg)
    if growth and not args.yes:
        nodes = len(cfg.layout.nodes)
        if not sys.stdin.isatty():
            raise CliError(f"refusing to deploy without confirmation: {growth}. Nothing was deployed. "
                           "Fix: check decode_instances, prefill_per_decode and replicas_per_prefill_instance, "
                           "or pass --yes if this is the fleet you mean.", 1)  # fmt: skip
        print(f"check the size: {growth}", file=sys.stderr)
        answer = input(f"type the instance count ({nodes}) to deploy them: ").strip()
        if answer != str(nodes):
            raise CliError(f"not confirmed ({answer!r} is not {nodes}): nothing was deployed.", 1)
    context = _context_args(args)
    image = _resolve_image(cfg, args, "deploy")
    code = _cdk("deploy", cfg, context + image, extra)
    # Recorded once the stack exists: a deploy refused before anything was made leaves no record.
    if code == 0 or _stack_exists(cfg):
        _record(cfg, context, image=image[0].split("=", 1)[1] if image else cfg.ami_id)
    if code != 0:
        line = _failure_line(cfg)
        if line:
            print(f"deploy failed: {line}", file=sys.stderr)
    return code


def _stack_exists(cfg: ClusterConfig) -> bool:
    try:
        stacks = _session(cfg).client("cloudformation").describe_stacks(StackName=cfg.stack_name)["Stacks"]
    except Exception:  # does not exist, or cannot be asked: nothing to record either way
        return False
    return any(s["StackStatus"] != "DELETE_COMPLETE" for s in stacks)


def _what_goes(cfg: ClusterConfig) -> str:
    """What a destroy deletes: the plan's instances, and the live ones when AWS can be asked."""
    from cluster_ops.awserrors import explain
    from cluster_ops.remote import find_nodes

    layout = cfg.layout
    roles: dict[str, int] = {}
    for n in layout.nodes:
        roles[n.role] = roles.get(n.role, 0) + 1
    text = (f"{len(layout.nodes)} x {cfg.instance_type} ({', '.join(f'{c} {r}' for r, c in roles.items())})"
            + (", the internal NLB" if cfg.load_balanced else "")
            + (", the VPC and its NAT gateway" if cfg.network.vpc_id is None and cfg.network.egress == "nat" else
               ", the VPC" if cfg.network.vpc_id is None else "")
            + f", the log group /gptoss/{cfg.cluster_name}" * cfg.observability.enabled
            + (", the compile cache bucket and the caches in it" if not cfg.compile_cache_s3_uri and cfg.compile_cache_bucket else ""))  # fmt: skip
    try:
        live = find_nodes(_session(cfg).client("ec2"), cfg.cluster_name)
        text += f"; running now: {len(live)} instance{'s' if len(live) != 1 else ''} tagged gptoss:cluster={cfg.cluster_name}"
    except Exception as e:
        reason = explain(e, region=cfg.region) or f"{type(e).__name__}"
        text += f"; could not list the running instances ({reason.split('. Fix')[0]})"
    return text


def cmd_destroy(args: argparse.Namespace, extra: list[str]) -> int:
    """Delete the named stack after confirmation (or --yes); never the default one by omission."""
    if not (args.context or args.config or args.stack):
        recorded = ", ".join(f"--stack {k}" for k in sorted(deployed())) or "none recorded"
        raise CliError("destroy deletes a cluster: name it (-c config=FILE, -c KEY=VALUE or --stack NAME; "
                       f"deployed from this checkout: {recorded}). Nothing was deleted.")  # fmt: skip
    cfg = load(args)
    _announce(cfg)
    print(f"account {_account(cfg)}", file=sys.stderr)
    goes = _what_goes(cfg)
    print(f"destroy {cfg.stack_name} in {cfg.region} deletes: {goes}", file=sys.stderr)
    if not args.yes:
        if not sys.stdin.isatty():
            raise CliError(f"refusing to destroy {cfg.stack_name} without confirmation (no terminal). "
                           "Fix: run it in a terminal, or pass --yes (make destroy YES=1).", 1)  # fmt: skip
        answer = input(f"type the stack name ({cfg.stack_name}) to delete it: ").strip()
        if answer != cfg.stack_name:
            raise CliError(f"not confirmed ({answer!r} is not {cfg.stack_name}): nothing was deleted.", 1)
    context = _context_args(args)
    _empty_cache_bucket(cfg)
    code = _cdk("destroy", cfg, context, ["--force", *extra])
    if code == 0:
        _record(cfg, context, remove=True)
    return code


def _cache_bucket(cfg: ClusterConfig) -> str | None:
    """The stack's own compile cache bucket, when the stack made one and it exists."""
    from cluster_ops import cache

    if cfg.compile_cache_s3_uri or not cfg.compile_cache_bucket:
        return None
    try:
        return cache.location(cfg, _session(cfg).client("cloudformation")).removeprefix("s3://")
    except Exception:  # no such stack (never deployed, or already gone): nothing to empty
        return None


def _empty_cache_bucket(cfg: ClusterConfig) -> None:
    """CloudFormation deletes only an empty bucket: the compile caches in the stack's own bucket go first."""
    bucket = _cache_bucket(cfg)
    if bucket is None:
        return
    s3 = _session(cfg).client("s3")
    deleted = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            deleted += len(keys)
    print(f"emptied the compile cache bucket {bucket} ({deleted} objects) so that CloudFormation can delete it", file=sys.stderr)


def cmd_diff(args: argparse.Namespace, extra: list[str]) -> int:
    """`cdk diff` of the named stack (with the image a deploy would resolve now)."""
    cfg = load(args)
    _announce(cfg)
    print(f"account {_account(cfg)}", file=sys.stderr)
    return _cdk("diff", cfg, _context_args(args) + _resolve_image(cfg, args, "diff"), extra)


# ---- the parser ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(prog="gptoss", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("-c", "--context", action="append", metavar="KEY=VALUE", help="the same keys as `cdk -c`")
        sp.add_argument("--config", metavar="FILE", help="YAML or JSON config file (as `cdk -c config=FILE`)")
        sp.add_argument("--stack", metavar="NAME", help="a stack deployed from this checkout (its recorded parameters), or a recipe's stack")
        sp.add_argument("--decode-instances", type=int, metavar="N", help="decode instances (default 1: the tested 6P1D)")
        sp.add_argument("--prefill-per-decode", type=int, metavar="N", help="prefill replicas per decode server (default 6)")
        sp.add_argument("--replicas-per-prefill-instance", type=int, metavar="N", help="default: fill each prefill instance")
        sp.add_argument("--instance-type", metavar="TYPE", help="default trn3.48xlarge")

    def width(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--wide", action="store_true", help="tables as wide as the terminal (at least 160 columns); default 80")
        sp.add_argument("--width", type=int, default=None, metavar="N", help="tables exactly N columns wide")

    plan = sub.add_parser("plan", help="what runs where (80-column summary; --details for every unit)")
    common(plan)
    plan.add_argument("--details", action="store_true", help="every unit's environment and command line")
    plan.add_argument("--node", help="the detail of one node")
    plan.add_argument("--json", action="store_true", help="machine-readable plan (everything the tables show)")
    plan.add_argument("--cost", action="store_true", help="prices per hour from the AWS Price List API (needs credentials)")
    plan.add_argument("--diagram", metavar="FILE", help="also draw the layout (PNG or SVG by extension)")
    width(plan)
    plan.set_defaults(func=cmd_plan)

    rec = sub.add_parser("recipes", help="list the documented deployments (-c recipe=NAME)")
    rec.add_argument("--json", action="store_true", help="machine-readable list")
    width(rec)
    rec.set_defaults(func=cmd_recipes)

    pre = sub.add_parser("preflight", help="check the account: type offered, hardware, DLAMI, quota, capacity")
    common(pre)
    pre.add_argument("--cost", action="store_true", help="also the prices per hour (AWS Price List API)")
    width(pre)
    pre.set_defaults(func=cmd_preflight)

    pin = sub.add_parser("pin-ami", help="resolve the DLAMI parameter once and record the image (cdk.context.json)")
    common(pin)
    pin.add_argument("--upgrade", action="store_true", help="re-resolve a pinned image (a deliberate upgrade)")
    pin.set_defaults(func=cmd_pin_ami)

    dep = sub.add_parser("deploy", help="cdk deploy of the named stack (extra arguments go to cdk)")
    common(dep)
    dep.add_argument("--yes", action="store_true", help="deploy without asking: a fleet 4x or more the expected size, or a new image")
    dep.set_defaults(func=cmd_deploy, passthrough=True)

    des = sub.add_parser("destroy", help="cdk destroy of the named stack, after confirmation")
    common(des)
    des.add_argument("--yes", action="store_true", help="delete without asking (CI)")
    des.set_defaults(func=cmd_destroy, passthrough=True)

    dif = sub.add_parser("diff", help="cdk diff of the named stack")
    common(dif)
    dif.set_defaults(func=cmd_diff, passthrough=True)

    st = sub.add_parser("status", help="every unit's state and health on every node (SSM)")
    common(st)
    width(st)
    st.set_defaults(func=cmd_status)

    wr = sub.add_parser("wait-ready", help="wait until every server answers its health route")
    common(wr)
    width(wr)
    wr.add_argument("--timeout", type=float, default=6 * 3600, help="seconds (first compiles take hours)")
    wr.add_argument("--interval", type=float, default=60, help="seconds between polls")
    wr.set_defaults(func=cmd_wait_ready)

    be = sub.add_parser("bench", help="run the benchmark on a proxy node and print its metrics")
    common(be)
    width(be)
    be.add_argument("--node", help="proxy node to run it on (default: the first)")
    be.add_argument("--interval", type=float, default=60, help="seconds between polls")
    be.add_argument("--timeout", type=float, default=6 * 3600,
                    help="seconds before the benchmark is stopped and the command fails (default 6 h)")  # fmt: skip
    be.set_defaults(func=cmd_bench)

    sc = sub.add_parser("save-cache", help="upload the compile caches of chosen nodes and promote them to the fleet's cache (after the first compile)")
    common(sc)
    sc.add_argument("--node", action="append", help="promote this node's upload (repeatable; default: the first prefill and decode node)")
    sc.set_defaults(func=cmd_save_cache)

    lo = sub.add_parser("local", help="the whole lifecycle on this machine against moto on localhost (no AWS account): up, down, env",
                        description="up: start moto on localhost:5005 (GPTOSS_LOCAL_PORT; or use GPTOSS_LOCAL_ENDPOINT), seed it, "
                                    "bootstrap the CDK, deploy examples/local.yaml and show its status. down: destroy it, remove "
                                    "everything up made, list what is left, stop the server. env: the exports that point this "
                                    "shell's AWS clients at it.")  # fmt: skip
    lo.add_argument("action", choices=["up", "down", "env"], help="up, down or env")
    lo.set_defaults(func=cmd_local)
    # Each subcommand's --help starts with what it does (the line the command list shows).
    for sp in sub.choices.values():
        sp.description = sp.description or next(a.help for a in sub._choices_actions if a.dest == sp.prog.split()[-1])
    return p


def cmd_local(args: argparse.Namespace) -> int:
    """`gptoss local up|down|env` (cluster_ops/local.py)."""
    from cluster_ops import local

    gptoss = str(Path(sys.executable).parent / "gptoss")
    return {"up": lambda: local.up(gptoss), "down": lambda: local.down(gptoss), "env": local.env}[args.action]()


def main(argv: list[str] | None = None) -> int:
    """Run one command: exit 0 done, 1 not done (checks failed, not ready, not confirmed), 2 cannot run."""
    # Throttled calls are retried with client-side rate limiting before an error reaches anyone.
    os.environ.setdefault("AWS_RETRY_MODE", "adaptive")
    # A local endpoint (AWS_ENDPOINT_URL) does not throttle: a failing one is said after 3 attempts, not a minute of them.
    os.environ.setdefault("AWS_MAX_ATTEMPTS", "3" if os.environ.get("AWS_ENDPOINT_URL") else "8")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if getattr(args, "passthrough", False):
            return int(args.func(args, [a for a in extra if a != "--"]))
        return int(args.func(args))
    except SpecError as e:
        print(f"invalid deployment parameters:\n{e}", file=sys.stderr)
        return 2
    except CliError as e:
        print(f"gptoss {args.command}: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (gptoss plan | head): stop quietly, as cat does; Python would
        # otherwise complain again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:
        from cluster_ops.awserrors import explain  # botocore's parsers: a tenth of a second that plan needs not pay

        line = explain(e, region=_REGION or os.environ.get("AWS_REGION", "the configured region"))
        if line:
            print(f"gptoss {args.command}: {line}", file=sys.stderr)
            return 2
        if os.environ.get("GPTOSS_DEBUG"):
            raise
        print(f"gptoss {args.command}: internal error: {type(e).__name__}: {e} (set GPTOSS_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
