"""gptoss-apply: a new software version on a running node, in place (rollout.software=in-place).

The real scripts as shipped (gptoss-apply, gptoss-fetch-scripts, gptoss-bootstrap, gptoss-signal's
verdict) on a node's file tree, with the node's real rendered files of two versions of the spec (the
stack's software asset, built as the stack builds it). What cannot run here is faked: S3 and SSM (a
fake `aws` that serves the two assets), systemd (a fake `systemctl`/`journalctl` that records what is
restarted and fails a decode server started with a flag vLLM refuses), and the decode server's health
route (a loopback server that answers while that fake unit is active). The booted VMs run the same
change under real systemd (tests/vm/test_boot.py).
"""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clusterspec.loading import load_config
from node_render.render import render_cluster
from node_render.userdata import software_asset
from tests.conftest import fake_command
from tests.local_moto import free_port
from tests.userdata.conftest import Shipped

NODE = "decode-0"
# The fake systemd: each unit's state in a file; a decode server whose unit carries --bogus-flag fails to start
# (vLLM exits at its argument parser), with the line the journal would hold.
SYSTEMCTL = r'''#!/usr/bin/env python3
import pathlib, sys
state = pathlib.Path(sys.argv[0]).parent.parent / "units"
state.mkdir(exist_ok=True)
root = pathlib.Path(__import__("os").environ["GPTOSS_ROOT"])
verb, args = sys.argv[1], sys.argv[2:]
with open(state.parent / "systemctl.log", "a") as log:
    print(" ".join(sys.argv[1:]), file=log)
if verb == "restart":
    for unit in args:
        text = (root / "etc/systemd/system" / unit).read_text() if (root / "etc/systemd/system" / unit).exists() else ""
        failed = "--bogus-flag" in text
        (state / unit).write_text("failed" if failed else "active")
        (state / f"{unit}.journal").write_text("vllm serve: error: unrecognized arguments: --bogus-flag\n" if failed else "")
    sys.exit(0)
if verb == "show":
    units = [a for a in args if not a.startswith("--")]
    print("\n\n".join(f"ActiveState={(state / u).read_text() if (state / u).exists() else 'active'}\nSubState=running\nNRestarts=0"
                      for u in units))
'''
JOURNALCTL = r'''#!/usr/bin/env python3
import pathlib, sys
state = pathlib.Path(sys.argv[0]).parent.parent / "units"
unit = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("_SYSTEMD_UNIT=")), sys.argv[-1])
journal = state / f"{unit}.journal"
print(journal.read_text() if journal.exists() else "", end="")
'''


