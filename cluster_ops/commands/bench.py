"""`gptoss bench`: the reference's benchmark on a proxy node, its key metrics printed."""

from __future__ import annotations

import argparse
from typing import Any

from cluster_ops import common


def run(args: argparse.Namespace) -> int:
    """Run the reference's benchmark on a proxy node and print its key metrics."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from cluster_ops import bench

    cfg = common.load(args)
    common.announce(cfg)
    session = common.session(cfg)
    common.account(cfg)  # no credentials: one line before anything is shown
    console = common.console(args)
    if args.sweep:
        return _sweep(cfg, session, console, args)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task("gptoss-bench.service: starting", total=None)
        try:
            metrics = bench.run(cfg, session.client("ec2"), session.client("ssm"), node=args.node, poll_s=args.interval,
                                timeout_s=args.timeout,
                                on_poll=lambda state, t: progress.update(task, description=f"gptoss-bench.service: {state}"[:100]))  # fmt: skip
        except bench.BenchError as e:
            raise common.CliError(f"bench failed: {e}", 1) from None
    t = common.table(title=f"{cfg.serving.bench.result_file} (measured leg, {cfg.serving.bench.measured_prompts} prompts)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key, label in bench.METRICS:
        value = metrics.get(key)
        t.add_row(label, "-" if value is None else f"{value:,.2f}")
    console.print(t)
    return 0


def default_concurrencies(cfg: Any) -> list[int]:
    """One request alone, then 1/16, 1/4, 1/2, 3/4 and all of the decode servers' sequence slots."""
    servers = max(1, len(cfg.layout.decode_nodes))
    capacity = cfg.serving.capacity
    return sorted({1} | {max(1, round(f * capacity)) * servers for f in (1 / 16, 1 / 4, 1 / 2, 3 / 4, 1)})


def _numbers(text: str, kind: type) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: a comma-separated list of numbers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text}: numbers above 0")
    return values


def _sweep(cfg: Any, session: Any, console: Any, args: argparse.Namespace) -> int:
    """`bench --sweep`: the benchmark at each concurrency and rate, saved as vLLM's JSON for gptoss size."""
    from pathlib import Path

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from cluster_ops import bench

    concurrencies = args.concurrencies or default_concurrencies(cfg)
    out = Path(args.out or f"bench-results/{cfg.stack_name}")
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as progress:  # fmt: skip
        task = progress.add_task(f"{bench.SWEEP_UNIT}: starting", total=None)
        try:
            written = bench.sweep(cfg, session.client("ec2"), session.client("ssm"), out=out, concurrencies=concurrencies,
                                  rates=args.rates or [], prompts_per=args.prompts_per, node=args.node, poll_s=args.interval,
                                  timeout_s=args.timeout,
                                  on_poll=lambda state, t: progress.update(task, description=f"{bench.SWEEP_UNIT}: {state}"[:100]))  # fmt: skip
        except bench.BenchError as e:
            raise common.CliError(f"bench --sweep failed: {e}", 1) from None
    shape = cfg.serving.shape
    print(f"{len(written)} runs in {out}/ (concurrencies {', '.join(map(str, concurrencies))}"
          + (f"; rates {', '.join(f'{r:g}' for r in args.rates)} req/s" if args.rates else "") + "). Size a fleet from them: "
          f"gptoss size --bench {out} --isl {shape.input_len} --osl {shape.output_len} --rate R --ttft-p99 S --tpot-p99 S")  # fmt: skip
    return 0


def register(sub: Any) -> None:
    """Add the command to the parser."""
    be = sub.add_parser("bench", help="run the benchmark on a proxy node and print its metrics")
    common.add_target_arguments(be)
    common.add_width_arguments(be)
    be.add_argument("--node", help="proxy node to run it on (default: the first)")
    be.add_argument("--interval", type=float, default=60, help="seconds between polls")
    be.add_argument("--timeout", type=float, default=6 * 3600,
                    help="seconds before the benchmark is stopped and the command fails (default 6 h)")  # fmt: skip
    be.add_argument("--sweep", action="store_true", help="the benchmark at several loads, saved as vLLM's JSON for gptoss size")
    be.add_argument("--concurrencies", type=lambda v: _numbers(v, int), metavar="C,C,...",
                    help="--sweep: closed-loop concurrencies (default: 1, then 1/16 to all of the decode servers' slots)")  # fmt: skip
    be.add_argument("--rates", type=lambda v: _numbers(v, float), metavar="R,R,...", help="--sweep: open-loop request rates (req/s) too")
    be.add_argument("--prompts-per", type=int, default=10, metavar="N",
                    help="--sweep: prompts per unit of concurrency (and minutes of arrivals per rate); default 10")  # fmt: skip
    be.add_argument("--out", metavar="DIR", help="--sweep: where the results go (default bench-results/STACK)")
    be.set_defaults(func=run)
