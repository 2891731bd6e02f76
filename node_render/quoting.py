"""Quoting for the node's unit files and env files, read the same way by systemd and bash."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./${}-]+$")


class Expand(str):
    """An Exec-line argument systemd must expand (${VAR}, %i): the project's own references.

    Every other argument is literal: its `$` and `%` are escaped, so a value reaches the server
    exactly as written.
    """

    __slots__ = ()


def systemd_quote(arg: str) -> str:
    """Quote one argument for an Exec line: literal unless it is an Expand."""
    if not isinstance(arg, Expand):
        arg = arg.replace("$", "$$").replace("%", "%%")
    elif re.search(r"%(?![in])", arg):
        raise ValueError(f"argument {arg!r} holds a systemd specifier other than %i and %n")
    if _SAFE.fullmatch(arg):
        return arg
    if "'" in arg or "\\" in arg or "\n" in arg:
        raise ValueError(f"argument {arg!r} cannot be single-quoted for systemd")
    return f"'{arg}'"


def env_file(env: Mapping[str, str]) -> str:
    """An environment file both systemd and bash read the same way."""
    lines = []
    for k, v in env.items():
        if "'" in v or "\n" in v:
            raise ValueError(f"environment value of {k} holds a quote or a newline: {v!r}")
        lines.append(f"{k}={v}" if _SAFE.fullmatch(v) and "$" not in v else f"{k}='{v}'")
    return "\n".join(lines) + "\n"


def parse_env_file(text: str) -> dict[str, str]:
    """Read an environment file written by env_file()."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = shlex.split(v)[0] if v else ""
    return out


def expand(arg: str, env: Mapping[str, str], instance: str | None = None) -> str:
    """What systemd makes of one argument: an Expand's ${VAR} and %i filled in, any other as is."""
    if not isinstance(arg, Expand):
        return arg
    out = re.sub(r"\$\{([A-Za-z0-9_]+)\}", lambda m: env.get(m.group(1), f"<{m.group(1)}>"), arg)
    return out.replace("%i", instance) if instance is not None else out


def systemd_expand(word: str, env: Mapping[str, str], instance: str | None = None) -> str:
    """Expand one word read back from an Exec line as systemd does: $$, ${VAR}, %%, %i, %n."""

    def var(m: re.Match[str]) -> str:
        return "$" if m.group(0) == "$$" else env.get(m.group(1), f"<{m.group(1)}>")

    def spec(m: re.Match[str]) -> str:
        return {"%%": "%", "%i": instance or "", "%n": "<unit>"}[m.group(0)]

    return re.sub(r"%[%in]", spec, re.sub(r"\$\$|\$\{([A-Za-z0-9_]+)\}", var, word))