class _Health(http.server.BaseHTTPRequestHandler):
    """The decode server's /health: 200 while its (fake) unit is active; its /metrics: the requests it holds
    (the file `running`, 0 without it), each read noted with whether the node's drain file existed then."""

    state: Path
    marker: Path

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/metrics":
            running = (self.state / "running").read_text().strip() if (self.state / "running").exists() else "0"
            with (self.state / "metrics.log").open("a") as log:
                print(running, self.marker.exists(), file=log)
            body = f'vllm:num_requests_running{{engine="0"}} {running}.0\nvllm:num_requests_waiting{{engine="0"}} 0.0\n'.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        unit = self.state / "gptoss-decode.service"
        ok = not unit.exists() or unit.read_text() == "active"
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def node(request: pytest.FixtureRequest, tmp_path: Path, shipped: Shipped) -> Iterator[dict[str, Any]]:
    """decode-0 of the default layout (or of the spec the test names: indirect parametrization), booted with
    version A (the spec as given), and a way to ship version B."""
    port = free_port()
    spec = dict(getattr(request, "param", {}))
    node_name = spec.pop("node", NODE)
    base = {"serving.decode.http_port": str(port)} | spec
    root = tmp_path / "root"
    (root / "etc/gptoss").mkdir(parents=True)
    s3 = tmp_path / "s3"
    s3.mkdir()
    fakes = tmp_path / "fakes"
    (fakes / "units").mkdir(parents=True)
    bin_dir = fakes / "bin"
    aws_log = tmp_path / "aws.log"
    fake_command(bin_dir, "aws", f'echo "$*" >>"{aws_log}"\ncase $1 in ssm) cat "{tmp_path}/parameter" ;; cloudwatch) ;; '
                                 f'*) cp "{s3}/${{4##*/}}" "${{*: -1}}" ;; esac\n')  # fmt: skip
    for name, text in (("systemctl", SYSTEMCTL), ("journalctl", JOURNALCTL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    handler = type("Health", (_Health,), {"state": fakes / "units", "marker": root / "run/gptoss/servers-draining"})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def version(**change: str) -> str:
        """Put the software of the spec with CHANGE in S3; returns its version ('URI SHA256')."""
        data = software_asset(render_cluster(load_config(base | change)))
        sha = hashlib.sha256(data).hexdigest()
        (s3 / f"{sha}.xz").write_bytes(data)
        return f"s3://assets/{sha}.xz {sha}"

    for script in ("gptoss-apply", "gptoss-fetch-scripts", "gptoss-bootstrap", "gptoss-signal", "gptoss-gate-failure", "gptoss-drain"):
        shipped(script)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GPTOSS_ROOT": str(root),
           "GPTOSS_DEPLOY_ENV": str(root / "etc/gptoss/deploy.env"), "GPTOSS_CLUSTER_ENV": str(root / "etc/gptoss/cluster.env"),
           "GPTOSS_ETC": str(root / "etc/gptoss"), "GPTOSS_STATE_DIR": str(root / "var/lib/gptoss"), "GPTOSS_RUN_DIR": str(root / "run/gptoss"),
           "GPTOSS_SYSTEMCTL": str(bin_dir / "systemctl"), "GPTOSS_JOURNALCTL": str(bin_dir / "journalctl"), "GPTOSS_SIGNAL_POLL_S": "0.2",
           "GPTOSS_FETCH_TIMEOUT_S": "10", "GPTOSS_TELEMETRY_CONFIG": str(root / "etc/gptoss/telemetry.json"),
           "GPTOSS_DRAIN_ENV": str(root / "etc/gptoss/drain.env"), "GPTOSS_DRAIN_FILE": str(root / "run/gptoss/servers-draining"),
           "GPTOSS_DRAIN_POLL_S": "0.2"}  # fmt: skip
    # The boot of version A: the user data's deploy.env, the parameter naming A, the fetch installing it.
    (root / "etc/gptoss/deploy.env").write_text(f"AWS_REGION=us-east-2\nGPTOSS_NODE={node_name}\nGPTOSS_SOFTWARE_PARAMETER=/gptoss/gptoss-8k1k/software\n")
    a = version()
    (tmp_path / "parameter").write_text(a + "\n")
    boot = subprocess.run([str(shipped("gptoss-fetch-scripts"))], env=env, capture_output=True, text=True, timeout=60)
    assert boot.returncode == 0, boot.stderr
    (fakes / "systemctl.log").write_text("")

    def apply(v: str, timeout_s: int = 5) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(shipped("gptoss-apply")), v, str(timeout_s)], env=env, capture_output=True, text=True, timeout=120)

    def restarted() -> list[list[str]]:
        return [line.split()[1:] for line in (fakes / "systemctl.log").read_text().splitlines() if line.startswith("restart ")]

    try:
        yield {"root": root, "a": a, "version": version, "apply": apply, "restarted": restarted, "env": env, "tmp": tmp_path,
               "fetch": shipped("gptoss-fetch-scripts"), "aws_log": aws_log, "units": fakes / "units"}  # fmt: skip
    finally:
        server.shutdown()


def _installed(root: Path) -> str:
    return (root / "var/lib/gptoss/software").read_text()


