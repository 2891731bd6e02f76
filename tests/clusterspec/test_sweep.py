"""A generated sweep over the parameters (hypothesis, derandomized so every run tries the same cases).

Strings with control characters, line separators, lone surrogates, other scripts' digits and
shell or systemd specials; numbers spelled every way YAML, JSON and Python disagree on; huge
lists; nested structures in a config file. Every outcome is either a clean refusal (one
SpecError whose first entry names the setting the user wrote, with a fix, and echoes a bounded
value) or the value carried intact: the config holds exactly it, every node's user data renders
and parses back, and where the value reaches a node's environment file bash reads it back
exactly as written.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from clusterspec.errors import SpecError
from clusterspec.loading import load_config
from node_render.render import render_cluster
from node_render.userdata import parse_user_data
from tests.conftest import node_user_data

SWEEP = settings(derandomize=True, database=None, deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])

# Characters that have broken a layer before, or would: controls, separators, a lone surrogate,
# digits of other scripts, a zero-width space, shell and systemd specials.
ODD = "\x00\x07\t\n\r\x1b\x7f\x85\u2028\u2029\ud800\u0663\uff15\u200b $%;'\"\\`*?~=,:/.{}[]#&|<>!"
CHARS = st.one_of(st.characters(codec="utf-8"), st.sampled_from(ODD))

# A legal value per string setting (so mutations of it are sometimes accepted), and, where the
# value reaches the node's cluster.env, that it must come back from bash unchanged.
STRINGS: dict[str, tuple[str, bool]] = {
    "cluster_name": ("gptoss-prod", True),
    "stack_name": ("GptOssProd", False),
    "region": ("us-east-2", False),
    "availability_zone": ("us-east-2a", False),
    "nvme_mount": ("/opt/dlami/nvme", True),
    "results_dir": ("/root/results", True),
    "venv_glob": ("/opt/aws_neuronx_venv_pytorch_*_vllm_*", True),
    "proxy_ingress_cidr": ("10.0.0.0/8", False),
    "examples.ref": ("release-2.33", True),
    "examples.repo_url": ("https://github.com/vllm-project/vllm-neuron.git", True),
    "examples.s3_uri": ("s3://my-bucket/examples", False),
    "model.s3_uri": ("s3://my-bucket/models/gpt-oss-120b", False),
    "model.hf_token_secret_arn": ("arn:aws:secretsmanager:us-east-2:123456789012:secret:hf-AbCdEf", False),
    "compile_cache_s3_uri": ("s3://my-bucket/cache", False),
    "results_s3_uri": ("s3://my-bucket/results", False),
    "serving.model_id": ("openai/gpt-oss-120b", True),
    "serving.server_health_path": ("/health", False),
    "ami_id": ("ami-0123456789abcdef0", False),
    "network.vpc_cidr": ("10.42.0.0/16", False),
}
NUMBERS = ["decode_instances", "prefill_per_decode", "ready_timeout_s", "root_volume_gb", "stage_timeout_s",
           "serving.decode.max_num_seqs", "model.expected_shards", "boot.nvme_attempts"]  # fmt: skip
NUMBER_TEXTS = ["0", "1", "2", "8", "\u0663", "\uff18", "1_0", "010", "-1", "1e309", "1e3", "NaN", "nan", "inf", "Infinity",
                "1.5", "1.0", "0x10", "0b1", " 8", "8 ", "+8", "true", "false", "null", "[]", "{}", "8\u200b", "9" * 40]  # fmt: skip
KMS = "arn:aws:kms:us-east-2:123456789012:key/0123abcd-0123-4567-89ab-0123456789ab"


def mutated(base: str) -> st.SearchStrategy[str]:
    """The legal value, with one to three odd (or plain) characters put in or in place of some."""
    plain = st.sampled_from("abcxyz0189-_./")
    edit = st.tuples(st.integers(0, len(base)), st.integers(0, 3), st.text(st.one_of(CHARS, plain, plain), min_size=1, max_size=3))

    def apply(edits: list[tuple[int, int, str]]) -> str:
        s = base
        for pos, cut, text in edits:
            s = s[:pos] + text + s[pos + cut :]
        return s

    return st.one_of(st.just(base), st.lists(edit, min_size=1, max_size=3).map(apply), st.text(CHARS, max_size=60))


def outcome(context: dict[str, Any]) -> Any:
    """The config, or the refusal's text; anything else (a crash) fails the test as it is."""
    try:
        return load_config(context)
    except SpecError as e:
        return str(e)


def assert_clean_refusal(message: str, field: str) -> None:
    first = message.splitlines()[0]
    assert first.startswith("  - "), message
    named = first[4:]
    top = field.split(".")[0]
    assert named.startswith((field, top, "-c ")), f"the refusal does not name {field}: {first[:300]}"
    assert "Fix:" in message and "internal error" not in message, message
    assert len(first) < 1200, f"the refusal echoes an unbounded value ({len(first)} characters)"


def get(cfg: Any, path: str) -> Any:
    value: Any = cfg.model_dump(mode="json")
    for part in path.split("."):
        value = value[part]
    return value


