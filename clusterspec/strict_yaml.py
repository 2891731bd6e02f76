"""The YAML a config file may use: plain mappings, lists and scalars, read one way only.

PyYAML's safe loader follows YAML 1.1, where `01000` is 512, `1_0` is 10, `1:20` is 80, `on`
is true and a date is a date; it expands aliases (a few lines can expand to gigabytes), keeps the
last of two equal keys without a word, and honours tags such as `!!binary`. A config is read by
people who expect none of that. This loader refuses each of those forms with the line and column,
and reads the rest as YAML 1.2's core schema does (true/false, null, decimal numbers).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import yaml
from yaml.nodes import MappingNode, Node


class StrictYamlError(yaml.YAMLError):
    """A form this loader refuses: `problem` and `fix` are for the user, `mark` says where."""

    def __init__(self, problem: str, fix: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.fix, self.problem_mark = problem, fix, mark


_AMBIGUOUS = "tag:gptoss.dev,2026:ambiguous"


class StrictLoader(yaml.SafeLoader):
    """SafeLoader without aliases, anchors, tags, duplicate keys or YAML 1.1's number and bool forms."""

    yaml_implicit_resolvers: ClassVar[dict[Any, list[tuple[str, re.Pattern[str]]]]] = {}

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise StrictYamlError(f"uses the alias *{event.anchor}", "write the value out instead of referring to an anchor", event.start_mark)
        if getattr(event, "anchor", None):
            raise StrictYamlError(f"sets the anchor &{event.anchor}", "remove the anchor; write each value out", event.start_mark)
        tag = getattr(event, "tag", None)
        if tag is not None:
            raise StrictYamlError(f"uses a YAML tag a config may not use ({tag})", "write plain values (no ! or !! tags); quote text that starts with !", event.start_mark)
        return super().compose_node(parent, index)  # type: ignore[no-any-return]

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                duplicate = key in seen
            except TypeError:
                raise StrictYamlError("uses a list or mapping as a key", "use a setting name as the key", key_node.start_mark) from None
            if duplicate:
                raise StrictYamlError(f"gives the key {key!r} twice in one mapping", "keep one (YAML would keep the last without a word)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)  # type: ignore[no-any-return]


def _ambiguous(loader: StrictLoader, node: Node) -> Any:
    raise StrictYamlError(
        f"{node.value!r} means different things in YAML 1.1 and 1.2 (a leading zero, an underscore, a base prefix, "
        "a colon between digits or on/off/yes/no)",
        "write a decimal number without leading zeros or underscores, true or false, or quote it as text",
        node.start_mark,
    )


_DIGITS = list("-+0123456789")
# First match wins among the resolvers of a first character: the ambiguous forms come first.
StrictLoader.add_implicit_resolver(
    _AMBIGUOUS,
    re.compile(
        r"""^(?:[-+]?0[0-9_]+(?:\.[0-9_]*)?
        |[-+]?[0-9][0-9]*_[0-9_]*(?:\.[0-9_]*)?
        |[-+]?0[xXoObB][0-9a-fA-F_]*
        |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?
        |yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF)$""",
        re.X,
    ),
    [*_DIGITS, *"yYnNoO"],
)
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""])
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), _DIGITS)
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:(?:0|[1-9][0-9]*)\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?(?:0|[1-9][0-9]*)[eE][-+]?[0-9]+$"),
    [*_DIGITS, "."],
)
StrictLoader.add_constructor(_AMBIGUOUS, _ambiguous)


def load(text: str) -> Any:
    """Parse one YAML document with the strict loader."""
    return yaml.load(text, Loader=StrictLoader)
