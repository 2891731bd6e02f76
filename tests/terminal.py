"""Run a command in a pseudo-terminal and answer its prompts, as a person at a terminal would.

`cdk deploy` asks before IAM and security-group changes and `cdk destroy` asks before it deletes;
both refuse without a terminal. The tests that run them as typed answer here.
"""

from __future__ import annotations

import os
import pty
import re
import select
import time
from dataclasses import dataclass, field
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


@dataclass
class Terminal:
    """What the command printed (escape codes removed), its exit code, and the prompts it answered."""

    output: str
    code: int
    answered: list[str] = field(default_factory=list)


def run(argv: list[str], *, cwd: Path, env: dict[str, str], answers: dict[str, str], timeout: float = 600) -> Terminal:
    """Run argv on a terminal; each time its output ends with a key of `answers` (a prompt), type the value."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, on the terminal
        os.chdir(cwd)
        os.execvpe(argv[0], argv, env)
    raw = b""
    answered: list[str] = []
    deadline = time.monotonic() + timeout
    seen = 0
    status: int | None = None
    try:
        while status is None:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise AssertionError(f"{argv} did not end within {timeout:.0f} s:\n{ANSI.sub('', raw.decode(errors='replace'))[-3000:]}")
            ready, _, _ = select.select([fd], [], [], 1)
            chunk = b""
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # the terminal is closed: the command ended
                    chunk = b""
            if chunk:
                raw += chunk
                text = ANSI.sub("", raw[seen:].decode(errors="replace"))
                for prompt, answer in answers.items():
                    if prompt in text:
                        os.write(fd, answer.encode() + b"\n")
                        answered.append(prompt)
                        seen = len(raw)
                        break
                continue
            done, wstatus = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(wstatus)
    finally:
        os.close(fd)
    return Terminal(ANSI.sub("", raw.decode(errors="replace")), status, answered)
