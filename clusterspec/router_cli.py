"""The pinned router's own command-line parser, read from its wheel, to check a router argv at plan time.

`serving.proxy.router.extra_flags` are flags the spec does not model. The router's parser
(vllm_router/router_args.py, standard library only) decides whether they exist, take a value
and leave the modeled flags alone; it is loaded from the wheel the stack ships (checked against
the pinned sha256 first), never imported from an environment, so plan checks what nodes run.
Abbreviations are refused, as gptoss-router refuses them on the node.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import sys
import types
import zipfile
from pathlib import Path
from typing import NoReturn

from clusterspec.errors import SpecError, rule_error
from clusterspec.paths import WHEELS_DIR

FIELD = "serving.proxy.router.extra_flags"


def _refused(field: str, value: object, rule: str, fix: str) -> SpecError:
    return SpecError([str(rule_error(field, value, rule, fix))])


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise argparse.ArgumentError(None, message)


@functools.lru_cache(maxsize=4)
def router_parser(wheel: Path, sha256: str) -> argparse.ArgumentParser:
    """The router's argument parser from the pinned wheel (raises SpecError naming the fix)."""
    if not wheel.is_file():
        raise SpecError([f"{FIELD}: checking them needs the router wheel {wheel.name} in .wheels/. "
                         "Fix: run `make setup` (it fetches the pinned release)."])  # fmt: skip
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != sha256:
        raise SpecError([f"serving.proxy.router.sha256: .wheels/{wheel.name} is not the pinned {sha256}. "
                         "Fix: delete it and run `make setup`."])  # fmt: skip
    with zipfile.ZipFile(wheel) as z:
        source = z.read("vllm_router/router_args.py").decode()
    name = "_gptoss_pinned_vllm_router_args"
    module = types.ModuleType(name)
    # dataclasses look their class's module up in sys.modules while the class is made.
    sys.modules[name] = module
    try:
        exec(compile(source, f"{wheel.name}/vllm_router/router_args.py", "exec"), module.__dict__)  # the pinned wheel, its sha256 checked above
    finally:
        del sys.modules[name]
    parser = _Parser(prog="vllm-router", allow_abbrev=False, exit_on_error=False, add_help=False)
    module.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser


def check_router_argv(modeled: list[str], extra: list[tuple[str, str | None]], wheel_name: str, sha256: str) -> None:
    """Refuse extra flags the router does not know, that miss or take a value, or that set a modeled flag."""
    parser = router_parser(WHEELS_DIR / wheel_name, sha256)
    by_option = {opt: action for action in parser._actions for opt in action.option_strings}
    modeled_dests = {by_option[a].dest for a in modeled if a in by_option}
    for name, value in extra:
        action = by_option.get(name)
        if action is None:
            raise _refused(FIELD, name, "is not a flag of vllm-router (abbreviations are refused)", "give the flag's full name, as `vllm-router --help` lists it")
        if action.dest in modeled_dests:
            raise _refused(FIELD, name, "sets what the spec already sets from a typed field", "set the serving.proxy.router field instead")
        takes_value = action.nargs != 0
        if takes_value and value is None:
            raise _refused(FIELD, name, "takes a value", "give it one (value: ...)")
        if not takes_value and value is not None:
            raise _refused(FIELD, f"{name} {value}", "takes no value", "drop the value")
    argv = list(modeled)
    for name, value in extra:
        argv += [name] + ([value] if value is not None else [])
    try:
        parser.parse_args(argv)
    except argparse.ArgumentError as e:
        raise _refused(FIELD, [n for n, _ in extra], f"vllm-router refuses the command line: {e}", "fix the flags' values") from None
