"""Fixtures of the VM scenarios: the cached guest image, the accelerator, the booted cluster.

Every test here carries the `vm` mark: `make test` leaves them out, `make test-vm` runs them.
A machine that cannot run them (not root, a tool missing, neither KVM nor TCG boots the guest)
fails them with the reason: a scenario that did not run never passes, so CI cannot turn green
without booting the nodes (.ci/run also checks that every collected scenario passed).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vm import image as vm_image
from tests.vm import profile
from tests.vm.cluster import VmCluster
from tests.vm.machine import accelerator


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vm)


@pytest.fixture(scope="session")
def guest_image() -> vm_image.Image:
    if os.geteuid() != 0:
        pytest.fail("VM scenarios need root (mmdebstrap --mode=root builds the guest image)", pytrace=False)
    missing = vm_image.missing_tools()
    if missing:
        pytest.fail(f"VM scenarios need these Debian packages: {', '.join(missing)} (`make test-vm` installs them)", pytrace=False)
    return vm_image.build()


@pytest.fixture(scope="session")
def accel(guest_image: vm_image.Image) -> str:
    """KVM when it runs the guest kernel, else TCG software emulation (slower, always there)."""
    found = accelerator(guest_image)
    if found is None:
        pytest.fail("QEMU can start the guest kernel with neither KVM nor TCG on this machine", pytrace=False)
    return found


@pytest.fixture(scope="module")
def cluster(guest_image: vm_image.Image, accel: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VmCluster]:
    c = VmCluster(tmp_path_factory.mktemp("vm-cluster"), guest_image, accel)
    try:
        yield c
    finally:
        c.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """On a failure, attach each guest's console tail and its project units' journal."""
    outcome = yield
    report = outcome.get_result()
    cluster = item.funcargs.get("cluster") if hasattr(item, "funcargs") else None
    if report.when == "call" and isinstance(cluster, VmCluster):
        # What the scenario cost each guest, by unit (the profile's guest CPU).
        for vm in cluster.running():
            try:
                r = vm.ssh(profile.CPU_READ, check=False, timeout=60) if vm.proc is not None and vm.proc.poll() is None else None
            except subprocess.TimeoutExpired:
                r = None
            if r is not None and r.returncode == 0:
                profile.record_guest_cpu(item.name, vm.name, r.stdout)
    if report.when == "call" and report.failed and isinstance(cluster, VmCluster):
        for vm in cluster.running():
            journal = ""
            if vm.proc is not None and vm.proc.poll() is None:
                # The report of a failure must not fail itself: a guest too busy to answer within
                # two minutes says so instead of its journal (pytest would end in INTERNALERROR).
                try:
                    journal = vm.ssh("journalctl -b -o short-monotonic --no-pager -u 'gptoss-*' | tail -n 80", check=False, timeout=120).stdout
                except subprocess.TimeoutExpired:
                    journal = "(the guest did not answer journalctl within 120 s)"
            report.sections.append((f"{vm.name} console", vm.console()[-3000:]))
            report.sections.append((f"{vm.name} journal (gptoss-*)", journal))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Time each scenario whole (setup, which boots the cluster for the first, call and teardown) and name it for the profile.
    Only the VM scenarios: this hook sees every test of a session (`make test` wrote its own 1,100 rows over the VM
    suite's profile, from each worker)."""
    if item.get_closest_marker("vm") is None:
        yield
        return
    profile.current = item.name
    started = time.monotonic()
    yield
    profile.wall[item.name] = time.monotonic() - started


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The profile of every scenario run, printed and kept beside the report (docs/verification.md)."""
    if not profile.wall:
        return
    out = Path(os.environ.get("GPTOSS_VM_PROFILE", str(Path(session.config.rootpath) / ".make" / "vm-profile.json")))
    out.parent.mkdir(parents=True, exist_ok=True)
    text = profile.write(out)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("-", f"where the VM scenarios' time went (seconds/count of each kind; {out})")
        reporter.write_line(text)
