"""The default layout's two nodes booted from the project's own user data, under real cloud-init and systemd.

One cluster goes through the scenarios in order, as a fleet's life would: first boot, reboot,
a crash, faults, a redeploy that replaces both nodes' instances (with vLLM's router), a surge
that replaces one node beside its running instance while a client's load goes through the
router, and a new image whose instances cannot serve. Each scenario
asserts what a person would check on the node: cloud-init's and systemd's verdicts, unit
states, the array and the mount, what was downloaded, and the command line and environment
each server was started with (recorded by the fake `vllm`), compared with `plan`.

Fakes (in the guest image only): IMDS, the `vllm` binary, the Hub, the examples' git repository
and its proxy and schedule helper, the wait condition handle. The cluster's AWS is one moto on
the host that every guest reaches (tests/vm/aws.py). Everything else is real: Debian trixie
with systemd 257, cloud-init 25.1, mdadm, xfsprogs, curl, git, the AWS CLI, huggingface_hub,
and vLLM's router from its pinned wheel.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import time
from collections import Counter
from typing import Any

from node_render.node_files import Service
from node_render.paths import MANIFEST
from tests.conftest import ODD_VALUES
from tests.vm.aws import CACHE_BUCKET, STACK, group_logical_id
from tests.vm.cluster import API_KEY, DEVICES, HF_TOKEN, NODES, VmCluster

# The fake servers "compile" for COMPILE_S the first time a role runs on a node (blank compile
# cache), then "load" for LOAD_S.
# 30 s: long enough that replicas 1..5 visibly wait for replica 0's graph, short enough for CI's budget (the
# first boot's compile is the only one the scenarios wait out: every later start restores or keeps its cache).
COMPILE_S, LOAD_S = 30, 10
# At first boot the compiles last until the harness releases them, so "the boot finished while
# the servers compile" holds however slowly the guests boot.
FIRST_BOOT = {"vllm": {"compile_s": COMPILE_S, "load_s": LOAD_S, "hold_compile": True}, "imds": {"fail_s": 60}}
LATER = {"vllm": {"compile_s": COMPILE_S, "load_s": LOAD_S}}
MODEL = "/opt/dlami/nvme/models/gpt-oss-120b"
# Every deploy names the image by id, as `gptoss deploy` passes the one it resolved; the last one
# is a newer DLAMI. A short scripts-fetch budget keeps the unreachable-S3 scenario to minutes.
# Telemetry every 3 minutes, not 1: under TCG each AWS CLI call costs a guest 5-20 s of CPU (a
# second on a node), and a minute's calls would starve the servers' own boot.
IMAGE, NEW_IMAGE = "ami-0aaaaaaaaaaaaaaa1", "ami-0bbbbbbbbbbbbbbb2"
# The redeploy to vLLM's router comes with a newer image (a machine change: every node's instance is replaced,
# and the new ones boot the new software version); the surge's change with another one.
ROUTER_IMAGE, SURGE_IMAGE = "ami-0ccccccccccccccc3", "ami-0ddddddddddddddd4"
BASE = {"ami_id": IMAGE, "boot": {"scripts_fetch_s": 240}, "observability": {"interval_s": 180}}
# Typed here, not read from the code: what a server may never inherit, and the guest's own knobs
# (tests/vm/guest/rootfs/etc/systemd/system.conf.d/90-fakes.conf).
NEVER_IN_A_SERVER = {"GPTOSS_SIGNAL_URL", "HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
GUEST_KNOBS = {"GPTOSS_POLL_S", "GPTOSS_BACKOFF_BASE_S", "GPTOSS_SIGNAL_POLL_S"}
# Set by the server and replica units themselves (not a serving setting, so not in the plan): vLLM's
# usage statistics and the Hub's telemetry are off in every server (vLLM docs, "Usage Stats Collection").
NO_TELEMETRY = {"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
SERVABLE = {"config.json", "model.safetensors.index.json", "tokenizer.json", *(f"model-{i:05d}-of-00014.safetensors" for i in range(15))}
# The redeploy to vLLM's router, with odd but legal values in decode's environment and flags: the
# real systemd, bash and the exec chain must hand each one to the server exactly as written.
ODD_ENV = {f"ODD_{i}": {"value": v, "reason": "odd but legal"} for i, v in enumerate(ODD_VALUES)}
ODD_FLAGS = [{"name": f"--odd-{i}", "value": v, "reason": "odd but legal"} for i, v in enumerate(ODD_VALUES)]
# The guest's HAProxy is Debian 13's (3.0), the API gate's pin on a router node; a 10 s lame-duck (no load balancer here waits 20 s).
ROUTED_SERVING: dict[str, Any] = {"proxy": {"kind": "vllm-router", "gate": {"haproxy_version": "3.0", "lame_duck_s": 10}}, "decode": {"max_num_seqs": 4, "env": ODD_ENV, "extra_flags": ODD_FLAGS}}
# Telemetry is asserted at first boot (scenario 2); from the redeploy to the router on, three or four guests share
# two emulated cores and each collector's AWS CLI calls (one per unit with new journal lines, every interval) are
# background CPU the scenarios do not look at: every 10 minutes there (scenario 10 reads the first heartbeat, sent
# at the collector's start).
ROUTED = BASE | {"ami_id": ROUTER_IMAGE, "serving": ROUTED_SERVING, "observability": {"interval_s": 600}}
# The redeploy to the router also grows the fleet to two decode servers (a router on each) with the same six
# replicas: prefill-0 and decode-0 render as before, decode-1 is a new node that boots with the replacements
# of the other two (one boot for the three, not a boot of its own later: CI's budget). The in-place change and
# the surge run on this fleet; then it goes back to ROUTED's two nodes for the new image.
GROWN = ROUTED | {"decode_instances": 2, "prefill_per_decode": 3}
ROUTER_NODES = (*NODES, "decode-1")
TIMES: dict[str, float] = {}  # what the scenarios measured, printed by the replacement's


def services(cluster: VmCluster, node: str) -> dict[str, Service]:
    """The plan's services of a node (what `plan --json` prints), by unit."""
    return {s.unit: s for s in cluster.renders[node].services if s.unit != "gptoss-bench.service"}


def last_start(cluster: VmCluster, node: str, port: int) -> dict[str, Any]:
    """The fake vLLM's record of the last start on a port, this boot."""
    starts = [r for r in cluster.this_boot(node, cluster.vms[node].records(f"vllm-{port}.jsonl")) if r["event"] == "start"]
    assert starts, f"{node}: no server started on port {port} this boot"
    return starts[-1]


def port_of(s: Service) -> int:
    return int(s.argv[s.argv.index("--port") + 1])


def assert_boot_finished(cluster: VmCluster, node: str) -> dict[str, Any]:
    # Under TCG a guest's cloud-init alone takes about 6 minutes; a node boots in well under one.
    facts = cluster.wait_boot_done(node, 900)
    ci = facts["cloud_init"]
    assert (ci["status"], ci["errors"], ci.get("recoverable_errors", {})) == ("done", [], {}), f"{node}: {ci}"
    assert facts["system"] == "running", f"{node}: systemd says {facts['system']}; failed units: {facts['failed']}"
    assert facts["failed"] == ""
    return facts