def test_a_decode_flag_restarts_the_decode_server_alone_and_records_the_version(node: dict[str, Any]) -> None:
    root = node["root"]
    b = node["version"](**{"serving.decode.max_num_seqs": "4"})
    res = node["apply"](b)
    assert res.returncode == 0, res.stdout + res.stderr
    assert node["restarted"]() == [["gptoss-decode.service"]]
    unit = (root / "etc/systemd/system/gptoss-decode.service").read_text()
    assert "--max-num-seqs 4 " in unit and "--max-num-seqs 8 " not in unit
    assert _installed(root) == b + "\n"
    sha_a, sha_b = node["a"].split()[1], b.split()[1]
    assert sorted(p.name for p in (root / "var/lib/gptoss/versions").iterdir()) == sorted([sha_a, sha_b]), "the previous version is kept"
    assert f"gptoss-apply: {NODE}: serves with version {sha_b[:12]}" in res.stdout
    assert not (root / "run/gptoss/applying").exists(), "the health watch holds only while the change runs"
    # How long it took, for the next change's estimate: once, in the cluster's namespace, by cluster and role.
    took = res.stdout.split(f"serves with version {sha_b[:12]}, ")[1].split(" s after")[0]
    published = [line for line in node["aws_log"].read_text().splitlines() if line.startswith("cloudwatch ")]
    assert published == [f"cloudwatch put-metric-data --region us-east-2 --namespace GptOss/gptoss-8k1k --metric-name InPlaceRestartSeconds "
                         f"--dimensions Cluster=gptoss-8k1k,Role=decode --value {took} --unit Seconds"]  # fmt: skip


# decode-1 behind vLLM's router (decode-0 hosts the one router), its checks scaled down: a server leaves the
# routers within 1 x 1 + 1 + 1 = 3 s.
ROUTED = {"node": "decode-1", "decode_instances": "2", "prefill_per_decode": "3", "serving.proxy.kind": "vllm-router",
          "serving.proxy.router.max_routers": "1", "serving.proxy.router.health_check_interval_s": "1",
          "serving.proxy.router.health_failure_threshold": "1", "serving.proxy.router.health_check_timeout_s": "1"}  # fmt: skip


@pytest.mark.parametrize("node", [ROUTED], indirect=True)
def test_behind_the_router_a_server_leaves_the_routers_and_finishes_what_it_holds_before_its_restart(node: dict[str, Any]) -> None:
    """A decode node behind vLLM's router: before its server restarts, the drain file exists (its health route answers
    503: the routers take it out) for the routers' time to see it, then until the server holds no request (2
    running, then none), and it is gone by the restart (the new process answers its health route again)."""
    units, root = node["units"], node["root"]
    b = node["version"](**{"serving.decode.max_num_seqs": "4"})
    (units / "running").write_text("2")
    marker = root / "run/gptoss/servers-draining"

    def finish() -> None:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(4.5)  # past the routers' 3 s: what the server held finishes then
        (units / "running").write_text("0")

    finisher = threading.Thread(target=finish)
    finisher.start()
    res = node["apply"](b, 30)
    finisher.join()
    assert res.returncode == 0, res.stdout + res.stderr
    assert node["restarted"]() == [["gptoss-decode.service"]]
    assert "gptoss-drain: gptoss-decode.service leave the routers (their health route answers 503); the routers see it within 3s" in res.stderr
    assert re.search(r"gptoss-drain: no request left on gptoss-decode\.service after [1-9]\d*s more", res.stderr), res.stderr
    polls = [line.split() for line in (units / "metrics.log").read_text().splitlines()]
    assert polls[0] == ["2", "True"] and polls[-1] == ["0", "True"], "polled while it drained, until it held nothing"
    assert not marker.exists(), "the restarted server answers its health route: the routers take it back"


def test_a_collector_script_restarts_no_server(node: dict[str, Any], shipped: Shipped) -> None:
    """The telemetry collector's script changes (an edit of userdata/bin/gptoss-telemetry): its unit restarts, never
    the decode server (nor gptoss-signal, whose script names the collector: the gate's verdict is once per instance)."""
    from node_render.node_scripts import shipped_scripts

    scripts = shipped_scripts()
    original = scripts["gptoss-telemetry"]
    scripts["gptoss-telemetry"] = original + "# a one-line edit\n"
    try:
        b = node["version"]()
    finally:
        scripts["gptoss-telemetry"] = original
    res = node["apply"](b)
    assert res.returncode == 0, res.stdout + res.stderr
    assert node["restarted"]() == [["gptoss-telemetry.service"]]
    assert (node["root"] / "opt/gptoss/bin/gptoss-telemetry").read_text().endswith("# a one-line edit\n")


