"""Validation errors that name the field, the value, the rule and the fix."""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

SHOWN_CHARS = 120


def show(value: Any) -> str:
    """A value as a message quotes it: repr for text, bounded (a message never echoes a megabyte)."""
    if isinstance(value, str):
        text = repr(value)
    elif value is None or isinstance(value, bool):
        text = json.dumps(value)  # null, true, false as a user writes them (YAML, JSON, -c)
    else:
        text = str(value)
    if len(text) > SHOWN_CHARS:
        return f"{text[: SHOWN_CHARS - 20]}... ({len(text):,} characters)"
    return text


def rule_error(field: str, value: Any, rule: str, fix: str) -> PydanticCustomError:
    """Build an error for a broken rule; raised inside pydantic validators or on its own."""
    return PydanticCustomError(
        "spec_rule",
        "{field}={value}: {rule}. Fix: {fix}.",
        {"field": field, "value": show(value), "rule": rule, "fix": fix},
    )


class SpecError(ValueError):
    """One or more invalid deployment inputs; str() is the message the user sees."""

    def __init__(self, messages: list[str]):
        self.messages = messages
        super().__init__("\n".join(f"  - {m}" for m in messages))


def _loc(err: Any, prefix: str) -> str:
    parts = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    return ".".join([prefix, *parts] if prefix else parts)


_FIXES = {
    "int_parsing": "set `{field}` to a whole number",
    "int_type": "set `{field}` to a whole number",
    "bool_parsing": "set `{field}` to true or false",
    "literal_error": "set `{field}` to one of the values listed",
    "string_pattern_mismatch": "set `{field}` to a value of that form",
    "greater_than": "raise `{field}`",
    "greater_than_equal": "raise `{field}`",
    "less_than_equal": "lower `{field}`",
    "string_too_long": "shorten `{field}` (docs/parameters.md says what it holds)",
    "dict_type": "give `{field}` as a mapping of settings",
    "model_type": "give `{field}` as a mapping of settings",
}


def nearest(name: str, known: Iterable[str]) -> str:
    """ "did you mean X" for a misspelt setting name, or where every setting is listed."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else "docs/parameters.md lists every setting"


def _fields_at(model: Any, loc: tuple[Any, ...]) -> set[str]:
    """The setting names of the section at `loc` under `model` (a pydantic model class); none if unknown."""
    for part in loc:
        if isinstance(model, tuple):  # a mapping of sections (capacity.roles): any key, then the section
            model = model[1]
            continue
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return set()
        model = _section(fields[part].annotation)
    return set(getattr(model, "model_fields", {})) if model is not None and not isinstance(model, tuple) else set()


def _section(annotation: Any) -> Any:
    """The model class an annotation holds (Optional unwrapped), ("dict", model) for a mapping of them, else None."""
    candidates = (annotation,) if typing.get_origin(annotation) is dict else typing.get_args(annotation) or (annotation,)
    for t in candidates:
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
        if typing.get_origin(t) is dict:
            value = typing.get_args(t)[1]
            if isinstance(value, type) and issubclass(value, BaseModel):
                return ("dict", value)
    return None


def _annotation_at(model: Any, loc: tuple[Any, ...]) -> Any:
    """The type of the setting at `loc` under `model` (an item's type where loc holds a list index); None if unknown."""
    annotation: Any = model
    for part in loc:
        args = [a for a in typing.get_args(annotation) if a is not type(None) and a is not Ellipsis]
        if typing.get_origin(annotation) in (tuple, list) and args:
            annotation = args[0]
            if isinstance(part, int):
                continue
        elif typing.get_origin(annotation) is dict and len(args) == 2:
            annotation = args[1]
            continue
        elif args:  # Optional[X], Annotated[X, ...]
            annotation = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), args[0])
        fields = getattr(annotation, "model_fields", {}) if isinstance(annotation, type) else {}
        if part not in fields:
            return None
        annotation = fields[part].annotation
    return annotation


def _example(annotation: Any, given: Any = None) -> Any:
    """A value of that type as a user writes it: a list of one item, a mapping of its required settings."""
    args = [a for a in typing.get_args(annotation) if a is not type(None) and a is not Ellipsis]
    if typing.get_origin(annotation) in (tuple, list):
        return [_example(args[0] if args else str, given)]
    if typing.get_origin(annotation) is dict and len(args) == 2:
        keys = typing.get_args(args[0]) if typing.get_origin(args[0]) is typing.Literal else ("NAME",)
        return {str(keys[0]): _example(args[1])}
    if args:
        return _example(next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), args[0]), given)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        fields = annotation.model_fields
        required = [k for k, f in fields.items() if f.is_required()]
        if not required:  # every setting has a default: the first plain one, at its default
            defaults = {k: f.get_default(call_default_factory=True) for k, f in fields.items()}
            plain = [k for k, v in defaults.items() if isinstance(v, (str, int, float, bool))]
            if plain:
                return {plain[0]: defaults[plain[0]]}
            return {next(iter(fields)): _example(next(iter(fields.values())).annotation)}
        return {k: _example(fields[k].annotation, given if k == required[0] and isinstance(given, str) else None) for k in required}
    if annotation is int:
        return given if isinstance(given, int) else 1
    if annotation is bool:
        return True
    return given if isinstance(given, str) else "..."


def _shape_fix(field: str, model: Any, loc: tuple[Any, ...], value: Any) -> str | None:
    """For a list or an object given in another form: the -c that gives it, with the user's value in it."""
    annotation = _annotation_at(model, loc) if model is not None else None
    if annotation is None:
        return None
    whole = _example(annotation, value)
    # An item of a list: the whole list, which is what a -c sets (its field without the item's index).
    for part in reversed(loc):
        if not isinstance(part, int):
            break
        field, whole = field.rpartition(".")[0], [whole]
    return f"give it as JSON, e.g. -c '{field}={json.dumps(whole)}' (a config file takes the same as YAML)"


def explain(exc: ValidationError, prefix: str = "", model: Any = None) -> SpecError:
    """Turn a pydantic ValidationError into messages with field, value, rule and fix (`model`: the
    class validated, for the nearest name of a misspelt setting)."""
    messages = []
    for err in exc.errors():
        if err["type"] == "spec_rule":
            messages.append(err["msg"])
            continue
        field = _loc(err, prefix) or prefix or "config"
        value = err.get("input")
        shown = show(value) if not isinstance(value, dict) else "{...}"
        if err["type"] == "extra_forbidden":
            loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
            known = _fields_at(model, loc[:-1]) if model is not None else set()
            hint = nearest(str(loc[-1]), known) if known else "docs/parameters.md lists every setting"
            rule, fix = "is not a known setting", f"remove `{field}` or check its spelling ({hint})"
        elif err["type"] == "missing":
            rule, fix = "is required", f"set `{field}` in the config file or with -c"
        elif err["type"] in ("tuple_type", "list_type", "model_type", "dict_type", "model_attributes_type") and (
            shape := _shape_fix(field, model, tuple(p for p in err["loc"] if not str(p).startswith("function-")), value)
        ):
            kind = "a list" if err["type"] in ("tuple_type", "list_type") else "a mapping of settings"
            rule, fix = f"must be {kind}", shape
        else:
            rule = err["msg"][0].lower() + err["msg"][1:]
            fix = _FIXES.get(err["type"], "set `{field}` to a value that satisfies this rule").format(field=field)
        messages.append(f"{field}={shown}: {rule}. Fix: {fix}.")
    return SpecError(messages)