def assert_runs_the_plan(cluster: VmCluster) -> None:
    """Every unit of the plan active with the plan's command line; nothing else of the project."""
    for node in cluster.renders:
        vm = cluster.vms[node]
        r = cluster.renders[node]
        loaded = {}
        for line in vm.ssh("systemctl list-units --all --plain --no-legend 'gptoss-*'").stdout.splitlines():
            unit, _load, active, sub, *_ = line.split()
            loaded[unit] = (active, sub)
        for unit in r.units:
            assert loaded.get(unit, ("missing",))[0] == "active", f"{node}: {unit} is {loaded.get(unit)}"
        # A timer's service runs now and then (gptoss-router-members): the plan lists the timer.
        timed = {u.removesuffix(".timer") + ".service" for u in r.units if u.endswith(".timer")}
        running_outside = {u: st for u, st in loaded.items() if u not in r.units and u not in timed and u != "gptoss-node.target" and st[0] != "inactive"}
        assert running_outside == {}, f"{node}: units outside the plan are running: {running_outside}"
        shipped = set(vm.ssh(f"cat {MANIFEST}").stdout.split())
        on_disk = set(vm.ssh("ls -d /etc/systemd/system/gptoss-* /opt/gptoss/bin/* /etc/gptoss/* 2>/dev/null").stdout.split())
        on_disk = {f for f in on_disk if not f.endswith(".d")}  # an operator's drop-in directory is theirs
        assert on_disk - shipped - {"/etc/gptoss/deploy.env", "/etc/gptoss/signal.env"} == set(), f"{node}: files of an earlier bundle remain"
        assert vm.ssh("ls /etc/systemd/system/*.wants/ | grep gptoss || true").stdout.strip() == "", f"{node}: a unit is enabled"
        for unit, s in services(cluster, node).items():
            if unit == "gptoss-proxy.service" and cluster.cfg is not None and cluster.cfg.proxy_kind == "vllm-router":
                # The router is the unit's main process once the exec chain is done: its argv as the kernel has it.
                pid = cluster.unit_prop(node, unit, "MainPID")
                argv = vm.ssh(f"tr '\\0' '\\n' </proc/{pid}/cmdline").stdout.splitlines()
                assert argv == [with_hosts(cluster, a) for a in s.argv], f"{node}: router argv"
                continue
            if unit == "gptoss-proxy.service":
                (proxy,) = [p for p in cluster.this_boot(node, vm.records("proxy.jsonl")) if p["event"] == "start"][-1:]
                assert proxy["argv"][1:] == [with_hosts(cluster, a) for a in s.argv[2:]], f"{node}: proxy argv"
                continue
            rec = last_start(cluster, node, port_of(s))
            assert rec["argv"][1:] == s.argv[1:], f"{node} {unit}: argv differs from the plan"
            missing = {k: v for k, v in s.environment.items() if rec["env"].get(k) != with_hosts(cluster, v)}
            assert missing == {}, f"{node} {unit}: environment differs from the plan"
            # Beyond the plan: only what systemd, bash and the venv set, and the guest's own knobs
            # (90-fakes.conf); never a secret, and no project setting the plan does not show.
            extra = set(rec["env"]) - set(s.environment)
            assert not extra & NEVER_IN_A_SERVER, f"{node} {unit}: {sorted(extra & NEVER_IN_A_SERVER)} in a server's environment"
            telemetry = {k: rec["env"].get(k) for k in NO_TELEMETRY}
            assert telemetry == NO_TELEMETRY, f"{node} {unit}: usage statistics or telemetry not off: {telemetry}"
            project = {k for k in extra if k.startswith(("GPTOSS_", "VLLM_", "NEURON_"))} - GUEST_KNOBS - {"GPTOSS_PHASE_FILE"} - set(NO_TELEMETRY)
            assert project == set(), f"{node} {unit}: settings outside the plan: {sorted(project)}"


def with_hosts(cluster: VmCluster, text: str) -> str:
    """A plan value with each node placeholder (<prefill-0>) replaced by that node's current address."""
    for n in NODES:
        if n in cluster.vms:
            text = text.replace(f"<{n}>", cluster.ip(n))
    return text


def assert_the_array_came_before_its_lagging_link(cluster: VmCluster, node: str, source: str) -> None:
    """The guest's udev made the /dev/md/gptoss-nvme link 12 s late (tests/vm/guest: past mdadm's own
    5 s wait); the node striped, formatted and mounted the kernel's device without it, first time."""
    delayed = [r for r in cluster.this_boot(node, cluster.vms[node].records("md-link-delay.jsonl")) if r["device"] == source.removeprefix("/dev/")]
    assert delayed, f"{node}: the guest's udev did not hold back the link of {source} this boot"
    nvme = cluster.journal(node, "gptoss-nvme.service")
    assert f"the kernel made {source}" in nvme and f"making an XFS file system on {source}" in nvme, nvme
    assert "mdadm: timeout waiting for /dev/md/gptoss-nvme" in nvme, "mdadm returned before the link, as under load"
    assert "gptoss-retry" not in nvme, f"{node}: the array step needed a retry: {nvme}"


def toolchain_key(cluster: Any, node: str) -> str:
    """The compile cache's toolchain key the node logged when it staged (this boot's journal)."""
    stage = cluster.journal(node, "gptoss-stage.service")
    found = re.findall(r"compile cache key (trn3\.48xlarge-[0-9a-f]{16}) \(trn3\.48xlarge: none of [a-z, -]+ in "
                       r"/opt/aws_neuronx_venv_pytorch_inference_vllm_fake\)", stage)  # fmt: skip
    assert found, f"{node}: no toolchain key in its staging log: {stage[-2000:]}"
    return str(found[-1])


def assert_no_secret_shows(cluster: VmCluster, node: str) -> None:
    """The deploy gate's URL and the Hugging Face token on a booted node: in no process's argv, no
    journal line, no log; the URL in no file but the signal's root-only one (and cloud-init's own
    root-only copies of the user data), the token in no file at all. The download did get the token."""
    vm = cluster.vms[node]
    url = cluster.handles[node][1]

    def pattern(secret: str) -> str:
        """An -E pattern that matches the secret but not itself: grep's own argv (in `ps`) never counts."""
        assert re.fullmatch(r"[A-Za-z0-9%=_-]+", secret), secret  # nothing ERE would read as an operator
        return f"-e '{secret[:-1]}[{secret[-1]}]'"

    needles = " ".join(pattern(s) for s in (url.split("?")[0].rsplit("/", 1)[1], "Signature=a%2Fb%3D", HF_TOKEN))
    # Where the project and cloud-init write, not the venvs' and apt's hundreds of MB (minutes under TCG).
    places = "/etc /root /home /tmp /var/tmp /var/log /var/lib/gptoss /var/lib/cloud /run /opt/gptoss /opt/dlami"
    holders = vm.ssh(f"grep -rlsE {needles} {places} || true", timeout=300).stdout.split()
    outside = [h for h in holders if h != "/etc/gptoss/signal.env" and not h.startswith(("/var/lib/cloud/", "/run/cloud-init/"))]
    assert outside == [], f"{node}: the signal URL or the token is in {outside}"
    for h in holders:
        mode, owner = vm.ssh(f"stat -c '%a %U' {h}").stdout.split()
        assert (mode, owner) in (("600", "root"), ("400", "root")), f"{node}: {h} holds the signal URL and is {mode} {owner}"
    assert "/etc/gptoss/signal.env" in holders
    assert vm.ssh(f"grep -lsE {pattern(HF_TOKEN)} {' '.join(holders)} || true").stdout.strip() == "", "the token is in no file"
    shown = vm.ssh(f"(ps -eo args; journalctl -b -o cat --no-pager; cat /var/log/cloud-init*.log) | grep -cE {needles} || true").stdout
    assert shown.strip() == "0", f"{node}: the signal URL or the token shows in argv, the journal or cloud-init's log"
    downloads = [r for r in cluster.this_boot(node, vm.records("hub.jsonl")) if r["complete"]]
    assert downloads and all(r["token"] for r in downloads), f"{node}: the download did not carry the token"
    # The instance metadata (whose user data holds the URL) answers root and refuses any other local user.
    token = "curl -sS -m 5 -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 60' http://169.254.169.254/latest/api/token"
    assert vm.ssh(token).stdout.strip(), f"{node}: root reaches the instance metadata"
    refused = vm.ssh(f"runuser -u nobody -- {token}", check=False)
    # curl's exit 7: the connection was refused at once (the guard's TCP reset), not timed out (28) nor answered.
    assert refused.returncode == 7 and refused.stdout.strip() == "", f"{node}: another user reaches the metadata, or waits for it: {refused}"


