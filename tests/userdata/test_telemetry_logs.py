"""The journal's way to CloudWatch Logs under CloudWatch's own rules (botocore's model of
PutLogEvents): batches, throttling, refusals, the cursor."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import fake_command
from tests.userdata.test_telemetry import _collector

Shipped = Callable[[str], Path]


# ---- the journal's way to CloudWatch Logs, under CloudWatch's own rules --------------------------


@pytest.fixture
def logs_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A journal (journalctl honouring --after-cursor, refusing a cursor it does not know) and an
    `aws logs put-log-events` that enforces PutLogEvents' documented rules: a batch must be in
    time order and span at most 24 hours (else InvalidParameterException, the whole batch
    refused); a stream listed in `throttled` answers ThrottlingException."""
    journal, accepted, throttled = tmp_path / "journal.jsonl", tmp_path / "accepted.jsonl", tmp_path / "throttled"
    journal.write_text("")
    throttled.write_text("")
    fake_command(tmp_path, "journalctl", f"""exec {sys.executable} - "$@" <<'PY'
import json, sys
args = sys.argv[1:]
lines = open("{journal}").read().splitlines()
if "--after-cursor" in args:
    c = args[args.index("--after-cursor") + 1]
    cursors = [json.loads(x)["__CURSOR"] for x in lines]
    if c not in cursors:
        print("Failed to seek to cursor: Invalid argument", file=sys.stderr); sys.exit(1)
    lines = lines[cursors.index(c) + 1:]
open("{tmp_path}/journalctl.args", "a").write(" ".join(args) + "\\n")
print("\\n".join(lines))
PY
""")
    fake_command(tmp_path, "aws", f"""exec {sys.executable} - "$@" <<'PY'
import json, sys
args = sys.argv[1:]
if args[:2] != ["logs", "put-log-events"]:
    sys.exit(0)
stream = args[args.index("--log-stream-name") + 1]
events = json.load(open(args[args.index("--log-events") + 1].removeprefix("file://")))
if stream in open("{throttled}").read().split():
    print("An error occurred (ThrottlingException) when calling the PutLogEvents operation: Rate exceeded", file=sys.stderr); sys.exit(254)
ts = [e["timestamp"] for e in events]
if ts != sorted(ts) or ts[-1] - ts[0] > 24 * 3600 * 1000:
    print("An error occurred (InvalidParameterException) when calling the PutLogEvents operation: The batch of log events "
          "in a single PutLogEvents request cannot span more than 24 hours.", file=sys.stderr); sys.exit(254)
with open("{accepted}", "a") as f:
    for e in events:
        f.write(json.dumps([stream, e["message"]]) + "\\n")
PY
""")
    monkeypatch.setenv("GPTOSS_JOURNALCTL", str(tmp_path / "journalctl"))
    monkeypatch.setenv("GPTOSS_AWS", str(tmp_path / "aws"))
    monkeypatch.setenv("GPTOSS_STATE_DIR", str(tmp_path / "state"))
    cfg = {"region": "us-east-2", "node": "decode-0", "log_group": "/gptoss/c1", "units": ["gptoss-decode.service", "gptoss-stage.service"]}

    def write(entries: list[tuple[str, int, str]]) -> None:
        """(unit, seconds since 2023-11-14, message) in journal order."""
        with journal.open("a") as f:
            n = len(journal.read_text().splitlines())
            for i, (unit, s, msg) in enumerate(entries):
                f.write(json.dumps({"__CURSOR": f"c{n + i}", "_SYSTEMD_UNIT": unit, "__REALTIME_TIMESTAMP": str((1_700_000_000 + s) * 1_000_000),
                                    "MESSAGE": msg}) + "\n")  # fmt: skip

    def sent() -> list[tuple[str, str]]:
        return [tuple(json.loads(x)) for x in accepted.read_text().splitlines()] if accepted.exists() else []  # type: ignore[misc]

    return {"cfg": cfg, "write": write, "sent": sent, "throttled": throttled, "cursor": tmp_path / "state/telemetry.cursor",
            "args": tmp_path / "journalctl.args", "mod": _collector()}  # fmt: skip


