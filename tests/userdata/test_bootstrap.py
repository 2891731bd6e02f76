"""The node's boot: units verified by systemd, user data parsed back and run, plan = user data."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from clusterspec.config import ClusterConfig
from clusterspec.loading import load_config
from clusterspec.names import host_var
from node_render.haproxy import NODE_KEY_ENV, NODE_KEY_PLACEHOLDER
from node_render.node_files import NodeRender, served
from node_render.node_scripts import NODE_SCRIPTS, node_script
from node_render.paths import BIN, DEPLOY_ENV, MANIFEST, MEMBERS_ENV, NIXL_ENV, UNITS_FILE
from node_render.quoting import parse_env_file, systemd_expand
from node_render.render import render_cluster, render_node
from node_render.userdata import (
    USER_DATA_LIMIT,
    boot_files,
    node_files_in,
    node_software,
    parse_user_data,
    software_asset,
    unbundle,
)
from tests.conftest import CACHE_URI, SOFTWARE_PARAMETER, node_user_data

LONGEST_IP = "10.255.255.254"
LAYOUTS = {"6p1d": {}, "3p8d": {"decode_instances": "8"}}


@functools.cache
def renders(layout: str) -> list[NodeRender]:
    return render_cluster(load_config(LAYOUTS[layout]))


def all_user_data(layout: str) -> dict[str, str]:
    return {r.node.name: node_user_data(r) for r in renders(layout)}


# ---- systemd ------------------------------------------------------------------------------


def _verify(cfg: ClusterConfig, node_name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify of one node's units with the node target: what systemd would load and start."""
    node = next(n for n in cfg.layout.nodes if n.name == node_name)
    d = tmp_path / node.name
    bindir = d / "bin"
    bindir.mkdir(parents=True)
    r = render_node(cfg, cfg.layout, node, bin_dir=str(bindir))
    for name in r.scripts:  # the asset's scripts are ExecStart binaries too
        (bindir / name).write_text(node_script(name))
        (bindir / name).chmod(0o755)
    units = []
    for path, (text, _) in r.files.items():
        p = Path(path)
        if p.suffix in {".service", ".target"}:
            (d / p.name).write_text(text)
            units.append(d / p.name)
    for rep in node.replicas:  # instances of the template unit
        (d / rep.unit).symlink_to(d / "gptoss-prefill@.service")
        units.append(d / rep.unit)
    units = [u for u in units if u.name != "gptoss-prefill@.service"]
    return subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True, cwd=d)


@pytest.mark.parametrize(("layout", "node"), [("6p1d", "prefill-0"), ("6p1d", "decode-0"), ("3p8d", "prefill-0"), ("3p8d", "decode-3")])
def test_every_unit_passes_systemd_analyze_verify(layout: str, node: str, tmp_path: Path) -> None:
    res = _verify(load_config(LAYOUTS[layout]), node, tmp_path)
    assert (res.returncode, res.stdout + res.stderr) == (0, ""), f"{node}: {res.stdout}{res.stderr}"


def test_systemd_analyze_verify_catches_an_ordering_cycle(tmp_path: Path) -> None:
    """The verify above would see the cycle that once kept the replicas from starting at all."""
    (tmp_path / "a.target").write_text("[Unit]\nWants=b.service\nAfter=b.service\n")
    (tmp_path / "b.service").write_text("[Unit]\nAfter=a.target\n[Service]\nExecStart=/bin/true\n")
    res = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "a.target")], capture_output=True, text=True, cwd=tmp_path)
    assert "ordering cycle" in res.stdout + res.stderr


def _units(layout: str = "6p1d") -> dict[str, str]:
    return {k.rsplit("/", 1)[1]: v[0] for r in renders(layout) for k, v in r.files.items() if k.startswith("/etc/systemd/system/")}


def test_no_unit_is_enabled_or_part_of_the_boot_transaction() -> None:
    """Every unit starts through gptoss-node.target, which gptoss-bootstrap starts at each boot."""
    for name, text in _units().items():
        assert "[Install]" not in text and "WantedBy" not in text, name
        assert "Before=multi-user.target" not in text and "cloud-final" not in text, name