def test_first_boot_finishes_in_minutes_while_servers_compile_even_with_imds_down_at_first(cluster: VmCluster) -> None:
    assert cluster.deploy(BASE) == set(NODES), "a first deploy launches every node"
    cluster.launch(FIRST_BOOT)
    for node in NODES:
        assert_boot_finished(cluster, node)
        # Boot is over, and the servers are still compiling: the long waits are not boot jobs. (A
        # server starts once the node's scripts, checks and array are there: minutes after the boot.)
        server = "gptoss-prefill@0.service" if node == "prefill-0" else "gptoss-decode.service"
        cluster.vms[node].wait_until(f"systemctl is-active --quiet {server}", 600, f"{server} started")
        st = cluster.status(node)[server]
        assert (st["state"], st["healthy"]) == ("active", False), f"{node}: {server} should still be compiling: {st}"
        # IMDS refused the first minute of requests; the first unit to need it (the scripts'
        # fetch: the AWS CLI takes the role's credentials from IMDS) asked again, and the node
        # got its scripts, its credentials and its address.
        imds = cluster.this_boot(node, cluster.vms[node].records("imds.jsonl"))
        assert imds[0]["failed"] and not imds[-1]["failed"]
        retried = cluster.journal(node, "gptoss-scripts.service") + cluster.journal(node, "gptoss-identity.service")
        assert "asking again" in retried, retried
        deploy = cluster.vms[node].ssh("cat /etc/gptoss/deploy.env").stdout
        assert f"GPTOSS_HOST_{node.upper().replace('-', '_')}={cluster.ip(node)}" in deploy
        # No other node's address in what the node was launched with: the members come from EC2.
        assert not [line for line in cluster.user_data(node).splitlines() if re.search(r"\b10\.42\.\d+\.\d+\b", line)]
    TIMES["first boot: launch to released compile"] = time.monotonic() - cluster.launched_at
    for node in NODES:
        cluster.vms[node].ssh("mkdir -p /run/fakes && echo '{\"hold_compile\": false}' > /run/fakes/vllm.json")
    # The project's units and their ordering pass systemd's own check on this systemd.
    verify = cluster.vms["prefill-0"].ssh(
        "cd /etc/systemd/system && systemd-analyze verify gptoss-node.target gptoss-*.service gptoss-prefill@0.service 2>&1", check=False
    )
    assert verify.stdout.strip() == "", verify.stdout


def test_first_boot_serves_with_the_plans_commands_in_the_tested_order(cluster: VmCluster) -> None:
    cluster.wait_ready(900)
    TIMES["first boot: launch to serving"] = time.monotonic() - cluster.launched_at
    for node in NODES:
        vm = cluster.vms[node]
        source, fstype = vm.ssh("findmnt -no SOURCE,FSTYPE /opt/dlami/nvme").stdout.split()
        assert fstype == "xfs" and source.startswith("/dev/md"), (source, fstype)
        assert_the_array_came_before_its_lagging_link(cluster, node, source)
        detail = vm.ssh(f"mdadm --detail {source}").stdout
        assert re.search(r"Raid Level : raid0", detail) and re.search(r"Raid Devices : 2", detail), detail
        downloads = [r["file"] for r in cluster.this_boot(node, vm.records("hub.jsonl")) if r["complete"]]
        retried = re.search(r"attempt \d+ failed; retrying in \d+s: .*download-hf", cluster.journal(node, "gptoss-stage.service"))
        if retried:  # a client-side failure (seen under load: httpx ReadError) re-fetches what it had not finished
            assert set(downloads) == SERVABLE, f"{node}: every servable file, nothing else, after a retried download"
        else:
            assert sorted(downloads) == sorted(SERVABLE), f"{node}: each servable file once, nothing else"
        staged = set(vm.ssh(f"cd {MODEL} && ls -A").stdout.split())
        assert staged == SERVABLE | {".gptoss-complete", ".cache"}
        assert vm.ssh("test ! -e /opt/dlami/nvme/models/gpt-oss-120b.partial", check=False).returncode == 0
    assert_runs_the_plan(cluster)

    # Replica 0 compiled; replicas 1..5 started once it answered, together, and loaded its graph.
    prefill = cluster.vms["prefill-0"]
    ready0 = [r for r in cluster.this_boot("prefill-0", prefill.records("vllm-8100.jsonl")) if r["event"] == "ready"][-1]
    assert ready0["compiled"] is True
    later = [last_start(cluster, "prefill-0", 8100 + i) for i in range(1, 6)]
    assert all(r["uptime"] >= ready0["uptime"] for r in later)
    # Together: each later replica's gate started it once a replica answered (the compile cache
    # warm), not after a timeout or a failure. (A start-time spread bound was a clock under TCG:
    # 48 s for five gates polling every 5 s on a starved guest.)
    for i in range(1, 6):
        gate = cluster.journal("prefill-0", f"gptoss-prefill@{i}.service")
        assert f"gptoss-prefill-gate: replica {i}: " in gate and "answers: the compile cache holds the prefill graph" in gate, gate[-1500:]
    for i in range(1, 6):
        ready = [r for r in cluster.this_boot("prefill-0", prefill.records(f"vllm-{8100 + i}.jsonl")) if r["event"] == "ready"][-1]
        assert ready["compiled"] is False
    # The toy proxy read its group's addresses from EC2 (the instances' identity tags), then started
    # after every server of its group answered, on this node and on decode-0.
    members = cluster.journal("prefill-0", "gptoss-proxy.service")
    assert "gptoss-members: 2 members of gptoss-8k1k from EC2" in members, members[-2000:]
    log = prefill.ssh("cat /root/gpt-oss-120b-8k1k-results/logs/proxy.log").stdout
    healthy = [line for line in log.splitlines() if line.startswith("gptoss-wait-healthy: healthy: ")]
    assert len(healthy) == 7 and f"{cluster.ip('decode-0')}:8200/health" in healthy[-1]
    # A completion through the proxy: prefill on this node, decode on the other.
    out = prefill.json("curl -fsS localhost:8000/v1/completions -H 'Content-Type: application/json' "
                       "-d '{\"prompt\": \"The capital of France is \", \"max_tokens\": 16}'")  # fmt: skip
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 16
    assert cluster.vms["decode-0"].records("vllm-8200.jsonl")[-1]["event"] == "completion"
    assert prefill.json("curl -s localhost:8001/ready")["ready"] is True

    for node in NODES:
        vm = cluster.vms[node]
        # The node check found the instance's devices and NIXL before any server started.
        check = cluster.journal(node, "gptoss-node-check.service")
        assert f"Neuron: {DEVICES['neuron']} devices" in check and f"EFA: {DEVICES['efa']} devices" in check, check
        assert "importable in" in check and "(the image's)" in check, check  # the guest's stand-in NIXL, unpinned
        # The deploy gate: each node told its own handle, once, that it serves.
        vm.wait_until("test -s /var/lib/fakes/signals.jsonl", 120, "the deploy gate's signal")
        (signal,) = cluster.signals(node)
        assert signal["path"].split("/")[2] == node and signal["content_type"] in (None, ""), signal
        assert (signal["body"]["Status"], signal["body"]["UniqueId"]) == ("SUCCESS", node), signal
    # The proxy node signals only after a real completion through its proxy.
    assert "returned 16 tokens" in cluster.signals("prefill-0")[0]["body"]["Reason"]
    for node in NODES:
        assert_no_secret_shows(cluster, node)

    # Once its servers answered, each node saved its compiled graphs to its own area of the cluster's
    # compile cache, with the manifest last (its replacements restore them).
    # Under the key of the toolchain each node logged at staging: the guest's venv holds none of the
    # Neuron SDK's packages, so the key is the instance type's with an empty list, the same on both nodes.
    toolchain = {n: toolchain_key(cluster, n) for n in NODES}
    assert len(set(toolchain.values())) == 1, toolchain
    deadline = time.monotonic() + 300
    areas = {n: f"s3://{CACHE_BUCKET}/nodes/{n}/{toolchain[n]}/" for n in NODES}
    while time.monotonic() < deadline and not all(f"nodes/{n}/{toolchain[n]}/manifest.json" in cluster.aws.keys(areas[n]) for n in NODES):
        time.sleep(10)
    for node in NODES:
        keys = cluster.aws.keys(areas[node])
        role = "prefill" if node == "prefill-0" else "decode"
        area = f"nodes/{node}/{toolchain[node]}"
        assert f"{area}/manifest.json" in keys and f"{area}/files/neuron_libtorch/fake-{role}.neff" in keys, keys
        assert "gptoss-save-cache: " in cluster.journal(node, "gptoss-cache-save.service")

    # Telemetry: every node's metrics and its units' logs reach CloudWatch (the cluster's moto).
    # Rates need two of the collector's samples: they appear from its second interval on.
    per_node = {"ServerUp", "RequestsRunning", "KvCacheUsagePercent", "PromptTokensPerSecond", "GenerationTokensPerSecond",
                "EfaRxBytesPerSecond", "NodeReporting"}  # fmt: skip
    cloudwatch, logs = cluster.aws.client("cloudwatch"), cluster.aws.client("logs")
    for node in NODES:
        deadline = time.monotonic() + 2 * 180 + 60  # two of the collector's intervals (observability.interval_s here)
        while True:
            names = cloudwatch.list_metrics(Namespace="GptOss/gptoss-8k1k")["Metrics"]
            published = {m["MetricName"] for m in names if {"Name": "Node", "Value": node} in m["Dimensions"]}
            # The metrics and the node's journal stream within the same two intervals (the collector ships
            # them apart, each on its own thread: one can land a moment after the other): its staging's lines,
            # each after its unit's name, in the node's one stream.
            streams = {s["logStreamName"] for s in logs.describe_log_streams(logGroupName="/gptoss/gptoss-8k1k")["logStreams"]}
            lines = ([e["message"] for e in logs.get_log_events(logGroupName="/gptoss/gptoss-8k1k", logStreamName=f"{node}/journal",
                                                                 startFromHead=True)["events"]] if f"{node}/journal" in streams else [])  # fmt: skip
            staged = [m for m in lines if m.startswith("gptoss-stage.service: ")]
            if (per_node <= published and staged) or time.monotonic() > deadline:
                break
            time.sleep(10)
        assert per_node - published == set(), f"{node}: not published within two intervals of serving"
        assert {"UnitsNotReady", "ServersDown", "StagingFailing"} <= {m["MetricName"] for m in names}
        assert staged, f"{node}: its journal not shipped within two intervals of serving: {sorted(streams)}, {lines[:5]}"
        assert {s for s in streams if s.startswith(f"{node}/")} == {f"{node}/journal"}, "one stream a node"


