"""Plan refuses every router value the pinned wheel refuses at start, held to the wheel itself.

The wheel (installed from .wheels/ into a directory of this test, offline) judges each command
line as a node would start it (tests/router_verdicts.py: its parser, its Python checks, its Rust
core's validation); plan judges the same command line with the same parser and
node_render.router_rules. The command lines are generated from the wheel's own parser: every
numeric flag at -1, 0, 1, the edges of 8, 16, 32 and 64 bits, and for fractions -0.5, 0, 0.5,
1, 1.5, NaN, +/-infinity. A new wheel with a new rule fails here until the table knows it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from annotated_types import Ge, Le

from clusterspec.errors import SpecError
from clusterspec.loading import load_config
from clusterspec.sections.proxy import Router
from node_render.command_lines import router_node_args, router_settings
from node_render.limits import check
from node_render.paths import WHEELS_DIR
from node_render.router_cli import router_parser, start_refusal
from tests.conftest import ROOT

# The router and its metrics listen on an address of this run's own (as tests/userdata/test_router.py);
# its servers' addresses answer nothing, so an accepted router waits for them until it is killed.
NET = f"127.{16 + os.getpid() % 224}"
INTS = ["-1", "0", "1", "255", "256", "65535", "65536", str(2**32 - 1), str(2**32), str(2**64 - 1), str(2**64)]
FLOATS = ["-0.5", "0", "0.5", "1", "1.5", "nan", "inf", "-inf"]
Verdicts = Callable[[list[list[str]]], list[dict[str, str]]]


@pytest.fixture(scope="module")
def wheel_verdicts(tmp_path_factory: pytest.TempPathFactory) -> Verdicts:
    """The pinned wheel's verdicts, one per command line (the wheel installed here, with no index)."""
    r = Router()
    wheel = WHEELS_DIR / r.wheel
    assert wheel.is_file(), f"{wheel} is missing: `make setup` fetches the pinned router wheel"
    site = tmp_path_factory.mktemp("router-site")
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr

    def run(argvs: list[list[str]]) -> list[dict[str, str]]:
        env = {"PYTHONPATH": str(site), "PATH": os.environ["PATH"], "HOME": str(site)}
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "router_verdicts.py")], input="".join(json.dumps(a) + "\n" for a in argvs),
                              capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
        out = [json.loads(line) for line in proc.stdout.splitlines()]
        assert proc.returncode == 0 and len(out) == len(argvs), proc.stderr[-3000:]
        unknown = [(a, v) for a, v in zip(argvs, out, strict=True) if v["verdict"] == "unknown"]
        assert not unknown, f"the wheel neither refused nor started: {unknown[:3]}"
        return out

    return run


def base_argv(cfg: Any) -> list[str]:
    """The router's command line as plan renders it (settings, then a pool of 2 + 2 servers), on this run's addresses."""
    argv = [*router_node_args(cfg), *router_settings(cfg)]
    for flag, value in (("--host", f"{NET}.5.1"), ("--prometheus-host", f"{NET}.5.1")):
        argv[argv.index(flag) + 1] = value
    return argv + [a for i in (1, 2) for a in ("--prefill", f"http://{NET}.6.{i}:8100", "--decode", f"http://{NET}.7.{i}:8200")]


def plan_verdict(argv: list[str]) -> str | None:
    """Why plan refuses a command line (None: it takes it): the pinned parser, then start_refusal."""
    r = Router()
    parser = router_parser(WHEELS_DIR / r.wheel, r.sha256)
    try:
        parsed = parser.parse_args(argv)
    except argparse.ArgumentError as e:  # the parser's own refusal
        return f"parser: {e}"
    refused = start_refusal(parser, parsed)
    return None if refused is None else f"{refused[0]} {refused[1]}"


