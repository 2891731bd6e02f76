"""Fixtures the node scripts' tests share: the deploy gate's loopback peers (the wait condition handle, a
proxy, health routes) and a node that runs the real gptoss-signal against them."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import boto3
import pytest

from node_render.paths import ROUTER_ENV, SOFTWARE_VERSION, WHEELS_DIR, router_object_key
from node_render.quoting import env_file as render_env_file
from node_render.render import cluster_env, render_cluster
from tests.api_gate import Gate
from tests.conftest import fake_command, private_etc, real_aws_cli, with_etc
from tests.userdata.api_gate_peers import Upstream, _gate
from tests.userdata.router_fleet import CREDS, _cfg

Shipped = Callable[[str], Path]


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
        type(self).authorizations = [*getattr(type(self), "authorizations", []), self.headers.get("Authorization")]
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


def router_node(cfg: Any, root: Path, bucket: str) -> dict[str, str]:
    """A router node's files that gptoss-install-router reads, as decode-0 renders them, under ROOT: cluster.env,
    router.env and the software version it installed (in BUCKET, where the wheel is too); its environment."""
    node = next(n for n in cfg.layout.nodes if n.name == "decode-0")
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc/cluster.env").write_text(render_env_file(cluster_env(cfg, node)))
    files = next(r for r in render_cluster(cfg) if r.node.name == "decode-0").files
    (root / "etc/router.env").write_text(files[ROUTER_ENV][0])
    version = root / SOFTWARE_VERSION.lstrip("/")
    version.parent.mkdir(parents=True, exist_ok=True)
    version.write_text(f"s3://{bucket}/{'1' * 64}.xz {'1' * 64}\n")
    return {"GPTOSS_CLUSTER_ENV": str(root / "etc/cluster.env"), "GPTOSS_ROUTER_ENV": str(root / "etc/router.env"), "GPTOSS_ROOT": str(root)}


@pytest.fixture(scope="module")
def router_venv(tmp_path_factory: pytest.TempPathFactory, shipped: Any, moto_url: str) -> Path:
    """The router's venv as a node builds it: the wheel from S3, checked, installed offline."""
    cfg = _cfg("vllm-router")
    r = cfg.serving.proxy.router
    wheel = WHEELS_DIR / r.wheel
    assert wheel.is_file(), f"{wheel} is missing: `make setup` fetches the pinned router wheel"
    tmp = tmp_path_factory.mktemp("router")
    url = moto_url
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-2", **{k.lower(): v for k, v in CREDS.items() if k != "AWS_DEFAULT_REGION"})
    s3.create_bucket(Bucket="assets", CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    # Where the stack's asset puts it: the key its pinned sha256 gives, in the software asset's bucket.
    s3.upload_file(str(wheel), "assets", router_object_key(r.sha256))
    bindir = tmp / "bin"
    real_aws_cli(bindir)
    venv = tmp / "venv"
    env = {**os.environ, **CREDS, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "AWS_ENDPOINT_URL": url, **router_node(cfg, tmp, "assets")}
    res = subprocess.run([str(shipped("gptoss-install-router")), str(venv), "--", "true"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (venv / ".gptoss-wheel-sha256").read_text().strip() == r.sha256
    # A second start installs nothing and needs no S3.
    res = subprocess.run([str(shipped("gptoss-install-router")), str(venv), "--", "echo", "started"],
                         env=env | {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == "started", res.stdout + res.stderr
    return venv


# The API gate's tests: the router's stand-in on loopback, and the real HAProxy in front of it.
@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    threading.Thread(target=up.serve_forever, daemon=True).start()
    yield up
    up.shutdown()


@pytest.fixture
def gate(upstream: Upstream, tmp_path: Path) -> Iterator[tuple[Upstream, int, Gate]]:
    g = _gate(tmp_path, upstream.server_address[1])
    yield upstream, g.port, g
    g.stop()