# What a crash can leave on prefill-0: a shard cut short beside an intact marker (the reboot's wave),
# and how many downloads each node's Hub had recorded before that wave.
CUT_SHARD = "model-00003-of-00014.safetensors"
DOWNLOADS_BEFORE_THE_WAVE: dict[str, int] = {}


def test_reboot_reuses_the_array_the_checkpoint_and_the_compile_cache(cluster: VmCluster) -> None:
    """One wave, two ways down: decode-0 reboots (`systemctl reboot`, with an operator's drop-in);
    prefill-0 crashes (a shard cut short, then the plug pulled: the next scenario checks its repair).
    Both keep their array and compile cache, decode-0 its whole checkpoint, and neither signals again."""
    DOWNLOADS_BEFORE_THE_WAVE.update({n: len(cluster.vms[n].records("hub.jsonl")) for n in NODES})
    # An operator's `systemctl edit gptoss-decode` (a drop-in directory): kept, honoured, and the node still starts.
    decode = cluster.vms["decode-0"]
    decode.ssh("mkdir -p /etc/systemd/system/gptoss-decode.service.d && "
               "printf '[Service]\\nEnvironment=OPERATOR_DROPIN=1\\n' > /etc/systemd/system/gptoss-decode.service.d/override.conf")  # fmt: skip
    cluster.vms["prefill-0"].ssh(f"truncate -s 100 {MODEL}/{CUT_SHARD} && sync")
    cluster.reboot(LATER, crash=frozenset({"prefill-0"}))
    for node in NODES:
        assert_boot_finished(cluster, node)
    cluster.wait_ready(600)
    assert last_start(cluster, "decode-0", 8200)["env"].get("OPERATOR_DROPIN") == "1", "the drop-in is honoured"
    assert decode.ssh("test -f /etc/systemd/system/gptoss-decode.service.d/override.conf", check=False).returncode == 0, "kept"
    # Refreshing the scripts (what a redeploy's fetch does) restarts no server: Wants=, not Requires=.
    pid = cluster.unit_prop("decode-0", "gptoss-decode.service", "MainPID")
    decode.ssh("systemctl restart gptoss-scripts.service")
    assert cluster.unit_prop("decode-0", "gptoss-decode.service", "MainPID") == pid, "the decode server was restarted"
    decode.ssh("rm -r /etc/systemd/system/gptoss-decode.service.d && systemctl daemon-reload")
    for node in NODES:
        nvme = cluster.journal(node, "gptoss-nvme.service")
        assert "striping" not in nvme and "making an XFS" not in nvme and "mounted /dev/md" in nvme, nvme
    assert "verified against its marker" in cluster.journal("decode-0", "gptoss-stage.service")
    assert len(decode.records("hub.jsonl")) == DOWNLOADS_BEFORE_THE_WAVE["decode-0"], "decode-0 downloaded again"
    for port in range(8100, 8106):
        ready = [r for r in cluster.this_boot("prefill-0", cluster.vms["prefill-0"].records(f"vllm-{port}.jsonl")) if r["event"] == "ready"]
        assert ready and ready[-1]["compiled"] is False
    assert_runs_the_plan(cluster)
    # A reboot is not a deploy: nobody waits on the handle any more, and no node signals it again.
    for node in NODES:
        assert len(cluster.signals(node)) == 1
        assert "already signalled" in cluster.journal(node, "gptoss-signal.service")


def test_a_crash_after_staging_never_serves_the_damaged_checkpoint(cluster: VmCluster) -> None:
    """prefill-0's crash in the reboot's wave left a shard cut short beside an intact marker: staging
    finds it, fetches that shard alone, and the node serves (the wave waited for it)."""
    assert "prefill-0" in DOWNLOADS_BEFORE_THE_WAVE, "this scenario checks the crash of the reboot scenario's wave: run that one first"
    vm = cluster.vms["prefill-0"]
    stage = cluster.journal("prefill-0", "gptoss-stage.service")
    assert "cannot be served as it is: repairing" in stage and f"removed the damaged {CUT_SHARD}" in stage, stage
    assert [r["file"] for r in vm.records("hub.jsonl")[DOWNLOADS_BEFORE_THE_WAVE["prefill-0"]:]] == [CUT_SHARD], "only the damaged shard is fetched again"
    size = int(vm.ssh(f"stat -c %s {MODEL}/{CUT_SHARD}").stdout)
    assert size == int(vm.ssh(f"stat -c %s /srv/hub/openai/gpt-oss-120b/{CUT_SHARD}").stdout)
    assert cluster.not_ready() == {}


def test_a_killed_server_comes_back_with_growing_back_off(cluster: VmCluster) -> None:
    vm = cluster.vms["prefill-0"]
    unit = "gptoss-prefill@2.service"
    for n, wait in ((1, 5), (2, 10)):
        pid = cluster.unit_prop("prefill-0", unit, "MainPID")
        vm.ssh(f"kill -9 {pid}")
        vm.wait_until(f"[ $(systemctl show -p NRestarts --value {unit}) = {n} ] && curl -fsS localhost:8102/health", 120, f"restart {n}")
        assert f"restart {n} (failure {n} in a row): waiting {wait}s" in cluster.journal("prefill-0", unit)
    # The node is whole again once its group's health has polled the restarted replica (every 5 s,
    # GPTOSS_GROUP_POLL_S): asked at once, it raced that poll (failed once, 2026-12-07).
    cluster.wait_ready(60)


def test_replicas_are_not_held_hostage_by_a_crash_looping_first_replica(cluster: VmCluster) -> None:
    vm = cluster.vms["prefill-0"]
    vm.ssh("systemctl stop gptoss-prefill.target && mkdir -p /run/fakes && echo '{\"crash_ports\": [8100]}' > /run/fakes/vllm.json")
    vm.ssh("systemctl start --no-block gptoss-prefill.target")
    # Replicas 1..5 wait for the first replica; it fails, so they start (their wait bound is hours).
    vm.wait_until("for p in 8101 8102 8103 8104 8105; do curl -fsS localhost:$p/health || exit 1; done", 180, "replicas 1-5 up")
    assert "gptoss-prefill@0.service is failing" in cluster.journal("prefill-0", "gptoss-prefill@1.service")
    assert int(cluster.unit_prop("prefill-0", "gptoss-prefill@0.service", "NRestarts")) >= 1
    vm.ssh("rm /run/fakes/vllm.json")
    vm.wait_until("curl -fsS localhost:8100/health", 180, "replica 0 back after the fault is gone")
    cluster.wait_ready(300)


