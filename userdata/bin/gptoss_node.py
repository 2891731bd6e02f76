#!/usr/bin/env python3
"""What the node's Python scripts share (gptoss-status, gptoss-signal, gptoss-group-health, gptoss-members;
imported from the folder they run in): one reading of an env file, one way to run a command, one probe of a
health route, and one reading of a unit's journal, so that the operator's `gptoss status` and the deploy gate
name the same line for the same failure.
A boot file (gptoss-status, which imports it, must work when the software's fetch does not).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import urllib.request
from pathlib import Path

JOURNALCTL = os.environ.get("GPTOSS_JOURNALCTL", "journalctl")
# Words of a line that explains a failure (the tools' own error lines and this project's).
ERROR_LINE = re.compile(
    r"\b(error|errors|fail(s|ed|ure)?|fatal|cannot|can't|could not|unable|no such|not found|denied|refused|timed out|"
    r"invalid|missing)\b",
    re.IGNORECASE,
)
# A boot step's own summary when its retries ran out ("...; giving up"): said beside the cause.
GAVE_UP = re.compile(r"^gptoss-[a-z-]+: .*giving up$")
# A step's progress between attempts ("attempt 1 failed; trying again"): never the cause.
PROGRESS = re.compile(r"^gptoss-[a-z-]+: .*(trying again|retrying|asking again|checking again)")


def run(*cmd: str, timeout: float = 20) -> str:
    """A command's output; empty when it cannot run or does not end in time (a report never fails on it)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def env_file(path: Path) -> dict[str, str]:
    """The settings of an env file the node's renderer wrote (NAME=value, each value shell-quoted); {} when it is missing."""
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k] = shlex.split(v)[0] if v else ""
    return out


def answers(url: str, timeout: float = 5) -> bool:
    """Whether a health route answers 2xx within TIMEOUT seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (OSError, ValueError):
        return False


def last_log(unit: str) -> str:
    """The line of this boot's journal that explains the unit's state.

    Its processes' own output (else systemd's words about it): the last line that reads as an
    error (a tool prints its usage text after the error), else the last line; when the
    step's retries ran out, its summary line (attempts, time) follows in brackets.
    """
    for args in ([f"_SYSTEMD_UNIT={unit}"], ["-u", unit]):
        lines = [x.strip() for x in run(JOURNALCTL, "-b", "-n", "60", "-o", "cat", "--no-pager", *args).splitlines() if x.strip()]
        if lines:
            break
    else:
        return ""
    own = [x for x in lines if not GAVE_UP.match(x) and not PROGRESS.match(x)] or lines
    cause = next((x for x in reversed(own) if ERROR_LINE.search(x)), own[-1])
    gave_up = next((x for x in reversed(lines) if GAVE_UP.match(x)), None)
    return (cause + (f" [{gave_up}]" if gave_up else ""))[-400:]
