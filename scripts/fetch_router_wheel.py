"""Fetch the pinned vllm-router wheel into .wheels/ and check its sha256 (run by `make setup`).

The stack ships this file to the router nodes as an asset; `plan` reads the router's own
argument parser from it. Nothing else downloads the router: the nodes install it offline.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

from clusterspec.sections.proxy import Router
from node_render.paths import WHEELS_DIR


def main() -> int:
    """Download the spec's wheel unless an intact copy is there; exit 2 naming the mismatch."""
    r = Router()
    path = WHEELS_DIR / r.wheel
    if not (path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == r.sha256):
        WHEELS_DIR.mkdir(exist_ok=True)
        path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--platform", "manylinux_2_28_x86_64", "--python-version", "3.12", "--dest", str(WHEELS_DIR),
               f"vllm-router=={r.version}"]  # fmt: skip
        if subprocess.run(cmd, check=False).returncode != 0:
            print(f"fetch_router_wheel: pip could not download vllm-router=={r.version}", file=sys.stderr)
            return 2
    if not path.is_file():
        print(f"fetch_router_wheel: the download holds no {r.wheel} (serving.proxy.router.wheel)", file=sys.stderr)
        return 2
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != r.sha256:
        path.unlink()
        print(f"fetch_router_wheel: {r.wheel} has sha256 {digest}, the spec pins {r.sha256}: deleted", file=sys.stderr)
        return 2
    print(f"router wheel: .wheels/{r.wheel} (sha256 {r.sha256[:12]}...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
