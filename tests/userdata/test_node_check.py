"""gptoss-node-check run for real as shipped: Neuron and EFA devices, libfabric, the pinned NIXL.

Tool outputs are injected (fi_info, /dev/neuron*, the venv's Python)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clusterspec.loading import load_config
from node_render.render import cluster_env
from tests.conftest import fake_command

Shipped = Callable[[str], Path]


# ---- gptoss-node-check --------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path, shipped: Shipped) -> Callable[..., subprocess.CompletedProcess[str]]:
    """A node with 16 Neuron devices, 16 EFA devices and nixl in its venv; each can be taken away."""

    def run(*, neuron: int = 16, efa: int = 16, provider: bool = True, nixl: bool = True, egress: str = "nat",
            expect_efa: int = 16, rdm: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
        dev = tmp_path / "dev"
        dev.mkdir(exist_ok=True)
        for p in dev.glob("neuron*"):
            p.unlink()
        for i in range(neuron):
            (dev / f"neuron{i}").touch()
        fakes = tmp_path / "fakes"
        domains = "".join(f"provider: efa\\n    domain: rdmap{i}s0-rdm\\n" for i in range(efa))
        # fi_info exits 61 (FI_ENODATA) for an endpoint type no provider offers.
        no_rdm = "" if rdm else 'case " $* " in *" FI_EP_RDM "*) echo "fi_getinfo: -61 (No data available)" >&2; exit 61;; esac'
        fake_command(fakes, "fi_info", f'{"exit 1" if not provider else ""}\n{no_rdm}\nprintf "{domains}"\n')
        venv = tmp_path / "venv-vllm"
        (venv / "bin").mkdir(parents=True, exist_ok=True)
        state = tmp_path / "nixl-installed"
        if nixl:
            state.touch()
        else:
            state.unlink(missing_ok=True)
        fake_command(
            venv / "bin", "python3",
            f'if [ "$1 $2" = "-c import nixl" ]; then [ -f "{state}" ]; exit; fi\n'
            f'if [ "$1 $2 $3" = "-m pip install" ]; then echo "pip $*" >>"{tmp_path}/pip.log"; touch "{state}"; exit 0; fi\nexit 2\n',
        )  # fmt: skip
        (tmp_path / "cluster.env").write_text(
            f"GPTOSS_VENV_GLOB={tmp_path}/venv-vllm*\nGPTOSS_EXPECT_NEURON=16\nGPTOSS_EXPECT_EFA={expect_efa}\nGPTOSS_EGRESS={egress}\n"
        )
        env = {**os.environ, "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_FI_INFO": str(fakes / "fi_info"),
               "GPTOSS_DEV_DIR": str(dev), "GPTOSS_CHECK_TIMEOUT_S": "1", "GPTOSS_POLL_S": "0.2", "GPTOSS_RUN_DIR": str(tmp_path / "run")}  # fmt: skip
        return subprocess.run([str(shipped("gptoss-node-check"))], env=env, capture_output=True, text=True, timeout=60)

    run.tmp = tmp_path  # type: ignore[attr-defined]
    run.shipped = shipped("gptoss-node-check")  # type: ignore[attr-defined]
    return run


def _cause(node: Any) -> str | None:
    """What the check recorded for the health watch: "hardware: ..." or "configuration: ...", or nothing."""
    path = node.tmp / "run" / "node-check.failed"
    return path.read_text() if path.exists() else None


def test_node_check_passes_on_a_complete_node(node: Any) -> None:
    r = node(neuron=15)
    assert r.returncode == 1 and _cause(node) is not None
    r = node()
    assert r.returncode == 0, r.stderr
    assert _cause(node) is None, "a check that passes clears the last failure's cause"
    assert (
        "Neuron: 16 devices" in r.stdout
        and "EFA: 16 devices, libfabric efa provider loads" in r.stdout
        and "NIXL of unknown version importable in" in r.stdout and "(the image's)" in r.stdout
    )


def test_node_check_names_missing_efa_devices(node: Any) -> None:
    r = node(efa=12)
    assert r.returncode == 1
    assert "gptoss-node-check: EFA: 12 devices, the instance table says 16 (efa_interfaces)" in r.stderr
    assert _cause(node) == "hardware: EFA: 12 devices, the instance table says 16 (efa_interfaces)\n", "a new instance has its devices: replaceable"


def test_node_check_refuses_a_node_whose_efa_provider_does_not_load(node: Any) -> None:
    r = node(provider=False)
    assert r.returncode == 1 and "libfabric's efa provider does not load" in r.stderr


def test_node_check_names_a_failing_rdm_query_instead_of_exiting_silently(node: Any) -> None:
    r = node(rdm=False)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert ("gptoss-node-check: EFA: fi_info -p efa -t FI_EP_RDM fails (exit 61): no reliable-datagram endpoint for NIXL's KV transfer"
            in r.stderr)  # fmt: skip


def test_node_check_names_missing_neuron_devices(node: Any) -> None:
    r = node(neuron=15)
    assert r.returncode == 1 and "Neuron: 15 devices in" in r.stderr and "the instance table says 16 (neuron_devices)" in r.stderr


def test_node_check_never_installs_an_unpinned_nixl(node: Any) -> None:
    """The venv lacks NIXL and nothing pins one: the node names the two fixes and runs no pip, egress or not."""
    for egress in ("nat", "none"):
        r = node(nixl=False, egress=egress)
        assert r.returncode == 1
        assert "NIXL is not importable" in r.stderr and "use a DLAMI whose vLLM venv has nixl, or pin one with nixl.requirements" in r.stderr
        assert (_cause(node) or "").startswith("configuration: NIXL is not importable"), "the image's or the spec's: a new instance fails the same way"
    assert not (node.tmp / "pip.log").exists()


def _wheel(folder: Path, version: str, body: str) -> Path:
    """A real wheel of a package named nixl (pure Python), as pip takes it from an index."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"nixl-{version}-py3-none-any.whl"
    info = f"nixl-{version}.dist-info"
    files = {
        "nixl/__init__.py": body,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: nixl\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return path


def test_a_pinned_nixl_is_installed_with_its_hash_checked_and_a_changed_upstream_file_is_refused(node: Any, tmp_path: Path) -> None:
    """Real pip in a real venv, from a local index folder: the pinned version installs over the image's;
    a file of the same name and version whose bytes changed upstream is refused and nothing changes."""
    venv = tmp_path / "real-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    index = tmp_path / "index"
    _wheel(tmp_path / "image", "0.9.0", "IMAGE = True\n")
    subprocess.run([str(venv / "bin/python3"), "-m", "pip", "install", "-q", "--no-index", str(tmp_path / "image/nixl-0.9.0-py3-none-any.whl")],
                   check=True, timeout=120)  # fmt: skip
    pinned = _wheel(index, "1.5.1", "PINNED = True\n")
    pinned_bytes = pinned.read_bytes()
    line = f"nixl==1.5.1 --hash=sha256:{hashlib.sha256(pinned_bytes).hexdigest()}"
    cfg = load_config({"nixl.requirements": [line]})
    node_env = cluster_env(cfg, cfg.layout.nodes[0])
    assert node_env["GPTOSS_NIXL_VERSION"] == "1.5.1" and node_env["GPTOSS_NIXL_REQUIREMENTS"] == line

    def check() -> subprocess.CompletedProcess[str]:
        node()  # the devices and the fake venv
        (tmp_path / "cluster.env").write_text(
            f"GPTOSS_VENV_GLOB={venv}\nGPTOSS_EXPECT_NEURON=16\nGPTOSS_EXPECT_EFA=16\nGPTOSS_EGRESS=nat\n"
            f"GPTOSS_NIXL_VERSION=1.5.1\nGPTOSS_NIXL_REQUIREMENTS='{line}'\n"
        )
        env = {**os.environ, "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_FI_INFO": str(tmp_path / "fakes/fi_info"),
               "GPTOSS_DEV_DIR": str(tmp_path / "dev"), "GPTOSS_CHECK_TIMEOUT_S": "1", "GPTOSS_POLL_S": "0.2", "GPTOSS_RUN_DIR": str(tmp_path / "run"),
               "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # fmt: skip
        return subprocess.run([str(node.shipped)], env=env, capture_output=True, text=True, timeout=300)

    imported = [str(venv / "bin/python3"), "-c", "import nixl, importlib.metadata as m; print(m.version('nixl'), sorted(vars(nixl)))"]
    # Upstream replaced the file of 1.5.1 (same name, other bytes): refused, the image's NIXL stays.
    _wheel(index, "1.5.1", "TAMPERED = True\n")
    r = check()
    assert r.returncode == 1 and "pip refused or failed the pinned NIXL requirements" in r.stderr and "THESE PACKAGES DO NOT MATCH THE HASHES" in r.stderr
    assert subprocess.run(imported, capture_output=True, text=True).stdout.startswith("0.9.0 ")
    # The pinned file itself: installed over the image's 0.9.0, and what the venv imports is it.
    pinned.write_bytes(pinned_bytes)
    r = check()
    assert r.returncode == 0, r.stderr
    assert "NIXL 1.5.1 is pinned and" in r.stdout and "has 0.9.0: installing the pinned requirements" in r.stdout
    assert "NIXL 1.5.1 importable in" in r.stdout and "(pinned, installed)" in r.stdout
    out = subprocess.run(imported, capture_output=True, text=True).stdout
    assert out.startswith("1.5.1 ") and "PINNED" in out
    # A second boot finds it in place: no install.
    r = check()
    assert r.returncode == 0 and "(pinned)" in r.stdout and "installing" not in r.stdout


def test_a_single_instance_node_needs_no_efa_and_no_nixl(node: Any) -> None:
    r = node(efa=0, provider=False, nixl=False, expect_efa=0)
    assert r.returncode == 0, r.stderr
    assert "EFA" not in r.stdout and "NIXL" not in r.stdout