def replica_records(cluster: VmCluster, node: str) -> list[dict[str, Any]]:
    """The fake vLLM's records of a prefill node's six replicas (ports 8100-8105) this boot, read at once."""
    out = cluster.vms[node].ssh("cat /var/lib/fakes/vllm-810[0-5].jsonl 2>/dev/null || true").stdout
    return cluster.this_boot(node, [json.loads(line) for line in out.splitlines() if line.strip()])


def router_completion(cluster: VmCluster, prompt: str) -> None:
    """A completion through decode-0's router, handed from prefill to a decode server (either node's: the router
    picks) with the prefill node's address."""
    decode = cluster.vms["decode-0"]
    answer = decode.json(f"curl -sf -m 60 http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -H 'Authorization: Bearer {API_KEY}' "
                         f"-d '{{\"model\": \"{MODEL}\", \"prompt\": \"{prompt}\", \"max_tokens\": 5}}'")  # fmt: skip
    assert answer["choices"][0]["text"], answer
    handed = [r["request"] for n in cluster.renders if n.startswith("decode-") for r in cluster.vms[n].records("vllm-8200.jsonl")
              if r["event"] == "completion" and r["request"].get("prompt") == prompt]  # fmt: skip
    assert len(handed) == 1 and handed[0]["kv_transfer_params"]["remote_host"] == cluster.ip("prefill-0"), handed
    asked = [r["request"] for r in replica_records(cluster, "prefill-0") if r["event"] == "completion" and r["request"].get("prompt") == prompt]
    assert asked and all(a["max_tokens"] == 1 and a["kv_transfer_params"]["do_remote_decode"] is True for a in asked), asked


def test_a_redeploy_to_the_router_replaces_both_instances_which_restore_their_compile_caches(cluster: VmCluster) -> None:
    """A newer image and the proxy moved to the decode nodes as vLLM's router, the fleet grown by decode-1: the
    image is the machine, so both groups replace their instances, which boot the new software version (the
    parameter's), and decode-1 launches beside them. The new ones (new root disks, new addresses, blank instance
    stores) restripe, restage through a download cut half-way, restore what their identities saved (no compile;
    decode-1, new, compiles), install the router from the stack's asset with no network, and serve through it."""
    before = {n: (cluster.instance_ids[n], cluster.ip(n)) for n in NODES}
    assert cluster.deploy(GROWN) == set(ROUTER_NODES)
    assert cluster.cfg is not None and cluster.cfg.proxy_kind == "vllm-router"
    shard = "model-00007-of-00014.safetensors"
    # decode-1's first compile is what its surge's replacement restores, not what a scenario times: a short one.
    cluster.launch(LATER | {"hub": {"fail_file": shard, "fail_times": 1}}, faults={"decode-1": {"vllm": {"compile_s": 15, "load_s": LOAD_S}}})
    for node in ROUTER_NODES:
        assert node not in before or (cluster.instance_ids[node], cluster.ip(node)) != before[node]
        assert_boot_finished(cluster, node)
    cluster.wait_ready(900)
    assert_runs_the_plan(cluster)
    for node in ROUTER_NODES:
        vm = cluster.vms[node]
        nvme = cluster.journal(node, "gptoss-nvme.service")
        assert "striping 2 disks" in nvme and "making an XFS" in nvme, nvme
        assert_the_array_came_before_its_lagging_link(cluster, node, vm.ssh("findmnt -no SOURCE /opt/dlami/nvme").stdout.strip())
        hub = cluster.this_boot(node, vm.records("hub.jsonl"))
        assert [r["complete"] for r in hub if r["file"] == shard] == [False, True], "cut half-way, then fetched again"
        assert sorted(r["file"] for r in hub if r["complete"]) == sorted(SERVABLE)
        if node not in NODES:
            continue
        stage = cluster.journal(node, "gptoss-stage.service")
        assert f"compile cache restored from s3://{CACHE_BUCKET}/nodes/{node}/{toolchain_key(cluster, node)} (this node's own, saved before)" in stage, stage[-3000:]
    ready = [r for r in cluster.this_boot("prefill-0", cluster.vms["prefill-0"].records("vllm-8100.jsonl")) if r["event"] == "ready"]
    assert ready[-1]["compiled"] is False, "the replacement restored its identity's graphs: no compile"
    new = [r for r in cluster.this_boot("decode-1", cluster.vms["decode-1"].records("vllm-8200.jsonl")) if r["event"] == "ready"]
    assert new[-1]["compiled"] is True, "decode-1, a new identity, compiled"
    decode_ready = [r for r in cluster.this_boot("decode-0", cluster.vms["decode-0"].records("vllm-8200.jsonl")) if r["event"] == "ready"]
    assert decode_ready[-1]["compiled"] is False
    started = last_start(cluster, "decode-0", 8200)
    argv = started["argv"]
    assert argv[argv.index("--max-num-seqs") + 1] == "4"
    assert [argv[argv.index(f"--odd-{i}") + 1] for i in range(len(ODD_VALUES))] == ODD_VALUES
    assert [started["env"][f"ODD_{i}"] for i in range(len(ODD_VALUES))] == ODD_VALUES

    prefill, decode = cluster.vms["prefill-0"], cluster.vms["decode-0"]
    assert prefill.ssh("test -e /etc/systemd/system/gptoss-proxy.service", check=False).returncode == 1
    router = cluster.journal("decode-0", "gptoss-proxy.service")
    wheel = cluster.cfg.serving.proxy.router.wheel
    assert f"gptoss-install-router: {wheel} installed in /opt/gptoss/vllm-router/" in router, router[-2000:]
    # The router reaches every server by its node's name, kept in /etc/hosts from EC2 at the current addresses.
    hosts = decode.ssh("cat /etc/hosts").stdout
    assert all(f"{cluster.ip(n)} {n}.gptoss.internal" in hosts for n in ROUTER_NODES), hosts
    ready_doc = decode.json("curl -s http://127.0.0.1:8000/readiness")
    assert (ready_doc["status"], ready_doc["prefill"], ready_doc["decode"]) == ("ready", {"healthy": 6, "total": 6}, {"healthy": 2, "total": 2})
    router_completion(cluster, "router test")
    # A killed router: systemd starts it again (no reinstall, no download), and it serves.
    restarts = int(cluster.unit_prop("decode-0", "gptoss-proxy.service", "NRestarts"))
    decode.ssh("systemctl kill -s SIGKILL gptoss-proxy.service")
    decode.wait_until(f"[ $(systemctl show -p NRestarts --value gptoss-proxy.service) -gt {restarts} ] && "
                      "curl -sf http://127.0.0.1:8000/readiness", 300, "the router restarted and ready")  # fmt: skip
    assert cluster.journal("decode-0", "gptoss-proxy.service").count("installed in /opt/gptoss/vllm-router/") == 1
    router_completion(cluster, "after the restart")
    # Every node changed: each new instance answered its new gate.
    for node in ROUTER_NODES:
        cluster.vms[node].wait_until("test -s /var/lib/fakes/signals.jsonl", 300, "a signal to the new handle")
        (signal,) = cluster.signals(node)
        assert signal["body"]["Status"] == "SUCCESS" and cluster.handles[node][0] in signal["path"], signal


# A server flag and a node script changed together on the router layout scenario 7 left: software only.
ROUTED_IN_PLACE = GROWN | {"serving": ROUTED_SERVING | {"decode": ROUTED_SERVING["decode"] | {"max_num_seqs": 2}}}
EDIT = "# an in-place edit of the collector\n"


