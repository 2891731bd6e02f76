"""One guest VM standing in for one EC2 instance of the cluster, under QEMU.

What maps to what:
- the root disk (a qcow2 overlay on the cached image) is the instance's EBS root volume: it
  survives reboots and stop/start;
- two emulated NVMe disks with serial gptoss-is-N are the instance store: a stop/start
  replaces them with blank ones;
- a NoCloud seed (cloud-localds) carries the user data the project renders, and the
  instance id: the same id models a restart of the same instance, a new VM a new instance;
- a private link between the VMs (a QEMU socket netdev to a hub on loopback, tests/vm/link.py) is
  the VPC subnet;
- a restricted user-mode NIC (no route anywhere) lets the harness log in over SSH, and relays
  the guest's AWS (10.0.2.100:5000) to the host's moto, the cluster's one AWS (tests/vm/aws.py);
- QEMU's fw_cfg passes the fakes' settings (IMDS address, server delays, faults).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.vm import profile
from tests.vm.image import Image

NVME_DISKS = 2
NVME_SIZE = 2 << 30
MEMORY_MB = 1536
# Where a guest reaches the cluster's AWS (the host's moto, through QEMU's guestfwd and socat).
AWS_GUEST_ADDRESS = "10.0.2.100"
# The guest kernel's options beyond root and console. tsc=reliable: no clocksource watchdog on the TSC,
# so a guest starved of CPU (three or four guests of two vCPUs on CI's two cores) never marks it unstable
# at run time, which flips sched_clock's static key by live text patching; under CI's nested KVM that
# patching once ended in an int3 oops in sched_clock_cpu and a panic at 97 s of a boot. panic=-1 with
# -no-reboot: a panicked guest's QEMU exits, so the harness sees it at once instead of waiting out a login.
GUEST_KERNEL_ARGS = "tsc=reliable panic=-1"


def _boots(img: Image, accel: str) -> bool:
    """Can QEMU run the guest kernel to its end with this accelerator? (It panics: no init, no root.)"""
    args = ["-accel", "kvm", "-cpu", "host"] if accel == "kvm" else ["-accel", "tcg", "-cpu", "max"]
    try:
        r = subprocess.run(
            ["qemu-system-x86_64", *args, "-m", "512", "-kernel", str(img.kernel), "-initrd", str(img.initrd),
             "-append", "console=ttyS0 panic=-1 rdinit=/nonexistent", "-display", "none", "-monitor", "none",
             "-serial", "stdio", "-no-reboot"],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    return "Kernel panic - not syncing" in r.stdout


def accelerator(img: Image) -> str | None:
    """KVM when it runs the guest kernel, else TCG software emulation, else None."""
    if os.access("/dev/kvm", os.R_OK | os.W_OK) and _boots(img, "kvm"):
        return "kvm"
    if _boots(img, "tcg"):
        return "tcg"
    return None


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A loopback port nothing listens on."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def network_config(mgmt_mac: str, vpc_mac: str, ip: str, prefix: int) -> str:
    """NoCloud network-config v2: the harness link and the cluster's subnet."""
    return json.dumps(
        {
            "version": 2,
            "ethernets": {
                "mgmt": {"match": {"macaddress": mgmt_mac}, "set-name": "mgmt", "addresses": ["10.0.2.15/24"]},
                "vpc": {"match": {"macaddress": vpc_mac}, "set-name": "vpc", "addresses": [f"{ip}/{prefix}"]},
            },
        }
    )