def test_a_failed_start_rolls_the_node_back_and_names_the_unit_and_its_log_line(node: dict[str, Any]) -> None:
    """The new version's decode server does not start (a flag vLLM refuses): the node goes back to version A,
    restarts the same unit again, serves with A, and the apply fails naming the node, the unit and the line."""
    root = node["root"]
    flags = {"serving.decode.extra_flags": [{"name": "--bogus-flag", "value": "1", "reason": "a flag this vLLM does not know"}]}
    b = node["version"](**flags)  # type: ignore[arg-type]
    res = node["apply"](b)
    assert res.returncode == 1, res.stdout + res.stderr
    sha_a, sha_b = node["a"].split()[1], b.split()[1]
    said = res.stderr.strip().splitlines()[-1]
    assert said == (f"gptoss-apply: {NODE}: FAILED: version {sha_b[:12]}: gptoss-decode.service failed: vllm serve: error: unrecognized "
                    f"arguments: --bogus-flag; rolled back to {sha_a[:12]}, which serves again")  # fmt: skip
    assert node["restarted"]() == [["gptoss-decode.service"], ["gptoss-decode.service"]]
    assert "--bogus-flag" not in (root / "etc/systemd/system/gptoss-decode.service").read_text()
    assert _installed(root) == node["a"] + "\n"
    assert "cloudwatch" not in node["aws_log"].read_text(), "a failed change is no measured restart"


def test_the_running_version_again_changes_nothing(node: dict[str, Any]) -> None:
    res = node["apply"](node["a"])
    assert res.returncode == 0 and "nothing to do" in res.stdout
    assert node["restarted"]() == []


def test_a_node_booted_after_the_change_runs_the_new_version(node: dict[str, Any]) -> None:
    """A replacement (or a surge's instance) boots with the launch template it always had: it reads the parameter,
    which names the new version, not the one the fleet ran when its template was made."""
    root = node["root"]
    b = node["version"](**{"serving.decode.max_num_seqs": "4"})
    (node["tmp"] / "parameter").write_text(b + "\n")
    fresh = node["tmp"] / "fresh"
    (fresh / "etc/gptoss").mkdir(parents=True)
    (fresh / "etc/gptoss/deploy.env").write_text((root / "etc/gptoss/deploy.env").read_text())
    env = node["env"] | {"GPTOSS_ROOT": str(fresh), "GPTOSS_DEPLOY_ENV": str(fresh / "etc/gptoss/deploy.env")}
    res = subprocess.run([str(node["fetch"])], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert _installed(fresh) == b + "\n"
    assert "--max-num-seqs 4 " in (fresh / "etc/systemd/system/gptoss-decode.service").read_text()


def test_a_version_that_is_not_one_is_refused_before_anything_runs(node: dict[str, Any]) -> None:
    res = node["apply"]("s3://assets/x.xz not-a-sha")
    assert res.returncode == 2 and "is not 'S3_URI SHA256'" in res.stderr
    assert node["restarted"]() == [] and _installed(node["root"]) == node["a"] + "\n"


def test_a_node_draining_for_its_blocks_end_is_not_changed(node: dict[str, Any]) -> None:
    """Its servers were stopped on purpose before EC2 reclaims the Capacity Block (gptoss-telemetry): an apply would
    start them again; it refuses, and the deploy hears why."""
    (node["root"] / "run/gptoss").mkdir(parents=True, exist_ok=True)
    (node["root"] / "run/gptoss/block-draining").touch()
    res = node["apply"](node["version"](**{"serving.decode.max_num_seqs": "4"}))
    assert res.returncode == 1 and "its Capacity Block ends (the node drains before EC2 reclaims it): not applied" in res.stderr
    assert node["restarted"]() == [] and _installed(node["root"]) == node["a"] + "\n"