def test_long_waits_are_in_the_main_process_not_in_start_jobs() -> None:
    """A start job that waits hours keeps systemd's boot 'starting' and cloud-init 'running'."""
    units = _units()
    for name in ("gptoss-decode.service", "gptoss-prefill@.service", "gptoss-proxy.service", "gptoss-stage.service"):
        text = units[name]
        assert "Type=exec" in text, name
        pre = re.findall(r"^ExecStartPre=(.*)$", text, re.M)
        # The toy proxy also reads its group's addresses from EC2 (bounded: 600 s) before it starts.
        members = ["/opt/gptoss/bin/gptoss-members write"] if name == "gptoss-proxy.service" else []
        # A proxy holds no state: its own back-off, 1 s doubling to 30 s (serving.proxy.restart_backoff_s, _max_s).
        backoff = "/opt/gptoss/bin/gptoss-backoff %n" + (" 1 30" if members else "")
        assert pre == [backoff, *members], f"{name}: only the restart back-off may run before the start"
        # The start job may last as long as the longest back-off (and the members' wait), and no longer: a
        # server's back-off reaches 900 s, a proxy's 30 s (it holds no state: serving.proxy.restart_backoff_max_s).
        timeout = int(re.search(r"TimeoutStartSec=(\d+)", text).group(1))  # type: ignore[union-attr]
        assert timeout == (30 + 60 + 600 if members else 900 + 60), name
    # The servers wait for this boot's staging, the replicas for the first one, the proxy for its group.
    assert "gptoss-exec decode /opt/gptoss/bin/gptoss-prepare-schedule --" in units["gptoss-decode.service"]
    assert "gptoss-exec prefill_%i /opt/gptoss/bin/gptoss-prefill-gate %i 14400 gptoss-prefill@0.service" in units["gptoss-prefill@.service"]
    assert "gptoss-exec proxy /opt/gptoss/bin/gptoss-wait-healthy 36000 http://" in units["gptoss-proxy.service"]


def test_restart_policies() -> None:
    """Servers come back whatever stopped them but an operator; staging retries failures; no start limit."""
    units = _units()
    for name in ("gptoss-decode.service", "gptoss-prefill@.service", "gptoss-proxy.service", "gptoss-group-health.service"):
        assert "\nRestart=always\n" in units[name] and "\nStartLimitIntervalSec=0\n" in units[name], name
    assert "\nRestart=on-failure\n" in units["gptoss-stage.service"] and "\nStartLimitIntervalSec=0\n" in units["gptoss-stage.service"]
    for name in ("gptoss-decode.service", "gptoss-prefill@.service"):
        assert "KillSignal=SIGINT" in units[name] and "KillMode=mixed" in units[name]


def test_every_unit_needs_the_fetched_scripts_and_runs_as_root() -> None:
    for name, text in _units().items():
        if name.endswith(".service"):
            assert "\nUser=root\n" in text, f"{name}: without User= systemd sets no HOME (the caches are under ~/.cache)"
            if name not in {"gptoss-scripts.service", "gptoss-bench.service"}:
                # Wants=, not Requires=: refreshing the scripts restarts no unit (and no server through it).
                assert "Wants=gptoss-scripts.service" in text and "Requires=gptoss-scripts" not in text and re.search(r"^After=gptoss-scripts\.service", text, re.M), name
    # After cloud-init's bootcmd stage under either name (cloud-init.service until 24.2, cloud-init-network.service since).
    assert "After=gptoss-scripts.service local-fs.target cloud-init.service cloud-init-network.service" in _units()["gptoss-nvme.service"]


