"""CI cannot turn green without its VM scenarios: they fail (never skip) when they cannot run, and
.ci/run checks that every collected scenario passed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

CHECK = [sys.executable, str(ROOT / "scripts" / "check_junit.py")]


def _report(tmp_path: Path, **counts: int) -> Path:
    attrs = " ".join(f'{k}="{v}"' for k, v in ({"failures": 0, "errors": 0, "skipped": 0} | counts).items())
    p = tmp_path / "report.xml"
    p.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" {attrs}></testsuite></testsuites>')
    return p


@pytest.mark.parametrize(
    ("counts", "ok"),
    [
        ({"tests": 11}, True),
        ({"tests": 11, "skipped": 11}, False),  # every scenario skipped: what CI used to call green
        ({"tests": 11, "skipped": 1}, False),
        ({"tests": 11, "failures": 1}, False),
        ({"tests": 11, "errors": 1}, False),
        ({"tests": 3}, False),  # scenarios lost at collection
    ],
)
def test_ci_passes_only_when_every_collected_scenario_passed(tmp_path: Path, counts: dict[str, int], ok: bool) -> None:
    res = subprocess.run([*CHECK, str(_report(tmp_path, **counts)), "--expect-at-least", "11"], capture_output=True, text=True)
    assert (res.returncode == 0) == ok, res.stdout
    assert res.stdout.splitlines()[0].startswith("check_junit: ")


def test_ci_fails_on_a_missing_report(tmp_path: Path) -> None:
    res = subprocess.run([*CHECK, str(tmp_path / "none.xml")], capture_output=True, text=True)
    assert res.returncode == 1 and "cannot read" in res.stdout


def test_ci_runs_the_vm_scenarios_and_checks_their_count() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test\n" in ci and "make test-vm" in ci and "scripts/check_junit.py" in ci
    assert "pytest.skip" not in "".join(p.read_text() for p in (ROOT / "tests" / "vm").glob("*.py"))
    # Every scenario: none deselected, and the report must hold as many passes as there are scenarios.
    (line,) = [x for x in ci.splitlines() if x.startswith("make test-vm")]
    assert " -k" not in line and "-m " not in line, line
    scenarios = sum(p.read_text().count("\ndef test_") for p in (ROOT / "tests" / "vm").glob("test_*.py"))
    assert scenarios == 10 and f"--expect-at-least {scenarios}" in ci


def test_make_test_vm_without_root_exits_non_zero_with_one_line() -> None:
    # As root: make runs as an unprivileged user (util-linux's setpriv). As a developer who is not
    # root: make runs as that developer, who is unprivileged already.
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv, "util-linux's setpriv runs make as an unprivileged user"
        as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    else:
        as_nobody = []
    # A copy of the Makefile where an unprivileged user can read it (the clone may be under /root).
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        shutil.copy(ROOT / "Makefile", Path(d) / "Makefile")
        os.chmod(Path(d) / "Makefile", 0o644)
        res = subprocess.run([*as_nobody, "make", "-s", "-C", d, "test-vm"], capture_output=True, text=True, timeout=60)
    out = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode != 0
    assert out[0] == "make test-vm: the VM scenarios need root (the guest image is built with mmdebstrap --mode=root); run it as root"
    assert all(line.startswith("make") for line in out), out


GUARD = [sys.executable, str(ROOT / "scripts" / "cpu_guard.py")]


def test_make_test_prints_its_cpu_time_and_fails_past_the_ceiling() -> None:
    """The guard around pytest: a run within the target says so; one past the ceiling fails even though the
    command passed; a failing command keeps its own exit code. make test runs pytest through it."""
    spin = [sys.executable, "-c", "import time; t = time.process_time()\nwhile time.process_time() - t < 0.3: pass"]
    ok = subprocess.run([*GUARD, "--label", "make test", "--target", "60", "--fail-above", "120", "--", *spin], capture_output=True, text=True)
    assert ok.returncode == 0 and "make test: 0.3 s of CPU" in ok.stdout and "within the 60 s target" in ok.stdout, ok.stdout
    over = subprocess.run([*GUARD, "--label", "make test", "--target", "0.05", "--fail-above", "0.1", "--", *spin], capture_output=True, text=True)
    assert over.returncode == 1 and "FAILED, over the 0.1 s ceiling" in over.stdout, over.stdout
    failing = subprocess.run([*GUARD, "--target", "60", "--fail-above", "120", "--", sys.executable, "-c", "raise SystemExit(3)"],
                             capture_output=True, text=True)  # fmt: skip
    assert failing.returncode == 3
    recipe = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "scripts/cpu_guard.py --label \"make test\" --target 600 --fail-above" in recipe and "-m pytest" in recipe, recipe


def test_ci_prints_the_wall_time_of_each_part() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'part "make test (with set-up)"' in ci and 'part "make test-vm"' in ci and "all of .ci/run" in ci
