"""A deployed cluster of guest VMs: render with the project's code, launch, replace, restart, inspect.

Each node identity (prefill-0, decode-0, and decode-1 of the two-decode router layout) is held by
one VM at a time, as an Auto Scaling group of one holds one instance (two during a surge). `deploy()` is what `cdk deploy` does: it renders each node's user data
with the same function the stack uses (tests/userdata prove the stack embeds exactly that
rendering), fills in what CloudFormation fills in (the software parameter's name, where the compile
cache is, each node's deploy gate), puts the stack's assets and its software parameter in the
cluster's AWS (one moto on the host, tests/vm/aws.py), and says which nodes changed: a changed node's group replaces its
instance (a new VM: new root disk, new instance id, new address, blank instance store),
`launch()` does that (the old instance first, then the new). With surge,
`surge()` launches the replacement beside the running instance (both on the subnet, a hub:
tests/vm/link.py) and `retire()` lets the old one go as CloudFormation does once the replacement
signalled its group. A software change of a running node (rollout.software=in-place) is `apply()`: what
State Manager's association runs, gptoss-apply on each node, one at a time. A reboot keeps every disk; a
crash in its wave (the plug pulled) is a hard reset of the same instance.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cluster_ops import in_place
from clusterspec.config import ClusterConfig
from clusterspec.loading import load_config
from clusterspec.sections.endpoint import keys_secret_name
from node_render import telemetry
from node_render.command_lines import router_fleet
from node_render.node_files import NodeRender
from node_render.paths import HEALTH_FILE, WHEELS_DIR, router_object_key, router_parameter, software_parameter
from node_render.render import render_cluster
from node_render.userdata import launch_inputs, node_digest, node_version, software_asset, user_data
from tests.vm import profile
from tests.vm.aws import ASSET_BUCKET, CACHE_BUCKET, HostAws
from tests.vm.image import Image
from tests.vm.link import Hub
from tests.vm.machine import Vm

NODES = ("prefill-0", "decode-0")
# Every node identity a scenario's layout may hold, and its index (its addresses): the default layout's
# two, and decode-1 of the two-decode router layout (the surge of a router node).
INDEX = {"prefill-0": 0, "decode-0": 1, "decode-1": 2}
# The guest's stand-in for the wait condition handle's presigned URL (fake-waitcondition).
SIGNAL_BASE = "http://127.0.0.1:9901/cloudformation-waitcondition-us-east-2"
# The Hugging Face token, in the cluster's Secrets Manager under this name; every deploy names it
# by its partial ARN (no random suffix), as an operator may. Nothing on the node may show it.
HF_TOKEN_NAME = "gptoss-vm-hf-token"
HF_TOKEN_SECRET = f"arn:aws:secretsmanager:us-east-2:123456789012:secret:{HF_TOKEN_NAME}"
HF_TOKEN = "hf_vmTOKENshownToNobody0123456789abcdef"
# The endpoint's API key (serving.endpoint.auth=keys, a router layout's default): the stack's secret as the stack makes
# it, its generated key 'initial' this one. The scenarios' clients send it; the gate refuses a request without it.
API_KEY = "vmKEYgeneratedByTheStack0123456789abcdefghijkl"
# The instance's devices, typed here (not read from the instance table the node check reads):
# trn3.48xlarge as the project assumes it, 16 Neuron devices and 16 EFA interfaces.
DEVICES = {"neuron": 16, "efa": 16}


def address(index: int, generation: int) -> str:
    """The private IP of the `generation`th instance of node `index` (a replacement gets a new one), in 10.42.0.0/20."""
    return f"10.42.{generation}.{10 + index}"


def _cloud_init_status(result_json: str, status_json: str) -> str:
    """`cloud-init status --format json`'s verdict, from the files it reads: result.json (written when
    the last stage ends) and status.json (each stage's errors and recoverable errors)."""
    try:
        v1 = json.loads(result_json)["v1"]
        stages = {k: v for k, v in json.loads(status_json)["v1"].items() if isinstance(v, dict) and "errors" in v}
    except (ValueError, KeyError, TypeError):
        return json.dumps({"status": "not done", "errors": [], "result.json": result_json[:500]})
    errors = list(v1.get("errors", [])) + [e for st in stages.values() for e in st.get("errors", []) if e not in v1.get("errors", [])]
    recoverable: dict[str, list[str]] = {}
    for st in [v1, *stages.values()]:
        for level, msgs in (st.get("recoverable_errors") or {}).items():
            recoverable.setdefault(level, []).extend(m for m in msgs if m not in recoverable.get(level, []))
    return json.dumps({"status": "done", "errors": errors, "recoverable_errors": recoverable})


# Every unit a node's health list names is active (a node without the list yet passes: gptoss-status decides).
# One systemctl for all (`is-active` exits 0 when any one is active: each unit's line is read instead).
ALL_ACTIVE = f"! test -s {HEALTH_FILE} || ! systemctl is-active $(awk '{{print $1}}' {HEALTH_FILE}) | grep -qvx active"


class VmCluster:
    """The VMs of the layout's node identities (INDEX), and the cluster's AWS."""

    def __init__(self, workdir: Path, image: Image, accel: str) -> None:
        self.workdir = workdir
        self.image, self.accel = image, accel
        self.aws = HostAws(workdir, "gptoss-8k1k")
        # The cluster's subnet: every instance's NIC on one hub.
        self.hub = Hub()
        self.vms: dict[str, Vm] = {}
        # A surge's old instance of a node, running beside its replacement until `retire` ends it.
        self.leaving: dict[str, Vm] = {}
        self.generations = {n: -1 for n in INDEX}
        self.instance_ids: dict[str, str] = {}
        self.cfg: ClusterConfig | None = None
        self.renders: dict[str, NodeRender] = {}
        self.user_data_text: dict[str, str] = {}
        # The fleet's software version ("URI SHA256", what the stack's parameter names) and its asset.
        self.version = ""
        self.software = b""
        # After a deploy: the running nodes whose own software changed, and the units gptoss-apply restarts on
        # each (rollout.software=in-place: State Manager's association would run it; `apply` does here).
        self.in_place: dict[str, list[str]] = {}
        self.fakes: dict[str, Any] = {}
        self.deploys = 0
        self.handles: dict[str, tuple[str, str]] = {}
        self.pending: set[str] = set()

    # ---- what a deploy does --------------------------------------------------------------

    def deploy(self, context: dict[str, Any]) -> set[str]:
        """Render every node for this config, put the stack's assets in S3; return the nodes whose
        launch template changed (their instances are replaced by `launch`)."""
        model = {"hf_token_secret_arn": HF_TOKEN_SECRET} | context.get("model", {})
        # The node check gives devices 20 s to appear here (boot.devices_s, 180 s by default).
        boot = {"devices_s": 20} | context.get("boot", {})
        # Members are read every 90 s here (30 s by default) and the health watch looks every
        # 2 minutes (1): an AWS CLI call costs a software-emulated guest about 20 s of CPU, and
        # every process it starts seconds.
        healing = {"members_poll_s": 90, "watch_interval_s": 120} | context.get("healing", {})
        # A leaving instance runs two members polls more (the spec's rule for rollout.drain_s).
        rollout = {"drain_s": 2 * healing["members_poll_s"] + 10} | context.get("rollout", {})
        # No API keys here unless a scenario asks: each router node reads the secret every keys_refresh_s (60 s at most)
        # with the AWS CLI, about 22 s of emulated CPU a read; with three router guests (a surge) on two host cores the
        # new guest did not finish booting in 900 s (2026-12-07: the redeploy to the router and the change in place
        # passed with keys on, the surge did not). The clients send the stack's key all the same (a gate without keys
        # ignores it); keys themselves are proved on loopback (tests/userdata/test_api_keys.py).
        serving = context.get("serving", {})
        serving = serving | {"endpoint": {"auth": "none"} | serving.get("endpoint", {})}
        self.cfg = load_config(context | {"model": model, "boot": boot, "healing": healing, "rollout": rollout, "serving": serving})
        renders = render_cluster(self.cfg)
        assert {r.node.name for r in renders} <= set(INDEX), f"the harness holds {sorted(INDEX)}, not {[r.node.name for r in renders]}"
        self.renders = {r.node.name: r for r in renders}
        data = software_asset(renders)
        sha = hashlib.sha256(data).hexdigest()
        uri = f"s3://{ASSET_BUCKET}/{sha}.xz"
        self.aws.put(uri, data)
        # The stack's software parameter: the version every node reads at boot.
        self.aws.client("ssm").put_parameter(Name=software_parameter(self.cfg.cluster_name), Value=f"{uri} {sha}", Type="String", Overwrite=True)
        previous, self.software, self.version = self.software, data, f"{uri} {sha}"
        if self.cfg.proxy_kind == "vllm-router":
            # The routers' settings and pool, the one SSM parameter the stack writes (read at run time).
            proxy = next(p for p in self.cfg.layout.proxies if p.kind == "vllm-router")
            self.aws.client("ssm").put_parameter(Name=router_parameter(self.cfg.cluster_name), Value=router_fleet(self.cfg, proxy),
                                                 Type="String", Overwrite=True)  # fmt: skip
            # The wheel where the stack's asset puts it: its key in the software asset's bucket.
            r = self.cfg.serving.proxy.router
            self.aws.put(f"s3://{ASSET_BUCKET}/{router_object_key(r.sha256)}", (WHEELS_DIR / r.wheel).read_bytes())
        self.aws.secret(HF_TOKEN_NAME, HF_TOKEN)
        if self.cfg.endpoint_auth == "keys":
            self.aws.secret(keys_secret_name(self.cfg.cluster_name), json.dumps({"keys": [], "initial": API_KEY}))
        self.aws.log_group(telemetry.log_group(self.cfg))
        self.deploys += 1
        changed = set()
        replace = self.cfg.rollout.software == "replace"
        for name, r in self.renders.items():
            # The deploy gate's handle, as CloudFormation keeps or makes it: the same URL while the
            # node's gate (its digest) stays, a new one when the node changes (and is replaced).
            digest = node_digest(r, node_version(r) if replace else "", launch_inputs(self.cfg, r.node.role))
            if self.handles.get(name, ("",))[0] != digest:
                self.handles[name] = (digest, f"{SIGNAL_BASE}/{name}/{digest}-{self.deploys}?Expires=1900000000&Signature=a%2Fb%3D")
                changed.add(name)
            signal = self.handles[name][1] if self.cfg.wait_for_ready else None
            self.user_data_text[name] = user_data(
                r, software_parameter=software_parameter(self.cfg.cluster_name), software_digest=node_version(r) if replace else None,
                signal_url=signal, compile_cache_uri=f"s3://{CACHE_BUCKET}",
            )  # fmt: skip
        self.pending = changed
        running = [n for n in self.renders if n in self.vms and n not in changed]
        self.in_place = {} if replace or not previous else in_place.compare("", sha, previous, data, running).restarts
        return changed

    def apply(self, timeout_s: int) -> dict[str, tuple[int, float, str]]:
        """What the stack's State Manager associations do after an in-place deploy: gptoss-apply with the new
        version on each running node whose software changed, a role after the other and one node at a time
        (MaxConcurrency 1), stopping at the first that fails (MaxErrors 0). Per node: (exit code, seconds, output)."""
        assert self.cfg is not None
        out: dict[str, tuple[int, float, str]] = {}
        for role in dict.fromkeys(n.role for n in self.cfg.layout.nodes):
            for name in [n for n in self.in_place if self.renders[n].node.role == role]:
                t0 = time.monotonic()
                # As the SSM agent runs a document's command: in a process systemd started (a transient service here,
                # with the manager's environment, the guest's way to the cluster's AWS among it), not a login shell.
                unit = f"vm-apply-{name}-{self.deploys}"
                res = self.vms[name].ssh(f"systemd-run --wait --pipe --quiet --collect --unit={unit} /opt/gptoss/bin/gptoss-apply '{self.version}' {timeout_s}",
                                         check=False, timeout=2 * timeout_s + 900)  # fmt: skip
                out[name] = (res.returncode, time.monotonic() - t0, res.stdout + res.stderr)
                if res.returncode != 0:
                    return out
        return out

    def user_data(self, name: str) -> str:
        """The user data of a node's launch template (what every instance of it boots from)."""
        return self.user_data_text[name]

    # ---- instances -------------------------------------------------------------------------

    def launch(
        self, fakes: dict[str, Any] | None = None, *, aws: dict[str, bool] | None = None, faults: dict[str, dict[str, Any]] | None = None
    ) -> None:
        """What the groups do after a deploy: each changed node's instance replaced by a new one
        (the first deploy launches them all), booted in parallel; waits for the harness's login.
        `aws` cuts a node's new instance off from the cluster's AWS ({node: False}); `faults` adds
        settings of the fakes for one node's instance only."""
        self.fakes = fakes or {}
        nodes = sorted(self.pending)
        self.pending = set()
        self.launched_at = time.monotonic()
        for name in nodes:
            self._new_instance(name, reach_aws=(aws or {}).get(name, True), fakes=self.fakes | (faults or {}).get(name, {}))
        self._each(lambda vm: vm.wait_ssh(600), [self.vms[n] for n in nodes])

    def surge(self, name: str, fakes: dict[str, Any] | None = None) -> None:
        """A changed node's rolling update with surge (MaxSize 2, MinInstancesInService 1): its group
        launches the replacement from the new template beside the running instance, tagged by
        CloudFormation; the old one keeps running and serving (`leaving`) until `retire`. Returns
        once the replacement accepts the harness's login."""
        assert name in self.pending, f"{name} did not change: nothing to roll"
        self.pending.discard(name)
        self.leaving[name] = self.vms[name]
        self._new_instance(name, reach_aws=True, fakes=self.fakes if fakes is None else fakes, keep_old=True)
        self.vms[name].wait_ssh(600)

    def retire(self, name: str) -> float:
        """What CloudFormation does once the surge's replacement signalled SUCCESS to its group: it
        terminates the old instance, which the group's drain hook holds in Terminating:Wait for
        rollout.drain_s, still running (`drained` ends it). Returns when (time.monotonic())."""
        self.aws.leave(self.leaving[name].instance_id)
        return time.monotonic()

    def drained(self, name: str) -> None:
        """The drain hook's time is up: EC2 shuts the old instance down (an ACPI power-off: systemd
        stops its units) and it is gone."""
        old = self.leaving.pop(name)
        old.shutdown()
        old.kill()
        self.hub.leave(old.link)
        self.aws.terminate(old.instance_id)

    def remove(self, name: str) -> None:
        """A node the deployed layout no longer holds: its group is deleted with its instance."""
        assert name not in self.renders, f"{name} is still in the layout"
        vm = self.vms.pop(name)
        vm.kill()
        self.hub.leave(vm.link)
        self.aws.terminate(self.instance_ids.pop(name))
        self.handles.pop(name, None)
        self.pending.discard(name)

    def _new_instance(self, name: str, *, reach_aws: bool, fakes: dict[str, Any] | None = None, keep_old: bool = False) -> None:
        assert self.cfg is not None
        old = self.vms.get(name)
        if old is not None and not keep_old:
            old.kill()
            self.hub.leave(old.link)
            self.aws.terminate(self.instance_ids[name])
        self.generations[name] += 1
        gen = self.generations[name]
        index = INDEX[name]
        ip = address(index, gen)
        vm = Vm(name, index, self.workdir / f"{name}-{gen}", self.image, ip, self.accel, self.hub.join(), gen,
                aws_port=self.aws.port if reach_aws else None)  # fmt: skip
        self.instance_ids[name] = self.aws.launch(name, name.split("-")[0], ip, rolling_update=keep_old)
        vm.instance_id = self.instance_ids[name]
        vm.seed(self.user_data(name))
        self.vms[name] = vm
        self._power_on(vm, self.fakes if fakes is None else fakes)

    def _power_on(self, vm: Vm, fakes: dict[str, Any]) -> None:
        # The instance's devices as the instance table says (a fault replaces them), and the token the
        # fake Hub expects: the one the harness put in the cluster's Secrets Manager (the host's moto).
        vm.start({"devices": DEVICES, "secrets": {"hf_token": HF_TOKEN}} | fakes)

    def reboot(self, fakes: dict[str, Any] | None = None, *, crash: frozenset[str] = frozenset()) -> None:
        """`reboot` in each guest: every disk stays (QEMU runs with -no-reboot: power on again). The
        nodes in `crash` lose power instead (QEMU killed: nothing flushed that the guest had not
        written), in the same wave, and are powered on again the same way."""

        def down(vm: Vm) -> None:
            if vm.name in crash:
                vm.kill()
            else:
                vm.ssh("systemctl reboot", check=False, timeout=30)
                vm.wait_exit(300)

        self._each(down)
        self.fakes = self.fakes if fakes is None else fakes
        for vm in self.running():
            self._power_on(vm, self.fakes)
        self._each(lambda vm: vm.wait_ssh(600))

    def stop(self) -> None:
        for vm in [*self.vms.values(), *self.leaving.values()]:
            vm.kill()
        self.hub.stop()
        self.aws.stop()

    def running(self) -> list[Vm]:
        return [self.vms[n] for n in INDEX if n in self.vms]

    def _each(self, fn: Any, vms: list[Vm] | None = None) -> list[Any]:
        vms = self.running() if vms is None else vms
        if not vms:
            return []
        with ThreadPoolExecutor(max_workers=len(vms)) as pool:
            return list(pool.map(fn, vms))

    # ---- what the tests read ----------------------------------------------------------------

    def ip(self, name: str) -> str:
        """The current private IP of a node (its instance's)."""
        return self.vms[name].ip

    def status(self, name: str) -> dict[str, Any]:
        """gptoss-status on one node, by unit."""
        doc = self.vms[name].json("/opt/gptoss/bin/gptoss-status")
        return {u["unit"]: u for u in doc["units"]}

    def not_ready(self, *, full: bool = False) -> dict[str, list[str]]:
        """Units of the plan that are not active and healthy, by node. Unless FULL, a node first answers a shell
        check (every unit of its own health list is active, or it has no list yet): gptoss-status is a Python start,
        seconds of a busy TCG guest's CPU at every poll of a boot; the check's failure implies the status's."""
        out = {}
        for name in self.renders:
            if not full:
                try:
                    quick = self.vms[name].ssh(ALL_ACTIVE, check=False, timeout=60).returncode
                except subprocess.TimeoutExpired:
                    quick = -1
                if quick != 0:
                    out[name] = ["a unit of its health list is not active yet (or the guest did not answer)"]
                    continue
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
        with profile.span("ready"):
            t0 = time.monotonic()
            last: dict[str, list[str]] = {}
            while time.monotonic() - t0 < timeout:
                last = self.not_ready()
                if not last:
                    return time.monotonic() - t0
                time.sleep(5)
            raise AssertionError(f"not ready after {timeout:.0f}s: {json.dumps(self.not_ready(full=True) or last, indent=1)}")

    def boot_facts(self, name: str) -> dict[str, str]:
        """cloud-init's and systemd's view of the current boot."""
        vm = self.vms[name]
        return {
            # cloud-init's own record of the finished boot (what `cloud-init status` reads; the
            # command itself is Python, and can take a guest busy starting its node minutes).
            "cloud_init": _cloud_init_status(vm.ssh("cat /run/cloud-init/result.json", check=False).stdout,
                                             vm.ssh("cat /run/cloud-init/status.json", check=False).stdout),
            "system": vm.ssh("systemctl is-system-running", check=False).stdout.strip(),
            "failed": vm.ssh("systemctl list-units --failed --no-legend --plain", check=False).stdout.strip(),
            "jobs": vm.ssh("systemctl list-jobs --no-legend", check=False).stdout.strip(),
        }

    def wait_boot_done(self, name: str, timeout: float) -> dict[str, Any]:
        """Wait until cloud-init is done and systemd's boot finished; returns the facts then."""
        with profile.span("cloud-init"):
            vm = self.vms[name]
            # cloud-init writes result.json when its last stage ends: a file test, where `cloud-init
            # status` (Python) can take a busy TCG guest longer than a poll's timeout to answer.
            vm.wait_until("test -s /run/cloud-init/result.json && "
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
        """Every PUT a node's current instance made to its deploy gate's handle, oldest first."""
        out = self.vms[name].ssh("cat /var/lib/fakes/signals.jsonl 2>/dev/null || true").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def unit_prop(self, name: str, unit: str, prop: str) -> str:
        return self.vms[name].ssh(f"systemctl show -p {prop} --value {unit}").stdout.strip()