@dataclass
class Vm:
    """A guest: its disks, its seed, its QEMU process and an SSH channel to it."""

    name: str
    index: int
    workdir: Path
    image: Image
    ip: str
    accel: str
    # The hub's port for this guest's NIC on the cluster's subnet (tests/vm/link.py).
    link: int
    # Which instance of its node this is (0 first): a replacement's NIC gets a MAC of its own.
    generation: int = 0
    prefix: int = 20
    ssh_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    boots: int = 0
    # The host's moto this guest reaches as its AWS (None: no AWS at all, e.g. S3 unreachable).
    aws_port: int | None = None
    # The instance's id, as EC2 (the host's moto) made it.
    instance_id: str = "i-00000000000000000"
    # The fakes' settings of the current boot, and whether a panicked first boot was launched again.
    fakes: dict[str, Any] = field(default_factory=dict)
    relaunched: bool = False
    _boot_id: tuple[tuple[int, int] | None, str] = (None, "")

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The harness's one SSH connection per boot (a master every command shares): a login costs a
        # TCG guest 1 s idle and several busy, a command over the open connection about 0.1 s. The
        # socket lives in a short private folder (a Unix socket's path has at most 107 bytes).
        self.control = Path(tempfile.mkdtemp(prefix="gptoss-vm-ssh-")) / "master"
        self.root = self.workdir / "root.qcow2"
        if not self.root.exists():
            self._new_root()
        self.blank_instance_store()

    def _new_root(self) -> None:
        """A new root disk: a copy-on-write layer over the guest image."""
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(self.image.root), str(self.root)], check=True)

    @property
    def mgmt_mac(self) -> str:
        return f"52:54:00:00:00:{self.index + 1:02x}"

    @property
    def vpc_mac(self) -> str:
        return f"52:54:00:42:{self.generation:02x}:{self.index + 1:02x}"


    def blank_instance_store(self) -> None:
        """New, empty instance-store disks: what a stop/start leaves."""
        for n in range(NVME_DISKS):
            disk = self.workdir / f"nvme{n}.raw"
            disk.unlink(missing_ok=True)
            with disk.open("wb") as f:
                f.truncate(NVME_SIZE)

    def seed(self, user_data: str) -> None:
        """Write the NoCloud seed: the project's user data, this instance's id, its addresses."""
        d = self.workdir / "seed"
        d.mkdir(exist_ok=True)
        (d / "user-data").write_text(user_data)
        (d / "meta-data").write_text(f"instance-id: {self.instance_id}\nlocal-hostname: {self.name}\n")
        (d / "network-config").write_text(network_config(self.mgmt_mac, self.vpc_mac, self.ip, self.prefix))
        subprocess.run(
            ["cloud-localds", "--network-config", str(d / "network-config"), str(self.workdir / "seed.img"),
             str(d / "user-data"), str(d / "meta-data")],
            check=True,
        )  # fmt: skip

    def start(self, fakes: dict[str, Any]) -> None:
        """Power the instance on with the fakes' settings (fw_cfg)."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is already running"
        fw = self.workdir / "fakes.json"
        imds = {"local_ipv4": self.ip, "instance_id": self.instance_id} | fakes.get("imds", {})
        fw.write_text(json.dumps(fakes | {"imds": imds}))
        self.boots += 1
        self.fakes = fakes
        console = self.workdir / f"console-{self.boots}.log"
        accel = ["-accel", "kvm", "-cpu", "host"] if self.accel == "kvm" else ["-accel", "tcg,thread=multi", "-cpu", "max"]
        cmd = [
            "qemu-system-x86_64", "-name", self.name, "-machine", "q35", *accel, "-smp", "2", "-m", str(MEMORY_MB),
            "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd),
            "-append", f"root=/dev/vda rw console=ttyS0,115200 quiet systemd.show_status=0 {GUEST_KERNEL_ARGS}",
            "-drive", f"file={self.root},if=virtio,format=qcow2,cache=unsafe",
            "-drive", f"file={self.workdir / 'seed.img'},if=virtio,format=raw,readonly=on",
            "-netdev", f"user,id=mgmt,restrict=on,hostfwd=tcp:127.0.0.1:{self.ssh_port}-:22{self._aws_forward()}",
            "-device", f"virtio-net-pci,netdev=mgmt,mac={self.mgmt_mac}",
            "-netdev", f"socket,id=vpc,udp=127.0.0.1:{self.link},localaddr=127.0.0.1:0",
            "-device", f"virtio-net-pci,netdev=vpc,mac={self.vpc_mac}",
            "-fw_cfg", f"name=opt/gptoss/fakes,file={fw}",
            "-serial", f"file:{console}", "-display", "none", "-monitor", "none", "-no-reboot",
        ]  # fmt: skip
        for n in range(NVME_DISKS):
            cmd += [
                "-drive", f"file={self.workdir / f'nvme{n}.raw'},if=none,id=nvme{n},format=raw,cache=writeback",
                "-device", f"nvme,serial=gptoss-is-{n},drive=nvme{n}",
            ]  # fmt: skip
        log = (self.workdir / "qemu.log").open("a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started_at = time.monotonic()

    def _aws_forward(self) -> str:
        """The guest's AWS (AWS_ENDPOINT_URL=http://10.0.2.100:5000): each connection relayed by socat to
        the host's moto, one AWS for every guest of the cluster; none when the VM is cut off from it."""
        if self.aws_port is None:
            return ""
        return f",guestfwd=tcp:{AWS_GUEST_ADDRESS}:5000-cmd:socat - TCP:127.0.0.1:{self.aws_port}"

    def console(self) -> str:
        """The serial console of the current boot."""
        p = self.workdir / f"console-{self.boots}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def _ssh_args(self) -> list[str]:
        return [
            "ssh", "-q", "-i", str(self.image.key), "-p", str(self.ssh_port),
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5", "-o", f"ControlPath={self.control}",
        ]  # fmt: skip

    def ssh(self, command: str, *, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run a shell command in the guest as root (over the boot's open connection when there is
        one, else a login of its own: the same command either way)."""
        with profile.span("command"):
            cmd = [*self._ssh_args(), "-o", "ControlMaster=no", "root@127.0.0.1", command]
            started = time.monotonic()
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            finally:
                profile.command(command, time.monotonic() - started)
            if check and r.returncode != 0:
                raise AssertionError(f"{self.name}$ {command}\nexit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
            return r

    def _open_connection(self) -> None:
        """Open this boot's shared connection (it ends with the boot: QEMU's exit closes it). If it cannot
        be opened, every command logs in by itself, as before."""
        self.control.parent.mkdir(mode=0o700, exist_ok=True)
        self.control.unlink(missing_ok=True)  # a master killed with its guest can leave its socket
        subprocess.run([*self._ssh_args(), "-o", "ControlMaster=yes", "-o", "ControlPersist=yes", "-fN", "root@127.0.0.1"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=False)  # fmt: skip

    def wait_ssh(self, timeout: float = 600) -> float:
        """Wait until the guest accepts the harness's SSH login; seconds since power-on.

        A guest whose kernel panics (panic=-1 with -no-reboot: QEMU exits) fails at once with its console,
        except on a new instance's first boot before any login: the test machine's kernel died under the
        nested, oversubscribed KVM of CI (an int3 oops in the guest's own text patching, seen once), not the
        node's code, which had not run yet. That instance is launched again once from blank disks (what
        EC2's replacement of an impaired instance gives) and the harness says so."""
        with profile.span("boot"):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    console = self.console()
                    if self.boots == 1 and not self.relaunched and "Kernel panic - not syncing" in console:
                        print(f"\n{self.name}: the guest kernel panicked at its first boot, before any login; launched again "
                              f"from blank disks (once):\n{console[-1500:]}", file=sys.stderr)  # fmt: skip
                        self.relaunched = True
                        self.root.unlink()
                        self._new_root()
                        self.blank_instance_store()
                        self.boots = 0
                        self.start(self.fakes)
                        deadline = time.monotonic() + timeout
                        continue
                    raise AssertionError(f"{self.name}: QEMU exited ({self.proc.returncode})\n{console[-3000:]}")
                try:
                    if self.ssh("true", check=False, timeout=30).returncode == 0:
                        up = time.monotonic() - self.started_at
                        self._open_connection()
                        return up
                except subprocess.TimeoutExpired:
                    pass
                time.sleep(3)
            raise AssertionError(f"{self.name}: no SSH after {timeout:.0f}s\n{self.console()[-3000:]}")

    def wait_until(self, command: str, timeout: float, what: str, interval: float = 3) -> float:
        """Poll a guest command until it succeeds; seconds since power-on."""
        with profile.span("wait"):
            deadline = time.monotonic() + timeout
            last = ""
            while time.monotonic() < deadline:
                try:
                    r = self.ssh(command, check=False, timeout=min(60, max(5, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    # A guest busy starting a dozen servers under TCG can be slow to answer one poll:
                    # that poll failed, the wait goes on to its own deadline.
                    last = "(the poll itself got no answer within its timeout)"
                    continue
                if r.returncode == 0:
                    return time.monotonic() - self.started_at
                last = r.stdout + r.stderr
                time.sleep(interval)
            raise AssertionError(f"{self.name}: {what} not reached after {timeout:.0f}s; last: {last}")

    def json(self, command: str) -> Any:
        """Run a guest command that prints JSON."""
        return json.loads(self.ssh(command).stdout)

    def records(self, name: str) -> list[dict[str, Any]]:
        """The JSON-lines records a fake wrote (this and earlier boots)."""
        out = self.ssh(f"cat /var/lib/fakes/{shlex.quote(name)} 2>/dev/null || true").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def boot_id(self) -> str:
        """The current boot's id, asked once per QEMU process (a guest of this harness boots again only in a new
        process: every reboot and power cut is the harness's own). Scenarios ask it for every record they read:
        25 guest commands of about 1 s each in the serving scenario alone."""
        process = (self.boots, self.proc.pid) if self.proc is not None else None
        if process is None or self._boot_id[0] != process:
            self._boot_id = (process, self.ssh("cat /proc/sys/kernel/random/boot_id").stdout.strip())
        return self._boot_id[1]

    def wait_exit(self, timeout: float) -> None:
        with profile.span("shutdown"):
            assert self.proc is not None
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{self.name}: did not power off within {timeout:.0f}s") from None

    def shutdown(self, timeout: float = 300) -> None:
        """A clean power-off (as EC2's stop does), waiting for QEMU to exit."""
        with profile.span("shutdown"):
            if self.proc is None or self.proc.poll() is not None:
                return
            self.ssh("systemctl poweroff", check=False, timeout=30)
            self.wait_exit(timeout)

    def kill(self) -> None:
        """Pull the plug: no shutdown, no flush of the guest's caches."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        shutil.rmtree(self.control.parent, ignore_errors=True)  # its connection ended with QEMU
