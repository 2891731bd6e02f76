"""The boot check, the deploy gate's signal and the telemetry collector, run for real as shipped.

Tool outputs are injected (fi_info, /dev/neuron*, the venv's Python, systemctl, journalctl);
the HTTP peers (the wait condition handle, the proxy, a vLLM /metrics page) are loopback
servers of the test. The collector's payloads are checked against botocore's own models of
PutMetricData and PutLogEvents.
"""

from __future__ import annotations

import hashlib
import http.server
import importlib.machinery
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import botocore.session
import pytest
from botocore.validate import validate_parameters

from clusterspec.loading import load_config
from node_render import telemetry
from node_render.paths import USERDATA_DIR
from node_render.render import cluster_env
from tests.conftest import fake_command, private_etc, real_aws_cli, with_etc

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


# ---- gptoss-signal --------------------------------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    """The handle (PUT), a proxy (POST /v1/completions) and health routes, on loopback."""

    puts: list[dict[str, Any]]
    completion: dict[str, Any]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    # What the handle answers, in turn (the last one from then on): (status, S3's XML body).
    put_answers: ClassVar[list[tuple[int, bytes]]] = [(200, b"")]
    completion_status = 200

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.puts.append({"content_type": self.headers.get("Content-Type"), "doc": json.loads(body)})
        answers = type(self).put_answers
        status, xml = answers.pop(0) if len(answers) > 1 else answers[0]
        self._reply(status, xml)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(self.completion_status, json.dumps(self.completion).encode())

    def do_GET(self) -> None:
        self._reply(200, b"ok")


