"""What every gptoss command shares: which cluster it acts on (the parameters from -c, --config or
--stack), the line that names it, the AWS session and account, the console its tables print to,
and the error that becomes one line and an exit code."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusterspec.config import ClusterConfig
from clusterspec.errors import SpecError
from clusterspec.loading import load_config

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


def checkout() -> Path:
    """Where cdk.json, cdk.context.json and the deploy records are: the current directory if it
    holds the app, else this installation's checkout."""
    return Path.cwd() if (Path.cwd() / "cdk.json").exists() else ROOT


def state_dir() -> Path:
    """The checkout's records (.gptoss/, ignored by git); GPTOSS_STATE_DIR elsewhere."""
    return Path(os.environ.get("GPTOSS_STATE_DIR") or checkout() / ".gptoss")


def deployed() -> dict[str, dict[str, Any]]:
    """Stacks deployed from this checkout: name -> {"context": [...], "region": ...}."""
    path = state_dir() / DEPLOYED
    try:
        return dict(json.loads(path.read_text())) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def record(cfg: ClusterConfig, context: list[str], *, remove: bool = False, image: str | None = None) -> None:
    """Write down (or forget) a stack deployed from this checkout, with its parameters and image."""
    path = state_dir() / DEPLOYED
    doc = deployed()
    if remove:
        doc.pop(cfg.stack_name, None)
    else:
        doc[cfg.stack_name] = {"context": context, "region": cfg.region, "cluster": cfg.cluster_name} | ({"image": image} if image else {})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def context_args(args: argparse.Namespace) -> list[str]:
    """The parameters as `-c KEY=VALUE` strings (what cdk receives too)."""
    items = list(args.context or [])
    if getattr(args, "stack", None):
        recorded = deployed().get(args.stack)
        if recorded is None:
            from clusterspec.recipes import RECIPES

            by_stack = {r.stack_name: r.name for r in RECIPES.values()}
            if args.stack not in by_stack:
                known = ", ".join(sorted(deployed()))
                mine = f"this checkout deployed ({known})" if known else "this checkout deployed (it has deployed none)"
                raise SpecError([f"--stack {args.stack}: neither a stack {mine} nor a recipe's stack ({', '.join(sorted(by_stack))}). "
                                 "Fix: one of those names, or name its parameters instead (-c config=FILE or -c KEY=VALUE)."])  # fmt: skip
            items = [f"recipe={by_stack[args.stack]}", *items]
        else:
            items = [*recorded["context"], *items]
    if getattr(args, "config", None):
        items.append(f"config={args.config}")
    for name in ("decode_instances", "prefill_per_decode", "replicas_per_prefill_instance", "instance_type"):
        value = getattr(args, name, None)
        if value is not None:
            items.append(f"{name}={value}")
    return items


def context(items: list[str]) -> dict[str, Any]:
    """The CDK context these `-c` strings give, over what cdk.context.json pins (as the CDK reads it)."""
    ctx: dict[str, Any] = {}
    path = checkout() / "cdk.context.json"
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
    from node_render import limits

    global _REGION
    cfg = load_config(context(context_args(args)))
    limits.check(cfg)
    _REGION = cfg.region
    return cfg


def loaded_region() -> str:
    """The region of the config a command loaded ('' before it loaded one)."""
    return _REGION


def target_line(cfg: ClusterConfig) -> str:
    """The first line of every command: what it acts on."""
    return f"stack {cfg.stack_name} · region {cfg.region} · cluster tag gptoss:cluster={cfg.cluster_name}"


def announce(cfg: ClusterConfig) -> None:
    """Say what the command acts on, before anything else (stderr: stdout stays the command's output),
    then each setting given that another choice makes irrelevant."""
    print(target_line(cfg), file=sys.stderr, flush=True)
    for line in cfg.ignored_settings():
        print(f"note: {line}", file=sys.stderr)


# ---- AWS ----------------------------------------------------------------------------------


def session(cfg: ClusterConfig) -> Any:
    """A boto3 session in the cluster's region."""
    import boto3

    return boto3.Session(region_name=cfg.region)


def account(cfg: ClusterConfig) -> str:
    """The account the credentials act in, asked before anything is synthesized (no credentials: one line, exit 2)."""
    return str(session(cfg).client("sts").get_caller_identity()["Account"])


# ---- the console --------------------------------------------------------------------------


def console(args: argparse.Namespace) -> Console:
    """Tables fit 80 columns (or a narrower terminal); --wide uses the terminal's width (at least
    160); --width N exactly N."""
    from rich.console import Console

    if getattr(args, "width", None):
        return Console(width=args.width)
    terminal = Console().width
    return Console(width=max(terminal, 160) if getattr(args, "wide", False) else min(terminal, 80))


def table(**kwargs: Any) -> Table:
    """A rich table (rich is imported only when one is printed)."""
    from rich.table import Table

    return Table(**kwargs)


# ---- the arguments every command takes ------------------------------------------------------


def add_target_arguments(sp: argparse.ArgumentParser) -> None:
    """-c, --config, --stack and the fleet's shortcuts: the cluster a command acts on."""
    sp.add_argument("-c", "--context", action="append", metavar="KEY=VALUE", help="the same keys as `cdk -c`")
    sp.add_argument("--config", metavar="FILE", help="YAML or JSON config file (as `cdk -c config=FILE`)")
    sp.add_argument("--stack", metavar="NAME", help="a stack deployed from this checkout (its recorded parameters), or a recipe's stack")
    sp.add_argument("--decode-instances", type=int, metavar="N", help="decode instances (default 1: the tested 6P1D)")
    sp.add_argument("--prefill-per-decode", type=int, metavar="N", help="prefill replicas per decode server (default 6)")
    sp.add_argument("--replicas-per-prefill-instance", type=int, metavar="N", help="default: fill each prefill instance")
    sp.add_argument("--instance-type", metavar="TYPE", help="default trn3.48xlarge")


def add_width_arguments(sp: argparse.ArgumentParser) -> None:
    """--wide and --width: how wide a command's tables are."""
    sp.add_argument("--wide", action="store_true", help="tables as wide as the terminal (at least 160 columns); default 80")
    sp.add_argument("--width", type=int, default=None, metavar="N", help="tables exactly N columns wide")


def pricing(cfg: ClusterConfig) -> Any:
    """A client of the AWS Price List API (its endpoint is in us-east-1, whatever the cluster's region)."""
    return session(cfg).client("pricing", region_name="us-east-1")
