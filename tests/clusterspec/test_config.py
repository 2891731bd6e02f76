"""The spec as loaded: defaults are the tested layout, a config file and -c context merged, examples valid, any
fleet one stack, odd but legal values reaching the server exactly, dotted keys, model ids."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clusterspec.errors import SpecError
from clusterspec.loading import load_config
from node_render import limits
from tests.conftest import CDK, ODD_VALUES, ROOT, cli_env


def test_defaults_are_the_tested_two_node_layout() -> None:
    cfg = load_config({})
    layout = cfg.layout
    assert [(n.name, n.role, len(n.replicas)) for n in layout.nodes] == [("prefill-0", "prefill", 6), ("decode-0", "decode", 0)]
    assert cfg.instance_type == "trn3.48xlarge"
    assert [p.node for p in layout.proxies] == ["prefill-0"]


def test_config_file_and_context_merge_with_context_winning(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text("decode_instances: 2\ncluster_name: prod-a\nserving:\n  bench:\n    warmup_prompts: 640\n")
    cfg = load_config({"config": str(f), "decode_instances": "3"})
    assert (cfg.decode_instances, cfg.cluster_name, cfg.serving.bench.warmup_prompts) == (3, "prod-a", 640)


def test_missing_config_file_is_named() -> None:
    with pytest.raises(SpecError, match=r"config='nope.yaml': the config file does not exist"):
        load_config({"config": "nope.yaml"})


def test_app_exits_before_writing_a_template(tmp_path: Path) -> None:
    """`cdk synth` with a bad value fails with the message and leaves no template behind."""
    out = tmp_path / "cdk.out"
    r = subprocess.run(
        [str(CDK), "synth", "--no-notices", "-o", str(out), "-c", "decode_instances=0"],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    assert "decode_instances=0: a fleet needs at least one decode server. Fix: set decode_instances >= 1." in r.stderr
    assert not list(out.glob("*.template.json"))


def test_app_module_never_imports_boto3() -> None:
    """Synthesis is hermetic: the app's import graph has no AWS SDK."""
    code = "import sys, runpy; sys.argv=['app.py']; import app; print('boto3' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_valid(example: Path) -> None:
    cfg = load_config({"config": str(example)})
    assert cfg.layout.nodes


def test_any_fleet_is_one_stack_and_the_refusal_of_too_many_cells_names_one_that_fits() -> None:
    """Cells hold the nodes: 1000 decode instances (the most a config takes) are one stack. Only the
    parent's own limit (one resource per cell) can refuse a fleet, and then the fix names one that fits."""

    size = limits.check(load_config({"decode_instances": "1000"}))
    assert (size.nodes, len(size.cells)) == (1375, 58) and all(c.template_bytes < 1e6 and c.resources < 500 for c in size.templates)
    with pytest.raises(SpecError) as err:
        limits.check(load_config({"decode_instances": "1000", "cell_nodes": "1"}))
    largest = int(re.search(r"at or below (\d+) decode instances", str(err.value)).group(1))  # type: ignore[union-attr]
    # Each one-node cell costs the parent two resources (the cell and its NodeSilent alarms' stack): 151 decode instances.
    assert 100 <= largest < 1000
    assert limits.check(load_config({"decode_instances": str(largest), "cell_nodes": "1"})).nodes > 0
    with pytest.raises(SpecError):
        limits.check(load_config({"decode_instances": str(largest + 1), "cell_nodes": "1"}))


# ---- every accepted value survives the trip -------------------------------------------------


