"""`gptoss plan` reads `-c` exactly as the pinned CDK CLI hands it to the app, or refuses it.

Each case runs the real CLI with the same `-c` strings and an app that records what
`cdk.App().node.get_all_context()` returned (what `app.py` validates), then validates that with
the project's loader and compares the verdict with plan's own reading of the strings. The
only allowed difference: plan refuses a value the CLI would change before the app sees it
(cut at a line break, a string without `=` dropped with a warning), so nothing plan accepted
reaches the template as another value.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster_ops import common
from clusterspec.errors import SpecError
from clusterspec.loading import load_config
from tests.conftest import CDK, ROOT, cli_env

# The app the CLI starts: the CDK's own App reading the context, written where the test says.
RECORDER = (
    f"{sys.executable} -c \"import json, os, aws_cdk; "
    "json.dump(aws_cdk.App().node.get_all_context(), open(os.environ['GPTOSS_CONTEXT_OUT'], 'w'))\""
)

CASES: list[tuple[str, list[str]]] = [
    ("plain", ["decode_instances=2"]),
    ("last one wins", ["decode_instances=1", "decode_instances=2"]),
    ("equals in the value", ["cluster_name=a=b"]),
    ("dotted key", ["network.egress=none"]),
    ("json value", ['serving={"proxy": {"kind": "toy"}}']),
    ("empty value", ["decode_instances="]),
    ("empty key", ["=2"]),
    ("space before the key", [" decode_instances=2"]),
    ("space in the value", ["decode_instances= 2"]),
    ("non-ascii", ["cluster_name=caf\u00e9"]),
    ("line break", ["proxy_ingress_cidr=10.0.0.0/8\n0.0.0.0/0"]),
    ("carriage return", ["decode_instances=2\r"]),
    ("line separator", ["cluster_name=gptoss\u2028prod"]),
    ("no equals sign", ["decode_instances"]),
    ("reserved prefix", ["aws:cdk:enable-path-metadata=false"]),
]


def verdict(context: dict[str, Any]) -> tuple[str, str]:
    try:
        cfg = load_config(context)
    except SpecError as e:
        return ("refused", str(e))
    return ("accepted", cfg.model_dump_json())


def what_the_app_gets(tmp_path: Path, items: list[str]) -> tuple[dict[str, Any] | None, str]:
    """The context the CLI handed to the app (None if the CLI refused before starting it), and its output."""
    out = tmp_path / "context.json"
    args = [str(CDK), "synth", "--no-notices", "--app", RECORDER, "-o", str(tmp_path / "cdk.out")]
    for item in items:
        args += ["-c", item]
    r = subprocess.run(args, cwd=ROOT, env=cli_env(GPTOSS_CONTEXT_OUT=str(out)), capture_output=True, text=True, timeout=120)
    got = json.loads(out.read_text()) if out.exists() else None
    return got, r.stdout + r.stderr


@pytest.mark.parametrize(("case", "items"), CASES, ids=[c[0] for c in CASES])
def test_plan_and_the_cdk_cli_read_the_same_context(tmp_path: Path, case: str, items: list[str], monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)  # no cdk.context.json of the checkout on either side
    monkeypatch.setattr(common, "checkout", lambda: tmp_path)
    try:
        plan: tuple[str, str] = verdict(common.context(items))
    except SpecError as e:
        plan = ("refused", str(e))
    app_context, output = what_the_app_gets(tmp_path, items)
    if app_context is None:
        # The CLI refused before the app ran: plan must refuse too.
        assert plan[0] == "refused", f"{case}: the CLI refused ({output.strip()[-300:]}) but plan accepted"
        return
    synth = verdict(app_context)
    if plan == synth:
        return
    # The one allowed difference: plan refused a value the CLI changed on its way to the app.
    assert plan[0] == "refused", f"{case}: plan accepted\n{plan[1][:300]}\nbut the app would see\n{synth[1][:300]}"
    raw = dict(item.partition("=")[::2] for item in items if "=" in item)
    changed = {k: v for k, v in raw.items() if app_context.get(k) != v}
    dropped = [item for item in items if "=" not in item]
    assert changed or dropped, f"{case}: plan refused ({plan[1]}) what the app accepts unchanged"
    assert "line break" in plan[1] or "KEY=VALUE" in plan[1], plan[1]


def test_the_recorder_sees_what_the_cli_was_given(tmp_path: Path) -> None:
    """The harness itself: a value reaches the recording app intact (else every case above is vacuous)."""
    got, output = what_the_app_gets(tmp_path, ["cluster_name=probe-1", "network.egress=none"])
    assert got is not None, output
    assert (got.get("cluster_name"), got.get("network.egress")) == ("probe-1", "none"), got


def test_the_cli_cuts_a_value_at_its_first_line_break(tmp_path: Path) -> None:
    """Why plan refuses a line break: what the CLI hands on is only the first line."""
    got, output = what_the_app_gets(tmp_path, ["proxy_ingress_cidr=10.0.0.0/8\n0.0.0.0/0"])
    assert got is not None, output
    assert got["proxy_ingress_cidr"] == "10.0.0.0/8"

