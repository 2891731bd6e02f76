"""Size a disaggregated fleet from an objective and the cluster's own benchmark runs (docs/sizing.md).

Input: `vllm bench serve --save-result` JSON files from `gptoss bench --sweep` (its --metadata
names the layout and image each was measured on). Model, per server so that runs of one layout
size any fleet of the same recipe, instance type and image:

- decode: from closed-loop runs (--max-concurrency C), per decode server c = C / decode servers.
  Capacity c* is the largest c whose TPOT p99 meets the target (interpolated between measured
  points, never beyond them); its request rate is c* / W by Little's law, W the time a request
  spends on the decode server (mean E2EL - mean TTFT).
- prefill: from open-loop runs (--request-rate R), per replica r = R / prefill replicas.
  Capacity r* is the highest r whose TTFT p99 meets the target; for runs straight at a prefill
  replica (leg "prefill"), the target less the measured prefill-to-decode overhead (TTFT through
  the endpoint minus TTFT at the replica, both at the lowest load). Without any rate run, an
  M/M/1-style estimate from the lowest-load TTFT, marked as such.
- a fleet for a rate R: D = ceil(R / ((1 - h) * decode rate)), P = ceil(R / ((1 - h) * r*)) replicas,
  prefill_per_decode = ceil(P / D); lengths within 15 % of the measured ones scale the capacities
  (prefill work with the input length, decode time with the output length).

Nothing here calls AWS: `gptoss size` runs anywhere the JSON files are.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LENGTH_TOLERANCE = 0.15  # a run's mean lengths within 15 % of the objective's
SHORTFALL = 0.9  # an open-loop run that achieved less than 90 % of its offered rate was building a queue
LITTLE_TOLERANCE = 0.15  # a closed-loop run must keep its concurrency in flight: throughput x E2EL = C within 15 %
META = ("gptoss_recipe", "gptoss_instance_type", "gptoss_image", "gptoss_prefill_replicas", "gptoss_decode_servers", "gptoss_leg")
PERCENTILE_FLAGS = "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99"


class SizingError(ValueError):
    """A run or an objective the sizer refuses: one line with the reason and the fix."""


@dataclass(frozen=True)
class Run:
    """One benchmark run, as the sizer reads it (times in ms, rates in requests per second)."""

    file: str
    leg: str  # "endpoint": through the proxy or router; "prefill": straight at one prefill replica
    concurrency: int | None  # --max-concurrency (closed loop)
    rate: float | None  # --request-rate (open loop); None for "inf"
    completed: int
    failed: int
    throughput: float
    input_len: float
    output_len: float
    ttft_p50: float
    ttft_p99: float
    ttft_mean: float
    tpot_p50: float
    tpot_p99: float
    tpot_mean: float
    e2el_mean: float
    prefill_replicas: int
    decode_servers: int
    recipe: str
    instance_type: str
    image: str


def _number(doc: dict[str, Any], *keys: str) -> float | None:
    """The first of `keys` the document holds as a number (metric names drift between vLLM releases)."""
    for k in keys:
        v = doc.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


def parse(file: str, text: str) -> Run:
    """One `vllm bench serve --save-result` document, or a refusal naming what it lacks."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SizingError(f"{file}: is not JSON ({e}). Fix: give the files gptoss bench --sweep saved.") from None
    if not isinstance(doc, dict):
        raise SizingError(f"{file}: is not a vllm bench serve result. Fix: give the files gptoss bench --sweep saved.")
    missing = [k for k in META if k not in doc]
    if missing:
        raise SizingError(f"{file}: has no {', '.join(missing)}: the layout and image it measured are unknown, so it cannot be "
                          "normalized or kept apart from other runs. Fix: measure with gptoss bench --sweep (it records them).")  # fmt: skip
    values: dict[str, float] = {}
    for name, keys in {
        "ttft_p50": ("p50_ttft_ms", "median_ttft_ms"), "ttft_p99": ("p99_ttft_ms",), "ttft_mean": ("mean_ttft_ms",),
        "tpot_p50": ("p50_tpot_ms", "median_tpot_ms"), "tpot_p99": ("p99_tpot_ms",), "tpot_mean": ("mean_tpot_ms",),
        "e2el_mean": ("mean_e2el_ms",), "completed": ("completed",), "throughput": ("request_throughput",),
        "input_tokens": ("total_input_tokens",), "output_tokens": ("total_output_tokens",),
    }.items():  # fmt: skip
        v = _number(doc, *keys)
        if v is None:
            raise SizingError(f"{file}: has no {keys[0]}. Fix: run vllm bench serve with {PERCENTILE_FLAGS} --save-result "
                              "(gptoss bench --sweep does).")  # fmt: skip
        values[name] = v
    completed = int(values["completed"])
    failed = _number(doc, "failed")
    if failed is None:  # older releases: no "failed" count, the prompts that did not complete
        failed = max(0.0, (_number(doc, "num_prompts") or completed) - completed)
    rate = doc.get("request_rate")
    concurrency = doc.get("max_concurrency")
    if completed <= 0:
        raise SizingError(f"{file}: completed no request. Fix: check the cluster (gptoss status), then measure again.")
    return Run(
        file=file, leg=str(doc["gptoss_leg"]), concurrency=int(concurrency) if isinstance(concurrency, int) else None,
        rate=None if rate in ("inf", None) else float(rate), completed=completed, failed=int(failed),
        throughput=values["throughput"], input_len=values["input_tokens"] / completed, output_len=values["output_tokens"] / completed,
        ttft_p50=values["ttft_p50"], ttft_p99=values["ttft_p99"], ttft_mean=values["ttft_mean"], tpot_p50=values["tpot_p50"],
        tpot_p99=values["tpot_p99"], tpot_mean=values["tpot_mean"], e2el_mean=values["e2el_mean"],
        prefill_replicas=int(doc["gptoss_prefill_replicas"]), decode_servers=int(doc["gptoss_decode_servers"]),
        recipe=str(doc["gptoss_recipe"]), instance_type=str(doc["gptoss_instance_type"]), image=str(doc["gptoss_image"]),
    )  # fmt: skip