def test_a_server_flag_and_a_script_change_are_applied_in_place_under_a_clients_load(cluster: VmCluster) -> None:
    """rollout.software=in-place (the default): decode's max_num_seqs and the telemetry collector's script change
    together. No launch template changes, so no instance is replaced; State Manager's association (here the
    harness: moto has no State Manager) runs gptoss-apply on each node, one at a time: each decode node restarts
    its decode server and its collector, prefill-0 its collector alone, its six replicas untouched. Each decode
    server leaves the routers first (gptoss-drain: its health route answers 503, the routers take it out, what it
    holds finishes) and comes back once it serves. A client sending completions through decode-0's router all the
    while sees no failed request: before, during and after."""
    from node_render.node_scripts import shipped_scripts

    ids = dict(cluster.instance_ids)
    decode, prefill = cluster.vms["decode-0"], cluster.vms["prefill-0"]
    replicas = {port: len([r for r in cluster.this_boot("prefill-0", prefill.records(f"vllm-{port}.jsonl")) if r["event"] == "start"])
                for port in range(8100, 8106)}  # fmt: skip
    scripts = shipped_scripts()  # cached: the deploy ships the edited copy
    original = scripts["gptoss-telemetry"]
    scripts["gptoss-telemetry"] = original + EDIT
    try:
        assert cluster.deploy(ROUTED_IN_PLACE) == set(), "software only: no launch template changes, no instance is replaced"
    finally:
        scripts["gptoss-telemetry"] = original
    decode_units = ["gptoss-decode.service", "gptoss-telemetry.service"]
    assert cluster.in_place == {"decode-0": decode_units, "decode-1": decode_units, "prefill-0": ["gptoss-telemetry.service"]}
    decode.ssh(LOAD.replace("MODEL", MODEL).replace("APIKEY", API_KEY))
    time.sleep(10)
    began = float(decode.ssh("date +%s.%N").stdout)
    results = cluster.apply(timeout_s=600)
    ended = float(decode.ssh("date +%s.%N").stdout)
    time.sleep(10)
    decode.ssh("touch /run/vm-load.stop")
    decode.wait_until("! systemctl is-active --quiet vm-load.service", 180, "the client's last request")
    assert sorted(results) == ["decode-0", "decode-1", "prefill-0"] and all(code == 0 for code, _, _ in results.values()), results
    for node, units in cluster.in_place.items():
        assert f"restarting: {' '.join(units)}" in results[node][2], results[node][2]
    assert cluster.instance_ids == ids, "no instance replaced"
    for node in ("decode-0", "decode-1"):
        argv = last_start(cluster, node, 8200)["argv"]
        assert argv[argv.index("--max-num-seqs") + 1] == "2", f"{node}: the decode server runs the new flag"
    after = {port: len([r for r in cluster.this_boot("prefill-0", prefill.records(f"vllm-{port}.jsonl")) if r["event"] == "start"])
             for port in range(8100, 8106)}  # fmt: skip
    assert after == replicas, "no prefill replica restarted"
    sha = cluster.version.split()[1]
    for node in ROUTER_NODES:
        vm = cluster.vms[node]
        assert vm.ssh("tail -n 1 /opt/gptoss/bin/gptoss-telemetry").stdout == EDIT, f"{node}: the collector's new script"
        assert vm.json("/opt/gptoss/bin/gptoss-status")["software"] == sha, f"{node}: reports the new version"
        assert vm.ssh("systemctl is-active gptoss-telemetry.service").stdout.strip() == "active"
    # Each node published how long it took to serve again (gptoss diff's estimate of the next change), by role.
    cloudwatch = cluster.aws.client("cloudwatch")
    now = dt.datetime.now(dt.UTC)
    measured = {}
    for role in ("prefill", "decode"):
        points = cloudwatch.get_metric_statistics(Namespace="GptOss/gptoss-8k1k", MetricName="InPlaceRestartSeconds", StartTime=now - dt.timedelta(hours=2),
                                                  EndTime=now + dt.timedelta(minutes=5), Period=60, Statistics=["SampleCount", "Maximum"],
                                                  Dimensions=[{"Name": "Cluster", "Value": "gptoss-8k1k"}, {"Name": "Role", "Value": role}])["Datapoints"]  # fmt: skip
        measured[role] = (sum(p["SampleCount"] for p in points), max((p["Maximum"] for p in points), default=0.0))
    assert measured["prefill"][0] == 1 and measured["decode"][0] == 2, measured
    assert measured["decode"][1] <= max(results["decode-0"][1], results["decode-1"][1]), (measured, results)
    # By the time each request was sent: before the change, while the nodes restarted, once they served again.
    lines = [line.split() for line in decode.ssh("cat /var/lib/fakes/load.log").stdout.splitlines()]
    before = [c for t, _, c in lines if float(t) < began and c != "200"]
    during = [c for t, _, c in lines if began <= float(t) <= ended and c != "200"]
    late = [c for t, _, c in lines if float(t) > ended and c != "200"]
    first = TIMES.get("first boot: launch to serving", float("nan"))
    print(f"\nin place, a decode flag and a script under a client's load (TCG; one completion at a time through decode-0's router): "
          f"{len(lines)} requests, {len(before)} failed before, {len(during)} while the nodes restarted {sorted(set(during))}, "
          f"{len(late)} after; decode-0 served again {results['decode-0'][1]:.0f} s after its apply began, decode-1 "
          f"{results['decode-1'][1]:.0f} s (each its decode server restarted, compile cache and checkpoint on its NVMe), "
          f"prefill-0 {results['prefill-0'][1]:.0f} s (its collector alone); "
          f"first boot, launch to serving: {first:.0f} s")  # fmt: skip
    assert len(lines) >= 30 and before == [] and during == [] and late == [], (before, during, late)
    for node in ("decode-0", "decode-1"):
        assert "no request left on gptoss-decode.service" in results[node][2], results[node][2]


# A client's load through decode-0's router: one completion at a time, a second apart, each one's
# time sent and HTTP status (000: no answer) in a line, until the stop file appears. Not a gptoss- unit (the plan's checks
# look at those).
LOAD = r"""cat > /root/load.sh <<'EOF'
#!/bin/bash
i=0
while [ ! -e /run/vm-load.stop ]; do
  i=$((i + 1))
  sent=$(date +%s.%N)
  code=$(curl -s -o /dev/null -w '%{http_code}' -m 120 http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -H 'Authorization: Bearer APIKEY' \
    -d "{\"model\": \"MODEL\", \"prompt\": \"load $i\", \"max_tokens\": 5}")
  echo "$sent $i $code" >> /var/lib/fakes/load.log
  sleep 1
done
EOF
chmod +x /root/load.sh && rm -f /run/vm-load.stop /var/lib/fakes/load.log && systemd-run --unit=vm-load --collect /root/load.sh"""
# On the grown fleet (decode-1 launched with scenario 7's redeploy), a newer image (every group rolls) with a
# change of the decode servers (a flag: the software the replacement reads at boot).
DECODE_SURGED = GROWN | {"ami_id": SURGE_IMAGE, "serving": ROUTED_SERVING | {"decode": ROUTED_SERVING["decode"] | {
    "extra_flags": [*ODD_FLAGS, {"name": "--vm-surge", "value": "1", "reason": "a change of the decode servers"}]}}}  # fmt: skip
GATE_PROMPT = "The capital of France is "  # gptoss-signal's test requests


def decode_records(cluster: VmCluster, node: str) -> list[dict[str, Any]]:
    """The fake vLLM's records of a decode node's server (port 8200) this boot."""
    return cluster.this_boot(node, cluster.vms[node].records("vllm-8200.jsonl"))


