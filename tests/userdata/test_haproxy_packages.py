"""The API gate's HAProxy on a node with no apt source (network.egress='none'): the spec's pinned package files,
fetched by the node's own gptoss-install-haproxy from S3 (moto, with the real AWS CLI), checked against their
sha256 and installed with dpkg (a stand-in: this machine's packages are not the node's)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import boto3

from node_render.paths import HAPROXY_ENV, package_object_key
from node_render.render import render_cluster
from tests.conftest import fake_command, real_aws_cli
from tests.userdata.conftest import router_node
from tests.userdata.router_fleet import CREDS, _cfg

HAPROXY = "haproxy_2.8.5-1ubuntu3.3_amd64.deb"
LUA = "liblua5.4-0_5.4.6-3build2_amd64.deb"


def _node(tmp_path: Path, moto_url: str, bucket: str, contents: dict[str, bytes], *, stored: dict[str, bytes] | None = None) -> tuple[dict[str, str], Path]:
    """A router node whose spec pins CONTENTS' files as the gate's packages, its image without HAProxy, the bucket
    of its software holding STORED (default: the same files) at the keys the stack's assets get."""
    packages = [{"file": f, "sha256": hashlib.sha256(b).hexdigest()} for f, b in contents.items()]
    cfg = _cfg("vllm-router", {"serving.proxy.gate.packages": packages})
    s3 = boto3.client("s3", endpoint_url=moto_url, region_name="us-east-2", **{k.lower(): v for k, v in CREDS.items() if k != "AWS_DEFAULT_REGION"})
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    for f, b in (stored or contents).items():
        s3.put_object(Bucket=bucket, Key=package_object_key(hashlib.sha256(contents[f]).hexdigest()), Body=b)
    bindir = tmp_path / "bin"
    real_aws_cli(bindir)
    # dpkg notes its arguments and, as the package does, puts a HAProxy of the haproxy file's release in place,
    # which dpkg-query then reports as installed.
    fake_command(bindir, "dpkg", f'echo "$*" >> "{tmp_path}/dpkg.log"\n'
                 'for f in "$@"; do case "${f##*/}" in haproxy_*) v=${f##*/haproxy_}; v=${v%_*.deb};; esac; done\n'
                 f'echo "$v" > "{tmp_path}/dpkg.status"\n'
                 f'printf \'#!/bin/sh\\necho "HAProxy version %s 2025/01/01"\\n\' "$v" > "{tmp_path}/haproxy"; chmod +x "{tmp_path}/haproxy"\n')  # fmt: skip
    fake_command(bindir, "dpkg-query", f'[ -f "{tmp_path}/dpkg.status" ] || exit 1\nprintf %s "$(cat "{tmp_path}/dpkg.status")"\n')
    fake_command(bindir, "apt-get", f'echo "$*" >> "{tmp_path}/apt.log"\nexit 100\n')
    fake_command(bindir, "systemctl", f'echo "$*" >> "{tmp_path}/systemctl.log"\n')
    # decode-0's own haproxy.env, as rendered.
    rendered = next(r for r in render_cluster(cfg) if r.node.name == "decode-0").files[HAPROXY_ENV][0]
    (tmp_path / "haproxy.env").write_text(rendered)
    env = {**os.environ, **CREDS, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "AWS_ENDPOINT_URL": moto_url,
           "GPTOSS_HAPROXY": str(tmp_path / "haproxy"), "GPTOSS_HAPROXY_ENV": str(tmp_path / "haproxy.env"),
           **router_node(cfg, tmp_path / "root", bucket)}  # fmt: skip
    return env, tmp_path / "root" / "var/lib/gptoss/haproxy-packages"