def test_the_node_target_wants_exactly_the_nodes_units() -> None:
    for r in renders("6p1d"):
        target = r.files["/etc/systemd/system/gptoss-node.target"][0]
        wants = re.search(r"^Wants=(.*)$", target, re.M).group(1).split()  # type: ignore[union-attr]
        assert wants == r.wants
        listed = r.files[UNITS_FILE][0].split()
        assert set(listed) == set(r.units)
        assert all(u in listed for u in wants)
    prefill, decode = renders("6p1d")
    assert prefill.wants == ["gptoss-scripts.service", "gptoss-nvme.service", "gptoss-identity.service", "gptoss-node-check.service",
                             "gptoss-stage.service", "gptoss-prefill.target", "gptoss-proxy.service", "gptoss-group-health.service",
                             "gptoss-members.timer", "gptoss-signal.service", "gptoss-cache-save.service", "gptoss-health-watch.timer",
                             "gptoss-telemetry.service"]  # fmt: skip
    assert "gptoss-decode.service" in decode.wants and "gptoss-proxy.service" not in decode.wants


# ---- user data ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_user_data_fits_16_kb_with_room_to_spare(layout: str) -> None:
    sizes = {name: len(text.encode()) for name, text in all_user_data(layout).items()}
    assert max(sizes.values()) <= USER_DATA_LIMIT * 0.7, sizes


def test_user_data_of_a_64_decode_fleet_still_fits() -> None:
    cfg = load_config({"decode_instances": "64"})
    sizes = [len(node_user_data(r).encode()) for r in render_cluster(cfg)]
    assert max(sizes) <= USER_DATA_LIMIT


def test_user_data_carries_only_the_boot_files() -> None:
    """The boot, the software fetch and its unit, the status report and the gate's failure answer: nothing a
    software change touches (the node's units, environment and other scripts are its software)."""
    for r in renders("6p1d"):
        files, _, _ = parse_user_data(node_user_data(r))
        assert {p.rsplit("/", 1)[1] for p in files if p.startswith(f"{BIN}/")} == set(NODE_SCRIPTS)
        assert set(files) - {f"{BIN}/{n}" for n in NODE_SCRIPTS} == {"/etc/systemd/system/gptoss-scripts.service"}
        assert files == boot_files(r) and not set(files) & set(node_software(r))
        manifest = set(r.files[MANIFEST][0].split())
        assert {f"{BIN}/{n}" for n in r.scripts} <= manifest and set(r.files) <= manifest


def test_the_software_asset_holds_every_other_file_and_script_any_node_runs() -> None:
    for layout in LAYOUTS:
        asset = unbundle(software_asset(renders(layout)))
        needed = set().union(*(r.scripts for r in renders(layout))) - NODE_SCRIPTS
        shared = {p: f for r in renders(layout) for p, f in r.shared.items()}
        scripts = {p: f for p, f in asset.items() if p not in shared and not p.startswith("/nodes/")}
        assert {p.rsplit("/", 1)[1] for p in scripts} == needed
        assert all(mode == 0o755 and text == node_script(p.rsplit("/", 1)[1]) for p, (text, mode) in scripts.items())
        # The API gate's configuration and its keys' reader (a router layout checks keys by default), the same on every
        # router node, travel once, not with each node's files.
        assert {p: asset[p] for p in shared} == shared
        gated = any("gptoss-api.service" in r.units for r in renders(layout))
        keys = {"/etc/gptoss/keys.env", "/etc/systemd/system/gptoss-keys.service", "/etc/systemd/system/gptoss-keys.timer"}
        assert set(shared) == ({"/etc/gptoss/haproxy.cfg"} | keys if gated else set())
        for r in renders(layout):
            manifest = r.files["/etc/gptoss/manifest"][0].split()
            assert all(p in manifest for p in r.shared) and all(p not in r.files for p in r.shared), r.node.name
            # Each node's own files under nodes/<node>/, exactly as rendered (its boot files aside).
            assert node_files_in(software_asset(renders(layout)), r.node.name) == node_software(r), r.node.name
    assert software_asset(renders("6p1d")) == software_asset(render_cluster(load_config({}))), "reproducible"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_no_unrendered_placeholder_and_no_secret(layout: str) -> None:
    for r in renders(layout):
        name, text = r.node.name, node_user_data(r)
        _, deploy, _ = parse_user_data(text)
        for path, (content, _) in r.files.items():
            jinja = re.search(r"\{\{-?\s*[\w.|() ]+\s*-?\}\}|\{%-?\s*\w+|\{##", content)
            assert not jinja, f"{name}:{path} holds unrendered template text {jinja.group(0)!r}"
            assert not re.search(r"=None$|\bUndefined\b", content, re.M), f"{name}:{path} holds an unset value"
            assert not re.search(r"<(prefill|decode)-\d+>", content), f"{name}:{path} holds a plan-only host placeholder"
            assert not re.search(r"hf_[A-Za-z0-9]{20,}", content), f"{name}:{path} holds a Hugging Face token"
        # No other node's address: any node's instance may be replaced (the members come from EC2).
        assert not [k for k in deploy if k.startswith("GPTOSS_HOST_")], f"{name}: {deploy}"
        assert not re.search(r"\b10\.\d+\.\d+\.\d+\b", text), f"{name}: an address in the user data"
        assert (deploy["GPTOSS_SOFTWARE_PARAMETER"], deploy["GPTOSS_NODE"]) == (SOFTWARE_PARAMETER, name)
        assert not [k for k in deploy if k.startswith("GPTOSS_SCRIPTS_")], "no software version: the parameter names it"


