"""`gptoss size`: vLLM's benchmark JSON read as it is, refused when it cannot describe the objective,
interpolated between measured points only, and a fleet that grows the right way with its inputs.

The runs are SYNTHETIC (tests/fakes/bench_runs.py: a known model in vLLM's result format): this
machine has no Trainium, and no number here is a Trn3 measurement.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_ops.sizing import Curve, Objective, Run, SizingError, accept, parse, size
from tests.conftest import ROOT
from tests.fakes.bench_runs import Model, result, sweep

FIXTURES = ROOT / "tests" / "fixtures" / "bench-synthetic"
PER_INSTANCE, MAX_PER_DECODE = 16, 128
PROPERTIES = settings(max_examples=60, deadline=None, derandomize=True, database=None)


def runs(model: Model | None = None, **kw: Any) -> list[Run]:
    return [parse(name, json.dumps(doc)) for name, doc in sweep(model, **kw).items()]


def fleet(rs: list[Run], **objective: Any) -> Any:
    obj = {"isl": 8192, "osl": 1024, "ttft_p99_s": 3.0, "tpot_p99_s": 0.02, "rate": 20.0} | objective
    return size(rs, Objective(**obj), replicas_per_instance=PER_INSTANCE, max_prefill_per_decode=MAX_PER_DECODE)


# ---- the format -----------------------------------------------------------------------------


def test_a_run_in_vllms_format_reads_as_measured() -> None:
    doc = result(Model(), leg="endpoint", prefill_replicas=48, decode_servers=8, concurrency=256)
    r = parse("c256.json", json.dumps(doc))
    assert (r.concurrency, r.rate, r.completed, r.failed, r.input_len, r.output_len) == (256, None, 1000, 0, 8192, 1024)
    assert (r.tpot_p50, r.tpot_p99, r.ttft_p99) == (doc["p50_tpot_ms"], doc["p99_tpot_ms"], doc["p99_ttft_ms"])
    assert (r.prefill_replicas, r.decode_servers, r.image) == (48, 8, "ami-0123456789abcdef0")


def test_older_releases_names_are_read_too() -> None:
    """vLLM releases name things differently: no 'failed' (the prompts not completed), p50 only as 'median'."""
    doc = result(Model(), leg="endpoint", prefill_replicas=48, decode_servers=8, concurrency=256)
    for k in ("failed", "p50_ttft_ms", "p50_tpot_ms"):
        del doc[k]
    doc["num_prompts"] = 1003
    r = parse("old.json", json.dumps(doc))
    assert r.failed == 3 and r.ttft_p50 == doc["median_ttft_ms"] and r.tpot_p50 == doc["median_tpot_ms"]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda d: d.pop("gptoss_image"), "has no gptoss_image: the layout and image it measured are unknown"),
        (lambda d: d.pop("p99_tpot_ms"), "has no p99_tpot_ms. Fix: run vllm bench serve with --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99"),
        (lambda d: d.update(completed=0), "completed no request"),
    ],
)
def test_a_document_that_cannot_be_read_as_a_run_is_refused_naming_what_it_lacks(change: Any, said: str) -> None:
    doc = result(Model(), leg="endpoint", prefill_replicas=48, decode_servers=8, concurrency=256)
    change(doc)
    with pytest.raises(SizingError, match=said):
        parse("bad.json", json.dumps(doc))
    with pytest.raises(SizingError, match="is not JSON"):
        parse("bad.json", "{")


# ---- refusals ---------------------------------------------------------------------------------


def _one(**kw: Any) -> Run:
    return parse("run.json", json.dumps(result(Model(), leg="endpoint", prefill_replicas=48, decode_servers=8, **kw)))


def test_runs_that_do_not_describe_the_objective_are_refused_with_the_reason() -> None:
    base = _one(concurrency=256)
    with pytest.raises(SizingError, match=r"averaged 8,192 input tokens, the objective asks 2,048: more than 15% apart"):
        accept([base], isl=2048, osl=1024)
    with pytest.raises(SizingError, match=r"3 of 1003 requests failed"):
        accept([replace(base, failed=3)], isl=8192, osl=1024)
    rated = _one(rate=40.0)
    with pytest.raises(SizingError, match=r"offered 40 req/s, achieved 30: a queue was building"):
        accept([replace(rated, throughput=30.0)], isl=8192, osl=1024)
    with pytest.raises(SizingError, match=r"not the 256 asked \(Little's law\): the run did not hold its concurrency"):
        accept([replace(base, throughput=base.throughput / 2)], isl=8192, osl=1024)
    with pytest.raises(SizingError, match=r"measured image ami-1111111111111111, run.json ami-0123456789abcdef0: runs of different layouts or images"):
        accept([base, replace(base, image="ami-1111111111111111")], isl=8192, osl=1024)
    with pytest.raises(SizingError, match=r"measured decode servers 1, run.json 8"):
        accept([base, replace(base, decode_servers=1)], isl=8192, osl=1024)


def test_an_objective_no_fleet_can_meet_says_so_naming_the_number() -> None:
    rs = runs()
    lone_tpot = Model().tpot_p99(1) / 1000
    with pytest.raises(SizingError, match=rf"tpot_p99=0.005 s: no fleet meets it: .* a token already takes {lone_tpot:.4g} s at p99"):
        fleet(rs, tpot_p99_s=0.005)
    lone_ttft = Model().ttft_p99(0.1) / 1000
    with pytest.raises(SizingError, match=rf"ttft_p99=0.5 s: no fleet meets it: .* the first token already takes {lone_ttft:.4g} s at p99"):
        fleet(rs, ttft_p99_s=0.5)


def test_every_run_it_accepts_obeys_littles_law() -> None:
    for r in accept(runs(), isl=8192, osl=1024):
        if r.concurrency:
            assert r.throughput * r.e2el_mean / 1000 == pytest.approx(r.concurrency, rel=0.01)


# ---- interpolation ------------------------------------------------------------------------------


@PROPERTIES
@given(st.lists(st.tuples(st.integers(1, 500), st.floats(1, 1000)), min_size=2, max_size=8, unique_by=lambda p: p[0]))
def test_the_curve_is_exact_at_measured_points_and_monotone_between(points: list[tuple[int, float]]) -> None:
    curve = Curve.of([(float(x), y) for x, y in points])
    tops = [max(y for x2, y in points if x2 <= x) for x, _ in sorted(points)]
    assert [curve.at(x) for x in curve.xs] == pytest.approx(tops), "exact where measured (noise made non-decreasing)"
    grid = [curve.xs[0] + (curve.xs[-1] - curve.xs[0]) * i / 50 for i in range(51)]
    values = [curve.at(x) for x in grid]
    assert all(a <= b + 1e-9 for a, b in itertools.pairwise(values))
    with pytest.raises(SizingError, match="past the largest measured load"):
        curve.at(curve.xs[-1] * 1.01 + 1)


# ---- the fleet grows the right way ------------------------------------------------------------------


@PROPERTIES
@given(st.floats(0.5, 150), st.floats(0.5, 150))
def test_more_load_never_yields_fewer_instances(a: float, b: float) -> None:
    small, large = sorted((a, b))
    rs = runs()
    f1, f2 = fleet(rs, rate=small), fleet(rs, rate=large)
    assert f2.prefill_instances + f2.decode_instances >= f1.prefill_instances + f1.decode_instances
    assert f2.decode_instances >= f1.decode_instances


@PROPERTIES
@given(st.floats(0.0115, 0.03), st.floats(0.0115, 0.03), st.floats(1, 120))
def test_a_tighter_tpot_target_never_yields_fewer_decode_instances(a: float, b: float, rate: float) -> None:
    tight, loose = sorted((a, b))
    rs = runs()
    assert fleet(rs, tpot_p99_s=tight, rate=rate).decode_instances >= fleet(rs, tpot_p99_s=loose, rate=rate).decode_instances


@PROPERTIES
@given(st.floats(0.98, 20), st.floats(0.98, 20), st.floats(1, 120))
def test_a_tighter_ttft_target_never_yields_fewer_prefill_instances(a: float, b: float, rate: float) -> None:
    tight, loose = sorted((a, b))
    rs = runs()
    assert fleet(rs, ttft_p99_s=tight, rate=rate).prefill_instances >= fleet(rs, ttft_p99_s=loose, rate=rate).prefill_instances


@PROPERTIES
@given(st.integers(7200, 9400), st.integers(7200, 9400), st.floats(1, 120))
def test_longer_inputs_never_yield_fewer_prefill_instances(a: int, b: int, rate: float) -> None:
    short, long = sorted((a, b))
    rs = runs()
    assert fleet(rs, isl=long, rate=rate).prefill_instances >= fleet(rs, isl=short, rate=rate).prefill_instances


@PROPERTIES
@given(st.integers(900, 1170), st.integers(900, 1170), st.floats(1, 120))
def test_longer_outputs_never_yield_fewer_decode_instances(a: int, b: int, rate: float) -> None:
    short, long = sorted((a, b))
    rs = runs()
    assert fleet(rs, osl=long, rate=rate).decode_instances >= fleet(rs, osl=short, rate=rate).decode_instances


@PROPERTIES
@given(st.floats(0, 0.6), st.floats(1, 120), st.booleans())
def test_the_headroom_reported_is_at_least_the_headroom_asked(headroom: float, load: float, clients: bool) -> None:
    objective = {"concurrency": int(load * 10), "rate": None} if clients else {"rate": load}
    f = fleet(runs(), headroom=headroom, **objective)
    assert min(f.headroom.values()) >= headroom - 1e-9, f.headroom


# ---- the model's own numbers ------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [5.0, 20.0, 60.0])
def test_predictions_at_the_chosen_fleet_agree_with_the_model_the_runs_came_from(rate: float) -> None:
    """Within 5 %: the sizer reads the model only at the points it measured and interpolates linearly between them."""
    model = Model()
    f = fleet(runs(model), rate=rate)
    p = f.predicted
    per_replica = rate / f.prefill_replicas
    assert p["ttft_p99_s"] * 1000 == pytest.approx(model.ttft_p99(per_replica), rel=0.05)
    assert p["ttft_p50_s"] * 1000 == pytest.approx(model.ttft_p50(per_replica), rel=0.05)
    per_server = p["sequences_per_decode_server"]
    assert per_server == pytest.approx(rate * model.residence_s(per_server) / f.decode_instances, rel=0.02), "Little's law"
    assert p["tpot_p99_s"] * 1000 == pytest.approx(model.tpot_p99(per_server), rel=0.05)
    assert p["tpot_p99_s"] <= 0.02 and p["ttft_p99_s"] <= 3.0
    assert p["output_tokens_per_s"] == pytest.approx(rate * 1024)


def test_without_a_rate_sweep_the_prefill_capacity_is_an_estimate_and_says_so() -> None:
    f = fleet(runs(rates=False), rate=20.0)
    assert any("ESTIMATE" in n and "M/M/1" in n for n in f.notes), f.notes
    assert f.prefill_instances >= 1


# ---- the command ------------------------------------------------------------------------------------


def test_the_committed_example_runs_are_the_generators() -> None:
    files = {p.name: json.loads(p.read_text()) for p in FIXTURES.glob("*.json")}
    assert files == sweep(), "tests/fixtures/bench-synthetic is stale: python -m tests.fakes.bench_runs tests/fixtures/bench-synthetic"
    assert all(d["gptoss_synthetic"].endswith("not a measurement") for d in files.values())


def test_size_json_puts_the_instance_counts_at_the_top_level_and_plan_takes_its_values() -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "cluster.py"), "size", "--bench", str(FIXTURES), "--isl", "8192", "--osl", "1024",
           "--rate", "20", "--ttft-p99", "3", "--tpot-p99", "0.02", "--json"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert isinstance(doc["prefill_instances"], int) and isinstance(doc["decode_instances"], int)
    assert doc["instances"] == doc["prefill_instances"] + doc["decode_instances"]
    assert math.ceil(doc["decode_instances"] * doc["prefill_per_decode"] / 16) == doc["prefill_instances"]
    plan = subprocess.run([sys.executable, str(ROOT / "scripts" / "cluster.py"), "plan", "--json", *[w for c in doc["context"] for w in c.split(" ", 1)]],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    totals = json.loads(plan.stdout)["totals"]
    assert (totals["prefill_nodes"], totals["decode_nodes"], totals["prefill_replicas"]) == (
        doc["prefill_instances"], doc["decode_instances"], doc["prefill_replicas"])


def test_size_refuses_in_one_line_with_the_fix(tmp_path: Any) -> None:
    bad = tmp_path / "plain.json"
    doc = result(Model(), leg="endpoint", prefill_replicas=48, decode_servers=8, concurrency=8)
    del doc["gptoss_decode_servers"]
    bad.write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "cluster.py"), "size", "--bench", str(bad), "--isl", "8192", "--osl", "1024",
                        "--rate", "20", "--ttft-p99", "3", "--tpot-p99", "0.02"], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"gptoss size: {bad}: has no gptoss_decode_servers") and "Fix: measure with gptoss bench --sweep" in line


def test_the_docs_show_what_size_prints_on_the_synthetic_runs() -> None:
    import re
    import shlex

    text = (ROOT / "docs" / "sizing.md").read_text()
    command = re.search(r"```bash\n(\.venv/bin/gptoss size [^\n]+)\n```\n\nprints \(synthetic runs\):\n\n```text\n(.*?)```", text, re.S)
    assert command, "docs/sizing.md: the size example and its output"
    words = shlex.split(command.group(1))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "cluster.py"), *words[1:]], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == command.group(2)