def test_a_node_without_an_apt_source_installs_the_pinned_haproxy_packages_from_the_stacks_assets(tmp_path: Path, moto_url: str, shipped: Any) -> None:
    contents = {HAPROXY: b"the haproxy package", LUA: b"the lua library"}
    env, folder = _node(tmp_path, moto_url, "assets-ok", contents)
    res = subprocess.run([str(shipped("gptoss-install-haproxy")), "2.8"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "HAProxy 2.8" in res.stdout, res.stdout + res.stderr
    assert f"fetching the pinned {HAPROXY} (serving.proxy.gate.packages)" in res.stdout
    # Both files, intact, given to one dpkg -i; no apt source asked; the package's own unit off.
    assert (tmp_path / "dpkg.log").read_text().split() == ["-i", str(folder / HAPROXY), str(folder / LUA)]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == contents
    assert not (tmp_path / "apt.log").exists()
    assert "disable --now haproxy.service" in (tmp_path / "systemctl.log").read_text()
    # Installed: the next start fetches nothing and installs nothing.
    (tmp_path / "dpkg.log").unlink()
    again = subprocess.run([str(shipped("gptoss-install-haproxy")), "2.8"], env=env | {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.returncode == 0 and "fetching" not in again.stdout and not (tmp_path / "dpkg.log").exists(), again
    # dpkg names the installed version with its epoch, the file's name without: still the pinned one.
    (tmp_path / "dpkg.status").write_text("1:2.8.5-1ubuntu3.3")
    again = subprocess.run([str(shipped("gptoss-install-haproxy")), "2.8"], env=env | {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert again.returncode == 0 and "fetching" not in again.stdout and not (tmp_path / "dpkg.log").exists(), again
    # A new pin (a security update of 2.8), applied in place: the gate's next start installs it over the old one.
    update = {"haproxy_2.8.5-1ubuntu3.4_amd64.deb": b"the updated haproxy package"}
    newer, _ = _node(tmp_path / "update", moto_url, "assets-update", update)
    newer = env | {k: v for k, v in newer.items() if k == "GPTOSS_HAPROXY_ENV" or k.startswith("GPTOSS_ROOT")}
    got = subprocess.run([str(shipped("gptoss-install-haproxy")), "2.8"], env=newer, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "the node has haproxy 2.8.5-1ubuntu3.3; installing the pinned 2.8.5-1ubuntu3.4" in got.stdout, got.stdout
    assert (tmp_path / "dpkg.log").read_text().split()[-1].endswith("haproxy_2.8.5-1ubuntu3.4_amd64.deb")


def test_a_package_whose_sha256_is_not_the_pinned_one_is_never_installed(tmp_path: Path, moto_url: str, shipped: Any) -> None:
    contents = {HAPROXY: b"the haproxy package", LUA: b"the lua library"}
    env, folder = _node(tmp_path, moto_url, "assets-bad", contents, stored={HAPROXY: b"the haproxy package", LUA: b"another file"})
    t = time.monotonic()
    res = subprocess.run([str(shipped("gptoss-install-haproxy")), "2.8"], env=env | {"GPTOSS_HAPROXY_FETCH_S": "3"},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 1 and time.monotonic() - t < 60, res.stdout + res.stderr
    sha = hashlib.sha256(b"the lua library").hexdigest()
    assert f"gptoss-install-haproxy: error: no intact copy of s3://assets-bad/{package_object_key(sha)} (sha256 {sha}) within 3s" in res.stderr
    assert not (tmp_path / "dpkg.log").exists(), "nothing installed"
    assert not (folder / LUA).exists()


def test_dpkg_refusing_the_packages_fails_the_gate_naming_the_fix(tmp_path: Path, moto_url: str, shipped: Any) -> None:
    contents = {HAPROXY: b"the haproxy package"}
    env, _ = _node(tmp_path, moto_url, "assets-deps", contents)
    fake_command(tmp_path / "bin", "dpkg", 'echo "dpkg: dependency problems prevent configuration of haproxy: haproxy depends on liblua5.4-0" >&2\nexit 1\n')
    res = subprocess.run([str(shipped("gptoss-install-haproxy")), "2.8"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"dpkg could not install {HAPROXY}" in res.stderr and "add each package dpkg names as missing to serving.proxy.gate.packages" in res.stderr