def bash_reads(env_file: str) -> dict[str, str]:
    """What the node's scripts see when they source the file."""
    r = subprocess.run(["bash", "-c", 'set -a; . /dev/stdin; env -0'], input=env_file, capture_output=True, text=True, check=True,
                       env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    return dict(item.split("=", 1) for item in r.stdout.split("\0") if "=" in item)


def assert_carried_intact(cfg: Any, field: str, value: str, into_env: bool) -> None:
    assert get(cfg, field) == value, f"{field}: the config holds {get(cfg, field)!r}, given {value!r}"
    for r in render_cluster(cfg):
        text = node_user_data(r)
        assert not any(ch < " " and ch not in "\n" for ch in text), f"{r.node.name}: control characters in the user data"
        parse_user_data(text)
        if into_env:
            seen = bash_reads(r.files["/etc/gptoss/cluster.env"][0])
            assert value in seen.values(), f"{r.node.name}: {field}={value!r} is not a value of cluster.env as bash reads it"


@pytest.mark.parametrize("field", sorted(STRINGS))
def test_each_base_value_is_accepted_and_carried_intact(field: str) -> None:
    """The sweep's starting points are legal: a sweep that refused every value could not tell a
    refusal from a broken loader, so each base value must load and reach the node as written."""
    base, into_env = STRINGS[field]
    got = outcome({field: base})
    assert not isinstance(got, str), got
    assert_carried_intact(got, field, base, into_env)


@settings(SWEEP, max_examples=400)
@given(data=st.data())
def test_every_string_setting_is_refused_by_name_or_carried_intact(data: st.DataObject) -> None:
    field = data.draw(st.sampled_from(sorted(STRINGS)), label="field")
    base, into_env = STRINGS[field]
    value = data.draw(mutated(base), label="value")
    got = outcome({field: value})
    event("refused" if isinstance(got, str) else "accepted")
    if isinstance(got, str):
        assert_clean_refusal(got, field)
    else:
        assert_carried_intact(got, field, value, into_env)


@SWEEP
@given(data=st.data())
def test_every_number_is_refused_by_name_or_read_as_the_decimal_written(data: st.DataObject) -> None:
    field = data.draw(st.sampled_from(NUMBERS), label="field")
    text = data.draw(st.one_of(st.sampled_from(NUMBER_TEXTS), st.integers(-(10**30), 10**30).map(str)), label="value")
    got = outcome({field: text})
    if isinstance(got, str):
        assert_clean_refusal(got, field)
        return
    value = get(got, field)
    if text.strip() == "null":  # the setting's default, where it has none of its own
        assert value is None, (field, value)
        return
    # Accepted: a JSON number in ASCII digits (blanks around it, as JSON allows), read as written.
    assert text.isascii() and text.strip()[-1:].isdigit(), f"{field}={text!r} was accepted as {value!r}"
    assert isinstance(value, int) and not isinstance(value, bool) and value == float(text), (field, text, value)


@SWEEP
@given(keys=st.lists(st.sampled_from([KMS, KMS.replace("0123abcd", "mrk-0123abcd0123abcd0123abcd0123abcd"), "x", KMS + "\n", ""]),
                     max_size=80))  # fmt: skip
def test_a_list_is_refused_by_name_or_kept_whole(keys: list[str]) -> None:
    got = outcome({"kms_key_arns": json.dumps(keys)})
    if isinstance(got, str):
        assert_clean_refusal(got, "kms_key_arns")
    else:
        assert list(got.kms_key_arns) == keys and len(keys) <= 64 and len(set(keys)) == len(keys)


NESTED = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.floats(), st.text(CHARS, max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(CHARS, max_size=8), inner, max_size=4)),
    max_leaves=40,
)
SECTIONS = ["serving", "network", "model", "boot", "observability", "capacity", "examples", "serving.decode", "serving.proxy.router"]


@SWEEP
@given(section=st.sampled_from(SECTIONS), value=NESTED, as_json=st.booleans())
def test_a_config_file_with_any_nested_value_is_refused_by_name_or_read(tmp_path_factory: Any, section: str, value: Any, as_json: bool) -> None:
    doc: dict[str, Any] = {}
    at = doc
    *parents, leaf = section.split(".")
    for p in parents:
        at = at.setdefault(p, {})
    at[leaf] = value
    path = Path(tmp_path_factory.mktemp("sweep")) / ("c.json" if as_json else "c.yaml")
    try:
        text = json.dumps(doc) if as_json else yaml.safe_dump(doc, allow_unicode=True)
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    except ValueError:  # NaN in strict JSON, and so on: what a user could not write either
        return
    got = outcome({"config": str(path)})
    if isinstance(got, str):
        first = got.splitlines()[0]
        assert first.startswith(("  - " + section.split(".")[0], f"  - config={str(path)!r}")), first[:300]
        assert "Fix:" in got and "internal error" not in got, got
        assert len(first) < 1200, f"the refusal echoes an unbounded value ({len(first)} characters)"
