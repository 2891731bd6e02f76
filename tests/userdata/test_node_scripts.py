"""The node's scripts run for real, as shipped, with injected commands and loopback servers."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from node_render.userdata import bundle
from tests.conftest import fake_command
from tests.local_moto import free_port

Shipped = Callable[[str], Path]



# ---- gptoss-bootstrap: every boot ------------------------------------------------------------


@pytest.fixture
def node_root(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A node's file tree after an earlier bundle, and a systemctl that logs its calls."""
    root = tmp_path / "root"
    for d in ("etc/systemd/system/multi-user.target.wants", "opt/gptoss/bin", "etc/gptoss"):
        (root / d).mkdir(parents=True)
    log = tmp_path / "systemctl.log"
    loaded = tmp_path / "loaded"
    loaded.write_text("")
    systemctl = fake_command(
        tmp_path / "fakes",
        "systemctl",
        f'echo "$*" >>"{log}"\nif [ "$1" = list-units ]; then cat "{loaded}"; fi\n',
    )
    yield {"root": root, "log": log, "loaded": loaded, "env": {**os.environ, "GPTOSS_ROOT": str(root), "GPTOSS_SYSTEMCTL": str(systemctl)}}


def _files(root: Path, paths: list[str]) -> None:
    for p in paths:
        (root / p.lstrip("/")).write_text("x")