def test_a_stop_of_more_than_a_day_is_shipped_in_batches_cloudwatch_takes_and_never_again(logs_node: dict[str, Any]) -> None:
    n, mod = logs_node, logs_node["mod"]
    day = 24 * 3600
    n["write"]([("gptoss-decode.service", 0, "stopping"), ("gptoss-decode.service", 2 * day, "started again")])
    mod.ship_logs(n["cfg"], set())
    assert n["sent"]() == [("decode-0/journal", "gptoss-decode.service: stopping"), ("decode-0/journal", "gptoss-decode.service: started again")]
    assert n["cursor"].read_text() == "c1" and not list(n["cursor"].parent.glob("*.tmp")), "written whole, by rename"
    mod.ship_logs(n["cfg"], {"decode-0/journal"})
    assert len(n["sent"]()) == 2, "nothing is sent twice"


def test_a_throttled_call_is_sent_again_and_nothing_is_duplicated(logs_node: dict[str, Any]) -> None:
    n, mod = logs_node, logs_node["mod"]
    day = 24 * 3600
    # Three lines of two units in two batches (a stop of more than a day between them) are taken; the next line's call is throttled.
    n["write"]([("gptoss-decode.service", 1, "d1"), ("gptoss-stage.service", 2, "s1"), ("gptoss-decode.service", 2 * day, "d2")])
    mod.ship_logs(n["cfg"], set())
    n["throttled"].write_text("decode-0/journal")
    n["write"]([("gptoss-stage.service", 2 * day + 1, "s2")])
    mod.ship_logs(n["cfg"], {"decode-0/journal"})
    assert n["cursor"].read_text() == "c2", "up to the first event that must be sent again"
    n["throttled"].write_text("")
    mod.ship_logs(n["cfg"], {"decode-0/journal"})
    assert n["sent"]() == [("decode-0/journal", m) for m in ("gptoss-decode.service: d1", "gptoss-stage.service: s1", "gptoss-decode.service: d2",
                                                               "gptoss-stage.service: s2")]  # fmt: skip
    assert n["cursor"].read_text() == "c3"


def test_a_batch_refused_for_good_is_dropped_and_said_not_re_sent_every_minute(logs_node: dict[str, Any], capsys: Any) -> None:
    n, mod = logs_node, logs_node["mod"]
    # Out of time order within a unit (a clock step): the documented rule refuses the batch whole.
    n["write"]([("gptoss-decode.service", 100, "late"), ("gptoss-decode.service", 50, "early")])
    mod.ship_logs(n["cfg"], set())
    assert n["sent"]() == [] and n["cursor"].read_text() == "c1"
    assert "dropped 2 events: An error occurred (InvalidParameterException)" in capsys.readouterr().out


def test_an_unusable_cursor_falls_back_to_the_last_ten_minutes(logs_node: dict[str, Any], capsys: Any) -> None:
    n, mod = logs_node, logs_node["mod"]
    n["write"]([("gptoss-decode.service", 1, "d1")])
    n["cursor"].parent.mkdir(parents=True)
    n["cursor"].write_text("s=not-a-cursor-journald-knows")
    mod.ship_logs(n["cfg"], set())
    assert "--since -10min" in n["args"].read_text().splitlines()[-1]
    assert "the saved journal cursor is not usable" in capsys.readouterr().out
    assert n["sent"]() == [("decode-0/journal", "gptoss-decode.service: d1")] and n["cursor"].read_text() == "c0"


@pytest.mark.parametrize(
    ("state", "sub", "restarts", "failing"),
    [
        ("active", "running", 0, False),  # downloading
        ("activating", "auto-restart", 1, True),  # failed, waiting RestartSec
        ("activating", "start-pre", 2, True),  # in gptoss-backoff before its next attempt
        ("activating", "start-pre", 0, False),  # a first start
        ("failed", "failed", 3, True),
        ("inactive", "dead", 0, False),
    ],
)
def test_staging_failing_and_status_retrying_agree(state: str, sub: str, restarts: int, failing: bool) -> None:
    """The StagingFailing alarm counts every state staging retries from; `gptoss status` says 'retrying' for the same ones."""
    from cluster_ops.status import UnitStatus

    st = {"ActiveState": state, "SubState": sub, "NRestarts": str(restarts)}
    assert (state == "failed" or _collector().retrying(st)) is failing
    problem = UnitStatus(node="n", unit="gptoss-stage.service", state=state, healthy=None, needs_health=False, sub=sub, restarts=restarts).problem
    assert problem.startswith("retrying") is (failing and state != "failed")
