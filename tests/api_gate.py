"""The node's API gate as it runs: the real HAProxy with the configuration the spec renders, on loopback.

The map and the admin socket live in the test's own folder; gptoss-api (the node's script)
reaches them through GPTOSS_API_MAP and GPTOSS_API_SOCKET.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from clusterspec.sections.proxy import Proxy
from node_render.haproxy import KeyCheck, api_gate_config
from tests.conftest import ROOT

API_CTL = ROOT / "userdata" / "bin" / "gptoss-api"


def haproxy() -> str:
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    assert found, "HAProxy is not installed: `make setup` installs it (Debian's haproxy package)"
    return found


@dataclass
class Gate:
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    folder: Path
    config: str
    socket_dir: Path  # short: a Unix socket's path holds at most 107 bytes

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "GPTOSS_API_MAP": str(self.folder / "api.map"),
            "GPTOSS_API_SOCKET": str(self.socket_dir / "haproxy.sock"),
            "GPTOSS_NODE_KEY": str(self.folder / "node-api-key"),
            "GPTOSS_NODE_KEY_ENV": str(self.folder / "node-api-key.env"),
            "GPTOSS_KEYS_MAP": str(self.folder / "api-keys.map"),
            "GPTOSS_KEY_RATE_MAP": str(self.folder / "api-key-rate.map"),
            "GPTOSS_KEY_CONCURRENCY_MAP": str(self.folder / "api-key-concurrency.map"),
        }

    def api(self, *args: str, extra: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["python3", str(API_CTL), *args], env=self.env | (extra or {}), capture_output=True, text=True, timeout=timeout
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def start_gate(
    folder: Path,
    proxy: Proxy,
    *,
    host: str,
    port: int,
    router_port: int,
    router_host: str = "127.0.0.1",
    max_model_len: int = 10240,
    keys: KeyCheck | None = None,
) -> Gate:
    """HAProxy in the foreground (-db) with the rendered configuration; returns once it accepts connections."""
    folder.mkdir(parents=True, exist_ok=True)
    socket_dir = Path(tempfile.mkdtemp(prefix="gptoss-gate-", dir="/tmp"))
    cfg = api_gate_config(proxy, max_model_len=max_model_len, bind=f"{host}:{port}", router_port=router_port, router_host=router_host,
                          api_map=str(folder / "api.map"), socket=str(socket_dir / "haproxy.sock"), keys=keys)  # fmt: skip
    (folder / "haproxy.cfg").write_text(cfg)
    if not (folder / "api.map").exists():
        # As the unit's ExecStartPre makes it: the node's own script.
        env = {**os.environ, "GPTOSS_API_MAP": str(folder / "api.map"), "GPTOSS_API_SOCKET": str(socket_dir / "haproxy.sock"),
               "GPTOSS_NODE_KEY": str(folder / "node-api-key"), "GPTOSS_NODE_KEY_ENV": str(folder / "node-api-key.env"),
               # The keys' maps in the test's folder when the gate checks none (gptoss-api init makes them anyway).
               "GPTOSS_KEYS_MAP": str(folder / "api-keys.map"), "GPTOSS_KEY_RATE_MAP": str(folder / "api-key-rate.map"),
               "GPTOSS_KEY_CONCURRENCY_MAP": str(folder / "api-key-concurrency.map")}
        if keys:
            env |= {"GPTOSS_KEYS_MAP": keys.keys_map, "GPTOSS_KEY_RATE_MAP": keys.rate_map, "GPTOSS_KEY_CONCURRENCY_MAP": keys.concurrency_map}
        subprocess.run(["python3", str(API_CTL), "init"], env=env, check=True, timeout=30)
    log = (folder / "haproxy.log").open("ab")
    proc = subprocess.Popen([haproxy(), "-db", "-f", str(folder / "haproxy.cfg")], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"HAProxy did not start: {(folder / 'haproxy.log').read_text()[-2000:]}") from None
            time.sleep(0.05)
    return Gate(proc, host, port, folder, cfg, socket_dir)