def test_odd_but_legal_values_reach_the_server_exactly(tmp_path: Path) -> None:
    """Env values and extra flag values with spaces, unicode, $, %, ; and quotes: verified by
    systemd-analyze, read back by bash from the env file, and expanded from the Exec line the
    way systemd does; each comes out as written."""
    from node_render.node_files import served
    from node_render.quoting import systemd_expand
    from node_render.render import render_cluster
    env = {f"ODD_{i}": {"value": v, "reason": "odd but legal"} for i, v in enumerate(ODD_VALUES)}
    env["ODD_BACKSLASH"] = {"value": "C:\\models\\x", "reason": "env files are single-quoted: a backslash is fine"}
    flags = [{"name": f"--odd-{i}", "value": v, "reason": "odd but legal"} for i, v in enumerate(ODD_VALUES)]
    cfg = load_config({"serving": {"decode": {"env": env, "extra_flags": flags}}})
    limits.check(cfg)
    decode = next(r for r in render_cluster(cfg) if r.node.name == "decode-0")
    files = decode.files
    unit = files["/etc/systemd/system/gptoss-decode.service"][0]
    # systemd's own parser accepts the unit (the scripts it names exist as stubs).
    d = tmp_path / "units"
    d.mkdir()
    env_path = d / "decode.env"
    env_path.write_text(files["/etc/gptoss/decode.env"][0])
    for path, (text, _) in files.items():  # the node's other units, which the decode unit names
        if path.startswith("/etc/systemd/system/"):
            text = text.replace("/opt/gptoss/bin/", f"{d}/").replace("/etc/gptoss/", f"{d}/")
            (d / path.rsplit("/", 1)[1]).write_text(text)
    for script in decode.scripts:
        (d / script).write_text("#!/bin/sh\n")
        (d / script).chmod(0o755)
    res = subprocess.run(["systemd-analyze", "verify", str(d / "gptoss-decode.service")], capture_output=True, text=True, cwd=d)
    assert (res.returncode, res.stdout + res.stderr) == (0, "")
    # bash reads every value back exactly (the node's scripts source these files).
    script = f"set -a; . {env_path}; " + "; ".join(f'printf "%s\\0" "${name}"' for name in env)
    values = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    assert values == [e["value"] for e in env.values()]
    # systemd's expansion of the Exec line gives each flag value exactly as written.
    import shlex

    words = shlex.split(re.search(r"^ExecStart=(.*)$", unit, re.M).group(1))  # type: ignore[union-attr]
    argv = served([systemd_expand(w, {}) for w in words])
    for i, v in enumerate(ODD_VALUES):
        assert argv[argv.index(f"--odd-{i}") + 1] == v
    assert next(s for s in decode.services if s.unit == "gptoss-decode.service").argv == argv


def test_dotted_keys_set_nested_values_as_users_type_them() -> None:
    cfg = load_config({"network.egress": "none", "model.source": "s3", "model.s3_uri": "s3://models-bucket/gpt-oss-120b",
                       "examples.s3_uri": "s3://models-bucket/vllm-neuron", "serving.decode.max_num_seqs": "4"})  # fmt: skip
    assert (cfg.network.egress, cfg.model.source, cfg.serving.decode.max_num_seqs) == ("none", "s3", 4)


MODEL_IDS = ["openai/gpt-oss-120b", "openai/gpt--oss", "openai/gpt-oss.", "openai/.gpt", "openai/-gpt", "openai/gpt..oss", "openai/gpt.git",
             "org_/name_", "o/n", "a" * 96 + "/b", "a" * 97 + "/b", "openai/gpt oss", "openai/gpt/oss", "openai/café", "Qwen/Qwen3-8B",
             "_x/y", "x/y-", "x/y_"]  # fmt: skip


def test_a_model_id_is_accepted_exactly_when_every_huggingface_hub_release_accepts_it() -> None:
    """The node downloads with huggingface_hub, whichever release the DLAMI's venv holds: a model id one of
    them would refuse at boot is refused at plan. (0.36 also takes non-ASCII names and longer
    namespaces, which the Hub itself refuses and later releases check.)"""
    code = ("import json, sys; from huggingface_hub.utils import validate_repo_id\n"
            "out = {}\nfor i in json.loads(sys.argv[1]):\n"
            "    try:\n        validate_repo_id(i); out[i] = True\n    except Exception:\n        out[i] = False\nprint(json.dumps(out))")  # fmt: skip
    hubs = []
    for version in ("0.36.2", "1.33.0", "2.4.0"):
        r = subprocess.run([sys.executable, "-c", code, json.dumps(MODEL_IDS)], env=os.environ | {"PYTHONPATH": str(ROOT / ".hf-clients" / version)},
                           capture_output=True, text=True, check=True)  # fmt: skip
        hubs.append(json.loads(r.stdout))
    ours = {}
    for model_id in MODEL_IDS:
        try:
            load_config({"serving.model_id": model_id})
            ours[model_id] = True
        except SpecError:
            ours[model_id] = False
    # The project asks for org/name (the checkpoint's whole name); the Hub alone also takes a bare name.
    assert ours == {i: all(h[i] for h in hubs) and "/" in i for i in MODEL_IDS}
    assert ours["openai/gpt-oss-120b"] and not ours["openai/gpt--oss"] and not ours["openai/gpt-oss."]
