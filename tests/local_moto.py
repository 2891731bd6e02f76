"""moto's own server on a free loopback port: the local AWS of the lifecycle tests and the VM cluster."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """`moto_server` from this venv, listening on 127.0.0.1, started and waited for.

    `url` names it by `host`: `localhost` for the CDK and the AWS CLI (the CDK parses asset bucket
    URLs by that name), `127.0.0.1` where a guest's relay needs an address.
    """

    def __init__(
        self, log: Path, *, host: str = "localhost", timeout: float = 60, extended: bool = False, module: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        # extended: moto with what the stack needs of CloudFormation and moto lacks (cluster_ops/local_aws.py);
        # module: another such launcher (python -m <module>, moto_server's arguments), with `env` added.
        if module is None and extended:
            module = "cluster_ops.local_aws"
        server = [sys.executable, "-m", module] if module else [str(Path(sys.executable).parent / "moto_server")]
        # Port 0: the kernel picks a free port as moto binds it, and moto says which. (A port found
        # free and handed over later can be taken meanwhile by another run on this machine.)
        self.proc = subprocess.Popen([*server, "-H", "127.0.0.1", "-p", "0"], cwd=Path(__file__).resolve().parent.parent,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=os.environ | (env or {}))  # fmt: skip
        deadline = time.monotonic() + timeout
        self.port = 0
        while True:
            if not self.port and (m := re.search(r"Running on http://127\.0\.0\.1:(\d+)", log.read_text())):
                self.port = int(m.group(1))
                self.url = f"http://{host}:{self.port}"
            if self.port:
                try:
                    urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2)
                    return
                except OSError:
                    pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"moto's server did not start within {timeout:.0f} s: {log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
