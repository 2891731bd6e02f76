"""A deployed cluster of guest VMs: render with the project's code, boot, restart, inspect.

`deploy()` is what `cdk deploy` does to the nodes: it renders each node's user data with the
same function the stack uses (tests/unit prove the stack embeds exactly that rendering), fills
in what CloudFormation fills in (the peers' IPs, where the scripts asset is), and writes each
VM's NoCloud seed. Restarting a VM then plays what EC2 does: a reboot keeps every disk, a
stop/start blanks the instance store, a redeploy is a stop/start with new user data and the
same instance id.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from clusterspec import telemetry
from clusterspec.config import ClusterConfig, load_config
from clusterspec.paths import WHEELS_DIR, members_parameter
from clusterspec.render import NodeRender, render_cluster
from clusterspec.userdata import launch_inputs, node_digest, scripts_asset, user_data
from tests.vm.image import Image
from tests.vm.machine import Vm, free_port

# The guests' addresses in the default subnet_cidr, 10.42.0.0/20.
ADDRESSES = {"prefill-0": "10.42.0.10", "decode-0": "10.42.0.11"}
# Nodes of a layout that has no VM here (a second decode server): in the members, nobody answers.
ABSENT = {"decode-1": "10.42.0.12", "prefill-1": "10.42.0.13"}
ASSET_BUCKET = "gptoss-vm-assets"
# The guest's stand-in for the wait condition handle's presigned URL (fake-waitcondition).
SIGNAL_BASE = "http://127.0.0.1:9901/cloudformation-waitcondition-us-east-2"
# The Hugging Face token, in the guest's Secrets Manager (moto) under this name; every deploy names
# it by its partial ARN (no random suffix), as an operator may. Nothing on the node may show it.
HF_TOKEN_NAME = "gptoss-vm-hf-token"
HF_TOKEN_SECRET = f"arn:aws:secretsmanager:us-east-2:123456789012:secret:{HF_TOKEN_NAME}"
HF_TOKEN = "hf_vmTOKENshownToNobody0123456789abcdef"
# The instance's devices, typed here (not read from the instance table the node check reads):
# trn3.48xlarge as the project assumes it, 16 Neuron devices and 16 EFA interfaces.
DEVICES = {"neuron": 16, "efa": 16}


class VmCluster:
    """The two VMs of the default layout (prefill-0 and decode-0)."""

    def __init__(self, workdir: Path, image: Image, accel: str) -> None:
        self.workdir = workdir
        a, b = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
        self.vms = {
            "prefill-0": Vm("prefill-0", 0, workdir / "prefill-0", image, ADDRESSES["prefill-0"], accel, a, b),
            "decode-0": Vm("decode-0", 1, workdir / "decode-0", image, ADDRESSES["decode-0"], accel, b, a),
        }
        self.cfg: ClusterConfig | None = None
        self.renders: dict[str, NodeRender] = {}
        self.asset = workdir / "scripts.tar.xz"
        self.scripts_uri = ""
        self.router_uri = ""
        self.members: dict[str, str] = {}
        self.fakes: dict[str, Any] = {}
        self.deploys = 0
        self.handles: dict[str, tuple[str, str]] = {}

    # ---- what a deploy does --------------------------------------------------------------

    def deploy(self, context: dict[str, Any]) -> None:
        """Render every node for this config and write the seeds (no VM is started)."""
        model = {"hf_token_secret_arn": HF_TOKEN_SECRET} | context.get("model", {})
        # The node check gives devices 20 s to appear here (boot.devices_s, 180 s by default).
        boot = {"devices_s": 20} | context.get("boot", {})
        self.cfg = load_config(context | {"model": model, "boot": boot})
        renders = render_cluster(self.cfg)
        self.renders = {r.node.name: r for r in renders if r.node.name in self.vms}
        data = scripts_asset(renders)
        self.asset.write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        self.scripts_uri = f"s3://{ASSET_BUCKET}/{sha}.xz"
        # vLLM's router: the pinned wheel as the stack's asset, and the members the stack writes.
        routed = self.cfg.proxy_kind == "vllm-router"
        self.router_uri = f"s3://{ASSET_BUCKET}/router/{self.cfg.serving.proxy.router.wheel}" if routed else ""
        self.members = {members_parameter(self.cfg.cluster_name): " ".join(f"{r.node.name}={(ADDRESSES | ABSENT)[r.node.name]}" for r in renders)} if routed else {}
        self.deploys += 1
        for name, r in self.renders.items():
            # The deploy gate's handle, as CloudFormation keeps or makes it: the same URL while
            # the node's gate (its digest) stays, a new one when the node changes.
            digest = node_digest(r, sha, launch_inputs(self.cfg, r.node.role))
            if self.handles.get(name, ("",))[0] != digest:
                self.handles[name] = (
                    digest,
                    f"{SIGNAL_BASE}/{name}/{digest}-{self.deploys}?Expires=1900000000&Signature=a%2Fb%3D",
                )
            signal = self.handles[name][1] if self.cfg.wait_for_ready else None
            self.vms[name].seed(
                user_data(
                    r, {p: ADDRESSES[p] for p in r.peers}, scripts_uri=self.scripts_uri, scripts_sha256=sha, signal_url=signal,
                    router_uri=self.router_uri or None,
                )
            )

    def user_data(self, name: str) -> str:
        """The user data the seed of a VM carries."""
        return (self.vms[name].workdir / "seed" / "user-data").read_text()

    # ---- power -----------------------------------------------------------------------------

    def start(self, fakes: dict[str, Any] | None = None) -> None:
        """Power on every VM of the layout (in parallel) and wait for the harness's login."""
        self.fakes = fakes or {}
        for name in self.renders:
            self.power_on(name, wait=False)
        self._each(lambda vm: vm.wait_ssh(600))

    def power_on(self, name: str, *, wait: bool = True) -> None:
        """Start one VM with the current seed and fakes (after pull_the_plug, for instance)."""
        assert self.cfg is not None
        # The instance's devices as the instance table says (a fault replaces them).
        hw = {"devices": DEVICES}
        # What the stack makes before the instances: the scripts asset, the log group.
        # The router's wheel (23 MB) only where a router runs, on a disk of its own (fw_cfg is too slow for it).
        wheel = WHEELS_DIR / self.cfg.serving.proxy.router.wheel
        routes = self.router_uri and "gptoss-install-router" in self.renders[name].scripts
        disk_objects = {self.router_uri: {"disk": "router", "size": wheel.stat().st_size}} if routes else {}
        made = {"s3": {"objects": {self.scripts_uri: "scripts"}, "disk_objects": disk_objects}, "logs": {"groups": [telemetry.log_group(self.cfg)]},
                "secrets": {"name": HF_TOKEN_NAME, "hf_token": HF_TOKEN}, "ssm": {"parameters": self.members}}  # fmt: skip
        settings = hw | self.fakes | made
        self.vms[name].start(settings, {"scripts": self.asset}, {"router": wheel} if routes else None)
        if wait:
            self.vms[name].wait_ssh(600)

    def reboot(self, fakes: dict[str, Any] | None = None) -> None:
        """`reboot` in each guest: every disk stays (QEMU runs with -no-reboot: power on again)."""
        self._each(lambda vm: (vm.ssh("systemctl reboot", check=False, timeout=30), vm.wait_exit(300)))
        self.start(self.fakes if fakes is None else fakes)

    def stop_start(self, fakes: dict[str, Any] | None = None) -> None:
        """An EC2 stop/start: clean power-off, blank instance store, same root volume and id."""
        self._each(lambda vm: vm.shutdown(300))
        for vm in self.running():
            vm.blank_instance_store()
        self.start(self.fakes if fakes is None else fakes)

    def pull_the_plug(self, name: str) -> None:
        """Kill a VM's QEMU: no shutdown, nothing flushed that the guest had not written."""
        self.vms[name].kill()

    def stop(self) -> None:
        for vm in self.vms.values():
            vm.kill()

    def running(self) -> list[Vm]:
        return [self.vms[n] for n in self.renders]

    def _each(self, fn: Any) -> list[Any]:
        with ThreadPoolExecutor(max_workers=len(self.vms)) as pool:
            return list(pool.map(fn, self.running()))

    # ---- what the tests read ----------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        """gptoss-status on one node, by unit."""
        doc = self.vms[name].json("/opt/gptoss/bin/gptoss-status")
        return {u["unit"]: u for u in doc["units"]}

    def not_ready(self) -> dict[str, list[str]]:
        """Units of the plan that are not active and healthy, by node."""
        out = {}
        for name in self.renders:
            try:
                st = self.status(name)
            except (AssertionError, ValueError) as e:
                out[name] = [f"status failed: {e}"[:300]]
                continue
            bad = [f"{u}: {s['state']}/{s['sub']} healthy={s['healthy']} {s.get('phase', '')}" for u, s in st.items()
                   if s["state"] != "active" or s["healthy"] is False]  # fmt: skip
            if bad:
                out[name] = bad
        return out

    def wait_ready(self, timeout: float) -> float:
        """Wait until every unit of the plan on every node is active and answers; seconds waited."""
        t0 = time.monotonic()
        last: dict[str, list[str]] = {}
        while time.monotonic() - t0 < timeout:
            last = self.not_ready()
            if not last:
                return time.monotonic() - t0
            time.sleep(5)
        raise AssertionError(f"not ready after {timeout:.0f}s: {json.dumps(last, indent=1)}")

    def boot_facts(self, name: str) -> dict[str, str]:
        """cloud-init's and systemd's view of the current boot."""
        vm = self.vms[name]
        return {
            "cloud_init": vm.ssh("cloud-init status --format json", check=False).stdout,
            "system": vm.ssh("systemctl is-system-running", check=False).stdout.strip(),
            "failed": vm.ssh("systemctl list-units --failed --no-legend --plain", check=False).stdout.strip(),
            "jobs": vm.ssh("systemctl list-jobs --no-legend", check=False).stdout.strip(),
        }

    def wait_boot_done(self, name: str, timeout: float) -> dict[str, Any]:
        """Wait until cloud-init is done and systemd's boot finished; returns the facts then."""
        vm = self.vms[name]
        vm.wait_until("cloud-init status | grep -q 'status: done' && "
                      "systemctl is-system-running | grep -Eq '^(running|degraded)$'", timeout, "boot finished")  # fmt: skip
        facts: dict[str, Any] = self.boot_facts(name)
        facts["cloud_init"] = json.loads(facts["cloud_init"])
        facts["uptime"] = float(vm.ssh("cut -d' ' -f1 /proc/uptime").stdout)
        return facts

    def this_boot(self, name: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Only the records written during a VM's current boot."""
        boot = self.vms[name].boot_id()
        return [r for r in records if r.get("boot_id") == boot]

    def journal(self, name: str, unit: str) -> str:
        """A unit's journal of the current boot, messages only."""
        return self.vms[name].ssh(f"journalctl -b -u {unit} -o cat --no-pager", check=False).stdout

    def signals(self, name: str) -> list[dict[str, Any]]:
        """Every PUT a node made to its deploy gate's handle, oldest first."""
        out = self.vms[name].ssh("cat /var/lib/fakes/signals.jsonl 2>/dev/null || true").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def guest_aws(self, name: str, command: str, *, until: str | None = None, timeout: float = 180) -> dict[str, Any]:
        """An AWS CLI call inside a guest, against its moto (what the node's collector wrote)."""
        cli = f"AWS_ENDPOINT_URL=http://127.0.0.1:5000 aws --region us-east-2 --output json {command}"
        if until:
            self.vms[name].wait_until(f"{cli} | grep -q '{until}'", timeout, f"{until} in `aws {command}`")
        return dict(self.vms[name].json(cli))

    def unit_prop(self, name: str, unit: str, prop: str) -> str:
        return self.vms[name].ssh(f"systemctl show -p {prop} --value {unit}").stdout.strip()
