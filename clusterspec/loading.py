"""Loading a deployment's parameters: CDK context and config files, the recipe under them, the
pinned image, and the checks every value passes before the model sees it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from clusterspec import strict_yaml
from clusterspec.config import DEFAULT_AMI_PARAMETER, ClusterConfig
from clusterspec.errors import SpecError, explain, nearest, show

_CONTEXT_KEYS = set(ClusterConfig.model_fields)
_SECTIONS = {k for k, f in ClusterConfig.model_fields.items() if isinstance(f.default_factory, type) and issubclass(f.default_factory, BaseModel)}
_JSON_FIX = (
    "quote names and strings with double quotes, e.g. -c 'network={\"egress\": \"none\"}', "
    "or set one value with a dotted key, e.g. -c network.egress=none"
)


def _parse_context_value(key: str, value: Any) -> Any:
    """`cdk -c key=value` gives strings: JSON for nested values, true/false, null."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    # Only `null` clears a value: `none` is a value of its own (network.egress=none).
    if text == "null":
        return None
    if text in {"true", "false"}:
        return text == "true"
    if re.fullmatch(r"[-+]?(?:[0-9]+_[0-9_]*|0[0-9]{1,19})", text, re.ASCII):
        raise SpecError(
            [
                f"{key}={show(value)}: is a number with an underscore or a leading zero, which tools read differently "
                "(10 or 1_0, 1000 or octal 512). Fix: write the decimal number without underscores or leading zeros."
            ]
        )
    if text[:1] and text[:1] in "{[":
        try:
            return json.loads(text)
        except RecursionError:
            raise SpecError([f"{key}: nests lists or mappings too deeply to read. Fix: {_JSON_FIX}."]) from None
        except json.JSONDecodeError as e:
            raise SpecError([f"{key}={value!r}: is not valid JSON ({e.msg} at column {e.colno}). Fix: {_JSON_FIX}."]) from None
    return value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """-c network.egress=none sets data["network"]["egress"]."""
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        current = node.setdefault(part, {})
        if not isinstance(current, dict):
            where = ".".join(parts[: i + 1])
            raise SpecError([f"{key}: {where} is not a section of settings. Fix: set {where} itself, or remove -c {key}."])
        node = current
    node[parts[-1]] = value


