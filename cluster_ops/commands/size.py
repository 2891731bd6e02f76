"""`gptoss size`: the smallest fleet that meets a latency objective at a load, from the cluster's own benchmark runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cluster_ops import common, sizing
from clusterspec.errors import SpecError
from clusterspec.loading import load_config


def _fleet_config(runs: list[sizing.Run]) -> Any:
    """The recipe and instance type the runs were measured on, as a config (for its shape and its limits)."""
    first = runs[0]
    try:
        return load_config({"recipe": first.recipe, "instance_type": first.instance_type})
    except SpecError as e:
        raise common.CliError(f"{first.file}: measured recipe {first.recipe} on {first.instance_type}, which this checkout cannot lay out "
                              f"({e.messages[0][:200]}). Fix: size with this checkout's recipes.") from None  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Size the fleet; print it with its predicted latency and headroom, and the -c values that deploy it."""
    try:
        runs = sizing.load_runs([Path(p) for p in args.bench])
        if not runs:
            raise sizing.SizingError(f"--bench {' '.join(args.bench)}: holds no .json file. Fix: give the files gptoss bench --sweep saved.")
        cfg = _fleet_config(runs)
        s = cfg.serving
        per_instance = cfg.hardware.logical_cores(s.prefill.lnc) // s.prefill.tensor_parallel
        objective = sizing.Objective(isl=args.isl, osl=args.osl, ttft_p99_s=args.ttft_p99, tpot_p99_s=args.tpot_p99, rate=args.rate,
                                     concurrency=args.concurrency, headroom=args.headroom)  # fmt: skip
        fleet = sizing.size(runs, objective, replicas_per_instance=per_instance, max_prefill_per_decode=s.decode.capacity)
    except sizing.SizingError as e:
        raise common.CliError(str(e)) from None
    context = [f"recipe={cfg.recipe}", f"instance_type={cfg.instance_type}", *fleet.context()]
    try:  # what plan and deploy will say of it: within one stack's limits
        from node_render import limits

        limits.check(load_config(dict(c.split("=", 1) for c in context)))
    except SpecError as e:
        raise common.CliError(f"the fleet that meets the objective does not fit one stack: {e.messages[0]}") from None
    first = runs[0]
    doc: dict[str, Any] = {
        "prefill_instances": fleet.prefill_instances,
        "decode_instances": fleet.decode_instances,
        "instances": fleet.prefill_instances + fleet.decode_instances,
        "instance_type": first.instance_type,
        "prefill_per_decode": fleet.prefill_per_decode,
        "prefill_replicas": fleet.prefill_replicas,
        "replicas_per_prefill_instance": fleet.replicas_per_prefill_instance,
        "predicted": {k: round(v, 6) for k, v in fleet.predicted.items()},
        "headroom": {k: round(v, 4) for k, v in fleet.headroom.items()},
        "limiting_pool": fleet.limiting,
        "capacity": {k: round(v, 6) for k, v in fleet.capacity.items()},
        "context": [f"-c {c}" for c in context],
        "objective": {"isl": args.isl, "osl": args.osl, "rate": args.rate, "concurrency": args.concurrency,
                      "ttft_p99_s": args.ttft_p99, "tpot_p99_s": args.tpot_p99, "headroom": args.headroom},
        "measured_on": {"recipe": first.recipe, "instance_type": first.instance_type, "image": first.image,
                        "prefill_replicas": first.prefill_replicas, "decode_servers": first.decode_servers, "runs": [r.file for r in runs]},
        "notes": fleet.notes,
    }
    if args.write:
        Path(args.write).write_text("# gptoss size: " + " ".join(f"{k}={v}" for k, v in doc["objective"].items() if v is not None) + "\n"
                                    + "".join(f"{c.split('=', 1)[0]}: {c.split('=', 1)[1]}\n" for c in context))  # fmt: skip
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    p = fleet.predicted
    load = f"{args.rate:g} req/s" if args.rate is not None else f"{args.concurrency} clients ({fleet.rate:.3g} req/s)"
    lines = [
        f"sized from {len(runs)} runs of {first.recipe} on {first.instance_type} ({first.prefill_replicas} prefill replicas, "
        f"{first.decode_servers} decode servers, image {first.image})",
        f"objective: {args.isl} in / {args.osl} out, {load}, TTFT p99 <= {args.ttft_p99:g} s, TPOT p99 <= {args.tpot_p99:g} s, "
        f"headroom {args.headroom:.0%}",
        f"fleet: {fleet.prefill_instances} prefill + {fleet.decode_instances} decode = {doc['instances']} x {first.instance_type}",
        f"  {fleet.prefill_replicas} prefill replicas ({fleet.prefill_per_decode} per decode server, up to "
        f"{fleet.replicas_per_prefill_instance} per instance)",
        f"predicted: TTFT p50 {p['ttft_p50_s']:.3g} s, p99 {p['ttft_p99_s']:.3g} s; TPOT p50 {p['tpot_p50_s'] * 1000:.3g} ms, "
        f"p99 {p['tpot_p99_s'] * 1000:.3g} ms; {p['output_tokens_per_s']:,.0f} output tok/s",
        f"headroom: decode {fleet.headroom['decode']:.0%}, prefill {fleet.headroom['prefill']:.0%}: the {fleet.limiting} pool "
        "limits the fleet first",
        "deploy it: gptoss plan " + " ".join(doc["context"]) + (f"  (or -c config={args.write})" if args.write else ""),
    ]
    lines += [f"note: {n}" for n in fleet.notes]
    print("\n".join(lines))
    return 0


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: a time in seconds above 0")
    return value


def register(sub: Any) -> None:
    """Add the command to the parser."""
    sz = sub.add_parser("size", help="the smallest fleet that meets a latency target at a load, from gptoss bench --sweep results")
    sz.add_argument("--bench", nargs="+", required=True, metavar="FILE", help="result files (or directories of them) of gptoss bench --sweep")
    sz.add_argument("--isl", type=int, required=True, help="input tokens per request")
    sz.add_argument("--osl", type=int, required=True, help="output tokens per request")
    load = sz.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="requests per second to serve")
    load.add_argument("--concurrency", type=int, help="clients, each with one request in flight")
    sz.add_argument("--ttft-p99", type=_seconds, required=True, metavar="SECONDS", help="time to first token at p99")
    sz.add_argument("--tpot-p99", type=_seconds, required=True, metavar="SECONDS", help="time per output token at p99 (vLLM's: excludes the first)")
    sz.add_argument("--headroom", type=float, default=0.2, help="share of each pool's capacity kept free (default 0.2)")
    sz.add_argument("--json", action="store_true", help="the fleet as JSON (prefill_instances and decode_instances at the top level)")
    sz.add_argument("--write", metavar="FILE", help="also write the fleet as a config file for -c config=FILE")
    sz.set_defaults(func=run)