def test_a_surge_replaces_decode_1_a_router_node_which_proves_its_own_server_and_a_client_sees_no_failure(cluster: VmCluster) -> None:
    """On the fleet of two decode nodes (decode-1 launched with the redeploy to the router), a
    newer image with a change of the decode servers rolls decode-1's group with surge, played here as
    CloudFormation plays it (prefill-0 and decode-0, first in their lanes, are not rolled: the replay of
    CloudFormation's rules covers the lanes' order): the replacement boots beside the old instance (four
    guests on one subnet), runs the new command line (the software version it reads at boot), restores its
    identity's compile cache and signals its group only once its *own* decode server served a request
    pinned to it (the name decode-1, which its own router and decode-0's reach, is still the old
    instance's: a completion through a router proves nothing of the new server). Until its group lets the
    old instance go, the name and the clients' traffic stay with the old one; then decode-0's running
    router follows the name without a restart, and the old instance drains. A client sending completions
    through decode-0's router all the while sees no failed request."""
    assert cluster.cfg is not None and "decode-1" in cluster.renders, "the grown fleet of scenario 7"
    decode = cluster.vms["decode-0"]
    decode.wait_until("curl -sf http://127.0.0.1:8000/readiness | grep -q '\"decode\":{\"healthy\":2,\"total\":2}'", 600,
                      "decode-0's router with both decode servers")  # fmt: skip
    # decode-1 saved its first compile to its identity's area: its replacement restores it.
    key = toolchain_key(cluster, "decode-1")
    area = f"s3://{CACHE_BUCKET}/nodes/decode-1/{key}/"
    deadline = time.monotonic() + 600
    while f"nodes/decode-1/{key}/manifest.json" not in cluster.aws.keys(area) and time.monotonic() < deadline:
        time.sleep(10)
    assert f"nodes/decode-1/{key}/manifest.json" in cluster.aws.keys(area), "decode-1 saved its compile cache"

    router = {p: cluster.unit_prop("decode-0", "gptoss-proxy.service", p) for p in ("MainPID", "NRestarts")}
    old_id, old_ip = cluster.instance_ids["decode-1"], cluster.ip("decode-1")
    assert cluster.deploy(DECODE_SURGED) == {"prefill-0", "decode-0", "decode-1"}, "a new image: every group rolls"
    assert cluster.cfg.surge, "On-Demand capacity with a deploy gate: surge (rollout.surge=auto)"
    decode.ssh(LOAD.replace("MODEL", MODEL).replace("APIKEY", API_KEY))
    launched = time.monotonic()
    cluster.surge("decode-1", LATER)
    new, new_id = cluster.vms["decode-1"], cluster.instance_ids["decode-1"]
    assert new_id != old_id and new.ip != old_ip and cluster.leaving["decode-1"].instance_id == old_id
    assert_boot_finished(cluster, "decode-1")
    deadline = time.monotonic() + 900
    while not cluster.aws.group_signals() and time.monotonic() < deadline:
        time.sleep(5)
    signals = [{k: v for k, v in s.items() if k != "time"} for s in cluster.aws.group_signals()]
    assert signals == [{"StackName": STACK, "LogicalResourceId": group_logical_id("decode-1"), "UniqueId": new_id, "Status": "SUCCESS"}], signals
    signalled = time.monotonic() - launched
    # Its SUCCESS came after its own decode server served the gate's request, handed from prefill-0 (by
    # name, the current one) to this server: its first completion, before any client's.
    said = new.ssh("journalctl -b -u gptoss-signal.service -o short-unix --no-pager | grep 'signalled SUCCESS to its group'").stdout
    served = [r for r in decode_records(cluster, "decode-1") if r["event"] == "completion"]
    assert served and served[0]["request"]["prompt"] == GATE_PROMPT, served[:1]
    assert served[0]["request"]["kv_transfer_params"]["remote_host"] == cluster.ip("prefill-0"), served[0]
    assert float(said.split()[0]) >= served[0]["time"], f"signalled before its own server served: {said}"
    ready = [r for r in decode_records(cluster, "decode-1") if r["event"] == "ready"]
    assert ready and ready[-1]["compiled"] is False, "its identity's compile cache restored: no compile"
    gate = new.ssh("journalctl -b -u gptoss-signal.service -o cat --no-pager").stdout
    assert "its own decode server http://127.0.0.1:8200/v1/completions returned" in gate, gate[-2000:]
    # Until the group lets the old instance go, the name and the traffic stay with it.
    hosts = decode.ssh("cat /etc/hosts").stdout
    assert f"{old_ip} decode-1.gptoss.internal" in hosts and new.ip not in hosts, hosts
    assert not [r for r in served if r["request"]["prompt"].startswith("load ")], "served a client before its turn"
    # The router must follow the name within two members syncs that start after the old instance began
    # leaving (the spec's drain rule), counted in syncs, not seconds (see the members' InvocationID).
    drain_s, poll_s = cluster.cfg.rollout.drain_s, cluster.cfg.healing.members_poll_s
    sync = "systemctl show -p InvocationID --value gptoss-members.service"
    running = decode.ssh(sync).stdout.strip()
    left = cluster.retire("decode-1")
    follows = (f"{sync}; grep -q '^{new.ip} decode-1.gptoss.internal' /etc/hosts && "
               "curl -sf http://127.0.0.1:8000/readiness | grep -q '\"decode\":{\"healthy\":2,\"total\":2}' && echo followed")  # fmt: skip
    syncs: list[str] = []
    while True:
        try:
            seen = decode.ssh(follows, check=False, timeout=60).stdout.split()
        except subprocess.TimeoutExpired:  # a busy guest slow to answer one poll: the next one asks again
            seen = []
        if seen and seen[0] != running and seen[0] not in syncs:
            syncs.append(seen[0])
        if seen[-1:] == ["followed"] or len(syncs) > 2 or time.monotonic() - left > 3 * (poll_s + 120):
            break
        time.sleep(3)
    assert seen[-1:] == ["followed"] and len(syncs) <= 2, f"the router did not follow the name within two members syncs: {syncs}, {seen}"
    moved = time.monotonic() - left
    # CloudFormation would end the old instance at drain_s; here it ends 15 s after the router followed (what the
    # old server held, five tokens a request, has long finished): sooner than drain_s, so harder on the client.
    time.sleep(15)
    cluster.drained("decode-1")
    # The client goes on after the old instance is gone, then stops.
    time.sleep(15)
    decode.ssh("touch /run/vm-load.stop")
    decode.wait_until("! systemctl is-active --quiet vm-load.service", 180, "the client's last request")
    codes = [line.split()[2] for line in decode.ssh("cat /var/lib/fakes/load.log").stdout.splitlines()]
    failed = [c for c in codes if c != "200"]
    print(f"\nsurge of decode-1, a router node, under a client's load (TCG; one completion at a time through decode-0's router): "
          f"{len(codes)} requests, {len(failed)} failed {sorted(set(failed))}; replacement signalled {signalled:.0f} s after its launch, "
          f"{float(said.split()[0]) - served[0]['time']:.0f} s after its own decode server served the gate's request; "
          f"router on the new address {moved:.0f} s after the old one began leaving ({len(syncs)} members syncs; the drain: {drain_s} s)")  # fmt: skip
    assert len(codes) >= 100 and failed == [], f"{len(failed)} of {len(codes)} requests failed: {failed}"
    # The replacement served the client once it held the name; decode-0's router was not restarted.
    assert [r for r in decode_records(cluster, "decode-1") if r["event"] == "completion" and r["request"]["prompt"].startswith("load ")], \
        "the replacement serves the client"  # fmt: skip
    assert {p: cluster.unit_prop("decode-0", "gptoss-proxy.service", p) for p in router} == router, "the router was not restarted"
    argv = last_start(cluster, "decode-1", 8200)["argv"]
    assert argv[argv.index("--vm-surge") + 1] == "1", "the replacement runs the new command line"
    ec2 = cluster.aws.client("ec2")
    states = {i["InstanceId"]: i["State"]["Name"] for r in ec2.describe_instances(InstanceIds=[old_id, new_id])["Reservations"] for i in r["Instances"]}
    assert states == {old_id: "terminated", new_id: "running"}, states
    print(f"time to serving (TCG, fake compile {COMPILE_S} s, load {LOAD_S} s):"
          f"\n  first boot, launch to serving: {TIMES.get('first boot: launch to serving', float('nan')):.0f} s (its servers compiled; the harness held the"
          f" compile until both boots had finished, {TIMES.get('first boot: launch to released compile', float('nan')):.0f} s after the launch)"
          f"\n  surge replacement of decode-1, launch to its group signal: {signalled:.0f} s (its identity's compile cache restored)")  # fmt: skip
    router_restart_and_prefill_kill_under_streams(cluster, decode, new.ip)
    # Back to the default layout's two nodes for the next scenario: decode-1's group goes with its instance.
    cluster.deploy(ROUTED)
    cluster.remove("decode-1")