def accept(runs: list[Run], *, isl: int, osl: int) -> list[Run]:
    """Every run, or the first refusal: measured lengths far from the objective's, failures, a queue
    that was building, a closed loop that did not hold its concurrency, runs of another layout mixed in."""
    if not runs:
        raise SizingError("no benchmark runs. Fix: gptoss bench --sweep on the deployed cluster, then --bench FILE...")
    for r in runs:
        for what, measured, asked in (("input", r.input_len, isl), ("output", r.output_len, osl)):
            if abs(measured - asked) > LENGTH_TOLERANCE * asked:
                raise SizingError(f"{r.file}: its requests averaged {measured:,.0f} {what} tokens, the objective asks {asked:,}: "
                                  f"more than {LENGTH_TOLERANCE:.0%} apart, so its latencies do not describe the objective's. "
                                  f"Fix: measure at --{'isl' if what == 'input' else 'osl'} {asked} (gptoss bench --sweep uses the "
                                  "recipe's shape), or ask for the shape it measured.")  # fmt: skip
        if r.failed:
            raise SizingError(f"{r.file}: {r.failed} of {r.failed + r.completed} requests failed; latencies of a failing run are not "
                              "capacity. Fix: find why (gptoss status), then measure again.")  # fmt: skip
        if r.rate is not None and r.throughput < SHORTFALL * r.rate:
            raise SizingError(f"{r.file}: offered {r.rate:g} req/s, achieved {r.throughput:.3g}: a queue was building, so its TTFT grows "
                              "with the run's length, not with the load. Fix: leave this rate out (it is past capacity), or measure lower rates.")  # fmt: skip
        if r.rate is None and r.concurrency:
            held = r.throughput * r.e2el_mean / 1000
            if abs(held - r.concurrency) > LITTLE_TOLERANCE * r.concurrency:
                raise SizingError(f"{r.file}: {r.throughput:.3g} req/s x {r.e2el_mean / 1000:.3g} s mean E2EL = {held:.3g} requests in "
                                  f"flight, not the {r.concurrency} asked (Little's law): the run did not hold its concurrency (too few "
                                  "prompts, or a warm-up in the measurement). Fix: more prompts per concurrency, then measure again.")  # fmt: skip
    first = runs[0]
    for r in runs[1:]:
        for what in ("recipe", "instance_type", "image", "prefill_replicas", "decode_servers"):
            if getattr(r, what) != getattr(first, what):
                raise SizingError(f"{r.file}: measured {what.replace('_', ' ')} {getattr(r, what)}, {first.file} "
                                  f"{getattr(first, what)}: runs of different layouts or images are not mixed. Fix: size from the "
                                  "runs of one layout and image (gptoss bench --sweep names its files by both).")  # fmt: skip
    return runs