@pytest.fixture
def peers() -> Iterator[type[_Recorder]]:
    handler = type(
        "R", (_Recorder,), {"puts": [], "put_answers": [(200, b"")], "completion": {"choices": [{"text": " Paris."}], "usage": {"completion_tokens": 16}}}
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield handler
    server.shutdown()


@pytest.fixture
def signal_node(tmp_path: Path, peers: Any, shipped: Shipped) -> Callable[..., subprocess.CompletedProcess[str]]:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "health").write_text(
        f"gptoss-node-check.service - -\ngptoss-stage.service - -\ngptoss-proxy.service {peers.url}/healthcheck proxy\n"
    )
    (etc / "signal.env").write_text(f"GPTOSS_SIGNAL_URL={peers.url}/handle?X-Amz-Signature=abc\n")
    states = tmp_path / "states.json"
    fake_command(
        tmp_path,
        "systemctl",
        # One block per unit named, in order, blank lines between (as systemctl show prints them).
        f'python3 -c \'import json,sys; s=json.load(open("{states}")); print("\\n\\n".join(s.get(u, "ActiveState=active") for u in sys.argv[1:] if u.endswith((".service", ".timer", ".target"))))\' "$@"\n',
    )
    fake_command(tmp_path, "journalctl", 'u=${*: -1}; echo "last line of ${u#_SYSTEMD_UNIT=}"\n')

    def run(
        units: dict[str, str] | None = None, *, timeout: int = 21600, completion: bool = True, query: str = "X-Amz-Signature=abc",
        aws: bool = False, gate: str = "", booted_ago_s: float = 0, extra_env: dict[str, str] | None = None,
        health: str | None = None, node_env: str = "", hosts: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        if health is not None:
            (etc / "health").write_text(health)
        (etc / "signal.env").write_text(f"GPTOSS_SIGNAL_URL={peers.url}/handle?{query}\n" + (f"GPTOSS_GATE={gate}\n" if gate else ""))
        states.write_text(json.dumps(units or {}))
        (etc / "cluster.env").write_text(
            f"GPTOSS_NODE=prefill-0\nGPTOSS_MODEL_DIR=/opt/dlami/nvme/models/gpt-oss-120b\nGPTOSS_READY_TIMEOUT_S={timeout}\n"
            + (f"GPTOSS_COMPLETION_URL={peers.url}/v1/completions\n" if completion else "")
            + ("AWS_REGION=us-east-2\n" if aws else "")
            + node_env
        )
        # The kernel's boot time (/proc/stat btime): this instance's first boot, BOOTED_AGO_S ago.
        (tmp_path / "stat").write_text(f"cpu 1 2 3 4\nbtime {int(time.time() - booted_ago_s)}\n")
        env = {**os.environ, "GPTOSS_ETC": str(etc), "GPTOSS_STATE_DIR": str(tmp_path / "state"), "GPTOSS_SYSTEMCTL": str(tmp_path / "systemctl"),
               "GPTOSS_JOURNALCTL": str(tmp_path / "journalctl"), "GPTOSS_SIGNAL_POLL_S": "0.1", "GPTOSS_SIGNAL_RETRY_MAX_S": "0.2",
               "GPTOSS_PROC_STAT": str(tmp_path / "stat"), **(extra_env or {})}  # fmt: skip
        argv = [sys.executable, str(shipped("gptoss-signal"))]
        if hosts is not None:
            # The node's names as gptoss-members writes them to /etc/hosts: a mount namespace of its own.
            argv = with_etc(argv, private_etc(tmp_path / "system", hosts))
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    return run


def test_signal_succeeds_after_a_real_completion_through_the_proxy_and_only_once(signal_node: Any, peers: Any) -> None:
    r = signal_node()
    assert r.returncode == 0, r.stderr
    (put,) = peers.puts
    assert put["content_type"] == "", "the presigned URL was signed without a content type"
    assert put["doc"]["Status"] == "SUCCESS" and put["doc"]["UniqueId"] == "prefill-0"
    assert put["doc"]["Reason"] == f"prefill-0: a completion through {peers.url}/v1/completions returned 16 tokens"
    assert signal_node().returncode == 0 and len(peers.puts) == 1, "a reboot does not signal again"


def test_signal_waits_while_the_completion_returns_no_tokens(signal_node: Any, peers: Any) -> None:
    peers.completion = {"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}
    r = signal_node(timeout=121)
    assert r.returncode == 0
    (put,) = peers.puts
    assert put["doc"]["Status"] == "FAILURE"
    assert "not ready before the deploy gate's timeout: completion returned no tokens" in put["doc"]["Reason"]


def test_signal_fails_naming_the_failed_unit_and_its_last_log_line(signal_node: Any, peers: Any) -> None:
    r = signal_node({"gptoss-node-check.service": "ActiveState=failed\nNRestarts=0"})
    assert r.returncode == 0, r.stderr
    (put,) = peers.puts
    assert put["doc"] == {"Status": "FAILURE", "UniqueId": "prefill-0",
                          "Reason": "prefill-0: gptoss-node-check.service failed: last line of gptoss-node-check.service",
                          "Data": "prefill-0: gptoss-node-check.service failed: last line of gptoss-node-check.service"}  # fmt: skip


def test_signal_fails_when_staging_keeps_failing(signal_node: Any, peers: Any) -> None:
    signal_node({"gptoss-stage.service": "ActiveState=activating\nSubState=auto-restart\nNRestarts=3"})
    assert (
        peers.puts[0]["doc"]["Reason"]
        == "prefill-0: gptoss-stage.service staging keeps failing (3 restarts): last line of gptoss-stage.service"
    )


def _amz(signed_ago_s: float, expires_s: int = 86399) -> str:
    """The query of a SigV4 presigned URL signed that long ago (as CloudFormation's handles are)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() - signed_ago_s))
    return f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Date={stamp}&X-Amz-SignedHeaders=host&X-Amz-Expires={expires_s}&X-Amz-Signature=abc"


# S3's answers to a PUT on a presigned URL (its REST error format): past the URL's expiry, and
# refused by a policy (a VPC endpoint policy, an SCP, a bucket policy) while the URL is still valid.
S3_EXPIRED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Request has expired</Message>'
              b"<X-Amz-Expires>86399</X-Amz-Expires><RequestId>R1</RequestId></Error>")  # fmt: skip
S3_DENIED = b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message><RequestId>R2</RequestId></Error>'


def test_an_expired_handle_is_told_nothing_and_asked_nothing_again(signal_node: Any, peers: Any, tmp_path: Path) -> None:
    """S3 answers 403 "Request has expired" to a presigned URL past its expiry: log once, stop
    (Restart=on-failure would ask for the node's life); the verdict is kept for the group."""
    peers.put_answers = [(403, S3_EXPIRED)]
    r = signal_node({"gptoss-node-check.service": "ActiveState=failed\nNRestarts=0"})
    assert r.returncode == 0, r.stderr
    assert len(peers.puts) == 1, "one PUT: an expired handle is not asked again"
    assert "the handle answered 403 AccessDenied: Request has expired" in r.stdout and "the deploy gate is over" in r.stdout
    again = signal_node({"gptoss-node-check.service": "ActiveState=failed\nNRestarts=0"})
    assert again.returncode == 0 and len(peers.puts) == 1 and "already signalled (FAILURE" in again.stdout
    assert "(the gate not told: the handle answered 403 AccessDenied: Request has expired)" in again.stdout


def test_a_403_that_is_not_expiry_is_named_and_tried_again_until_the_policy_lets_it_through(signal_node: Any, peers: Any) -> None:
    """A policy that denies the wait-condition bucket is not the end of the gate: the node says what
    refuses it at every attempt and signals as soon as the policy is fixed (here: after three refusals)."""
    peers.put_answers = [(403, S3_DENIED), (403, S3_DENIED), (403, S3_DENIED), (200, b"")]
    r = signal_node({"gptoss-node-check.service": "ActiveState=failed\nNRestarts=0"}, query=_amz(signed_ago_s=60))
    assert r.returncode == 0, r.stderr
    assert len(peers.puts) == 4 and all(p["doc"]["Status"] == "FAILURE" for p in peers.puts)
    refused = [line for line in r.stdout.splitlines() if "the wait-condition bucket refuses this node" in line]
    assert len(refused) == 3 and "(403 AccessDenied: Access Denied) although the handle has not expired" in refused[0]
    assert "VPC endpoint policy" in refused[0]
    assert "gptoss-signal: FAILURE: prefill-0: gptoss-node-check.service failed" in r.stdout
    assert "EXPIRED" not in r.stdout


def test_a_403_that_outlasts_the_handle_ends_when_the_handle_expires(signal_node: Any, peers: Any) -> None:
    peers.put_answers = [(403, S3_DENIED)]
    # 12 s of validity: room for a slow start on a busy machine, and for many 0.2 s retries after it.
    r = signal_node({"gptoss-node-check.service": "ActiveState=failed\nNRestarts=0"}, query=_amz(signed_ago_s=0, expires_s=12))
    assert r.returncode == 0, r.stderr
    assert len(peers.puts) >= 2, "tried again while the handle was valid"
    assert r.stdout.count("the wait-condition bucket refuses this node") >= len(peers.puts) - 1, "each refusal named while the handle was valid"
    assert ("the deploy gate is over; not signalling FAILURE to it (gptoss-node-check.service failed: last line of "
            "gptoss-node-check.service)") in r.stdout  # fmt: skip


def test_an_endpoint_that_refuses_the_test_completion_fails_the_gate_in_four_tries(signal_node: Any, peers: Any) -> None:
    """A 4xx that waiting does not change (the model name, the request) is a FAILURE with the answer, not a wait to the deadline."""
    peers.completion_status = 404
    peers.completion = {"error": {"message": "The model `/opt/dlami/nvme/models/gpt-oss-120b` does not exist.", "code": 404}}
    r = signal_node()
    assert r.returncode == 0, r.stderr
    (put,) = peers.puts
    assert put["doc"]["Status"] == "FAILURE"
    assert put["doc"]["Reason"].startswith("prefill-0: every unit is ready but the endpoint refused the test completion 4 times in a row: HTTP 404: ")
    assert "does not exist" in put["doc"]["Reason"]


def test_a_busy_endpoint_is_waited_for_not_failed(signal_node: Any, peers: Any) -> None:
    """429 (too many requests) passes: the gate waits for it (here until its short timeout)."""
    peers.completion_status = 429
    r = signal_node(timeout=121)
    assert r.returncode == 0
    (put,) = peers.puts
    assert "not ready before the deploy gate's timeout: completion request failed: HTTP 429" in put["doc"]["Reason"]


def test_a_handle_past_its_expiry_is_not_signalled_but_the_node_still_reaches_its_verdict(signal_node: Any, peers: Any) -> None:
    """A rollback's instance boots the previous template, whose handle was made at the previous deploy
    (here 25 hours ago: its URL has expired): nothing is PUT, and the node still watches its units to
    its verdict, which its group hears (the surge tests below)."""
    r = signal_node(query=_amz(signed_ago_s=90000))
    assert r.returncode == 0 and peers.puts == [], r.stdout
    assert "the deploy gate will not be told (its URL has expired)" in r.stdout
    assert f"gptoss-signal: SUCCESS: prefill-0: a completion through {peers.url}/v1/completions returned 16 tokens" in r.stdout


def _ready_after(peers: Any, calls: int) -> None:
    """The endpoint answers no tokens to its first CALLS test completions, then tokens."""
    answers = iter([{"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}] * calls)
    done = {"choices": [{"text": " Paris."}], "usage": {"completion_tokens": 16}}
    original = peers.do_POST

    def do_post(self: Any) -> None:
        type(self).completion = next(answers, done)
        original(self)

    peers.do_POST = do_post


def test_a_node_launched_hours_after_its_handle_was_made_gets_its_full_deadline(signal_node: Any, peers: Any) -> None:
    """The clock starts at the node's own turn: the later of its instance's first boot and its handle's
    making. A handle made 5 hours before this instance booted (a lane's late node, a replacement) leaves
    the node the gate's whole timeout: it waits for its completion and signals SUCCESS, where a clock
    from the handle (400 s, less the 300 s margin, long past) would have failed it at once."""
    _ready_after(peers, 3)
    r = signal_node(timeout=400, query=_amz(signed_ago_s=5 * 3600))
    assert r.returncode == 0, r.stderr
    (put,) = peers.puts
    assert put["doc"]["Status"] == "SUCCESS", put
    assert "not ready before the deploy gate's timeout" not in r.stdout


def test_a_handle_made_after_the_instance_booted_starts_the_clock_then(signal_node: Any, peers: Any) -> None:
    """An instance that booted 5 hours ago and is handed a handle made now counts from the handle: the
    later of the two, never the earlier."""
    _ready_after(peers, 3)
    r = signal_node(timeout=400, query=_amz(signed_ago_s=0), booted_ago_s=5 * 3600)
    assert r.returncode == 0, r.stderr
    assert [p["doc"]["Status"] for p in peers.puts] == ["SUCCESS"]


def test_the_deadline_ends_the_wait_with_a_failure_that_says_so(signal_node: Any, peers: Any) -> None:
    """A node that does not serve within its own deadline (booted now, 400 s - 300 s margin) reports FAILURE before CloudFormation's timeout."""
    peers.completion = {"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}
    r = signal_node(timeout=302, query=_amz(signed_ago_s=0))
    assert r.returncode == 0
    (put,) = peers.puts
    assert put["doc"]["Status"] == "FAILURE" and "not ready before the deploy gate's timeout" in put["doc"]["Reason"]


# ---- gptoss-telemetry -------------------------------------------------------------------------------


def _collector() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("gptoss_telemetry", str(USERDATA_DIR / "bin" / "gptoss-telemetry"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


class _VllmMetrics(http.server.BaseHTTPRequestHandler):
    """A vLLM server's /metrics (0.11 names) whose counters the test advances."""

    n = 0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        n = type(self).n
        if self.path == "/router-metrics":  # vllm-router 0.1.17's names: 10 requests and 1 decode error per step
            body = (
                f'vllm_router_pd_requests_total{{route="/v1/completions"}} {10.0 * n}\n'
                f'vllm_router_pd_decode_errors_total{{worker="http://10.0.0.2:8200"}} {1.0 * n}\n'
                f'vllm_router_retries_total{{route="/v1/completions"}} {2.0 * n}\n'
                'vllm_router_worker_health{worker="http://10.0.0.1:8100"} 1\n'
                'vllm_router_worker_health{worker="http://10.0.0.2:8200"} 0\n'
                'vllm_router_pd_pending_decode_requests{worker="http://10.0.0.3:8200",rank="aggregate"} 4\n'
                f'vllm_router_pd_request_duration_seconds_sum{{route="/v1/completions"}} {2.5 * n}\n'
                f'vllm_router_pd_request_duration_seconds_count{{route="/v1/completions"}} {10.0 * n}\n'
            )
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        body = "ok" if self.path == "/health" else (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {8192.0 * n}\n'
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {1024.0 * n}\n'
            f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {0.5 * n}\n'
            f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {1.0 * n}\n'
            f'vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {0.01 * 1024 * n}\n'
            f'vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {1024.0 * n}\n'
        )  # fmt: skip
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _validate(operation: str, service: str, params: dict[str, Any]) -> None:
    model = botocore.session.get_session().get_service_model(service)
    validate_parameters(params, model.operation_model(operation).input_shape)


def test_collector_publishes_every_catalog_metric_in_a_payload_cloudwatch_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = type("V", (_VllmMetrics,), {"n": 1})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    ib = tmp_path / "infiniband"
    for dev in ("rdmap0s0", "rdmap1s0"):
        (ib / dev / "ports/1/hw_counters").mkdir(parents=True)
    report = {"neuron_runtime_data": [{"report": {"neuroncore_counters": {"neuroncores_in_use": {"0": {"neuroncore_utilization": 80.0},
              "1": {"neuroncore_utilization": 60.0}}}, "memory_used": {"neuron_runtime_used_bytes": {"neuron_device": 2**30}},
              "execution_stats": {"error_summary": {"generic": 0, "numerical": 1}}}}]}  # fmt: skip
    fake_command(tmp_path, "neuron-monitor", f"echo '{json.dumps(report)}'\nsleep 30\n")
    stage_state = tmp_path / "stage.state"
    stage_state.write_text("ActiveState=activating\nSubState=auto-restart\nNRestarts=1\n")
    fake_command(
        tmp_path,
        "systemctl",
        f'for u; do case $u in -* | show) ;; gptoss-stage.service) cat "{stage_state}"; echo ;; *) echo ActiveState=active; echo ;; esac; done\n',
    )
    for k, v in {"GPTOSS_SYS_INFINIBAND": str(ib), "GPTOSS_NEURON_MONITOR": str(tmp_path / "neuron-monitor"),
                 "GPTOSS_SYSTEMCTL": str(tmp_path / "systemctl"), "GPTOSS_STATE_DIR": str(tmp_path / "state")}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    mod = _collector()
    # The node's API gate: the real HAProxy, in front of a stand-in router whose answers each request chooses.
    from clusterspec.sections.proxy import Proxy
    from tests.api_gate import start_gate
    from tests.unit.test_api_gate import Upstream, _port, completion

    upstream = Upstream()
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    gate = start_gate(tmp_path / "gate", Proxy(), host="127.0.0.1", port=_port(), router_port=upstream.server_address[1])
    cfg = {"namespace": "GptOss/c1", "region": "us-east-2", "cluster": "c1", "node": "decode-0", "role": "decode", "interval_s": 60,
           "log_group": "/gptoss/c1", "efa": True, "metrics": [m.name for m in telemetry.ALL_METRICS],
           "servers": [{"name": "decode-0/decode", "unit": "gptoss-decode.service", "health_url": f"{base}/health", "metrics_url": f"{base}/metrics"}],
           "units": ["gptoss-stage.service", "gptoss-decode.service"], "router_metrics_url": f"{base}/router-metrics",
           "gate_socket": str(gate.socket_dir / "haproxy.sock"), "block": "cr-0123456789abcdef0"}  # fmt: skip
    # The AWS CLI's answer for the block's end date (--output text).
    fake_command(tmp_path, "aws-block", 'echo 2099-01-01T00:00:00+00:00\n')
    monkeypatch.setattr(mod, "AWS", str(tmp_path / "aws-block"))
    try:
        for dev in ("rdmap0s0", "rdmap1s0"):
            (ib / dev / "ports/1/hw_counters/rx_bytes").write_text("1000\n")
            (ib / dev / "ports/1/hw_counters/tx_bytes").write_text("500\n")
        c = mod.Collector(cfg)
        import time

        for _ in range(50):
            if c.neuron.report:
                break
            time.sleep(0.1)
        c.collect(1000.0)
        handler.n = 11  # ten more requests in 60 s
        for i in range(20):  # and 20 through the gate whose first attempt the router answered 500: 20 retries
            assert completion(gate.port, id=f"r{i}", answers=[500])[0] == 200
        for dev in ("rdmap0s0", "rdmap1s0"):
            (ib / dev / "ports/1/hw_counters/rx_bytes").write_text(str(1000 + 6_000_000) + "\n")
            (ib / dev / "ports/1/hw_counters/tx_bytes").write_text(str(500 + 600_000) + "\n")
        data = c.collect(1060.0)
    finally:
        server.shutdown()
        gate.stop()
        upstream.shutdown()
        if c.neuron and c.neuron.proc:
            c.neuron.proc.kill()
    values = {d["MetricName"]: d["Value"] for d in data}
    assert values["PromptTokensPerSecond"] == pytest.approx(8192 * 10 / 60)
    assert values["GenerationTokensPerSecond"] == pytest.approx(1024 * 10 / 60)
    assert values["TimeToFirstTokenMs"] == pytest.approx(500.0) and values["TimePerOutputTokenMs"] == pytest.approx(10.0)
    assert (values["RequestsRunning"], values["RequestsWaiting"], values["KvCacheUsagePercent"], values["ServerUp"]) == (
        3,
        1,
        25,
        1,
    )
    assert (
        values["NeuronCoreUtilizationPercent"] == 70
        and values["NeuronDeviceMemoryUsedBytes"] == 2**30
        and values["NeuronExecutionErrors"] == 1
    )
    assert values["EfaRxBytesPerSecond"] == pytest.approx(2 * 6_000_000 / 60) and values["EfaTxBytesPerSecond"] == pytest.approx(
        2 * 600_000 / 60
    )
    assert (values["UnitsNotReady"], values["StagingFailing"], values["ServersDown"]) == (1, 1, 0)
    assert values["RouterRequestsPerSecond"] == pytest.approx(100 / 60, abs=1e-5) and values["RouterErrorsPerSecond"] == pytest.approx(10 / 60, abs=1e-5)
    assert values["RouterErrorPercent"] == pytest.approx(10.0) and values["GateRetriesPerSecond"] == pytest.approx(20 / 60, abs=1e-5)
    assert (values["RouterUnhealthyServers"], values["RouterPendingDecode"], values["RouterRequestMs"]) == (1, 4, pytest.approx(250.0))
    # Staged: the same collector reports it (the decode server is gone by now: one unit not ready).
    stage_state.write_text("ActiveState=active\nSubState=exited\nNRestarts=1\n")
    again = {d["MetricName"]: d["Value"] for d in c.collect(1120.0)}
    assert (again["StagingFailing"], again["ServersDown"]) == (0, 1)
    # Every metric of the catalog comes out, with its dimensions, in a payload the API accepts.
    assert set(values) == {m.name for m in telemetry.ALL_METRICS}
    by_name = {d["MetricName"]: {x["Name"] for x in d["Dimensions"]} for d in data}
    assert by_name["TimeToFirstTokenMs"] == {"Cluster", "Node", "Role", "Server"} and by_name["UnitsNotReady"] == {"Cluster"}
    _validate("PutMetricData", "cloudwatch", {"Namespace": "GptOss/c1", "MetricData": data})


def _states_collector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, units: dict[str, str], servers: list[dict[str, str]] | None = None) -> Any:
    """A collector over units whose `systemctl show` blocks the test writes (no metrics server, no neuron-monitor)."""
    states = tmp_path / "states.json"
    states.write_text(json.dumps(units))
    fake_command(
        tmp_path, "systemctl",
        f'python3 -c \'import json,sys; s=json.load(open("{states}")); print("\\n\\n".join(s.get(u, "ActiveState=active") for u in sys.argv[1:] if u.endswith((".service", ".timer"))))\' "$@"\n',
    )  # fmt: skip
    monkeypatch.setenv("GPTOSS_SYSTEMCTL", str(tmp_path / "systemctl"))
    monkeypatch.setenv("GPTOSS_STATE_DIR", str(tmp_path / "state"))
    mod = _collector()
    cfg = {"namespace": "GptOss/c1", "region": "us-east-2", "cluster": "c1", "node": "prefill-0", "role": "prefill", "interval_s": 60,
           "log_group": "/gptoss/c1", "efa": False, "neuron": False, "metrics": [m.name for m in telemetry.ALL_METRICS],
           "servers": servers or [], "units": list(units)}  # fmt: skip
    return mod, mod.Collector(cfg), states


def _values(data: list[dict[str, Any]]) -> dict[str, float]:
    return {d["MetricName"]: d["Value"] for d in data}


def test_units_not_ready_is_zero_on_a_healthy_node_whose_oneshots_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A timer's service between two runs and the signal that already reported are done, not "not
    ready" (the metric could never be 0 before); a stopped server, a failed oneshot, a starting unit are."""
    done = "ActiveState=inactive\nSubState=dead\nType=oneshot\nResult=success\nNRestarts=0"
    healthy = {"gptoss-members.service": done, "gptoss-signal.service": done, "gptoss-health-watch.service": done,
               "gptoss-decode.service": "ActiveState=active\nSubState=running\nType=exec\nResult=success\nNRestarts=0"}  # fmt: skip
    _, c, states = _states_collector(tmp_path, monkeypatch, healthy)
    assert _values(c.collect(1000.0))["UnitsNotReady"] == 0
    for unit, state in (("gptoss-decode.service", "ActiveState=inactive\nSubState=dead\nType=exec\nResult=success\nNRestarts=0"),
                        ("gptoss-signal.service", "ActiveState=failed\nSubState=failed\nType=oneshot\nResult=exit-code\nNRestarts=0"),
                        ("gptoss-members.service", "ActiveState=activating\nSubState=start\nType=oneshot\nResult=success\nNRestarts=0")):  # fmt: skip
        states.write_text(json.dumps(healthy | {unit: state}))
        assert _values(c.collect(1000.0))["UnitsNotReady"] == 1, unit


def test_staging_failing_counts_a_failed_nvme_step_under_an_inactive_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    units = {"gptoss-nvme.service": "ActiveState=failed\nSubState=failed\nType=oneshot\nResult=exit-code\nNRestarts=0",
             "gptoss-stage.service": "ActiveState=inactive\nSubState=dead\nType=oneshot\nResult=success\nNRestarts=0"}  # fmt: skip
    _, c, _ = _states_collector(tmp_path, monkeypatch, units)
    assert _values(c.collect(1000.0))["StagingFailing"] == 1


def test_servers_down_remembers_what_answered_across_a_restart_of_the_collector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("V", (_VllmMetrics,), {"n": 1}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    servers = [{"name": "prefill-0/prefill@0", "unit": "gptoss-prefill@0.service", "health_url": f"{base}/health", "metrics_url": f"{base}/metrics"}]
    try:
        _, first, _ = _states_collector(tmp_path, monkeypatch, {"gptoss-prefill@0.service": "ActiveState=active"}, servers)
        assert _values(first.collect(1000.0))["ServersDown"] == 0
    finally:
        server.shutdown()
        server.server_close()
    # The collector restarts (a crash, a reboot): it still knows the server answered on this instance.
    _, again, _ = _states_collector(tmp_path, monkeypatch, {"gptoss-prefill@0.service": "ActiveState=active"}, servers)
    assert _values(again.collect(1060.0))["ServersDown"] == 1


def test_the_heartbeat_is_published_with_the_nodes_dimensions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, c, _ = _states_collector(tmp_path, monkeypatch, {})
    (beat,) = [d for d in c.collect(1000.0) if d["MetricName"] == "NodeReporting"]
    assert beat["Value"] == 1 and {x["Name"]: x["Value"] for x in beat["Dimensions"]} == {"Cluster": "c1", "Node": "prefill-0", "Role": "prefill"}


def test_a_neuron_monitor_that_stopped_reporting_is_not_published_as_current(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(tmp_path, "neuron-monitor", "echo '{\"neuron_runtime_data\": []}'\nsleep 30\n")
    monkeypatch.setenv("GPTOSS_NEURON_MONITOR", str(tmp_path / "neuron-monitor"))
    mod = _collector()
    monitor = mod.NeuronMonitor(60)
    try:
        for _ in range(50):
            if monitor.report:
                break
            time.sleep(0.1)
        assert monitor.values() != {}, "a fresh report is published"
        monitor.report_at -= 181  # its last report is three periods old: neuron-monitor hung or exited
        assert monitor.values() == {}
    finally:
        assert monitor.proc is not None
        monitor.proc.kill()


def test_collector_ships_each_units_journal_to_its_own_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [{"__CURSOR": f"c{i}", "_SYSTEMD_UNIT": u, "__REALTIME_TIMESTAMP": str(1_700_000_000_000_000 + i), "MESSAGE": m}
               for i, (u, m) in enumerate([("gptoss-decode.service", "fake vllm: compiling"), ("gptoss-stage.service", "staged"),
                                           ("gptoss-decode.service", [104, 105])])]  # fmt: skip
    journal = tmp_path / "journal.jsonl"
    journal.write_text("".join(json.dumps(e) + "\n" for e in entries))
    fake_command(tmp_path, "journalctl", f'echo "$*" >>"{tmp_path}/journalctl.args"\ncat "{journal}"\n')
    fake_command(
        tmp_path,
        "aws",
        f'echo "$*" >>"{tmp_path}/aws.log"\nfor a; do case $a in file://*) cp "${{a#file://}}" "{tmp_path}/payload-$(date +%s%N).json";; esac; done\n',
    )
    monkeypatch.setenv("GPTOSS_JOURNALCTL", str(tmp_path / "journalctl"))
    monkeypatch.setenv("GPTOSS_AWS", str(tmp_path / "aws"))
    monkeypatch.setenv("GPTOSS_STATE_DIR", str(tmp_path / "state"))
    mod = _collector()
    cfg = {
        "region": "us-east-2",
        "node": "decode-0",
        "log_group": "/gptoss/c1",
        "units": ["gptoss-decode.service", "gptoss-stage.service"],
    }
    mod.ship_logs(cfg, set())
    calls = (tmp_path / "aws.log").read_text().splitlines()
    assert [c.split(" --log-stream-name ")[1].split()[0] for c in calls if "put-log-events" in c] == [
        "decode-0/gptoss-decode.service",
        "decode-0/gptoss-stage.service",
    ]
    assert sum("create-log-stream" in c for c in calls) == 2
    payloads = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("payload-*.json"))]
    assert [e["message"] for e in payloads[0]] == ["fake vllm: compiling", "hi"]
    for events in payloads:
        _validate("PutLogEvents", "logs", {"logGroupName": "/gptoss/c1", "logStreamName": "decode-0/x", "logEvents": events})
    assert (tmp_path / "state/telemetry.cursor").read_text() == "c2"
    mod.ship_logs(cfg, {"decode-0/gptoss-decode.service"})
    assert "--after-cursor c2" in (tmp_path / "journalctl.args").read_text().splitlines()[-1]


def test_a_burst_of_journal_lines_is_shipped_in_calls_within_cloudwatch_limits() -> None:
    """A crash-looping server can write megabytes between two rounds: no call may exceed 1 MB or 10,000 events."""
    mod = _collector()
    big = [{"timestamp": i, "message": "x" * 150_000} for i in range(20)]
    many = [{"timestamp": i, "message": "y"} for i in range(25_000)]
    for events in (big, many):
        batches = mod.log_batches(events)
        assert [e for b in batches for e in b] == events
        for b in batches:
            assert len(b) <= 10_000 and sum(len(e["message"]) + 26 for e in b) <= 1_048_576
    assert len(mod.log_batches(big)) == 4 and len(mod.log_batches(many)) == 3


# ---- the journal's way to CloudWatch Logs, under CloudWatch's own rules --------------------------


@pytest.fixture
def logs_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A journal (journalctl honouring --after-cursor, refusing a cursor it does not know) and an
    `aws logs put-log-events` that enforces PutLogEvents' documented rules: a batch must be in
    time order and span at most 24 hours (else InvalidParameterException, the whole batch
    refused); a stream listed in `throttled` answers ThrottlingException."""
    journal, accepted, throttled = tmp_path / "journal.jsonl", tmp_path / "accepted.jsonl", tmp_path / "throttled"
    journal.write_text("")
    throttled.write_text("")
    fake_command(tmp_path, "journalctl", f"""exec {sys.executable} - "$@" <<'PY'
import json, sys
args = sys.argv[1:]
lines = open("{journal}").read().splitlines()
if "--after-cursor" in args:
    c = args[args.index("--after-cursor") + 1]
    cursors = [json.loads(x)["__CURSOR"] for x in lines]
    if c not in cursors:
        print("Failed to seek to cursor: Invalid argument", file=sys.stderr); sys.exit(1)
    lines = lines[cursors.index(c) + 1:]
open("{tmp_path}/journalctl.args", "a").write(" ".join(args) + "\\n")
print("\\n".join(lines))
PY
""")
    fake_command(tmp_path, "aws", f"""exec {sys.executable} - "$@" <<'PY'
import json, sys
args = sys.argv[1:]
if args[:2] != ["logs", "put-log-events"]:
    sys.exit(0)
stream = args[args.index("--log-stream-name") + 1]
events = json.load(open(args[args.index("--log-events") + 1].removeprefix("file://")))
if stream in open("{throttled}").read().split():
    print("An error occurred (ThrottlingException) when calling the PutLogEvents operation: Rate exceeded", file=sys.stderr); sys.exit(254)
ts = [e["timestamp"] for e in events]
if ts != sorted(ts) or ts[-1] - ts[0] > 24 * 3600 * 1000:
    print("An error occurred (InvalidParameterException) when calling the PutLogEvents operation: The batch of log events "
          "in a single PutLogEvents request cannot span more than 24 hours.", file=sys.stderr); sys.exit(254)
with open("{accepted}", "a") as f:
    for e in events:
        f.write(json.dumps([stream, e["message"]]) + "\\n")
PY
""")
    monkeypatch.setenv("GPTOSS_JOURNALCTL", str(tmp_path / "journalctl"))
    monkeypatch.setenv("GPTOSS_AWS", str(tmp_path / "aws"))
    monkeypatch.setenv("GPTOSS_STATE_DIR", str(tmp_path / "state"))
    cfg = {"region": "us-east-2", "node": "decode-0", "log_group": "/gptoss/c1", "units": ["gptoss-decode.service", "gptoss-stage.service"]}

    def write(entries: list[tuple[str, int, str]]) -> None:
        """(unit, seconds since 2023-11-14, message) in journal order."""
        with journal.open("a") as f:
            n = len(journal.read_text().splitlines())
            for i, (unit, s, msg) in enumerate(entries):
                f.write(json.dumps({"__CURSOR": f"c{n + i}", "_SYSTEMD_UNIT": unit, "__REALTIME_TIMESTAMP": str((1_700_000_000 + s) * 1_000_000),
                                    "MESSAGE": msg}) + "\n")  # fmt: skip

    def sent() -> list[tuple[str, str]]:
        return [tuple(json.loads(x)) for x in accepted.read_text().splitlines()] if accepted.exists() else []  # type: ignore[misc]

    return {"cfg": cfg, "write": write, "sent": sent, "throttled": throttled, "cursor": tmp_path / "state/telemetry.cursor",
            "args": tmp_path / "journalctl.args", "mod": _collector()}  # fmt: skip


def test_a_stop_of_more_than_a_day_is_shipped_in_batches_cloudwatch_takes_and_never_again(logs_node: dict[str, Any]) -> None:
    n, mod = logs_node, logs_node["mod"]
    day = 24 * 3600
    n["write"]([("gptoss-decode.service", 0, "stopping"), ("gptoss-decode.service", 2 * day, "started again")])
    mod.ship_logs(n["cfg"], set())
    assert n["sent"]() == [("decode-0/gptoss-decode.service", "stopping"), ("decode-0/gptoss-decode.service", "started again")]
    assert n["cursor"].read_text() == "c1" and not list(n["cursor"].parent.glob("*.tmp")), "written whole, by rename"
    mod.ship_logs(n["cfg"], {"decode-0/gptoss-decode.service"})
    assert len(n["sent"]()) == 2, "nothing is sent twice"


def test_a_throttled_stream_is_sent_again_and_the_others_are_not_duplicated(logs_node: dict[str, Any]) -> None:
    n, mod = logs_node, logs_node["mod"]
    n["write"]([("gptoss-decode.service", 1, "d1"), ("gptoss-stage.service", 2, "s1"), ("gptoss-decode.service", 3, "d2")])
    n["throttled"].write_text("decode-0/gptoss-stage.service")
    mod.ship_logs(n["cfg"], set())
    assert n["cursor"].read_text() == "c0", "up to the first event that must be sent again"
    n["throttled"].write_text("")
    mod.ship_logs(n["cfg"], set())
    sent = n["sent"]()
    assert sent.count(("decode-0/gptoss-stage.service", "s1")) == 1 and sent.count(("decode-0/gptoss-decode.service", "d1")) == 1
    assert n["cursor"].read_text() == "c2"


def test_a_batch_refused_for_good_is_dropped_and_said_not_re_sent_every_minute(logs_node: dict[str, Any], capsys: Any) -> None:
    n, mod = logs_node, logs_node["mod"]
    # Out of time order within a unit (a clock step): the documented rule refuses the batch whole.
    n["write"]([("gptoss-decode.service", 100, "late"), ("gptoss-decode.service", 50, "early")])
    mod.ship_logs(n["cfg"], set())
    assert n["sent"]() == [] and n["cursor"].read_text() == "c1"
    assert "dropped 2 events: An error occurred (InvalidParameterException)" in capsys.readouterr().out


def test_an_unusable_cursor_falls_back_to_the_last_ten_minutes(logs_node: dict[str, Any], capsys: Any) -> None:
    n, mod = logs_node, logs_node["mod"]
    n["write"]([("gptoss-decode.service", 1, "d1")])
    n["cursor"].parent.mkdir(parents=True)
    n["cursor"].write_text("s=not-a-cursor-journald-knows")
    mod.ship_logs(n["cfg"], set())
    assert "--since -10min" in n["args"].read_text().splitlines()[-1]
    assert "the saved journal cursor is not usable" in capsys.readouterr().out
    assert n["sent"]() == [("decode-0/gptoss-decode.service", "d1")] and n["cursor"].read_text() == "c0"


@pytest.mark.parametrize(
    ("state", "sub", "restarts", "failing"),
    [
        ("active", "running", 0, False),  # downloading
        ("activating", "auto-restart", 1, True),  # failed, waiting RestartSec
        ("activating", "start-pre", 2, True),  # in gptoss-backoff before its next attempt
        ("activating", "start-pre", 0, False),  # a first start
        ("failed", "failed", 3, True),
        ("inactive", "dead", 0, False),
    ],
)
def test_staging_failing_and_status_retrying_agree(state: str, sub: str, restarts: int, failing: bool) -> None:
    """The StagingFailing alarm counts every state staging retries from; `gptoss status` says 'retrying' for the same ones."""
    from cluster_ops.status import UnitStatus

    st = {"ActiveState": state, "SubState": sub, "NRestarts": str(restarts)}
    assert (state == "failed" or _collector().retrying(st)) is failing
    problem = UnitStatus(node="n", unit="gptoss-stage.service", state=state, healthy=None, needs_health=False, sub=sub, restarts=restarts).problem
    assert problem.startswith("retrying") is (failing and state != "failed")


def test_a_crashed_collector_does_not_fail_the_deploy_gate(signal_node: Any, peers: Any, tmp_path: Path) -> None:
    """The telemetry collector is listed for `gptoss status` but is not what the node serves with: the gate hears SUCCESS."""
    health = tmp_path / "etc" / "health"
    health.write_text(health.read_text() + "gptoss-telemetry.service - -\n")
    r = signal_node({"gptoss-telemetry.service": "ActiveState=failed\nSubState=failed\nNRestarts=3"})
    assert r.returncode == 0, r.stderr
    (put,) = peers.puts
    assert put["doc"]["Status"] == "SUCCESS", put


# ---- the surge's signal to the node's group -------------------------------------------------------


class _CloudFormation(http.server.BaseHTTPRequestHandler):
    """CloudFormation's query API on loopback (moto has no SignalResource, and no wait condition to
    describe): SignalResource, recorded and answered as CloudFormation does, in turn (the last answer
    from then on); DescribeStackResource of the node's gate, answered with `gate_status`."""

    calls: list[dict[str, str]]
    answers: list[tuple[int, str]]
    gate_status = "CREATE_IN_PROGRESS"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        import urllib.parse

        form = dict(urllib.parse.parse_qsl(self.rfile.read(int(self.headers["Content-Length"])).decode()))
        ns = "http://cloudformation.amazonaws.com/doc/2010-05-15/"
        if form.get("Action") == "DescribeStackResource":
            self.asked.append(form)
            detail = (f"<StackName>{form['StackName']}</StackName><LogicalResourceId>{form['LogicalResourceId']}</LogicalResourceId>"
                      "<ResourceType>AWS::CloudFormation::WaitCondition</ResourceType><LastUpdatedTimestamp>2026-12-01T00:00:00Z"
                      f"</LastUpdatedTimestamp><ResourceStatus>{self.gate_status}</ResourceStatus>")  # fmt: skip
            self._send(200, f'<DescribeStackResourceResponse xmlns="{ns}"><DescribeStackResourceResult><StackResourceDetail>{detail}'
                            "</StackResourceDetail></DescribeStackResourceResult><ResponseMetadata><RequestId>r</RequestId>"
                            "</ResponseMetadata></DescribeStackResourceResponse>")  # fmt: skip
            return
        self.calls.append(form)
        status, message = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if status == 200:
            body = f'<SignalResourceResponse xmlns="{ns}"><ResponseMetadata><RequestId>r</RequestId></ResponseMetadata></SignalResourceResponse>'
        else:
            body = (f'<ErrorResponse xmlns="{ns}"><Error><Type>Sender</Type><Code>ValidationError</Code><Message>{message}</Message>'
                    "</Error><RequestId>r</RequestId></ErrorResponse>")  # fmt: skip
        self._send(status, body)

    def _send(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def surge_node(signal_node: Any, moto_url: str, tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.CompletedProcess[str], list[dict[str, str]]]]]:
    """gptoss-signal of a surge rollout: the real AWS CLI, EC2's tags in moto, CloudFormation on loopback."""
    import urllib.request

    import boto3

    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"), timeout=10)
    ec2 = boto3.client("ec2", endpoint_url=moto_url, region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    instance = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    handler = type("C", (_CloudFormation,), {"calls": [], "answers": [(200, "")], "asked": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bindir = tmp_path / "awsbin"
    real_aws_cli(bindir)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "identity.env").write_text(f"GPTOSS_INSTANCE_ID={instance}\n")

    def run(*, tags: bool = True, answers: list[tuple[int, str]] | None = None, gate_status: str = "CREATE_IN_PROGRESS",
            **kw: Any) -> tuple[subprocess.CompletedProcess[str], list[dict[str, str]]]:  # fmt: skip
        handler.gate_status = gate_status
        if tags:
            ec2.create_tags(Resources=[instance], Tags=[{"Key": "aws:cloudformation:stack-name", "Value": "GptOss8k1kStack-DecodeCell0-ABC"},
                                                        {"Key": "aws:cloudformation:logical-id", "Value": "Decode0Group30BAA125"}])  # fmt: skip
        handler.answers = answers or [(200, "")]
        env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "AWS_ENDPOINT_URL_EC2": moto_url,
               "AWS_ENDPOINT_URL_CLOUDFORMATION": f"http://127.0.0.1:{server.server_address[1]}", "GPTOSS_RUN_DIR": str(run_dir),
               "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}  # fmt: skip
        return signal_node(extra_env=env, aws=True, **kw), handler.calls

    run.instance = instance  # type: ignore[attr-defined]
    run.asked = handler.asked  # type: ignore[attr-defined]
    yield run
    server.shutdown()


def test_a_surge_replacement_signals_its_own_group_with_the_gates_verdict_once(surge_node: Any, peers: Any) -> None:
    r, calls = surge_node()
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p["doc"]["Status"] for p in peers.puts] == ["SUCCESS"], "the deploy gate hears it first"
    assert calls == [{"Action": "SignalResource", "Version": "2010-05-15", "StackName": "GptOss8k1kStack-DecodeCell0-ABC",
                      "LogicalResourceId": "Decode0Group30BAA125", "UniqueId": surge_node.instance, "Status": "SUCCESS"}], calls  # fmt: skip
    assert "signalled SUCCESS to its group (GptOss8k1kStack-DecodeCell0-ABC/Decode0Group30BAA125)" in r.stdout
    again, calls = surge_node()
    assert again.returncode == 0 and len(calls) == 1, "a reboot signals neither the gate nor the group again"


def test_a_rollbacks_replacement_with_an_expired_handle_tells_its_group_success_once_it_serves(surge_node: Any, peers: Any) -> None:
    """A rollback re-applies the previous template: its replacement boots user data whose handle was made
    at the previous deploy (two days ago here, its URL long expired). It tells the handle nothing, and
    its group SUCCESS once it serves (a surge's rollback waits for it), with its own deadline."""
    _ready_after(peers, 2)
    r, calls = surge_node(query=_amz(signed_ago_s=48 * 3600), timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert peers.puts == [], "an expired handle is told nothing"
    assert [(c["Status"], c["UniqueId"]) for c in calls] == [("SUCCESS", surge_node.instance)], r.stdout
    assert "the deploy gate will not be told (its URL has expired)" in r.stdout


def test_a_replacement_whose_gate_was_answered_does_not_answer_it_again(surge_node: Any, peers: Any) -> None:
    """An unchanged node's replacement (its instance lost; a rollback's): CloudFormation has its gate
    CREATE_COMPLETE, answered by the instance before it. The replacement asks (its own stack, its gate's
    id from signal.env), PUTs nothing, and still tells its group."""
    query = _amz(signed_ago_s=3600)
    r, calls = surge_node(gate="Decode0Ready6c55a2a5ConditionB5F58AE7", gate_status="CREATE_COMPLETE", query=query)
    assert r.returncode == 0, r.stdout + r.stderr
    assert peers.puts == []
    assert [(a["StackName"], a["LogicalResourceId"]) for a in surge_node.asked] == [("GptOss8k1kStack-DecodeCell0-ABC", "Decode0Ready6c55a2a5ConditionB5F58AE7")]
    assert [c["Status"] for c in calls] == ["SUCCESS"]
    assert "CloudFormation has its wait condition answered already" in r.stdout
    again, calls = surge_node(gate="Decode0Ready6c55a2a5ConditionB5F58AE7", gate_status="CREATE_COMPLETE", query=query)
    assert peers.puts == [] and len(calls) == 1 and "already signalled (SUCCESS" in again.stdout, "a reboot: the verdict is kept, nothing again"


def test_the_instance_id_written_after_the_signal_started_is_the_one_it_signals(surge_node: Any, peers: Any, tmp_path: Path) -> None:
    """gptoss-signal starts at boot beside gptoss-identity, which writes the instance's id once the instance
    metadata answers: the id is read when the verdict is there, not when the script started."""
    identity = tmp_path / "run" / "identity.env"
    written = identity.read_text()
    identity.unlink()
    original = peers.do_POST

    def do_post(self: Any) -> None:
        identity.write_text(written)  # gptoss-identity, done while the node was still getting ready
        original(self)

    peers.do_POST = do_post
    r, calls = surge_node()
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(c["Status"], c["UniqueId"]) for c in calls] == [("SUCCESS", surge_node.instance)], r.stdout


def test_a_failed_node_tells_its_group_at_once_not_after_the_surge_timeout(surge_node: Any, peers: Any) -> None:
    r, calls = surge_node(units={"gptoss-proxy.service": "ActiveState=failed\nSubState=failed\nNRestarts=0"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert [c["Status"] for c in calls] == ["FAILURE"] and peers.puts[0]["doc"]["Status"] == "FAILURE"


def test_a_group_that_waits_for_no_signal_is_said_and_not_asked_again(surge_node: Any) -> None:
    """The first deploy (a creation, no rolling update): CloudFormation refuses the signal; the node says so."""
    refused = "Resource Decode0Group30BAA125 is in CREATE_COMPLETE state and cannot be signaled"
    r, calls = surge_node(answers=[(400, refused)])
    assert r.returncode == 0 and len(calls) == 1, r.stdout + r.stderr
    assert "waits for no signal (no rolling update in progress)" in r.stdout


def test_a_throttled_signal_is_sent_again(surge_node: Any) -> None:
    r, calls = surge_node(answers=[(400, "Rate exceeded"), (200, "")])
    assert r.returncode == 0 and [c["Status"] for c in calls] == ["SUCCESS", "SUCCESS"], r.stdout + r.stderr
    assert "attempt 1 to signal the group failed" in r.stdout and "signalled SUCCESS to its group" in r.stdout


def test_an_instance_no_stack_launched_signals_no_group(surge_node: Any) -> None:
    r, calls = surge_node(tags=False)
    assert r.returncode == 0 and calls == [], r.stdout + r.stderr
    assert "carries no aws:cloudformation tags" in r.stdout


class _Engine(http.server.BaseHTTPRequestHandler):
    """A vLLM server's /health and /metrics, its gauges and token counters set by the test."""

    running, waiting, tokens = 0.0, 0.0, 0.0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        cls = type(self)
        body = "ok" if self.path == "/health" else (
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {cls.running}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {cls.waiting}\n'
            f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {cls.tokens}\n'
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {cls.tokens / 8}\n'
        )  # fmt: skip
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_a_hung_engine_is_killed_after_engine_hang_s_and_a_slow_or_idle_one_never(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three servers whose /health all answer: one holds requests and counts no token (hung), one is
    saturated (requests waiting, tokens counted), one is idle (no request, no token). With
    healing.engine_hang_s=120 and the collector every 60 s, only the hung one's unit is killed, once,
    at the first interval 120 s after its tokens stopped, with the evidence in the journal."""
    engines = {"hung": type("H", (_Engine,), {"running": 4.0, "waiting": 2.0, "tokens": 9000.0}),
               "busy": type("B", (_Engine,), {"running": 4.0, "waiting": 12.0, "tokens": 0.0}),
               "idle": type("I", (_Engine,), {"tokens": 500.0})}  # fmt: skip
    servers, http_servers = [], []
    for i, (name, handler) in enumerate(engines.items()):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        http_servers.append(srv)
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        servers.append({"name": f"prefill-0/{name}", "unit": f"gptoss-prefill@{i}.service", "health_url": f"{base}/health", "metrics_url": f"{base}/metrics"})
    try:
        mod, c, _ = _states_collector(tmp_path, monkeypatch, {s["unit"]: "ActiveState=active" for s in servers}, servers)
        kills = tmp_path / "kills"
        fake_command(tmp_path / "wrap", "systemctl", f'if [ "$1" = kill ]; then echo "$@" >> "{kills}"; exit 0; fi\nexec "{tmp_path / "systemctl"}" "$@"\n')
        mod.SYSTEMCTL = str(tmp_path / "wrap" / "systemctl")
        c.cfg["hang_s"] = 120
        for step, now in enumerate((1000.0, 1060.0, 1119.0, 1120.0, 1180.0, 1239.0)):
            engines["busy"].tokens = 4096.0 * step  # a saturated engine still counts tokens
            c.collect(now)
            if now == 1119.0:
                assert not kills.exists(), "119 s without a token is not yet 120"
        assert kills.read_text().splitlines() == ["kill --signal=SIGKILL gptoss-prefill@0.service"], "the hung one, once (the next verdict waits another 120 s)"
        out = capsys.readouterr().out.splitlines()
        said = [line for line in out if "hung" in line]
        assert said == ["gptoss-telemetry: gptoss-prefill@0.service hung: 6 requests in its engine and no token for 120s "
                        "(healing.engine_hang_s=120) while /health answers; killing it (systemd starts it again)"], out  # fmt: skip
        # engine_hang_s=0 turns the watch off.
        c.cfg["hang_s"] = 0
        kills.unlink()
        for now in (2000.0, 3000.0, 4000.0):
            c.collect(now)
        assert not kills.exists()
    finally:
        for srv in http_servers:
            srv.shutdown()
            srv.server_close()


def test_the_engine_watch_gets_its_bound_from_the_spec() -> None:
    cfg = load_config({"healing.engine_hang_s": 900})
    node = cfg.layout.nodes[0]
    doc = json.loads(telemetry.node_config(cfg, node, [], []))
    assert doc["hang_s"] == 900 and json.loads(telemetry.node_config(load_config({}), node, [], []))["hang_s"] == 600


def test_a_held_replacement_is_published_while_the_health_watch_holds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gptoss-health-watch writes watch/budget-spent (with the reason) when a budget stops it from asking
    for a replacement, and removes it when nothing is wanted: ReplacementHeld is 1 exactly then."""
    mod, c, _ = _states_collector(tmp_path, monkeypatch, {})
    monkeypatch.setattr(mod, "RUN_DIR", tmp_path / "run")
    assert _values(c.collect(1000.0))["ReplacementHeld"] == 0
    (tmp_path / "run" / "watch").mkdir(parents=True)
    (tmp_path / "run" / "watch" / "budget-spent").write_text("prefill-1 was replaced 2 times in the last 21600s (its budget is 2): ...\n")
    assert _values(c.collect(1060.0))["ReplacementHeld"] == 1
    (tmp_path / "run" / "watch" / "budget-spent").unlink()
    assert _values(c.collect(1120.0))["ReplacementHeld"] == 0


# ---- the deploy gate tests this instance's own servers ----------------------------------------------


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A decode server whose /health answers while it refuses every request (it cannot take KV): a 503."""

    posts = 0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts += 1
        body = b'{"error": "KV transfer failed"}'
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def pd_pair(tmp_path: Path) -> Iterator[Callable[[str], tuple[int, int]]]:
    """Strict loopback vLLM fakes (tests/fakes/vllm_pd.py): start(role) -> (port, its side channel port).
    A decode server accepts only the KV transfer parameters the prefill server returned for the prompt."""
    procs: list[subprocess.Popen[bytes]] = []
    fake = Path(__file__).resolve().parent.parent / "fakes" / "vllm_pd.py"

    def start(role: str, engines: dict[str, list[Any]] | None = None) -> tuple[int, int]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        side = port + 1
        argv = [sys.executable, str(fake), "--role", role, "--host", "127.0.0.1", "--port", str(port), "--side-channel-port", str(side)]
        if engines is not None:
            argv += ["--engines", json.dumps(engines)]
        procs.append(subprocess.Popen(argv, env={**os.environ, "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                return port, side
            except OSError:
                assert time.monotonic() < deadline, f"the {role} fake did not start"
                time.sleep(0.1)

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _stats(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as r:
        return dict(json.loads(r.read()))


def test_a_router_nodes_replacement_proves_its_own_decode_server_with_a_request_pinned_to_it(
    signal_node: Any, peers: Any, pd_pair: Any, tmp_path: Path
) -> None:
    """A surge replacement of decode-1, a router node: the completion through its router succeeds, but the
    router reaches "decode-1" by name, which is the old instance until it leaves. The gate also sends a
    disaggregated request whose decode half goes to this instance's own decode server, its prefill half to
    a prefill server of the fleet's document (by name, as the router's): the strict fakes accept only a
    handoff exactly as a NIXL proxy makes it."""
    from tests.fakes.vllm_pd import engine_id

    prefill, side = pd_pair("prefill")
    decode, _ = pd_pair("decode", {engine_id("127.0.0.1", prefill): ["127.0.0.1", side]})
    fleet = tmp_path / "router-fleet"
    fleet.write_text(f"domain gptoss.internal\nrestart_gap 60\narg --policy\narg round_robin\npool prefill 0 0 {prefill} {prefill}\npool decode 0 1 8200 8200\n")
    health = f"gptoss-decode.service http://127.0.0.1:{decode}/health decode\ngptoss-proxy.service {peers.url}/readiness proxy\n"
    r = signal_node(health=health, node_env="GPTOSS_MEMBERS_FORM=hosts\n", hosts={"prefill-0": "127.0.0.1"},
                    extra_env={"GPTOSS_ROUTER_FLEET": str(fleet)})  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    (put,) = peers.puts
    assert put["doc"]["Status"] == "SUCCESS", put
    assert put["doc"]["Reason"] == (f"prefill-0: its own decode server http://127.0.0.1:{decode}/v1/completions returned 16 tokens; a "
                                    f"completion through {peers.url}/v1/completions returned 16 tokens")  # fmt: skip
    assert (_stats(prefill)["served"], _stats(decode)["served"]) == (1, 1)
    assert _stats(prefill)["violations"] == [] and _stats(decode)["violations"] == []


def test_a_router_nodes_replacement_whose_own_decode_server_refuses_never_signals_success(
    signal_node: Any, peers: Any, pd_pair: Any, tmp_path: Path
) -> None:
    """Its decode server answers /health but refuses every request (it cannot take KV), while the completion
    through the router succeeds: the old instance still holds the name decode-1 and serves it. The node
    never says SUCCESS: at its deadline (a 302 s gate: 2 s) it says FAILURE, naming its own decode server."""
    prefill, _ = pd_pair("prefill")
    own = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("D", (_Refusing,), {"posts": 0}))
    threading.Thread(target=own.serve_forever, daemon=True).start()
    fleet = tmp_path / "router-fleet"
    fleet.write_text(f"domain gptoss.internal\npool prefill 0 0 {prefill} {prefill}\n")
    health = f"gptoss-decode.service http://127.0.0.1:{own.server_address[1]}/health decode\ngptoss-proxy.service {peers.url}/readiness proxy\n"
    try:
        r = signal_node(health=health, node_env="GPTOSS_MEMBERS_FORM=hosts\n", hosts={"prefill-0": "127.0.0.1"}, timeout=302,
                        query=_amz(signed_ago_s=0), extra_env={"GPTOSS_ROUTER_FLEET": str(fleet)})  # fmt: skip
    finally:
        own.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p["doc"]["Status"] for p in peers.puts] == ["FAILURE"], "never SUCCESS"
    reason = peers.puts[0]["doc"]["Reason"]
    assert reason.startswith(f"prefill-0: not ready before the deploy gate's timeout: its own decode server http://127.0.0.1:{own.server_address[1]}"
                             "/v1/completions refused a request: HTTP 503"), reason  # fmt: skip
    assert own.RequestHandlerClass.posts >= 1  # type: ignore[attr-defined]


def test_a_prefill_node_proves_each_of_its_own_replicas_with_a_prefill_request(signal_node: Any, peers: Any, pd_pair: Any) -> None:
    """A prefill node (no proxy: a router layout) tells its gate SUCCESS once every one of its replicas took a
    real prefill request (the strict fake answers only the handoff a proxy sends); a replica that refuses
    holds the node at wait and is named."""
    ports = [pd_pair("prefill")[0] for _ in range(2)]
    health = "".join(f"gptoss-prefill@{i}.service http://127.0.0.1:{p}/health prefill_{i}\n" for i, p in enumerate(ports))
    r = signal_node(health=health, completion=False)
    assert r.returncode == 0, r.stdout + r.stderr
    (put,) = peers.puts
    assert put["doc"]["Reason"] == "prefill-0: its 2 prefill replicas each took a prefill request"
    assert [_stats(p)["served"] for p in ports] == [1, 1] and all(_stats(p)["violations"] == [] for p in ports)


def test_a_capacity_blocks_hours_left_come_from_ec2_and_follow_an_extension(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector asks EC2 (the AWS CLI, as the node runs it: here a stand-in printing what
    `--query CapacityReservations[0].EndDate --output text` prints) for its block's end, publishes the hours
    until EC2 starts reclaiming it (the end less 30 min), asks again after 10 minutes (an extension moves
    the end), and keeps the last answer through a failed call."""
    import datetime as dt
    import time as clock

    mod, c, _ = _states_collector(tmp_path, monkeypatch, {})
    c.cfg["block"] = "cr-0123456789abcdef0"
    end = tmp_path / "end"
    calls = tmp_path / "calls"
    fake_command(tmp_path, "aws", f'echo "$*" >> "{calls}"\n[ -s "{end}" ] || exit 254\ncat "{end}"\n')
    monkeypatch.setattr(mod, "AWS", str(tmp_path / "aws"))
    in_26h = dt.datetime.fromtimestamp(clock.time() + 26 * 3600 + 1800, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00")
    end.write_text(in_26h + "\n")
    assert _values(c.collect(1000.0))["CapacityBlockHoursLeft"] == pytest.approx(26, abs=0.05)
    assert calls.read_text().split("\n")[0] == ("ec2 describe-capacity-reservations --capacity-reservation-ids cr-0123456789abcdef0 "
                                                "--query CapacityReservations[0].EndDate --output text")  # fmt: skip
    end.write_text(dt.datetime.fromtimestamp(clock.time() + 74 * 3600 + 1800, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00") + "\n")
    assert _values(c.collect(1300.0))["CapacityBlockHoursLeft"] == pytest.approx(26, abs=0.05), "asked again only after 10 minutes"
    assert _values(c.collect(1700.0))["CapacityBlockHoursLeft"] == pytest.approx(74, abs=0.05), "extended by 48 h"
    end.write_text("")  # EC2 does not answer: the last end date stands
    assert _values(c.collect(2400.0))["CapacityBlockHoursLeft"] == pytest.approx(74, abs=0.05)
    assert calls.read_text().count("describe-capacity-reservations") == 3
    assert not (Path(os.environ["GPTOSS_RUN_DIR"]) / "block-draining").exists(), "74 h left: nothing drains"
    # Within block_drain_s (the request timeout and a minute, rendered) of EC2's reclaim: the node drains, once.
    api_calls = tmp_path / "api"
    fake_command(tmp_path, "gptoss-api", f'echo "$*" >> "{api_calls}"\n')
    monkeypatch.setattr(mod, "API", str(tmp_path / "gptoss-api"))
    c.cfg |= {"block_drain_s": 1860, "block_retry_after_s": 600, "gate_socket": "/run/gptoss/haproxy.sock"}
    end.write_text(dt.datetime.fromtimestamp(clock.time() + 1500 + 1800, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00") + "\n")
    assert _values(c.collect(3100.0))["CapacityBlockHoursLeft"] == pytest.approx(1500 / 3600, abs=0.01)
    marker = Path(os.environ["GPTOSS_RUN_DIR"]) / "block-draining"
    assert marker.exists() and api_calls.read_text() == "drain 600\n", "the gate takes nothing new, answers 503 with Retry-After"
    c.collect(3800.0)
    assert api_calls.read_text() == "drain 600\n", "once"
