"""The pinned router's own rules for its values, beyond its command-line parser, checked at plan time.

vllm-router 0.1.17 parses its command line in Python (router_args.py: router_cli checks that),
then hands the values to its Rust core, which refuses some at start: a field out of range
("Configuration validation failed: Invalid value for field 'retry.jitter_factor': 1.5 - Must be
between 0.0 and 1.0"), or a number that does not fit the Rust field's integer type ("number too
large to fit in target type"). A router that refuses its values exits, and systemd starts it
again, on every router node: the fleet has no endpoint. So plan refuses them first.

The table is typed out from the wheel's messages; tests/node_render/test_router_rules.py runs the
pinned wheel over every numeric flag of its parser (each at -1, 0, 1, at the edges of 8, 16, 32
and 64 bits, and for fractions at -0.5, 0.5, 1, 1.5, NaN and infinity) and holds this table to
what it refuses. Values the spec models have their own bounds, inside these (the same test
starts the wheel with every modeled field at its spec minimum and at its maximum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

U32 = 2**32 - 1
U64 = 2**64 - 1


@dataclass(frozen=True)
class Rule:
    """One flag's rule: its lowest and highest accepted value, and the router's words for it."""

    flag: str
    low: float
    high: float
    says: str


def _int(flag: str, low: int, high: int, says: str = "") -> Rule:
    bits = "a 32-bit unsigned number" if high == U32 else "a 64-bit unsigned number" if high == U64 else f"at most {high}"
    return Rule(flag, low, high, says or (f"must be {bits}" if low == 0 else f"must be >= {low} and {bits}"))


INT_RULES = (
    _int("--worker-startup-timeout-secs", 1, U64),
    _int("--worker-startup-check-interval", 1, U64),
    _int("--balance-abs-threshold", 0, U64),
    _int("--eviction-interval-secs", 1, U64),
    _int("--max-tree-size", 1, U64),
    _int("--max-payload-size", 1, U64),
    _int("--intra-node-data-parallel-size", 0, U64),
    _int("--request-timeout-secs", 1, U64),
    _int("--retry-max-retries", 1, U32, "must be >= 1 (set to 1 to effectively disable retries) and a 32-bit unsigned number"),
    _int("--retry-initial-backoff-ms", 1, U64),
    _int("--retry-max-backoff-ms", 0, U64),
    _int("--cb-failure-threshold", 1, U32, "must be >= 1 (set to u32::MAX to effectively disable CB) and a 32-bit unsigned number"),
    _int("--cb-success-threshold", 1, U32),
    _int("--cb-timeout-duration-secs", 1, U64),
    _int("--cb-window-duration-secs", 1, U64),
    _int("--health-failure-threshold", 0, U32),
    _int("--health-success-threshold", 0, U32),
    _int("--health-check-timeout-secs", 0, U64),
    _int("--health-check-interval-secs", 0, U64),
    _int("--max-concurrent-requests", 0, U64),
    _int("--queue-size", 0, U64),
    _int("--queue-timeout-secs", 0, U64),
    _int("--rate-limit-tokens-per-second", 0, U64),
    _int("--kv-event-block-size", 0, U32),
    _int("--service-discovery-port", 0, 65535),
    _int("--port", 0, 65535),
    _int("--prometheus-port", 0, 65535),
    _int("--kv-aware-session-affinity-ttl-secs", 1, 31_536_000, "must be between 1 and 31536000"),
)
# Fractions: the router compares them (NaN passes some of its comparisons); plan takes only finite numbers.
FLOAT_RULES = (
    Rule("--cache-threshold", 0.0, 1.0, "must be between 0.0 and 1.0"),
    Rule("--balance-rel-threshold", 1.0, math.inf, "must be >= 1.0"),
    Rule("--retry-backoff-multiplier", 1.0, math.inf, "must be >= 1.0"),
    Rule("--retry-jitter-factor", 0.0, 1.0, "must be between 0.0 and 1.0"),
)
RULES = {r.flag: r for r in INT_RULES + FLOAT_RULES}


def refusal(flag: str, value: object, *, float_flag: bool, values: dict[str, object]) -> str | None:
    """Why the pinned router refuses `value` for `flag` (None: it takes it). `values` holds the
    whole command line's values by flag, for the rules that compare two flags."""
    if value is None:
        return None
    if float_flag and isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    rule = RULES.get(flag)
    if rule is not None and isinstance(value, int | float) and not rule.low <= value <= rule.high:
        return rule.says
    if flag == "--retry-max-backoff-ms":
        initial = values.get("--retry-initial-backoff-ms")
        if isinstance(value, int) and isinstance(initial, int) and value < initial:
            return f"must be >= --retry-initial-backoff-ms ({initial})"
    return None
