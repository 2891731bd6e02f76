"""A transient hiccup at boot never fails the node; a lasting one reaches the gate by name.

The NVMe step runs for real against injected disk tools that behave like the kernel and udev
do under load: the array's kernel device (/dev/mdN) comes first, its /dev/md/<name> link later
(or never). Then every boot unit is started the way systemd starts it (its rendered ExecStart,
Environment and Restart=), with a failure injected once (it must end in success and the deploy
gate must send nothing but SUCCESS) or for good (the gate's FAILURE must name the unit and the
line that explains it), while the real gptoss-signal watches the unit's state and journal.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterspec.loading import load_config
from clusterspec.sections.boot import BootConfig
from node_render.paths import BIN, UNIT_DIR
from node_render.render import render_node
from node_render.userdata import bundle
from tests.conftest import fake_command
from tests.userdata.test_node_scripts import imds  # noqa: F401 - the IMDS fake, reused
from tests.userdata.test_staging import artifacts_env  # noqa: F401 - the staging node, reused

Shipped = Callable[[str], Path]
MKFS_USAGE = (
    "Usage: mkfs.xfs\n/* blocksize */\t\t[-b size=num]\n/* force overwrite */\t[-f]\n"
    "<devicename> is required unless -d name=xxx is given.\n<value> is xxx (512 byte blocks).\n"
)


# ---- gptoss-stage-nvme: the kernel's device, never the lagging link ------------------------------


@pytest.fixture
def nvme(tmp_path: Path, shipped: Shipped) -> dict[str, Any]:
    """Disk tools as the kernel and udev behave: `mdadm --create` returns, the kernel's /dev/md127
    shows in sysfs (lsblk) after KERNEL_DELAY, the /dev/md/gptoss-nvme link after LINK_DELAY."""
    state, fakes = tmp_path / "state", tmp_path / "fakes"
    state.mkdir()
    log = state / "calls.log"
    md = state / "md127"
    disks = [state / f"nvme{i}n1" for i in (1, 2)]
    for d in disks:
        d.write_bytes(b"\0" * 4096)
    (state / "lsblk.out").write_text("/dev/nvme0n1 Amazon Elastic Block Store\n" + "".join(f"{d} Amazon EC2 NVMe Instance Storage\n" for d in disks))
    (state / "kernel_delay").write_text("1")
    (state / "link_delay").write_text("30")
    # `lsblk -dpno NAME,MODEL`: the disks; `lsblk -nrpo NAME,TYPE DISK`: the disk and the array the kernel runs on it.
    fake_command(fakes, "lsblk", f'if [ "$1" = -nrpo ]; then echo "$3 disk"; [ -f "{state}/kernel-md" ] && cat "{state}/kernel-md"; exit 0; fi\ncat "{state}/lsblk.out"\n')
    fake_command(fakes, "mountpoint", f'[ -f "{state}/mounted" ]\n')
    fake_command(fakes, "mount", f'echo "mount $*" >>"{log}"; touch "{state}/mounted"\n')
    fake_command(
        fakes, "mdadm",
        f'echo "mdadm $*" >>"{log}"\n'
        f'if [ "$1" = --create ]; then\n'
        f'  (sleep "$(cat {state}/kernel_delay)"; head -c 4096 /dev/zero >"{md}"; echo "{md} raid0" >"{state}/kernel-md") >/dev/null 2>&1 &\n'
        f'  (sleep "$(cat {state}/link_delay)"; mkdir -p "$(dirname "$2")"; ln -sf "{md}" "$2") >/dev/null 2>&1 &\n'
        f'  echo "mdadm: timeout waiting for $2" >&2; echo "mdadm: array $2 started." >&2\n'
        f"fi\n",
    )  # fmt: skip
    # mkfs.xfs as the real one fails: the error, then its usage text. `mkfs_fail` counts failures to inject.
    fake_command(
        fakes, "mkfs.xfs",
        f'echo "mkfs $*" >>"{log}"\ndev=${{*: -1}}\nn=$(cat "{state}/mkfs_fail" 2>/dev/null || echo 0)\n'
        f'if [ ! -e "$dev" ] || [ "$n" -gt 0 ]; then echo $((n - 1)) >"{state}/mkfs_fail"\n'
        f'  if [ -e "$dev" ]; then why="Input/output error"; else why="No such file or directory"; fi\n'
        f'  echo "Error accessing specified device $dev: $why" >&2; printf %s "{MKFS_USAGE}" >&2; exit 1; fi\n'
        f'echo xfs >"{state}/fs-$(basename "$dev")"\n',
    )  # fmt: skip
    fake_command(
        fakes, "blkid",
        f'[ -f "{state}/blkid_rc" ] && exit "$(cat {state}/blkid_rc)"\n'
        f'f="{state}/fs-$(basename "${{*: -1}}")"; [ -f "$f" ] || exit 2; cat "$f"\n',
    )  # fmt: skip
    cluster_env = tmp_path / "cluster.env"
    cluster_env.write_text(f"GPTOSS_NVME_MOUNT={tmp_path}/nvme\n")
    env = {
        **os.environ,
        "GPTOSS_CLUSTER_ENV": str(cluster_env),
        "GPTOSS_RUN_DIR": str(tmp_path / "run"),
        "GPTOSS_NVME_ARRAY": str(state / "md" / "gptoss-nvme"),
        "GPTOSS_NVME_DEVICE_WAIT_S": "10",
        **{f"GPTOSS_{k}": str(fakes / v) for k, v in
           {"LSBLK": "lsblk", "MOUNTPOINT": "mountpoint", "MOUNT": "mount", "MDADM": "mdadm", "MKFS": "mkfs.xfs",
            "BLKID": "blkid"}.items()},
    }  # fmt: skip
    return {"env": env, "state": state, "md": md, "disks": disks, "mount": tmp_path / "nvme", "log": log, "script": shipped("gptoss-stage-nvme")}


def _nvme(n: dict[str, Any], argv: list[str] | None = None) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    res = subprocess.run(argv or [str(n["script"])], env=n["env"], capture_output=True, text=True, timeout=60)
    return res, n["log"].read_text().splitlines() if n["log"].exists() else []


def _reboot(n: dict[str, Any]) -> None:
    """The array and its file system survive; the mount, /run and the call log do not."""
    (n["state"] / "mounted").unlink(missing_ok=True)
    subprocess.run(["rm", "-rf", n["env"]["GPTOSS_RUN_DIR"]], check=True)
    n["log"].write_text("")


def test_nvme_formats_the_device_the_kernel_made_while_its_udev_link_lags(nvme: dict[str, Any]) -> None:
    res, calls = _nvme(nvme)
    assert res.returncode == 0, res.stderr
    md, mount, array = nvme["md"], nvme["mount"], nvme["env"]["GPTOSS_NVME_ARRAY"]
    assert calls == [
        "mdadm --assemble --scan",
        f"mdadm --create {array} --run --level=0 --raid-devices=2 {' '.join(map(str, nvme['disks']))}",
        f"mkfs -f {md}",
        f"mount -o noatime {md} {mount}",
    ]
    assert f"the kernel made {md}" in res.stdout and f"mounted {md} at {mount}" in res.stdout
    # It waited for the kernel's device (1 s), not for the link: the fake makes the link 30 s after
    # the array, and it is still not there when the step is done (no clock of ours is read).
    assert not os.path.lexists(array)
    res, again = _nvme(nvme)
    assert res.returncode == 0 and again == calls and "already mounted; reusing it" in res.stdout


def test_nvme_retried_after_a_failed_mkfs_formats_the_array_this_boot_created(nvme: dict[str, Any], shipped: Shipped) -> None:
    (nvme["state"] / "mkfs_fail").write_text("1")
    argv = [str(shipped("gptoss-retry")), "5", "600", "--", str(nvme["script"])]
    res, calls = _nvme({**nvme, "env": nvme["env"] | {"GPTOSS_SLEEP": "true"}}, argv)
    assert res.returncode == 0, res.stderr
    assert [c.split()[0:2] for c in calls].count(["mdadm", "--create"]) == 1, "the array is created once"
    assert [c for c in calls if c.startswith("mkfs")] == [f"mkfs -f {nvme['md']}"] * 2
    assert calls[-1] == f"mount -o noatime {nvme['md']} {nvme['mount']}"
    assert "attempt 1 of 5 failed (exit 1); trying again in 2s" in res.stdout and "succeeded at attempt 2 of 5" in res.stdout


def test_nvme_after_a_reboot_mounts_the_array_the_kernel_assembled_without_formatting(nvme: dict[str, Any]) -> None:
    assert _nvme(nvme)[0].returncode == 0
    _reboot(nvme)
    res, calls = _nvme(nvme)
    assert res.returncode == 0, res.stderr
    assert calls == [f"mount -o noatime {nvme['md']} {nvme['mount']}"]


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("probe", "blkid -p could not probe {md} (exit 8): not formatting it"),
        ("foreign", "{md} holds a ext4 file system, not XFS: it is left as it is"),
        ("left blank", "{md} holds no file system and was not created by this boot"),
    ],
)
def test_nvme_never_formats_an_array_this_boot_did_not_create_blank(nvme: dict[str, Any], fault: str, message: str) -> None:
    """At a reboot the array and the model on it survive: a probe error, another file system, or an
    array an earlier boot left without one is reported, never formatted."""
    assert _nvme(nvme)[0].returncode == 0
    _reboot(nvme)
    fs = nvme["state"] / "fs-md127"
    if fault == "probe":
        (nvme["state"] / "blkid_rc").write_text("8")
    elif fault == "foreign":
        fs.write_text("ext4")
    else:
        fs.unlink()
    res, calls = _nvme(nvme)
    assert res.returncode == 1
    assert f"gptoss-stage-nvme: error: {message.format(md=nvme['md'])}" in res.stderr
    assert not [c for c in calls if c.startswith(("mkfs", "mount", "mdadm --create"))]


def test_nvme_does_not_format_a_device_it_cannot_read(nvme: dict[str, Any]) -> None:
    nvme["md"].mkdir()  # reads fail (EISDIR) where a dying disk would fail with EIO
    (nvme["state"] / "kernel-md").write_text(f"{nvme['md']} raid0\n")
    res, calls = _nvme(nvme)
    assert res.returncode == 1 and f"{nvme['md']} cannot be read: not formatting it" in res.stderr
    assert not [c for c in calls if c.startswith("mkfs")]


def test_nvme_gives_up_naming_the_array_when_the_kernel_never_shows_it(nvme: dict[str, Any]) -> None:
    (nvme["state"] / "kernel_delay").write_text("30")
    res, calls = _nvme({**nvme, "env": nvme["env"] | {"GPTOSS_NVME_DEVICE_WAIT_S": "2"}})
    assert res.returncode == 1
    assert f"the kernel shows no array on {nvme['disks'][0]} after 2s" in res.stderr
    assert not [c for c in calls if c.startswith("mkfs")]


def test_nvme_single_disk_is_formatted_blank_and_mounted_as_it_is_after_a_reboot(nvme: dict[str, Any]) -> None:
    disk = nvme["disks"][0]
    (nvme["state"] / "lsblk.out").write_text(f"/dev/nvme0n1 Amazon Elastic Block Store\n{disk} Amazon EC2 NVMe Instance Storage\n")
    res, calls = _nvme(nvme)
    assert res.returncode == 0, res.stderr
    assert calls == [f"mkfs -f {disk}", f"mount -o noatime {disk} {nvme['mount']}"]
    _reboot(nvme)
    assert _nvme(nvme)[1] == [f"mount -o noatime {disk} {nvme['mount']}"]


def test_nvme_without_instance_store_falls_back_to_the_root_volume(nvme: dict[str, Any]) -> None:
    (nvme["state"] / "lsblk.out").write_text("/dev/nvme0n1 Amazon Elastic Block Store\n")
    res, calls = _nvme(nvme)
    assert res.returncode == 0 and calls == []
    assert "no instance-store NVMe disk found" in res.stdout and "root volume" in res.stdout


# ---- gptoss-retry --------------------------------------------------------------------------------


@pytest.fixture
def retry(tmp_path: Path, shipped: Shipped) -> Callable[..., tuple[subprocess.CompletedProcess[str], list[str]]]:
    """gptoss-retry over a command that fails FAILS times (exit 3) then succeeds; returns the pauses."""
    slept = tmp_path / "slept"
    sleeper = fake_command(tmp_path, "sleep", f'echo "$1" >>"{slept}"\n')
    cmd = fake_command(
        tmp_path, "flaky", f'n=$(cat "{tmp_path}/left"); echo $((n - 1)) >"{tmp_path}/left"\n[ "$n" -le 0 ] || {{ echo "flaky: error: not yet" >&2; exit 3; }}\n'
    )

    def run(fails: int, attempts: int = 5, budget: int = 600, real_sleep: bool = False) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        (tmp_path / "left").write_text(str(fails))
        slept.unlink(missing_ok=True)
        env = os.environ | ({} if real_sleep else {"GPTOSS_SLEEP": str(sleeper)})
        res = subprocess.run([str(shipped("gptoss-retry")), str(attempts), str(budget), "--", str(cmd)], env=env, capture_output=True, text=True, timeout=60)
        return res, slept.read_text().split() if slept.exists() else []

    return run


def test_retry_pauses_longer_each_time_and_succeeds_when_the_command_does(retry: Any) -> None:
    res, pauses = retry(fails=2)
    assert res.returncode == 0 and pauses == ["2", "4"]
    assert res.stdout.splitlines() == [
        "gptoss-retry: flaky attempt 1 of 5 failed (exit 3); trying again in 2s",
        "gptoss-retry: flaky attempt 2 of 5 failed (exit 3); trying again in 4s",
        "gptoss-retry: flaky succeeded at attempt 3 of 5",
    ]


def test_retry_gives_up_after_its_attempts_with_the_commands_status(retry: Any) -> None:
    res, pauses = retry(fails=100, attempts=6)
    assert res.returncode == 3 and pauses == ["2", "4", "8", "16", "30"]
    assert res.stderr.splitlines()[-1].startswith("gptoss-retry: flaky failed 6 of 6 attempts in ")
    assert res.stderr.splitlines()[-1].endswith("s (exit 3); giving up")


def test_retry_starts_no_attempt_past_its_budget(retry: Any) -> None:
    res, _ = retry(fails=100, attempts=20, budget=5, real_sleep=True)
    # Attempt 1, a 2 s pause, attempt 2; a 4 s pause would end past the 5 s budget: not taken.
    # bash's SECONDS counts whole seconds and can tick during attempt 1, so the budget leaves a
    # second of slack either way (a budget of 3 gave up after attempt 1 on a loaded CI machine).
    assert res.returncode == 3 and "failed 2 of 20 attempts" in res.stderr
    assert "trying again in 2s" in res.stdout and "trying again in 4s" not in res.stdout, res.stdout


def test_a_first_success_prints_nothing(retry: Any) -> None:
    res, pauses = retry(fails=0)
    assert (res.returncode, res.stdout, res.stderr, pauses) == (0, "", "", [])


# ---- every boot unit as systemd runs it, watched by the deploy gate -------------------------------


BOOT_UNITS = ("gptoss-scripts.service", "gptoss-identity.service", "gptoss-nvme.service", "gptoss-node-check.service", "gptoss-stage.service")


def _rendered_unit(name: str) -> dict[str, Any]:
    """ExecStart, Environment= and Restart= of a boot unit as the default layout's prefill-0 gets it."""
    cfg = load_config({})
    layout = cfg.layout
    render = render_node(cfg, layout, layout.nodes[0])
    unit: dict[str, Any] = {"env": {}, "restart": "no"}
    for line in render.files[f"{UNIT_DIR}/{name}"][0].splitlines():
        key, _, value = line.partition("=")
        if key == "Environment":
            k, _, v = value.partition("=")
            unit["env"][k] = v
        elif key == "ExecStart":
            unit["argv"] = shlex.split(value)
        elif key == "Restart":
            unit["restart"] = value
    return unit