@dataclass(frozen=True)
class Curve:
    """Measured points y(x), made non-decreasing (a later point never below an earlier one: noise
    is not capacity), read between measured points only."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    @classmethod
    def of(cls, points: list[tuple[float, float]]) -> Curve:
        points = sorted(points)
        xs: list[float] = []
        ys: list[float] = []
        top = -math.inf
        for x, y in points:
            if xs and x == xs[-1]:
                top = max(top, y)
                ys[-1] = top
                continue
            top = max(top, y)
            xs.append(x)
            ys.append(top)
        return cls(tuple(xs), tuple(ys))

    def at(self, x: float) -> float:
        """y at x, linear between the measured points around it; below the first point, the first (a
        lower load is no slower); never past the last."""
        if x > self.xs[-1] * (1 + 1e-9):
            raise SizingError(f"{x:g} is past the largest measured load {self.xs[-1]:g}")
        if x <= self.xs[0]:
            return self.ys[0]
        for (x0, y0), (x1, y1) in zip(zip(self.xs, self.ys, strict=True), zip(self.xs[1:], self.ys[1:], strict=True), strict=False):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return self.ys[-1]

    def largest_within(self, limit: float) -> tuple[float, bool] | None:
        """The largest x whose y is at most `limit`, and whether it is the last measured point (the
        capacity is then at least that); None when even the first point is over."""
        if self.ys[0] > limit:
            return None
        for i in range(len(self.xs) - 1):
            if self.ys[i + 1] > limit:
                x0, x1, y0, y1 = self.xs[i], self.xs[i + 1], self.ys[i], self.ys[i + 1]
                return x0 + (x1 - x0) * (limit - y0) / (y1 - y0), False
        return self.xs[-1], True


@dataclass(frozen=True)
class Objective:
    """What the fleet must serve: a load (a request rate, or a number of clients) and latency targets (seconds)."""

    isl: int
    osl: int
    ttft_p99_s: float
    tpot_p99_s: float
    rate: float | None = None
    concurrency: int | None = None
    headroom: float = 0.2


@dataclass
class Fleet:
    """The smallest fleet that meets the objective, and what it is predicted to do."""

    prefill_instances: int
    decode_instances: int
    prefill_per_decode: int
    replicas_per_prefill_instance: int
    prefill_replicas: int
    rate: float
    predicted: dict[str, float]
    headroom: dict[str, float]
    limiting: str
    notes: list[str] = field(default_factory=list)
    capacity: dict[str, float] = field(default_factory=dict)

    def context(self) -> list[str]:
        """The -c values that deploy it (plan and deploy take them as any other fleet)."""
        return [f"decode_instances={self.decode_instances}", f"prefill_per_decode={self.prefill_per_decode}"]


def _decode_model(runs: list[Run], obj: Objective) -> tuple[float, float, Curve, Curve, Curve, list[str]]:
    """(sequences per decode server at the TPOT target, its request rate, TPOT p50/p99 and residence curves, notes)."""
    closed = [r for r in runs if r.leg == "endpoint" and r.rate is None and r.concurrency]
    if not closed:
        raise SizingError("no closed-loop run through the endpoint (--max-concurrency): the decode capacity is unmeasured. "
                          "Fix: gptoss bench --sweep (its concurrencies measure it).")  # fmt: skip
    # Decode time scales with the output length: a run at a slightly other length is read at the objective's.
    scale = {r.file: (obj.osl - 1) / max(1.0, r.output_len - 1) for r in closed}
    per = [(r.concurrency / r.decode_servers, r) for r in closed if r.concurrency]
    p99 = Curve.of([(c, r.tpot_p99) for c, r in per])
    p50 = Curve.of([(c, r.tpot_p50) for c, r in per])
    residence = Curve.of([(c, (r.e2el_mean - r.ttft_mean) / 1000 * scale[r.file]) for c, r in per])
    found = p99.largest_within(obj.tpot_p99_s * 1000)
    if found is None:
        lone = min(per, key=lambda cr: cr[0])
        raise SizingError(f"tpot_p99={obj.tpot_p99_s:g} s: no fleet meets it: at the lowest measured load ({lone[0]:g} sequences per "
                          f"decode server, {lone[1].file}) a token already takes {p99.ys[0] / 1000:.4g} s at p99. Fix: a TPOT target "
                          f"of at least {p99.ys[0] / 1000:.4g} s, or a faster decode configuration.")  # fmt: skip
    c_star, at_edge = found
    notes = [f"decode: at least {c_star:g} sequences per server (the most measured) meet TPOT p99"] if at_edge else []
    return c_star, c_star / residence.at(c_star), p50, p99, residence, notes


def _prefill_model(runs: list[Run], obj: Objective) -> tuple[float, Any, Any, list[str]]:
    """(requests per second per prefill replica at the TTFT target, TTFT p50 and p99 as functions of that rate, notes)."""
    scale = {r.file: max(1.0, r.input_len) / obj.isl for r in runs}  # prefill work grows with the prompt
    target_ms = obj.ttft_p99_s * 1000
    endpoint_low = min((r for r in runs if r.leg == "endpoint"), key=lambda r: (r.rate or 0, r.concurrency or 0), default=None)
    prefill_low = min((r for r in runs if r.leg == "prefill"), key=lambda r: (r.rate or 0, r.concurrency or 0), default=None)
    overhead = max(0.0, endpoint_low.ttft_p50 - prefill_low.ttft_p50) if endpoint_low and prefill_low else 0.0
    notes: list[str] = []
    for leg in ("endpoint", "prefill"):
        rated = [r for r in runs if r.leg == leg and r.rate is not None]
        if not rated:
            continue
        add = overhead if leg == "prefill" else 0.0
        points = [(r.rate * scale[r.file] / r.prefill_replicas, r) for r in rated if r.rate is not None]
        p99 = Curve.of([(x, r.ttft_p99 + add) for x, r in points])
        p50 = Curve.of([(x, r.ttft_p50 + add) for x, r in points])
        found = p99.largest_within(target_ms)
        if found is None:
            raise SizingError(f"ttft_p99={obj.ttft_p99_s:g} s: no fleet meets it: at the lowest measured rate ({p99.xs[0]:g} req/s per "
                              f"prefill replica) the first token already takes {p99.ys[0] / 1000:.4g} s at p99"
                              + (f" (with {overhead / 1000:.3g} s of prefill-to-decode overhead)" if add else "") + ". "
                              f"Fix: a TTFT target of at least {p99.ys[0] / 1000:.4g} s.")  # fmt: skip
        r_star, at_edge = found
        if at_edge:
            notes.append(f"prefill: at least {r_star:.4g} req/s per replica (the most measured) meets TTFT p99")
        if leg == "prefill":
            notes.append(f"prefill: the replicas measured directly, plus {overhead:.0f} ms of prefill-to-decode overhead")
        return r_star, p50.at, p99.at, notes
    # No rate sweep: a queueing estimate from the lowest-load TTFT, said as such.
    low = endpoint_low or prefill_low
    assert low is not None
    service = (low.ttft_mean + (overhead if low.leg == "prefill" else 0.0)) * scale[low.file] / 1000

    def p99_at(r: float) -> float:
        rho = r * service
        if rho >= 1:
            return math.inf
        wait = service / (1 - rho) * math.log(100 * rho) if rho > 0.01 else 0.0
        return (service + max(0.0, wait)) * 1000

    def p50_at(r: float) -> float:
        rho = r * service
        if rho >= 1:
            return math.inf
        wait = service / (1 - rho) * math.log(2 * rho) if rho > 0.5 else 0.0
        return (service + max(0.0, wait)) * 1000

    if p99_at(0) > target_ms:
        raise SizingError(f"ttft_p99={obj.ttft_p99_s:g} s: no fleet meets it: one request alone takes {service:.4g} s to its first token "
                          f"({low.file}). Fix: a TTFT target of at least {service:.4g} s.")  # fmt: skip
    lo, hi = 0.0, 1 / service
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p99_at(mid) <= target_ms else (lo, mid)
    notes.append("prefill: an ESTIMATE (no --request-rate run): an M/M/1 queue on the lowest-load TTFT; measure rates for a sizing "
                 "from data (gptoss bench --sweep --rates ...)")  # fmt: skip
    return lo, p50_at, p99_at, notes


def _layout(decode_min: int, replicas_min: int, *, per_instance: int, max_per_decode: int) -> tuple[int, int]:
    """(decode instances, prefill replicas per decode server) with the fewest instances in all.

    The layout holds decode x prefill_per_decode replicas, so the replicas come in multiples of the
    decode count: one more decode instance can save prefill instances. Among the fewest instances,
    the fewest decode instances. (A larger load or a tighter target only removes choices from the
    left of this search, so it never yields a smaller fleet.)
    """
    best: tuple[int, int, int] | None = None  # (instances, decode, per decode)
    start = max(decode_min, math.ceil(replicas_min / max_per_decode))
    for decode in range(start, start + 2 * per_instance + 2):
        per_decode = max(1, math.ceil(replicas_min / decode))
        instances = decode + math.ceil(decode * per_decode / per_instance)
        if best is None or instances < best[0]:
            best = (instances, decode, per_decode)
    assert best is not None
    return best[1], best[2]


def size(runs: list[Run], obj: Objective, *, replicas_per_instance: int, max_prefill_per_decode: int) -> Fleet:
    """The smallest fleet (decode instances, prefill replicas) that meets the objective with the headroom asked."""
    if not 0 <= obj.headroom < 1:
        raise SizingError(f"--headroom {obj.headroom:g}: the share of each pool's capacity kept free is at least 0 and below 1. Fix: e.g. 0.2.")
    if (obj.rate is None) == (obj.concurrency is None):
        raise SizingError("give the load as --rate R (requests per second) or --concurrency C (clients), one of them.")
    if (obj.rate is not None and obj.rate <= 0) or (obj.concurrency is not None and obj.concurrency <= 0):
        raise SizingError("the load must be above 0. Fix: --rate R with R > 0, or --concurrency C with C >= 1.")
    accept(runs, isl=obj.isl, osl=obj.osl)
    c_star, decode_rate, tpot_p50, tpot_p99, residence, notes = _decode_model(runs, obj)
    prefill_rate, ttft_p50, ttft_p99, prefill_notes = _prefill_model(runs, obj)
    notes += prefill_notes
    use = 1 - obj.headroom
    if obj.rate is not None:
        rate = obj.rate
        decode_min = max(1, math.ceil(rate / (use * decode_rate) - 1e-9))
    else:
        assert obj.concurrency is not None
        # Closed loop: every client has one request in flight, on a decode server for nearly all of its time.
        decode_min = max(1, math.ceil(obj.concurrency / (use * c_star) - 1e-9))
        rate = obj.concurrency / (_ttft_mean_s(runs) + residence.at(obj.concurrency / decode_min))
    replicas_min = max(1, math.ceil(rate / (use * prefill_rate) - 1e-9))
    decode, per_decode = _layout(decode_min, replicas_min, per_instance=replicas_per_instance, max_per_decode=max_prefill_per_decode)
    replicas = decode * per_decode
    if obj.concurrency is not None:
        per_server = obj.concurrency / decode
    else:  # sequences on each decode server by Little's law, L = rate x W(L) / decode: from c* down to its fixed point
        per_server = c_star
        for _ in range(50):
            per_server = min(c_star, rate * residence.at(per_server) / decode)
    per_replica = rate / replicas
    predicted = {
        "ttft_p50_s": ttft_p50(per_replica) / 1000, "ttft_p99_s": ttft_p99(per_replica) / 1000,
        "tpot_p50_s": tpot_p50.at(per_server) / 1000, "tpot_p99_s": tpot_p99.at(per_server) / 1000,
        "requests_per_s": rate, "output_tokens_per_s": rate * obj.osl,
        "sequences_per_decode_server": per_server, "requests_per_s_per_prefill_replica": per_replica,
    }  # fmt: skip
    # A pool's headroom: the share of its capacity left at this load (decode: sequences per server against c*).
    headroom = {"decode": 1 - per_server / c_star, "prefill": 1 - rate / (replicas * prefill_rate)}
    return Fleet(
        prefill_instances=math.ceil(replicas / replicas_per_instance), decode_instances=decode, prefill_per_decode=per_decode,
        replicas_per_prefill_instance=replicas_per_instance, prefill_replicas=replicas, rate=rate, predicted=predicted,
        headroom=headroom, limiting=min(headroom, key=lambda k: headroom[k]), notes=notes,
        capacity={"decode_requests_per_s_per_server": decode_rate, "decode_sequences_per_server": c_star,
                  "prefill_requests_per_s_per_replica": prefill_rate},
    )  # fmt: skip


def _ttft_mean_s(runs: list[Run]) -> float:
    """The mean time to first token through the endpoint at the lowest measured load (for a rate from clients)."""
    low = min((r for r in runs if r.leg == "endpoint"), key=lambda r: (r.rate or 0, r.concurrency or 0))
    return low.ttft_mean / 1000


def load_runs(paths: list[Path]) -> list[Run]:
    """Parse each file (a directory: every *.json in it)."""
    files: list[Path] = []
    for p in paths:
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    out = []
    for f in files:
        try:
            text = f.read_text()
        except OSError as e:
            raise SizingError(f"{f}: cannot be read ({e.strerror}). Fix: check the path.") from None
        out.append(parse(str(f), text))
    return out