def test_plan_refuses_every_value_of_every_numeric_flag_the_wheel_refuses(wheel_verdicts: Verdicts) -> None:
    cfg = load_config({"decode_instances": 2, "prefill_per_decode": 1})
    base = base_argv(cfg)
    r = cfg.serving.proxy.router
    parser = router_parser(WHEELS_DIR / r.wheel, r.sha256)
    cases = [[]] + [[a.option_strings[0], v] for a in parser._actions if a.option_strings and a.type in (int, float)
                    for v in (INTS if a.type is int else FLOATS)
                    # A port below 1024 binds for root only: whether it starts depends on who runs the test.
                    if not (a.option_strings[0].endswith("-port") and v.isdigit() and int(v) < 1024)]  # fmt: skip
    assert len(cases) > 250, "the wheel's parser has the numeric flags it had"
    verdicts = wheel_verdicts([base + c for c in cases])
    table = {tuple(c): (v, plan_verdict(base + c)) for c, v in zip(cases, verdicts, strict=True)}
    assert table[()] == ({"verdict": "accepted"}, None), "plan's own command line starts the router"
    missed = {c: v["message"] for c, (v, p) in table.items() if v["verdict"] == "refused" and p is None}
    assert not missed, f"the wheel refuses these at start, plan took them: {json.dumps({' '.join(c): m for c, m in missed.items()}, indent=1)}"
    stricter = {c: p for c, (v, p) in table.items() if v["verdict"] == "accepted" and p is not None}
    # Plan takes only finite fractions; the wheel lets NaN through the rules that compare with >= (and does not look at some).
    assert all(c[1] in ("nan", "inf") and p.endswith("must be a finite number") for c, p in stricter.items()), stricter
    refused = {" ".join(c): v["message"] for c, (v, _) in table.items() if v["verdict"] == "refused"}
    # A few of the wheel's words, typed out: the table reads what the wheel says.
    assert refused["--retry-jitter-factor 1.5"].endswith("Invalid value for field 'retry.jitter_factor': 1.5 - Must be between 0.0 and 1.0")
    assert refused["--retry-max-retries 0"].endswith("'retry.max_retries': 0 - Must be >= 1 (set to 1 to effectively disable retries)")
    assert refused["--cb-window-duration-secs 0"].endswith("'circuit_breaker.window_duration_secs': 0 - Must be > 0")
    assert refused["--retry-backoff-multiplier 0.5"].endswith("'retry.backoff_multiplier': 0.5 - Must be >= 1.0")
    assert refused[f"--cb-success-threshold {2**32}"] == "number too large to fit in target type"
    assert refused["--retry-max-backoff-ms 1"].endswith("'retry.max_backoff_ms': 1 - Must be >= initial_backoff_ms")
    assert len(refused) >= 80, len(refused)
    print(f"\nrouter values: {len(cases)} command lines; the wheel refused {len(refused)}, plan refused all of them and "
          f"{len(stricter)} more (non-finite fractions)")  # fmt: skip


def _bounds(edge: type) -> dict[str, int]:
    """Every bounded whole-number field of serving.proxy.router at its lower (Ge) or upper (Le) spec bound."""
    out = {}
    for name, field in Router.model_fields.items():
        if field.annotation is int:
            (b,) = [m for m in field.metadata if isinstance(m, edge)]
            out[name] = int(b.ge if isinstance(b, Ge) else b.le)  # type: ignore[union-attr]
    return out


@pytest.mark.parametrize("edge", [Ge, Le], ids=["minimum", "maximum"])
def test_every_modeled_router_value_at_its_spec_bound_starts_the_wheel(wheel_verdicts: Verdicts, edge: type) -> None:
    values = _bounds(edge)
    # Ports keep distinct values (at one bound, all would be one port).
    values = {k: v for k, v in values.items() if not k.endswith("port")}
    assert {"health_check_interval_s", "health_failure_threshold", "request_timeout_s", "worker_startup_check_interval_s"} <= set(values)
    cfg = load_config({"decode_instances": 2, "prefill_per_decode": 1} | {f"serving.proxy.router.{k}": v for k, v in values.items()})
    check(cfg)
    argv = base_argv(cfg)
    assert plan_verdict(argv) is None
    assert wheel_verdicts([argv]) == [{"verdict": "accepted"}], (values, argv)


@pytest.mark.parametrize(
    ("flag", "value", "rule"),
    [
        ("--retry-jitter-factor", "1.5", "--retry-jitter-factor must be between 0.0 and 1.0"),
        ("--retry-backoff-multiplier", "nan", "--retry-backoff-multiplier must be a finite number"),
        ("--cb-window-duration-secs", "0", "--cb-window-duration-secs must be >= 1 and a 64-bit unsigned number"),
        ("--kv-event-block-size", str(2**32), "--kv-event-block-size must be a 32-bit unsigned number"),
        ("--kv-aware-session-affinity-ttl-secs", "0", "kv_aware_session_affinity_ttl_secs must be between 1 and 31536000"),
    ],
)
def test_an_extra_router_flag_the_router_would_refuse_at_start_is_refused_at_plan_time(flag: str, value: str, rule: str) -> None:
    cfg = load_config({"decode_instances": 8, "serving.proxy.router.extra_flags": json.dumps([{"name": flag, "value": value, "reason": "test"}])})
    with pytest.raises(SpecError) as e:
        check(cfg)
    message = str(e.value)
    assert message.startswith("  - serving.proxy.router.extra_flags=") and f"vllm-router (the pinned wheel) refuses it at start: {rule}. Fix: " in message, message