class _Handle(http.server.BaseHTTPRequestHandler):
    puts: list[dict[str, Any]]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_PUT(self) -> None:
        self.puts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def handle() -> Iterator[type[_Handle]]:
    h = type("H", (_Handle,), {"puts": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), h)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    h.url = f"http://127.0.0.1:{server.server_address[1]}/handle?X-Amz-Signature=abc"  # type: ignore[attr-defined]
    yield h
    server.shutdown()


def _boot_unit(tmp_path: Path, shipped: Shipped, handle: Any, unit: str, env: dict[str, str]) -> dict[str, Any]:
    """Start `unit` as systemd would (restarting it while Restart=on-failure says so, as far as
    the gate's budget goes), with the real gptoss-signal watching its state and journal."""
    spec = _rendered_unit(unit)
    shipped_dir = shipped("gptoss-retry").parent
    for name in ("gptoss-stage-nvme", "gptoss-fetch-scripts", "gptoss-bootstrap", "gptoss-identity", "gptoss-node-check", "gptoss-stage-artifacts", "gptoss-checkpoint",
                 "gptoss-gate-failure", "gptoss-cache-manifest"):
        shipped(name)
    argv = [a.replace(BIN, str(shipped_dir)) for a in spec["argv"]]
    sysd = tmp_path / "systemd"
    sysd.mkdir()
    states, journal = sysd / "states.json", sysd / "journal.log"
    journal.touch()
    fake_command(sysd, "systemctl", f'python3 -c \'import json,sys; s=json.load(open("{states}")); print("\\n\\n".join(s.get(u, "") for u in sys.argv[1:] if u.endswith((".service", ".timer", ".target"))))\' "$@"\n')
    fake_command(sysd, "journalctl", f'tail -n 60 "{journal}"\n')
    etc = sysd / "etc"
    etc.mkdir()
    (etc / "health").write_text(f"{unit} - -\n")
    (etc / "signal.env").write_text(f"GPTOSS_SIGNAL_URL={handle.url}\n")
    cluster = render_node(load_config({}), load_config({}).layout, load_config({}).layout.nodes[0]).files["/etc/gptoss/cluster.env"][0]
    keep = ("GPTOSS_NODE=", "GPTOSS_READY_TIMEOUT_S=", "GPTOSS_SIGNAL_MARGIN_S=", "GPTOSS_STAGE_ATTEMPTS=")
    (etc / "cluster.env").write_text("".join(line + "\n" for line in cluster.splitlines() if line.startswith(keep)))

    def state(active: str, sub: str, restarts: int) -> None:
        states.write_text(json.dumps({unit: f"ActiveState={active}\nSubState={sub}\nNRestarts={restarts}"}))

    state("activating", "start", 0)
    # The instance booted just now (its kernel's btime): the gate's clock starts here, not at the test machine's own boot.
    (sysd / "stat").write_text(f"cpu 0 0 0 0\nbtime {int(time.time())}\n")
    node_files = {"GPTOSS_ETC": str(etc), "GPTOSS_STATE_DIR": str(sysd / "state"), "GPTOSS_PROC_STAT": str(sysd / "stat")}  # the node's /etc/gptoss, /var/lib/gptoss, /proc/stat
    signal = subprocess.Popen(
        [sys.executable, str(shipped("gptoss-signal"))],
        env={**os.environ, **node_files, "GPTOSS_SYSTEMCTL": str(sysd / "systemctl"),
             "GPTOSS_JOURNALCTL": str(sysd / "journalctl"), "GPTOSS_SIGNAL_POLL_S": "0.1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    restarts = 0
    attempts = BootConfig().stage_attempts
    while True:
        run = subprocess.run(argv, env=os.environ | node_files | spec["env"] | env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=120)  # fmt: skip
        with journal.open("a") as j:
            j.write(run.stdout)
        if run.returncode == 0:
            state("active", "exited", restarts)
            break
        if spec["restart"] != "on-failure":
            state("failed", "failed", restarts)
            break
        restarts += 1
        state("activating", "auto-restart", restarts)
        if restarts >= attempts:
            break  # systemd would go on restarting; the gate's budget is spent: the signal decides now
        time.sleep(0.3)  # RestartSec, shortened
        if signal.poll() is not None:
            break
    out, _ = signal.communicate(timeout=60)
    return {"puts": handle.puts, "journal": journal.read_text(), "signal": out}


@pytest.fixture
def boot_env(tmp_path: Path, request: pytest.FixtureRequest) -> Callable[[str, bool], tuple[dict[str, str], str]]:
    """(environment, the line that explains a lasting failure) for each boot unit, with its fault
    injected once (transient) or for good. Budgets are shrunk to seconds where a unit waits."""

    def make(unit: str, lasting: bool) -> tuple[dict[str, str], str]:
        fakes = tmp_path / "fakes"
        left = tmp_path / "fail_left"
        left.write_text("1000" if lasting else "1")
        once = f'n=$(cat "{left}"); echo $((n - 1)) >"{left}"; if [ "$n" -gt 0 ]; then'
        if unit == "gptoss-scripts.service":
            root = tmp_path / "root"
            (root / "etc/gptoss").mkdir(parents=True)
            asset = tmp_path / "asset.xz"
            asset.write_bytes(bundle({"/opt/gptoss/bin/gptoss-exec": ("#!/bin/sh\n", 0o755),
                                      "/nodes/prefill-0/etc/gptoss/manifest": ("/opt/gptoss/bin/gptoss-exec\n/etc/gptoss/manifest\n", 0o644),
                                      "/nodes/prefill-0/etc/gptoss/units": ("", 0o644)}))  # fmt: skip
            error = "An error occurred (SlowDown) when calling the GetObject operation: Please reduce your request rate."
            version = f"s3://bucket/asset.xz {hashlib.sha256(asset.read_bytes()).hexdigest()}"
            fake_command(fakes, "aws", f'if [ "$1" = ssm ]; then echo "{version}"; exit 0; fi\n{once} echo "{error}" >&2; exit 1; fi\ncp "{asset}" "${{*: -1}}"\n')
            # The user data's deploy.env: the node, and the parameter that names its software version.
            (root / "etc/gptoss/deploy.env").write_text("AWS_REGION=us-east-2\nGPTOSS_NODE=prefill-0\nGPTOSS_SOFTWARE_PARAMETER=/gptoss/c/software\n")
            return {"PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}", "GPTOSS_ROOT": str(root),
                    "GPTOSS_DEPLOY_ENV": str(root / "etc/gptoss/deploy.env"), "GPTOSS_SYSTEMCTL": "true", "GPTOSS_FETCH_TIMEOUT_S": "3"}, error  # fmt: skip
        if unit == "gptoss-identity.service":
            imds = request.getfixturevalue("imds")
            imds.fail_until = time.monotonic() + (3600 if lasting else 1.5)
            (tmp_path / "cluster.env").write_text("GPTOSS_NODE=prefill-0\nGPTOSS_SELF_HOST_VAR=GPTOSS_HOST_PREFILL_0\n")
            (tmp_path / "deploy.env").write_text("")
            return {"GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_DEPLOY_ENV": str(tmp_path / "deploy.env"),
                    "GPTOSS_RUN_DIR": str(tmp_path / "run"), "GPTOSS_IMDS_URL": imds.url, "GPTOSS_IMDS_TIMEOUT_S": "3"}, \
                "curl: (22) The requested URL returned error: 503"  # fmt: skip
        if unit == "gptoss-nvme.service":
            n = request.getfixturevalue("nvme")
            (n["state"] / "kernel_delay").write_text("0")
            (n["state"] / "mkfs_fail").write_text(left.read_text())
            return n["env"] | {"GPTOSS_SLEEP": "true"}, f"Error accessing specified device {n['md']}: Input/output error"
        if unit == "gptoss-node-check.service":
            dev = tmp_path / "dev"
            dev.mkdir()
            for i in range(15):
                (dev / f"neuron{i}").touch()
            if not lasting:  # the sixteenth device shows a second late
                threading.Timer(1.0, (dev / "neuron15").touch).start()
            (tmp_path / "cluster.env").write_text("GPTOSS_EXPECT_NEURON=16\nGPTOSS_EXPECT_EFA=0\n")
            return {"GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_DEV_DIR": str(dev), "GPTOSS_CHECK_TIMEOUT_S": "3",
                    "GPTOSS_POLL_S": "0.2", "GPTOSS_RUN_DIR": str(tmp_path / "run")}, f"gptoss-node-check: Neuron: 15 devices in {dev}, the instance table says 16 (neuron_devices)"  # fmt: skip
        env = request.getfixturevalue("artifacts_env")
        bindir = Path(env["PATH"].split(os.pathsep)[0])
        (bindir / "aws").rename(bindir / "aws.real")
        error = "fatal error: An error occurred (InternalError) when calling the ListObjectsV2 operation: We encountered an internal error."
        fake_command(bindir, "aws", f'if [ "$1 $2" = "s3 sync" ]; then {once} echo "{error}" >&2; exit 1; fi; fi\nexec "{bindir}/aws.real" "$@"\n')
        return env | {"GPTOSS_RETRIES": "1"}, error

    return make


@pytest.mark.parametrize("unit", BOOT_UNITS)
def test_a_boot_unit_that_fails_once_ends_in_success_and_the_gate_hears_only_success(
    unit: str, tmp_path: Path, shipped: Shipped, handle: Any, boot_env: Any
) -> None:
    env, _ = boot_env(unit, lasting=False)
    seen = _boot_unit(tmp_path, shipped, handle, unit, env)
    assert [p["Status"] for p in seen["puts"]] == ["SUCCESS"], seen
    assert seen["puts"][0]["Reason"] == "prefill-0: 1 units active and healthy"
    # It did fail once, and was tried again.
    assert any(w in seen["journal"] for w in ("trying again", "asking again", "checking again", "SlowDown", "InternalError")), seen["journal"]


@pytest.mark.parametrize("unit", BOOT_UNITS)
def test_a_boot_unit_that_keeps_failing_sends_failure_naming_it_and_its_error_line(
    unit: str, tmp_path: Path, shipped: Shipped, handle: Any, boot_env: Any
) -> None:
    env, error = boot_env(unit, lasting=True)
    seen = _boot_unit(tmp_path, shipped, handle, unit, env)
    (put,) = seen["puts"]
    assert put["Status"] == "FAILURE", seen
    what = "staging keeps failing (3 restarts)" if unit == "gptoss-stage.service" else "failed"
    assert put["Reason"].startswith(f"prefill-0: {unit} {what}: {error}"), put["Reason"]
    assert "Usage:" not in put["Reason"] and "512 byte blocks" not in put["Reason"]
    if unit == "gptoss-nvme.service":
        n = BootConfig().nvme_attempts
        assert re.search(rf" \[gptoss-retry: gptoss-stage-nvme failed {n} of {n} attempts in \d+s \(exit 1\); giving up\]$", put["Reason"]), put
        assert seen["journal"].count("Error accessing specified device") == n


# ---- the spec: each budget a value, and the gate waits for all of them -----------------------------


def test_each_boot_units_budget_comes_from_the_spec() -> None:
    cfg = load_config({"boot": {"nvme_attempts": 7, "nvme_s": 900, "identity_s": 120, "scripts_fetch_s": 240, "devices_s": 60}})
    render = render_node(cfg, cfg.layout, cfg.layout.nodes[0])
    text = {n: render.files[f"{UNIT_DIR}/{n}"][0] for n in BOOT_UNITS}
    assert f"ExecStart={BIN}/gptoss-retry 7 900 -- {BIN}/gptoss-stage-nvme\nTimeoutStartSec=900\n" in text["gptoss-nvme.service"]
    assert "Environment=GPTOSS_IMDS_TIMEOUT_S=120\n" in text["gptoss-identity.service"] and "TimeoutStartSec=180" in text["gptoss-identity.service"]
    assert "Environment=GPTOSS_FETCH_TIMEOUT_S=240\n" in text["gptoss-scripts.service"] and "TimeoutStartSec=360" in text["gptoss-scripts.service"]
    assert "Environment=GPTOSS_CHECK_TIMEOUT_S=60\n" in text["gptoss-node-check.service"] and "TimeoutStartSec=660" in text["gptoss-node-check.service"]
    assert "GPTOSS_STAGE_ATTEMPTS=3\n" in render.files["/etc/gptoss/cluster.env"][0]


def test_the_gate_waits_for_every_boot_budget_end_to_end() -> None:
    cfg = load_config({})
    # Typed from the unit caps: fetch 600+120, identity 600+60, nvme 600, node check 180+600; staging
    # 7200 plus two back-off pauses (60, 120) and RestartSec (5) each; servers 14400; margin 300.
    assert cfg.gate_needs_s == 720 + 660 + 600 + 780 + 7200 + 65 + 125 + 14400 + 300 == 24850
    assert cfg.gate_timeout_s == 24900, "rounded up to 5 minutes"
    assert load_config({"boot": {"nvme_s": 3600}}).gate_timeout_s == 27900, "24850 + 3000, rounded up"
    assert load_config({"recipe": "gptoss-20b-single"}).gate_timeout_s == 21600, "never below the 6 h the gate always allowed"