def _read_file(path: str) -> dict[str, Any]:
    """A YAML or JSON config file, every way it can be wrong turned into one message."""
    p = Path(path)
    where = f"config={path!r}"
    if not p.exists():
        raise SpecError([f"{where}: the config file does not exist. Fix: pass -c config=<path to a YAML or JSON file>."])
    if p.is_dir():
        raise SpecError([f"{where}: is a directory. Fix: name a YAML or JSON file in it, e.g. examples/production-3p8d.yaml."])
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            with p.open("rb") as f:
                key, span = _top_level_keys(f.read(64 << 20).decode("utf-8", "replace")).largest()  # a scan, no parse
            which = f" ({key} takes {span:,} of them)" if key else ""
            raise SpecError([f"{where}: is {size:,} bytes{which}; a config file is at most {MAX_CONFIG_BYTES:,} (the examples are under 1,000). "
                             "Fix: keep only the settings you change."])  # fmt: skip
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecError([f"{where}: is not UTF-8 text. Fix: save it as UTF-8."]) from None
    except OSError as e:
        raise SpecError([f"{where}: cannot be read ({e.strerror}). Fix: check the path and its permissions."]) from None
    try:
        loaded = strict_yaml.load(text)
    except strict_yaml.StrictYamlError as e:
        mark = e.problem_mark
        raise SpecError([f"{where}: {e.problem} (line {mark.line + 1}, column {mark.column + 1}). Fix: {e.fix}."]) from None
    except RecursionError:
        deep = _top_level_keys(text).too_deep
        at = f" ({deep} nests them)" if deep else ""
        raise SpecError([f"{where}: nests lists or mappings too deeply to read{at}. Fix: write the setting as docs/parameters.md shows it."]) from None
    except yaml.constructor.ConstructorError as e:
        raise SpecError(
            [f"{where}: uses a YAML tag a config may not use ({e.problem}). Fix: write plain values (no !! or ! tags)."]
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError([f"{where}: is not valid YAML ({at}{getattr(e, 'problem', None) or e}). Fix: correct the file there."]) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SpecError([f"{where}: the file must hold a mapping of settings. Fix: write `key: value` lines."])
    bad = [k for k in loaded if not isinstance(k, str)]
    if bad:
        raise SpecError([f"{where}: key {bad[0]!r} is not a setting name. Fix: use the names docs/parameters.md lists."])
    return loaded


@dataclass
class _Scan:
    """Where a config file's text goes, by top-level setting: bytes per key, and the first nested too deeply."""

    spans: dict[str, int]
    too_deep: str | None

    def largest(self) -> tuple[str | None, int]:
        return max(self.spans.items(), key=lambda kv: kv[1]) if self.spans else (None, 0)


_KEY = re.compile(r'"([A-Za-z_][A-Za-z0-9_]*)"\s*:|^([A-Za-z_][A-Za-z0-9_]*)\s*:', re.M)


def _top_level_keys(text: str) -> _Scan:
    """Name the setting a file's bulk or its nesting belongs to, without parsing it (the parse is what
    failed, or what the size refuses). Brackets count depth; quoted text is skipped."""
    spans: dict[str, int] = {}
    depth, key, start, too_deep, i, quote = 0, None, 0, None, 0, ""
    json_like = text.lstrip().startswith("{")
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            if (depth == 1 if json_like else depth == 0) and (m := _KEY.match(text, i)) and m.group(1):
                if key:
                    spans[key] = spans.get(key, 0) + i - start
                key, start = m.group(1), i
            quote = ch
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH + 1 and too_deep is None:
                too_deep = key
        elif ch in "]}":
            depth -= 1
        elif not json_like and depth == 0 and (i == 0 or text[i - 1] == "\n") and (m := _KEY.match(text, i)) and m.group(2):
            if key:
                spans[key] = spans.get(key, 0) + i - start
            key, start = m.group(2), i
        i += 1
    if key:
        spans[key] = spans.get(key, 0) + len(text) - start
    return _Scan(spans, too_deep)


def _dotted(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Every key of the settings, dotted, with each of its prefixes (serving, serving.proxy, ...)."""
    out = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        out.append(key)
        if isinstance(v, dict):
            out += _dotted(v, f"{key}.")
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, mappings merged key by key (lists and values replaced)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _with_recipe(data: dict[str, Any]) -> dict[str, Any]:
    """The chosen recipe's parameters, then the user's on top."""
    from clusterspec.recipes import DEFAULT_RECIPE, RECIPES

    name = data.get("recipe", DEFAULT_RECIPE)
    if not isinstance(name, str) or name not in RECIPES:
        raise SpecError([f"recipe={show(name)}: is not a recipe. Fix: use one of {', '.join(RECIPES)} (gptoss recipes lists them)."])
    recipe = RECIPES[name]
    serving = data.get("serving")
    if isinstance(serving, dict):
        _recipe_facts(recipe.name, recipe.serving.model_dump(mode="json"), serving)
    return deep_merge(recipe.defaults(), data)


# What a recipe's reference tested, not a setting: the topology its units are built for and the
# decode EP degree its reference vouches for (the guard against untested degrees hangs on it).
RECIPE_FACTS = ("topology", "tested_decode_ep")
_SIZE = re.compile(r"gpt-oss-([0-9]+)b", re.IGNORECASE)


def _recipe_facts(name: str, facts: dict[str, Any], serving: dict[str, Any]) -> None:
    """Refuse a user's value for what the recipe's reference fixed, and a checkpoint of another size."""
    for key in RECIPE_FACTS:
        if key in serving and serving[key] != facts[key] and str(serving[key]) != str(facts[key]):  # -c gives text
            raise SpecError(
                [
                    f"serving.{key}={show(serving[key])}: is what the {name} recipe's reference tested ({facts[key]!r}), "
                    f"not a setting. Fix: remove serving.{key}, or choose the recipe that runs what you want with recipe=NAME."
                ]
            )
    model = serving.get("model_id")
    ours, theirs = _SIZE.search(str(facts["model_id"])), _SIZE.search(str(model)) if isinstance(model, str) else None
    if ours and theirs and ours.group(1) != theirs.group(1):
        raise SpecError(
            [
                f"serving.model_id={show(model)}: names a {theirs.group(1)}B checkpoint; the {name} recipe's flags, cores and "
                f"shard count are sized for {ours.group(1)}B ({facts['model_id']}). Fix: choose the {theirs.group(1)}B recipe "
                "(gptoss recipes lists them), or a checkpoint of the recipe's size."
            ]
        )


def pin_key(region: str) -> str:
    """The context key `gptoss pin-ami` records a region's image under (cdk.context.json)."""
    return f"gptoss:pinned-ami:{region}"


def _apply_pin(data: dict[str, Any], context: dict[str, Any]) -> None:
    """Use the pinned image while the config names the pinned parameter and no ami_id of its own."""
    region = data.get("region") or ClusterConfig.model_fields["region"].default
    parameter = data.get("ami_ssm_parameter", DEFAULT_AMI_PARAMETER)
    pin = context.get(pin_key(str(region)))
    if isinstance(pin, str):
        try:
            pin = json.loads(pin)
        except ValueError:
            pin = None
    if isinstance(pin, dict) and data.get("ami_id") is None and parameter and pin.get("parameter") == parameter:
        data["ami_id"], data["ami_ssm_parameter"] = pin.get("ami_id"), None


# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: systemd, bash and YAML
# read each of them as the end of a line or drop it; no setting documents one.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_DEPTH = 10
MAX_CONFIG_BYTES = 256 * 1024
MAX_ITEMS = 1000


def check_text(value: Any, where: str = "", depth: int = 0) -> None:
    """Every setting, at any depth: one line of printable, valid text, in bounded structures.

    Runs on the merged settings before the model sees them, so each refusal names the user's
    field (`serving.server_health_path`), not the variable a unit would have carried it in.
    """
    at = where or "config"
    if depth > MAX_DEPTH:
        raise SpecError([f"{at}: nested more than {MAX_DEPTH} levels deep; no setting is. Fix: write the setting as docs/parameters.md shows it."])
    if isinstance(value, dict | list | tuple) and len(value) > MAX_ITEMS:
        raise SpecError([f"{at}: holds {len(value):,} entries; no setting takes more than {MAX_ITEMS:,}. Fix: remove the extra entries."])
    if isinstance(value, dict):
        for k, v in value.items():
            name = f"{where}.{k}" if where else str(k)
            if isinstance(k, str):
                _check_string(f"{at} (a name in it)", k)
            check_text(v, name, depth + 1)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_text(v, f"{at}[{i}]", depth + 1)
    elif isinstance(value, str):
        _check_string(at, value)


def _types(annotation: Any) -> tuple[Any, ...]:
    """The types an annotation admits, unions and Optional flattened (Annotated unwrapped)."""
    import types
    import typing

    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return tuple(t for a in typing.get_args(annotation) for t in _types(a))
    return (annotation,)


def check_numbers(model: type[BaseModel], data: Any, where: str = "") -> None:
    """A yes/no where a number belongs is refused (pydantic would read true as 1, false as 0)."""
    import typing

    if not isinstance(data, dict):
        return
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        at = f"{where}.{key}" if where else key
        admitted = _types(field.annotation)
        if isinstance(value, bool) and bool not in admitted and (int in admitted or float in admitted):
            example = f" (e.g. {field.default})" if isinstance(field.default, int | float) and not isinstance(field.default, bool) else ""
            raise SpecError([f"{at}={show(value)}: is a yes/no, not a number. Fix: give {at} as a number{example}."])
        for t in admitted:
            origin, args = typing.get_origin(t), typing.get_args(t)
            if isinstance(t, type) and issubclass(t, BaseModel):
                check_numbers(t, value, at)
            elif origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel) and isinstance(value, dict):
                for k, v in value.items():
                    check_numbers(args[1], v, f"{at}.{k}")
            elif origin in (list, tuple) and args and isinstance(args[0], type) and issubclass(args[0], BaseModel) and isinstance(value, list):
                for i, v in enumerate(value):
                    check_numbers(args[0], v, f"{at}[{i}]")


def _check_string(where: str, value: str) -> None:
    if any("\ud800" <= ch <= "\udfff" for ch in value):
        raise SpecError([f"{where}={show(value)}: is not valid UTF-8 text. Fix: give the value as UTF-8 text."])
    m = _CONTROL.search(value)
    if m:
        raise SpecError(
            [
                f"{where}={show(value)}: holds the control character {m.group()!r} at position {m.start()}; "
                "a setting is one line of printable text (systemd and bash would end or drop the line there). Fix: remove it."
            ]
        )


# Where the CDK CLI cuts a -c value: it splits KEY=VALUE with the JavaScript pattern /=(.*)/,
# whose '.' stops at these four line terminators.
CLI_LINE_BREAKS = "\n\r\u2028\u2029"


def load_config(context: dict[str, Any]) -> ClusterConfig:
    """Build the config from a `config` file (YAML/JSON) and CDK context keys; context wins."""
    data: dict[str, Any] = {}
    path = context.get("config")
    if path:
        data.update(_read_file(str(path)))
    for key, value in context.items():
        if key == "config" or key.startswith(("@aws-cdk", "aws-cdk", "cdk-", "acknowledged-issue")) or ":" in key:
            continue
        top = key.split(".", 1)[0]
        if top not in _CONTEXT_KEYS and top != "capacity_reservation_id":
            raise SpecError(
                [
                    f"{key}={show(value)}: is not a known setting. Fix: remove -c {key} or check its spelling "
                    f"({nearest(top, _CONTEXT_KEYS)})."
                ]
            )
        if isinstance(value, str) and any(ch in value for ch in CLI_LINE_BREAKS):
            raise SpecError(
                [
                    f"{key}={show(value)}: holds a line break; the CDK CLI keeps only the text before the first line "
                    "break of a -c value, so the template would get another value than plan checks. "
                    "Fix: give the value on one line (JSON for nested values)."
                ]
            )
        parsed = _parse_context_value(key, value)
        if "." in key:
            if top not in _SECTIONS:
                raise SpecError([f"{key}: {top} is a value, not a section of settings. Fix: -c {top}=VALUE."])
            _set_dotted(data, key, parsed)
        else:
            data[key] = parsed
    if "capacity_reservation_id" in data:
        rid = data["capacity_reservation_id"]
        raise SpecError(
            [
                f"capacity_reservation_id={rid!r}: moved into the capacity section (it also takes Capacity Blocks and groups). "
                f"Fix: -c capacity='{{\"type\": \"odcr\", \"reservation_id\": \"{rid}\"}}' "
                "(or capacity.type: capacity-block for a Capacity Block for ML)."
            ]
        )
    check_text(data)
    check_numbers(ClusterConfig, data)
    given = frozenset(_dotted(data))
    data = _with_recipe(data)
    _apply_pin(data, context)
    try:
        cfg = ClusterConfig.model_validate(data)
        cfg._given = given
        cfg.layout  # noqa: B018 - validates the fleet too
    except ValidationError as e:
        raise explain(e, model=ClusterConfig) from None
    return cfg