def test_bootstrap_retires_what_the_new_bundle_no_longer_ships_then_starts_the_node(node_root: dict[str, Any], shipped: Shipped) -> None:
    root: Path = node_root["root"]
    # The earlier bundle: 7 replicas and a proxy, enabled the way an older version did it.
    old = ["/etc/systemd/system/gptoss-proxy.service", "/etc/systemd/system/gptoss-prefill@.service",
           "/etc/gptoss/prefill@6.env", "/opt/gptoss/bin/gptoss-wait-healthy", "/etc/gptoss/prefill@0.env"]  # fmt: skip
    _files(root, old)
    (root / "etc/systemd/system/multi-user.target.wants/gptoss-proxy.service").symlink_to(root / "etc/systemd/system/gptoss-proxy.service")
    (root / "etc/gptoss/deploy.env").write_text("GPTOSS_HOST_DECODE_0=10.0.0.2\n")
    # The new bundle: one replica, no proxy.
    new = ["/etc/systemd/system/gptoss-prefill@.service", "/etc/gptoss/prefill@0.env", "/etc/gptoss/manifest", "/etc/gptoss/units"]
    _files(root, new)
    (root / "etc/gptoss/manifest").write_text("\n".join(new) + "\n")
    (root / "etc/gptoss/units").write_text("gptoss-prefill@0.service\ngptoss-prefill.target\n")
    node_root["loaded"].write_text(
        "gptoss-prefill@0.service loaded active running x\ngptoss-prefill@6.service loaded active running x\n"
        "gptoss-proxy.service loaded active running x\n"
    )
    res = subprocess.run([str(shipped("gptoss-bootstrap")), "--installed"], env=node_root["env"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    calls = node_root["log"].read_text().splitlines()
    assert calls == [
        "list-units --all --plain --no-legend gptoss-*",
        "stop gptoss-prefill@6.service gptoss-proxy.service",
        "daemon-reload",
        "reset-failed gptoss-*",
        "start --no-block gptoss-node.target",
    ]
    left = sorted("/" + str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink())
    assert left == sorted([*new, "/etc/gptoss/deploy.env"])


def test_bootstrap_keeps_an_operators_drop_in_and_starts_the_node(node_root: dict[str, Any], shipped: Shipped) -> None:
    """`systemctl edit gptoss-decode` makes gptoss-decode.service.d/: neither a stale file nor a unit,
    and never a reason not to start the node (rm of a directory under set -e stopped it)."""
    root: Path = node_root["root"]
    files = ["/etc/systemd/system/gptoss-decode.service", "/etc/gptoss/manifest", "/etc/gptoss/units"]
    _files(root, files)
    (root / "etc/gptoss/manifest").write_text("\n".join(files) + "\n")
    (root / "etc/gptoss/units").write_text("gptoss-decode.service\n")
    dropin = root / "etc/systemd/system/gptoss-decode.service.d"
    dropin.mkdir()
    (dropin / "override.conf").write_text("[Service]\nEnvironment=OPERATOR=1\n")
    (root / "etc/gptoss/signal.env").write_text("GPTOSS_SIGNAL_URL=x\n")
    res = subprocess.run([str(shipped("gptoss-bootstrap")), "--installed"], env=node_root["env"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    calls = node_root["log"].read_text().splitlines()
    assert calls[-1] == "start --no-block gptoss-node.target" and not [c for c in calls if c.startswith("stop")]
    assert (dropin / "override.conf").read_text() == "[Service]\nEnvironment=OPERATOR=1\n"
    assert (root / "etc/gptoss/signal.env").exists(), "written by the user data, never by the bundle"


def test_bootstrap_on_an_unchanged_node_stops_and_removes_nothing(node_root: dict[str, Any], shipped: Shipped) -> None:
    root: Path = node_root["root"]
    files = ["/etc/systemd/system/gptoss-decode.service", "/etc/gptoss/manifest", "/etc/gptoss/units", "/opt/gptoss/bin/gptoss-exec"]
    _files(root, files)
    (root / "etc/gptoss/manifest").write_text("\n".join(files) + "\n")
    (root / "etc/gptoss/units").write_text("gptoss-decode.service\n")
    node_root["loaded"].write_text("gptoss-decode.service loaded inactive dead x\ngptoss-node.target loaded inactive dead x\n")
    res = subprocess.run([str(shipped("gptoss-bootstrap")), "--installed"], env=node_root["env"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "stop" not in node_root["log"].read_text().split()
    assert all((root / f.lstrip("/")).exists() for f in files)


# ---- gptoss-identity: IMDSv2, asked again ------------------------------------------------------


class _Imds(http.server.BaseHTTPRequestHandler):
    fail_until = 0.0
    fail_times = 0  # the first this many token requests fail (a count, not a clock: a slow machine sees the same)
    requests: list[str] = []  # noqa: RUF012 - one server per test

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: str) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_PUT(self) -> None:
        self.requests.append(f"PUT {self.path}")
        if time.monotonic() < self.fail_until or sum(r.startswith("PUT") for r in self.requests) <= self.fail_times:
            return self._reply(503, "unavailable")
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._reply(200 if ok else 400, "tok")

    def do_GET(self) -> None:
        self.requests.append(f"GET {self.path}")
        if self.headers.get("X-aws-ec2-metadata-token") != "tok":
            return self._reply(401, "")
        values = {"/latest/meta-data/local-ipv4": "10.42.0.10", "/latest/meta-data/instance-id": "i-0123456789abcdef0"}
        self._reply(200, values[self.path]) if self.path in values else self._reply(404, "")


@pytest.fixture
def imds(tmp_path: Path) -> Iterator[type[_Imds]]:
    handler = type("Imds", (_Imds,), {"requests": [], "fail_until": 0.0, "fail_times": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield handler
    server.shutdown()


def _identity_env(tmp_path: Path, imds: Any, timeout: int) -> dict[str, str]:
    (tmp_path / "cluster.env").write_text("GPTOSS_NODE=prefill-0\nGPTOSS_SELF_HOST_VAR=GPTOSS_HOST_PREFILL_0\n")
    (tmp_path / "deploy.env").write_text("GPTOSS_HOST_DECODE_0=10.42.0.11\nGPTOSS_HOST_PREFILL_0=stale\n")
    return {**os.environ, "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_DEPLOY_ENV": str(tmp_path / "deploy.env"),
            "GPTOSS_RUN_DIR": str(tmp_path / "run"), "GPTOSS_IMDS_URL": imds.url, "GPTOSS_IMDS_TIMEOUT_S": str(timeout)}  # fmt: skip


def test_identity_asks_imds_again_until_it_answers(tmp_path: Path, imds: Any, shipped: Shipped) -> None:
    imds.fail_times = 2
    res = subprocess.run([str(shipped("gptoss-identity"))], env=_identity_env(tmp_path, imds, 60), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("asking again") == 2, res.stdout
    assert (tmp_path / "deploy.env").read_text() == "GPTOSS_HOST_DECODE_0=10.42.0.11\nGPTOSS_HOST_PREFILL_0=10.42.0.10\n"
    assert (tmp_path / "run/identity.env").read_text() == "GPTOSS_INSTANCE_ID=i-0123456789abcdef0\n"


def test_identity_fails_loudly_when_imds_never_answers(tmp_path: Path, imds: Any, shipped: Shipped) -> None:
    imds.fail_until = time.monotonic() + 3600
    res = subprocess.run([str(shipped("gptoss-identity"))], env=_identity_env(tmp_path, imds, 3), capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "the instance metadata service did not answer within 3s" in res.stderr
    assert "10.42.0.10" not in (tmp_path / "deploy.env").read_text()


# ---- gptoss-fetch-scripts: the software version, S3, sha256, install -----------------------------

# The fleet's software as the stack ships it: the shared scripts at their paths, each node's own files under nodes/<node>/.
MANIFEST_0 = "/etc/gptoss/manifest\n/etc/gptoss/units\n/etc/systemd/system/gptoss-decode.service\n/opt/gptoss/bin/gptoss-exec\n"
SOFTWARE = {
    "/opt/gptoss/bin/gptoss-exec": ("#!/bin/sh\n", 0o755),
    "/opt/gptoss/bin/gptoss-prepare-schedule": ("#!/bin/sh\n", 0o755),
    "/nodes/decode-0/etc/gptoss/manifest": (MANIFEST_0, 0o644),
    "/nodes/decode-0/etc/gptoss/units": ("gptoss-decode.service\n", 0o644),
    "/nodes/decode-0/etc/systemd/system/gptoss-decode.service": ("[Service]\nExecStart=/opt/gptoss/bin/gptoss-exec\n", 0o644),
    "/nodes/decode-1/etc/gptoss/manifest": ("/etc/gptoss/manifest\n", 0o644),
}


@pytest.fixture
def fetch_env(tmp_path: Path, shipped: Shipped) -> dict[str, Any]:
    """A node whose user data was unpacked (deploy.env), an S3 with the software asset, an SSM with its parameter,
    and a systemctl that logs what the bootstrap then asks of it."""
    root = tmp_path / "root"
    (root / "etc/gptoss").mkdir(parents=True)
    asset = bundle(SOFTWARE)
    sha = hashlib.sha256(asset).hexdigest()
    s3 = tmp_path / "s3"
    s3.mkdir()
    (s3 / "asset.xz").write_bytes(asset)
    (tmp_path / "parameter").write_text(f"s3://bucket/asset.xz {sha}\n")
    deploy = root / "etc/gptoss/deploy.env"
    deploy.write_text("AWS_REGION=us-east-2\nGPTOSS_NODE=decode-0\nGPTOSS_SOFTWARE_PARAMETER=/gptoss/c/software\n")
    log = tmp_path / "aws.log"
    fakes = tmp_path / "fakes"
    fake_command(fakes, "aws", f'echo "$*" >>"{log}"\n[ -f "{tmp_path}/$1-down" ] && {{ echo "Could not connect to the endpoint URL" >&2; exit 255; }}\n'
                              f'if [ "$1" = ssm ]; then cat "{tmp_path}/parameter"; else cp "{s3}/${{4##*/}}" "${{*: -1}}"; fi\n')  # fmt: skip
    systemctl_log = tmp_path / "systemctl.log"
    systemctl = fake_command(fakes, "systemctl", f'echo "$*" >>"{systemctl_log}"\n')
    shipped("gptoss-bootstrap")
    shipped("gptoss-gate-failure")
    env = {**os.environ, "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}", "GPTOSS_ROOT": str(root), "GPTOSS_DEPLOY_ENV": str(deploy),
           "GPTOSS_SYSTEMCTL": str(systemctl), "GPTOSS_FETCH_TIMEOUT_S": "3"}  # fmt: skip
    return {"root": root, "log": log, "env": env, "tmp": tmp_path, "sha": sha, "asset": asset, "systemctl": systemctl_log}


def _tree(root: Path) -> list[str]:
    return sorted("/" + str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "var/lib" not in str(p))


def test_fetch_installs_the_version_the_parameter_names_then_starts_the_node(fetch_env: dict[str, Any], shipped: Shipped) -> None:
    """The node's own files and the scripts its manifest lists (not another role's), the version recorded, the
    bootstrap's retiring pass, the node's target; a reboot needs no S3 (the kept version is intact)."""
    root, sha = fetch_env["root"], fetch_env["sha"]
    res = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=fetch_env["env"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert _tree(root) == ["/etc/gptoss/deploy.env", "/etc/gptoss/manifest", "/etc/gptoss/units", "/etc/systemd/system/gptoss-decode.service",
                           "/opt/gptoss/bin/gptoss-exec"], "another role's script and another node's files stay out"  # fmt: skip
    assert (root / "var/lib/gptoss/software").read_text() == f"s3://bucket/asset.xz {sha}\n"
    assert fetch_env["log"].read_text().splitlines() == [
        "ssm get-parameter --name /gptoss/c/software --query Parameter.Value --output text",
        f"s3 cp --only-show-errors s3://bucket/asset.xz {root}/var/lib/gptoss/scripts-{sha}.tar.xz.partial",
    ]
    assert fetch_env["systemctl"].read_text().splitlines()[-1] == "start --no-block gptoss-node.target"
    assert not list((root / "var/lib/gptoss").glob("scripts-*")), "the tarball goes once the version's files are kept"
    # A reboot: S3 is down, the parameter names the same version: its kept files are installed again.
    (fetch_env["tmp"] / "s3-down").touch()
    (root / "opt/gptoss/bin/gptoss-exec").unlink()
    res = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=fetch_env["env"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and (root / "opt/gptoss/bin/gptoss-exec").exists(), res.stderr


def test_a_reboot_with_ssm_out_of_reach_keeps_the_installed_version_and_says_so(fetch_env: dict[str, Any], shipped: Shipped) -> None:
    root = fetch_env["root"]
    assert subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=fetch_env["env"], capture_output=True, timeout=60).returncode == 0
    (fetch_env["tmp"] / "ssm-down").touch()
    (fetch_env["tmp"] / "s3-down").touch()
    res = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=fetch_env["env"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert f"/gptoss/c/software not read (Could not connect to the endpoint URL); keeping the installed version {fetch_env['sha']}" in res.stderr
    assert (root / "var/lib/gptoss/software").read_text().split()[1] == fetch_env["sha"]
    # Its time up before a third try (a slow AWS CLI on a busy node; here no time at all): kept all the same.
    res = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=fetch_env["env"] | {"GPTOSS_FETCH_TIMEOUT_S": "0"},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0 and f"keeping the installed version {fetch_env['sha']}" in res.stderr, res.stderr
    assert res.stderr.count("not read") == 1, "after one try"


def test_a_first_boot_with_ssm_out_of_reach_gives_up_within_its_budget(fetch_env: dict[str, Any], shipped: Shipped) -> None:
    (fetch_env["tmp"] / "ssm-down").touch()
    res = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=fetch_env["env"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "Could not connect to the endpoint URL; /gptoss/c/software not read within 3s; giving up" in res.stderr
    assert _tree(fetch_env["root"]) == ["/etc/gptoss/deploy.env"]


def test_fetch_refuses_an_object_whose_sha256_differs(fetch_env: dict[str, Any], shipped: Shipped) -> None:
    (fetch_env["tmp"] / "parameter").write_text(f"s3://bucket/asset.xz {'f' * 64}\n")
    res = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=fetch_env["env"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert f"what S3 holds does not match sha256 {'f' * 64}; no intact copy of s3://bucket/asset.xz within 3s; giving up" in res.stderr
    assert not (fetch_env["root"] / "opt/gptoss/bin/gptoss-exec").exists()
    assert len([c for c in fetch_env["log"].read_text().splitlines() if c.startswith("s3 ")]) >= 2, "asked again"


class _Handle(http.server.BaseHTTPRequestHandler):
    puts: list[dict[str, Any]]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_PUT(self) -> None:
        self.puts.append({"content_type": self.headers.get("Content-Type"), "doc": json.loads(self.rfile.read(int(self.headers["Content-Length"])))})
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_a_scripts_fetch_that_gives_up_answers_the_gate_itself_naming_the_cause(fetch_env: dict[str, Any], shipped: Shipped) -> None:
    """Without the asset no unit runs, gptoss-signal included: the fetch (in the user data) says FAILURE,
    with the unit and S3's error, within its budget; the URL is in no argv (curl reads it on stdin)."""
    handler = type("H", (_Handle,), {"puts": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tmp: Path = fetch_env["tmp"]
    url = f"http://127.0.0.1:{server.server_address[1]}/handle?X-Amz-Signature=secret-part"
    etc = tmp / "etc"
    etc.mkdir()
    (etc / "signal.env").write_text(f"GPTOSS_SIGNAL_URL={url}\n")
    # The node's name, from the user data's deploy.env (its cluster.env is its software, not there yet).
    shutil.copy(fetch_env["root"] / "etc/gptoss/deploy.env", etc / "deploy.env")
    error = "An error occurred (AccessDenied) when calling the GetObject operation: Access Denied"
    (tmp / "parameter").write_text(f"s3://bucket/asset.xz {fetch_env['sha']}\n")
    fake_command(tmp / "fakes", "aws", f'if [ "$1" = ssm ]; then cat "{tmp}/parameter"; exit 0; fi\necho "{error}" >&2; exit 1\n')
    argv_log = tmp / "curl-argv"
    curl = fake_command(tmp / "rec", "curl", f'printf "%s\\n" "$*" >>"{argv_log}"\nexec {shutil.which("curl")} "$@"\n')
    shipped("gptoss-gate-failure")
    env = fetch_env["env"] | {"GPTOSS_ETC": str(etc), "GPTOSS_STATE_DIR": str(tmp / "state"), "GPTOSS_CURL": str(curl)}
    try:
        res = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=env, capture_output=True, text=True, timeout=60)
        again = subprocess.run([str(shipped("gptoss-gate-failure")), "gptoss-scripts.service", "again"], env=env, capture_output=True, text=True)
    finally:
        server.shutdown()
    assert res.returncode == 1
    (put,) = handler.puts
    assert put["content_type"] in (None, ""), "the presigned URL was signed without a content type"
    reason = put["doc"]["Reason"]
    assert put["doc"]["Status"] == "FAILURE" and put["doc"]["UniqueId"] == "decode-0"
    assert reason == f"decode-0: gptoss-scripts.service failed: {error}; no intact copy of s3://bucket/asset.xz within 3s"
    assert "secret-part" not in argv_log.read_text(), "the URL never in curl's argv"
    assert again.returncode == 0 and "answered already" in again.stdout and len(handler.puts) == 1, "once per handle"


# ---- gptoss-backoff ------------------------------------------------------------------------------


@pytest.fixture
def backoff(tmp_path: Path, shipped: Shipped) -> Callable[..., str]:
    """Run the back-off as systemd would before a start: (NRestarts now, clock, *the unit's BASE MAX) -> seconds slept."""
    state = tmp_path / "state"
    state.mkdir()
    systemctl = fake_command(tmp_path, "systemctl", f'cat "{state}/restarts"\n')
    sleeper = fake_command(tmp_path, "sleep", f'echo "$1" >"{state}/slept"\n')
    clock = fake_command(tmp_path, "clock", f'cat "{state}/now"\n')

    def run(restarts: int, now: int, *limits: str) -> str:
        (state / "restarts").write_text(f"{restarts}\n")
        (state / "now").write_text(f"{now}\n")
        (state / "slept").unlink(missing_ok=True)
        res = subprocess.run(
            [str(shipped("gptoss-backoff")), "gptoss-decode.service", *limits],
            env={**os.environ, "GPTOSS_SYSTEMCTL": str(systemctl), "GPTOSS_SLEEP": str(sleeper), "GPTOSS_CLOCK": str(clock),
                 "GPTOSS_RUN_DIR": str(tmp_path / "run")},
            capture_output=True, text=True,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        return (state / "slept").read_text().strip() if (state / "slept").exists() else ""

    return run


def test_backoff_doubles_up_to_its_cap_and_never_delays_a_first_start(backoff: Callable[[int, int], str]) -> None:
    t = 1_000_000
    assert backoff(0, t) == ""
    waits = [backoff(n, t + 10 * n) for n in range(1, 8)]
    assert waits == ["60", "120", "240", "480", "900", "900", "900"]


def test_a_proxys_backoff_is_its_own_one_second_doubling_to_thirty(backoff: Callable[..., str]) -> None:
    """The proxy and router units pass 1 30 (serving.proxy.restart_backoff_s, _max_s): a router that crashed is back in seconds."""
    t = 1_000_000
    assert backoff(0, t, "1", "30") == ""
    assert [backoff(n, t + 10 * n, "1", "30") for n in range(1, 8)] == ["1", "2", "4", "8", "16", "30", "30"]


def test_backoff_starts_over_after_an_hour_of_running(backoff: Callable[[int, int], str]) -> None:
    t = 1_000_000
    assert [backoff(0, t), backoff(1, t + 5), backoff(2, t + 70), backoff(3, t + 200)] == ["", "60", "120", "240"]
    # The fourth restart comes after a healthy hour: the back-off starts over.
    assert backoff(4, t + 200 + 3600) == "60"
    assert backoff(5, t + 200 + 3700) == "120"


def test_backoff_does_not_delay_an_operators_start(backoff: Callable[[int, int], str]) -> None:
    t = 1_000_000
    backoff(0, t)
    assert backoff(1, t + 5) == "60"
    assert backoff(1, t + 20) == "", "NRestarts unchanged: a manual start, not an automatic restart"


# ---- the waits that start servers ------------------------------------------------------------------


def test_wait_healthy_runs_its_command_once_every_url_answers(health_server: str, tmp_path: Path, shipped: Shipped) -> None:
    res = subprocess.run(
        [str(shipped("gptoss-wait-healthy")), "5", f"{health_server}/health", f"{health_server}/healthcheck", "--", "echo", "started"],
        capture_output=True, text=True, env={**os.environ, "GPTOSS_PHASE_FILE": str(tmp_path / "phase")},
    )  # fmt: skip
    assert res.returncode == 0
    assert res.stdout.splitlines() == [f"gptoss-wait-healthy: healthy: {health_server}/health",
                                       f"gptoss-wait-healthy: healthy: {health_server}/healthcheck", "started"]  # fmt: skip
    assert (tmp_path / "phase").read_text() == "started: echo\n"


def test_wait_healthy_times_out_naming_the_silent_url(health_server: str, shipped: Shipped) -> None:
    dead = f"http://127.0.0.1:{free_port()}/health"
    res = subprocess.run(
        [str(shipped("gptoss-wait-healthy")), "2", f"{health_server}/health", dead, "--", "echo", "never"],
        capture_output=True, text=True, env={**os.environ, "GPTOSS_POLL_S": "0.2"}, timeout=30,
    )  # fmt: skip
    assert res.returncode == 1 and "never" not in res.stdout
    assert f"no answer after 2s from: {dead}" in res.stderr


@pytest.fixture
def prefill_gate(tmp_path: Path, shipped: Shipped) -> Callable[..., subprocess.CompletedProcess[str]]:
    """The prefill gate with a systemctl that reports replica 0's state from a file."""
    (tmp_path / "first").write_text("ActiveState=activating\nNRestarts=0\n")
    systemctl = fake_command(tmp_path, "systemctl", f'cat "{tmp_path}/first"\n')

    def run(index: str, timeout: str, *urls: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(shipped("gptoss-prefill-gate")), index, timeout, "gptoss-prefill@0.service", *urls, "--", "echo", f"replica {index} runs"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "GPTOSS_POLL_S": "0.2", "GPTOSS_SYSTEMCTL": str(systemctl), "GPTOSS_PHASE_FILE": str(tmp_path / "phase")},
        )  # fmt: skip

    run.state = tmp_path / "first"  # type: ignore[attr-defined]
    return run


def test_gate_starts_replica_zero_at_once_and_the_others_when_a_replica_answers(prefill_gate: Any, health_server: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}/health"
    r0 = prefill_gate("0", "1", dead)
    assert r0.returncode == 0 and r0.stdout.splitlines()[-1] == "replica 0 runs"
    r3 = prefill_gate("3", "30", dead, f"{health_server}/health")
    assert r3.returncode == 0 and "answers: the compile cache holds the prefill graph" in r3.stdout
    assert r3.stdout.splitlines()[-1] == "replica 3 runs"


def test_gate_releases_the_replicas_when_the_first_one_crash_loops(prefill_gate: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}/health"
    prefill_gate.state.write_text("ActiveState=activating\nNRestarts=2\n")
    # Its timeout is 4 hours: it returns at all (the helper gives it a minute) because it released the replicas.
    r = prefill_gate("3", "14400", dead)
    assert r.returncode == 0, "no hours-long wait for a replica that cannot come up"
    assert "gptoss-prefill@0.service is failing (activating, restarts 2): starting without its compile cache" in r.stdout


def test_gate_waits_at_most_its_bound(prefill_gate: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}/health"
    r = prefill_gate("2", "1", dead)
    assert r.returncode == 0 and "no replica answered within 1s: starting without waiting longer" in r.stdout


def test_exec_waits_for_this_boots_staging_then_runs_in_the_venv(tmp_path: Path, shipped: Shipped) -> None:
    venv = tmp_path / "venv-vllm-x"
    fake_command(venv / "bin", "served", 'echo "served in $VIRTUAL_ENV: $*"\n')
    (venv / "bin/activate").write_text(f'export VIRTUAL_ENV={venv}\nexport PATH="{venv}/bin:$PATH"\n')
    (tmp_path / "cluster.env").write_text(f"GPTOSS_VENV_GLOB={tmp_path}/venv-vllm*\nGPTOSS_LOG_DIR={tmp_path}/logs\n")
    run = tmp_path / "run"
    env = {**os.environ, "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_RUN_DIR": str(run), "GPTOSS_POLL_S": "1"}
    proc = subprocess.Popen([str(shipped("gptoss-exec")), "decode", "served", "--port", "8200"], env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(2.5)
    assert proc.poll() is None, "it waits while staging runs"
    assert (run / "phase/decode").read_text() == "waiting for staging\n"
    (run / "staged").touch()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.splitlines()[-1] == f"served in {venv}: --port 8200"
    assert (tmp_path / "logs/decode.log").read_text().splitlines()[-1] == f"served in {venv}: --port 8200"
    assert (run / "phase/decode").read_text() == "started: served\n"


def test_exec_stops_waiting_for_staging_at_its_deadline_and_names_why(tmp_path: Path, shipped: Shipped) -> None:
    """The NVMe step failed, so staging never runs: the server fails by name instead of waiting for ever."""
    (tmp_path / "cluster.env").write_text(f"GPTOSS_VENV_GLOB={tmp_path}/venv*\nGPTOSS_LOG_DIR={tmp_path}/logs\nGPTOSS_STAGE_WAIT_S=2\n")
    systemctl = fake_command(tmp_path, "systemctl", 'echo inactive; exit 3\n')
    env = {**os.environ, "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_RUN_DIR": str(tmp_path / "run"), "GPTOSS_POLL_S": "1",
           "GPTOSS_SYSTEMCTL": str(systemctl)}  # fmt: skip
    res = subprocess.run([str(shipped("gptoss-exec")), "decode", "served"], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 1
    assert "gptoss-exec: error: this boot's staging did not finish within 2s (gptoss-stage.service is inactive): not starting decode" in res.stdout + res.stderr