def booted_env(files: dict[str, tuple[str, int]], deploy: dict[str, str], self_ip: str) -> dict[str, str]:
    """deploy.env after gptoss-identity appended the node's own IP under GPTOSS_SELF_HOST_VAR."""
    return deploy | {parse_env_file(files["/etc/gptoss/cluster.env"][0])["GPTOSS_SELF_HOST_VAR"]: self_ip}


def runtime_env(files: dict[str, tuple[str, int]], path: str, self_ip: str, ip: Callable[[str], str]) -> dict[str, str]:
    """What the boot writes under /run: the side channel's address (gptoss-identity), the members (gptoss-members), a
    router node's own key (gptoss-api init)."""
    if path == NIXL_ENV:
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": self_ip}
    if path == NODE_KEY_ENV:  # a router node's own API key (gptoss-api init), which the benchmark sends
        return {"OPENAI_API_KEY": NODE_KEY_PLACEHOLDER}  # made at boot: the plan can only name it
    assert path == MEMBERS_ENV, path
    need = parse_env_file(files["/etc/gptoss/cluster.env"][0])["GPTOSS_MEMBERS_NEED"].split()
    return {host_var(n): ip(n) for n in need}


def _unit_env(files: dict[str, tuple[str, int]], deploy: dict[str, str], text: str, inst: str | None, self_ip: str,
              ip: Callable[[str], str] = lambda n: LONGEST_IP) -> dict[str, str]:  # fmt: skip
    env: dict[str, str] = {}
    for f in re.findall(r"^EnvironmentFile=(\S+)$", text, re.M):
        f = f.replace("%i", inst or "").removeprefix("-")
        if f == DEPLOY_ENV:
            env |= booted_env(files, deploy, self_ip)
        elif f.startswith("/run/"):
            env |= runtime_env(files, f, self_ip, ip)
        else:
            env |= parse_env_file(files[f][0])
    return env


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_exec_variable_is_defined_by_the_units_environment(layout: str) -> None:
    for r in renders(layout):
        name, files = r.node.name, r.files
        _, deploy, _ = parse_user_data(node_user_data(r))
        for path, (content, _) in files.items():
            if not path.endswith((".service", ".target")):
                continue
            env = _unit_env(files, deploy, content, "0" if "@%i" in content else None, LONGEST_IP)
            for line in re.findall(r"^Exec\w*=(.*)$", content, re.M):
                for var in re.findall(r"\$\{(\w+)\}", line):
                    assert var in env, f"{name}:{path} uses ${{{var}}} that no EnvironmentFile defines"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_plan_and_user_data_agree(layout: str, tmp_path: Path, shipped: Callable[[str], Path]) -> None:
    """Each plan service is what its unit runs once systemd expands the node's env files."""
    for r in renders(layout):
        _, deploy, doc = parse_user_data(node_user_data(r))
        files = r.files
        assert doc["bootcmd"][4] == [f"{BIN}/gptoss-bootstrap"] and set(doc) == {"bootcmd"}, "no first-boot-only runcmd"
        listed = files[UNITS_FILE][0].split()
        for s in r.services:
            template = re.sub(r"@\d+\.service$", "@.service", s.unit)
            inst = s.unit.split("@")[1].split(".")[0] if "@" in s.unit else None
            text = files[f"/etc/systemd/system/{template}"][0]
            env = _unit_env(files, deploy, text, inst, f"<{r.node.name}>", lambda n: f"<{n}>")
            deploy_only = ("AWS_REGION", "GPTOSS_NODE", "GPTOSS_SOFTWARE_PARAMETER", "GPTOSS_COMPILE_CACHE_URI")
            plan_env = {k: v for k, v in env.items() if k not in deploy_only or k in s.environment}
            assert plan_env == s.environment, f"{r.node.name} {s.unit}"
            lines = [shlex.split(line) for line in re.findall(r"^ExecStart=(.*)$", text, re.M)]
            unit_argv = [systemd_expand(a, env, inst) for a in lines[1 if s.step == "measured" else 0]]
            assert unit_argv[0] == f"{BIN}/gptoss-exec"
            final = served(unit_argv)
            if f"{BIN}/gptoss-router-pool" in unit_argv:
                # The router's settings and servers come from the fleet's document (the stack's SSM parameter,
                # which gptoss-members copies to the node): the shipped step adds them.
                from node_render.command_lines import router_fleet

                pool = tmp_path / f"{r.node.name}-fleet"
                cfg = load_config(LAYOUTS[layout])
                pool.write_text(router_fleet(cfg, next(p for p in cfg.layout.proxies if p.node == r.node.name)))
                res = subprocess.run([str(shipped("gptoss-router-pool")), str(pool), "--", "printf", "%s\\0", *final],
                                     env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
                final = res.stdout.split("\0")[:-1]
            assert final == s.argv, f"{r.node.name} {s.unit}"
            assert (s.unit in listed) == (s.unit != "gptoss-bench.service"), s.unit


def test_stack_embeds_exactly_the_rendered_user_data(default_synth: object) -> None:
    """Each node's launch template carries its boot files and the software parameter's name, with CloudFormation
    filling the deploy-time values; the parameter names the software asset the CLI packaged, by its sha256."""
    from node_render.userdata import user_data

    t = default_synth.template  # type: ignore[attr-defined]
    by_node = {r.node.logical_id: r for r in renders("6p1d")}
    assets = [k for k in t["Resources"] if k.startswith("NodeSoftwareAsset")]
    seen = []
    for lid, res in t["Resources"].items():
        if res["Type"] != "AWS::EC2::LaunchTemplate":
            continue
        node = next(v for k, v in by_node.items() if lid.startswith(k + "Template"))
        seen.append(node.node.name)
        joined = res["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]
        parts = joined["Fn::Join"][1] if isinstance(joined, dict) else [joined]
        text = ""
        for p in parts:
            if isinstance(p, str):
                text += p
            elif "Ref" in p and "Ready" in p["Ref"]:
                assert p["Ref"].endswith(tuple("0123456789ABCDEF")), p  # the node's wait condition handle
                text += "<signal>"
            else:
                assert p["Ref"].startswith("CompileCacheBucket"), p  # the stack's compile cache
                text += "<cache>"
        gate = re.search(r"'GPTOSS_GATE=(\w+)'", text).group(1)  # type: ignore[union-attr]
        assert gate.startswith(f"{node.node.logical_id}Ready") and "Condition" in gate, "the node's own wait condition, which it asks about"
        assert text == user_data(node, software_parameter=SOFTWARE_PARAMETER, signal_url="<signal>", gate_id=gate, compile_cache_uri="s3://<cache>")
    (param,) = [r["Properties"] for r in t["Resources"].values() if r["Type"] == "AWS::SSM::Parameter"]
    assert param["Name"] == SOFTWARE_PARAMETER
    (uri, sha) = param["Value"]["Fn::Join"][1]
    key = uri["Fn::Join"][1][-1]
    assert uri["Fn::Join"][1][:2] == ["s3://", {"Fn::Sub": "cdk-hnb659fds-assets-${AWS::AccountId}-us-east-2"}] and key.endswith(".xz")
    # The file the CLI packaged under that key is the one the node checks against the sha256.
    packaged = default_synth.outdir / f"asset.{key.lstrip('/')}"  # type: ignore[attr-defined]
    assert hashlib.sha256(packaged.read_bytes()).hexdigest() == sha
    assert packaged.read_bytes() == software_asset(renders("6p1d"))
    assert sorted(seen) == ["decode-0", "prefill-0"], "one launch template per node identity"
    assert assets == [], "the asset is a file asset, not a resource"


def test_bootcmd_really_unpacks_the_bundle_and_writes_the_deploy_values(tmp_path: Path) -> None:
    """Run the user data's first two bootcmd entries with sh, base64 and tar, rooted in a temporary folder."""
    r = next(r for r in renders("6p1d") if r.node.name == "prefill-0")
    doc = yaml.safe_load(node_user_data(r))
    root = tmp_path / "root"
    for cmd in doc["bootcmd"][:2]:
        rooted = [a.replace("/var/lib/gptoss", f"{root}/var/lib/gptoss").replace("/etc/gptoss", f"{root}/etc/gptoss")
                  .replace("-C /", f"-C {root}") if i == 2 else a for i, a in enumerate(cmd)]  # fmt: skip
        subprocess.run(rooted, check=True)
    assert (root / "var/lib/gptoss/bundle.tar.xz").is_file()
    extracted = {"/" + str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file() and p.suffix != ".xz"}
    deploy = extracted.pop("/etc/gptoss/deploy.env")
    assert deploy == f"AWS_REGION=us-east-2\nGPTOSS_NODE=prefill-0\nGPTOSS_SOFTWARE_PARAMETER={SOFTWARE_PARAMETER}\nGPTOSS_COMPILE_CACHE_URI={CACHE_URI}\n"
    assert extracted == {path: text for path, (text, _) in boot_files(r).items()}
    assert os.access(root / "opt/gptoss/bin/gptoss-bootstrap", os.X_OK)


def test_the_signal_url_lands_in_a_root_only_file_that_no_other_unit_reads(tmp_path: Path) -> None:
    """Run the user data's bootcmd as cloud-init does (one /bin/sh script), rooted in a temporary folder:
    the deploy gate's URL is written by a shell builtin to a 0600 file, and no unit's environment
    (EnvironmentFile= or Environment=) nor any other file of the node holds it."""
    from node_render.userdata import user_data

    url = "https://cloudformation-waitcondition-us-east-2.s3.amazonaws.com/arn%3Aaws%3A?X-Amz-Expires=86399&X-Amz-Signature=0a1b"
    r = next(r for r in renders("6p1d") if r.node.name == "prefill-0")
    doc = yaml.safe_load(user_data(r, software_parameter=SOFTWARE_PARAMETER, signal_url=url, compile_cache_uri=CACHE_URI))
    root = tmp_path / "root"
    lines = []
    for cmd in doc["bootcmd"][:3]:
        line = cmd if isinstance(cmd, str) else shlex.join(cmd)
        lines.append(line.replace("/var/lib/gptoss", f"{root}/var/lib/gptoss").replace("/etc/gptoss", f"{root}/etc/gptoss").replace("-C /", f"-C {root}"))
    script = tmp_path / "bootcmd.sh"
    script.write_text("\n".join(lines) + "\n")
    subprocess.run(["/bin/sh", str(script)], check=True)
    signal_env = root / "etc/gptoss/signal.env"
    assert signal_env.read_text() == f"GPTOSS_SIGNAL_URL={url}\n"
    assert signal_env.stat().st_mode & 0o777 == 0o600
    # The only argv holding it is cloud-init's own /bin/sh reading the script: no line execs a program with it.
    (line,) = [c for c in doc["bootcmd"] if url in str(c)]
    assert isinstance(line, str) and line.startswith("(umask 077 && printf ")
    holders = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and url.encode() in p.read_bytes())
    assert holders == ["etc/gptoss/signal.env"]
    for path, (text, _) in r.files.items():
        if path.endswith((".service", ".target")):
            assert "signal.env" not in text, path
    signal_unit = r.files["/etc/systemd/system/gptoss-signal.service"][0]
    assert "EnvironmentFile" not in signal_unit and "GPTOSS_SIGNAL_URL" not in signal_unit
    # Without a gate, the file of an earlier deploy is removed.
    no_gate = yaml.safe_load(node_user_data(r))["bootcmd"][2]
    subprocess.run(["/bin/sh", "-c", no_gate.replace("/etc/gptoss", f"{root}/etc/gptoss")], check=True)
    assert not signal_env.exists()


def test_health_list_names_every_unit_a_ready_node_runs() -> None:
    prefill = renders("6p1d")[0]
    lines = [line.split() for line in prefill.files["/etc/gptoss/health"][0].splitlines()]
    # Every unit that must be running (the signal finishes once it has reported; the cache's upload is
    # a best effort that retries on its own and must never fail the deploy gate: not listed).
    helpers = ("gptoss-prefill.target", "gptoss-signal.service", "gptoss-cache-save.service")
    assert sorted(u for u, *_ in lines) == sorted(u for u in prefill.units if u not in helpers)
    assert ["gptoss-members.timer", "-", "-"] in lines and ["gptoss-health-watch.timer", "-", "-"] in lines
    assert ["gptoss-prefill@3.service", "http://127.0.0.1:8103/health", "prefill_3"] in lines
    assert ["gptoss-group-health.service", "http://127.0.0.1:8001/ready", "-"] in lines



def test_user_data_text_is_the_same_with_libyamls_emitter_and_pythons() -> None:
    import node_render.userdata as ud

    assert ud._DUMPER is yaml.CSafeDumper, "this PyYAML has libyaml: the comparison below means something"
    for layout in LAYOUTS:
        for r in renders(layout):
            fast = node_user_data(r)
            try:
                ud._DUMPER = yaml.SafeDumper
                slow = node_user_data(r)
            finally:
                ud._DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
            assert fast == slow, r.node.name


def test_an_environment_file_a_unit_writes_for_itself_is_optional_when_systemd_first_reads_it() -> None:
    """systemd reads a unit's EnvironmentFile= before the first process of each state (start-pre,
    then start). A file the unit's own ExecStartPre writes (the router's members) does not exist
    when start-pre begins: unless it is optional (`-`), the unit fails with result 'resources'
    before the script that would write it runs. Files under /run written by another unit the
    service requires (gptoss-identity's nixl.env) exist by then and stay required."""
    from clusterspec.loading import load_config
    from node_render.render import render_cluster

    writes = {MEMBERS_ENV: "gptoss-members write", NIXL_ENV: "gptoss-identity"}
    seen = set()
    for ctx in ({}, {"decode_instances": "2"}, {"decode_instances": "8"}):
        for r in render_cluster(load_config(ctx)):
            for path, (text, _) in r.files.items():
                if not path.endswith(".service"):
                    continue
                pre = " ".join(re.findall(r"^ExecStartPre=(.*)$", text, re.M))
                for f in re.findall(r"^EnvironmentFile=(\S+)$", text, re.M):
                    name = f.removeprefix("-")
                    if name not in writes:
                        continue
                    seen.add(name)
                    own = writes[name] in pre
                    assert f.startswith("-") == own, f"{r.node.name}:{path}: EnvironmentFile={f} (written by {'its own ExecStartPre' if own else 'another unit'})"
    assert seen == {MEMBERS_ENV, NIXL_ENV}, seen
