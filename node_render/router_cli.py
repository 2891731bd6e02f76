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
import logging
import sys
import types
import zipfile
from pathlib import Path
from typing import Any, NoReturn

from clusterspec.errors import SpecError, rule_error
from node_render.paths import WHEELS_DIR
from node_render.router_rules import refusal

FIELD = "serving.proxy.router.extra_flags"


def _refused(field: str, value: object, rule: str, fix: str) -> SpecError:
    return SpecError([str(rule_error(field, value, rule, fix))])


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting; carries the wheel's RouterArgs (its Python checks)."""

    router_args: Any = None

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
    parser.router_args = module.RouterArgs
    # Its checks log advice for a node's journal ("The main --policy flag will be ignored"); plan says nothing of it.
    logging.getLogger(name).disabled = True
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
        parsed = parser.parse_args(argv)
    except argparse.ArgumentError as e:
        raise _refused(FIELD, [n for n, _ in extra], f"vllm-router refuses the command line: {e}", "fix the flags' values") from None
    refused = start_refusal(parser, parsed)
    if refused is not None:
        flag, why = refused
        # A modeled flag's value is inside the wheel's rules by its spec bounds (tests/node_render/test_router_rules.py).
        given = dict(extra)
        shown: object = [n for n, _ in extra] if flag is None else f"{flag} {given.get(flag, getattr(parsed, by_option[flag].dest))}"
        raise _refused(FIELD, shown, f"vllm-router (the pinned wheel) refuses it at start: {why if flag is None else f'{flag} {why}'}",
                       "change the value the router names (it would exit at every start on every router node)")  # fmt: skip


def start_refusal(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> tuple[str | None, str] | None:
    """The first value of a parsed command line that the router refuses at start, (flag or None, why): its
    Python checks (the wheel's own RouterArgs._validate_router_args, as gptoss-router calls it),
    then its Rust core's rules (router_rules)."""
    try:
        parser.router_args.from_cli_args(parsed, use_router_prefix=False)._validate_router_args()  # type: ignore[attr-defined]
    except ValueError as e:
        return None, str(e)
    numeric = {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.type in (int, float)}
    values = {flag: getattr(parsed, a.dest) for flag, a in numeric.items()}
    for flag, a in numeric.items():
        why = refusal(flag, values[flag], float_flag=a.type is float, values=values)
        if why is not None:
            return flag, why
    return None