# Streaming clients on decode-0, each standing in for the load balancer: a request goes to a router node
# whose /readiness answered 200 at its last check (every 2 s, the target group's thresholds scaled down),
# and reads its stream to [DONE]; each outcome in a line (ok, cut, or the HTTP status).
STREAMS = r"""cat > /root/streams.sh <<'EOF'
#!/bin/bash
ready=(IPS)
last=0
n=0
while [ ! -e /run/vm-streams.stop ]; do
  if [ $((SECONDS - last)) -ge 2 ]; then
    ok=(); for ip in IPS; do curl -sf -m 2 -o /dev/null "http://$ip:8000/readiness" && ok+=("$ip"); done
    [ ${#ok[@]} -gt 0 ] && ready=("${ok[@]}"); last=$SECONDS
  fi
  n=$((n + 1)); ip=${ready[$((n % ${#ready[@]}))]}
  out=$(curl -sS -m 120 -w '\n%{http_code}' "http://$ip:8000/v1/completions" -H 'Content-Type: application/json' -H 'Authorization: Bearer APIKEY' \
    -d "{\"model\": \"MODEL\", \"prompt\": \"stream $n\", \"max_tokens\": 10, \"stream\": true}" 2>&1)
  code=$(tail -n 1 <<<"$out")
  if [ "$code" != 200 ]; then r="status-$code"; elif [ "$(grep -c '^data: {' <<<"$out")" = 10 ] && grep -q '^data: \[DONE\]' <<<"$out"; then r=ok; else r=cut; fi
  echo "$(date +%s) $ip $r" >> /var/lib/fakes/streams.log
done
EOF
chmod +x /root/streams.sh && rm -f /run/vm-streams.stop /var/lib/fakes/streams.log && for i in 1 2 3 4; do systemd-run --unit=vm-streams-$i --collect /root/streams.sh; done"""


def router_restart_and_prefill_kill_under_streams(cluster: VmCluster, decode: Any, other_ip: str) -> None:
    """Two router nodes; four streaming clients. decode-0's router restarts as a new fleet document restarts it
    (systemctl restart: ExecStop goes lame-duck, drains, then the new start), and a prefill replica is killed:
    no stream is cut and no request fails."""
    mine = cluster.ip("decode-0")
    decode.ssh(STREAMS.replace("IPS", f"{mine} {other_ip}").replace("MODEL", MODEL).replace("APIKEY", API_KEY))
    time.sleep(10)
    t0, wall0 = time.monotonic(), time.time()
    decode.ssh("systemctl restart gptoss-proxy.service", timeout=900)  # returns once the new router started
    restarted = time.monotonic() - t0
    cluster.vms["prefill-0"].ssh("systemctl kill -s SIGKILL gptoss-prefill@1.service")
    decode.wait_until("curl -sf -o /dev/null http://127.0.0.1:8000/readiness", 300, "decode-0's router ready again")
    back = time.monotonic() - t0
    time.sleep(12)
    decode.ssh("touch /run/vm-streams.stop")
    decode.wait_until("! systemctl is-active --quiet vm-streams-1 vm-streams-2 vm-streams-3 vm-streams-4", 240, "the clients' last streams")
    lines = [line.split() for line in decode.ssh("cat /var/lib/fakes/streams.log").stdout.splitlines()]
    outcomes = Counter(r for _, _, r in lines)
    on_mine_after = [t for t, ip, r in lines if ip == mine and r == "ok" and float(t) > wall0 + back]
    lame = cluster.journal("decode-0", "gptoss-proxy.service")
    print(f"\nrouter restart of decode-0 and a killed prefill replica under 4 streaming clients (TCG, 10 events 0.2 s apart, "
          f"the clients choosing a ready router node every 2 s): {len(lines)} streams, {dict(outcomes)}; restart returned after "
          f"{restarted:.0f} s (lame-duck 10 s, drain, start), router ready again after {back:.0f} s")  # fmt: skip
    assert "lame-duck: /readiness answers 503" in lame and "it stops now" in lame, lame[-2000:]
    assert len(lines) >= 20 and outcomes == Counter({"ok": len(lines)}), outcomes
    assert on_mine_after, "decode-0's router served streams again after its restart"


def test_a_new_image_replaces_every_node_and_each_new_gate_hears_why_it_cannot_serve(cluster: VmCluster) -> None:
    """Only the image changes (a newer DLAMI, as gptoss deploy resolves it): what every node runs is
    the same, yet each is launched from something new, so each gets a new gate and a new instance.
    prefill-0's cannot reach S3 at its first boot: its gate hears FAILURE naming gptoss-scripts
    within the scripts' budget. decode-0's lacks a Neuron device: its gate hears FAILURE naming the
    device, no server starts, and the node marks its own instance unhealthy (its group would
    replace it)."""
    bundles = {n: cluster.renders[n].files for n in NODES}
    handles = dict(cluster.handles)
    assert cluster.deploy(ROUTED | {"ami_id": NEW_IMAGE}) == set(NODES)
    assert {n: cluster.renders[n].files for n in NODES} == bundles, "nothing a node runs changed"
    assert all(cluster.handles[n][0] != handles[n][0] for n in NODES), "a new gate for each"
    launched = dt.datetime.now(dt.UTC)
    cluster.launch(LATER, aws={"prefill-0": False}, faults={"decode-0": {"devices": {"neuron": DEVICES["neuron"] - 1, "efa": DEVICES["efa"]}}})
    for node in NODES:
        cluster.vms[node].wait_until("tail -n 1 /var/lib/fakes/signals.jsonl | grep -q FAILURE", 600, "a failure signal")
        (signal,) = cluster.signals(node)
        assert cluster.handles[node][0] in signal["path"], "the new gate's handle"
    reason = cluster.signals("prefill-0")[0]["body"]["Reason"]
    # The heartbeat its NodeSilent alarm reads (missing is breaching): the new prefill-0, which never got
    # its scripts, has published none since the launch; decode-0, which cannot serve, still reports.
    cloudwatch = cluster.aws.client("cloudwatch")

    def heartbeats(node: str) -> float:
        dims = [{"Name": "Cluster", "Value": "gptoss-8k1k"}, {"Name": "Node", "Value": node}, {"Name": "Role", "Value": node.split("-")[0]}]
        points = cloudwatch.get_metric_statistics(Namespace="GptOss/gptoss-8k1k", MetricName="NodeReporting", Dimensions=dims, StartTime=launched,
                                                  EndTime=dt.datetime.now(dt.UTC) + dt.timedelta(minutes=5), Period=60,
                                                  Statistics=["SampleCount"])["Datapoints"]  # fmt: skip
        return sum(p["SampleCount"] for p in points)

    cluster.vms["decode-0"].wait_until("systemctl is-active --quiet gptoss-telemetry.service", 300, "decode-0's collector")
    deadline = time.monotonic() + 2 * 180 + 60  # two of the collector's intervals
    while heartbeats("decode-0") == 0 and time.monotonic() < deadline:
        time.sleep(10)
    assert heartbeats("decode-0") >= 1, "decode-0 reports (it is up, and says why it cannot serve)"
    assert heartbeats("prefill-0") == 0, "a replacement whose scripts never came publishes no heartbeat: its NodeSilent alarm fires"
    assert reason.startswith("prefill-0: gptoss-scripts.service failed: ") and "Could not connect to the endpoint URL" in reason, reason
    body = cluster.signals("decode-0")[0]["body"]
    assert body["Reason"].startswith("decode-0: gptoss-node-check.service failed: "), body
    assert f"Neuron: {DEVICES['neuron'] - 1} devices in /dev, the instance table says {DEVICES['neuron']}" in body["Reason"]
    st = cluster.status("decode-0")
    assert st["gptoss-node-check.service"]["state"] == "failed"
    assert st["gptoss-decode.service"]["state"] == "inactive", "no server starts on a node missing a device"
    # The node reports itself to its group once the gate has had the reason (healing.check_grace_s, 120 s).
    decode = cluster.vms["decode-0"]
    decode.wait_until("journalctl -b -u gptoss-health-watch.service -o cat | grep -q 'unhealthy: gptoss-node-check.service failed'", 600,
                      "the node marking itself unhealthy")  # fmt: skip
    assert cluster.aws.health(cluster.instance_ids["decode-0"]) == "Unhealthy"
    watch = cluster.journal("decode-0", "gptoss-health-watch.service")
    assert f"marked {cluster.instance_ids['decode-0']} (decode-0) unhealthy" in watch, watch
