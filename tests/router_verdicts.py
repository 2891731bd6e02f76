"""The pinned router's verdict on command lines: run where the wheel is importable, one JSON argv per
line on stdin, one JSON verdict per line on stdout.

Each command line goes through what gptoss-router does on a node (the wheel's parser, its Python
checks, then its Rust core's start) in a forked child. "accepted": the router got past its
validation and waits for its servers (its log says so); "refused": the message it raised;
"unknown": neither within 20 s (the test fails on it). The child is killed either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
import time

from vllm_router.router import Router  # type: ignore[import-not-found]
from vllm_router.router_args import RouterArgs  # type: ignore[import-not-found]

ACCEPTED = b"to become healthy"  # "Waiting for N unique hosts (...) to become healthy", after validation


def verdict(argv: list[str]) -> dict[str, str]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1)
        os.dup2(w, 2)
        try:
            p = argparse.ArgumentParser(allow_abbrev=False)
            RouterArgs.add_cli_args(p, use_router_prefix=False)
            a = RouterArgs.from_cli_args(p.parse_args(argv), use_router_prefix=False)
            a._validate_router_args()
            Router.from_args(a).start()
        except BaseException as e:
            os.write(w, ("\nREFUSED " + str(e).replace("\n", " ") + "\n").encode())
        os._exit(3)
    os.close(w)
    out, deadline = b"", time.monotonic() + 20
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], 0.5)
        if ready:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            out += chunk
            if ACCEPTED in out or b"REFUSED " in out:
                break
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    os.close(r)
    text = out.decode(errors="replace")
    if "REFUSED " in text:
        return {"verdict": "refused", "message": text.split("REFUSED ", 1)[1].strip()}
    if ACCEPTED.decode() in text:
        return {"verdict": "accepted"}
    return {"verdict": "unknown", "output": text[-2000:]}

if __name__ == "__main__":
    for line in sys.stdin:
        print(json.dumps(verdict(json.loads(line))), flush=True)
