"""`scripts/cluster.py plan`: the table and the JSON document users read."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.conftest import ROOT, gptoss_in_process


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    """`gptoss plan ARGS`, in this process (what it prints is the test; the entry point's own process is
    test_a_reader_that_stops_early_gets_no_error_message's and the README's, tests/project/test_readme.py)."""
    return gptoss_in_process("plan", *args)


def plan_json(*args: str) -> dict[str, Any]:
    r = plan("--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_json_schema_of_the_default_two_node_plan() -> None:
    doc = plan_json()
    assert [(n["name"], n["role"], n["instance_type"]) for n in doc["nodes"]] == [
        ("prefill-0", "prefill", "trn3.48xlarge"),
        ("decode-0", "decode", "trn3.48xlarge"),
    ]
    for node in doc["nodes"]:
        for s in node["services"]:
            assert set(s) <= {"unit", "environment", "argv", "step", "waits"}
            assert isinstance(s["environment"], dict) and all(isinstance(a, str) for a in s["argv"])
    units = [s["unit"] for s in doc["nodes"][0]["services"]]
    assert units[:6] == [f"gptoss-prefill@{i}.service" for i in range(6)]
    assert "gptoss-proxy.service" in units


def test_details_name_every_node_unit_and_command() -> None:
    r = plan("--details", "--width", "250")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for text in ("gptoss-prefill@5.service", "gptoss-decode.service", "NEURON_VISIBLE_DEVICES=20-23", "--port 8105", "toy_proxy_server.py"):
        assert text in out, text


def test_bad_option_exits_2_with_the_rule() -> None:
    r = plan("--decode-instances", "0")
    assert r.returncode == 2
    assert "decode_instances=0: a fleet needs at least one decode server. Fix: set decode_instances >= 1." in r.stderr


def test_plan_draws_the_layout(tmp_path: object) -> None:
    from pathlib import Path

    out = Path(str(tmp_path)) / "fleet.png"
    r = plan("--decode-instances", "2", "--diagram", str(out))
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_production_plan_is_three_plus_eight() -> None:
    doc = plan_json("--decode-instances", "8")
    nodes = doc["nodes"]
    assert [n["name"] for n in nodes] == [f"prefill-{i}" for i in range(3)] + [f"decode-{d}" for d in range(8)]
    assert sum(n["replicas"] for n in nodes) == 48
    assert [n["idle_cores"] for n in nodes] == [0] * 11
    for n in nodes[:3]:
        assert [s["unit"] for s in n["services"]] == [f"gptoss-prefill@{i}.service" for i in range(16)]
    for n in nodes[3:]:
        units = [s["unit"] for s in n["services"]]
        assert units[:2] == ["gptoss-decode.service", "gptoss-proxy.service"]
    assert doc["totals"] == {"nodes": 11, "prefill_nodes": 3, "decode_nodes": 8, "prefill_replicas": 48, "proxies": 8, "idle_cores": 0}
    assert doc["load_balancer"] == {"internal_nlb": True, "port": 8000}
    # Behind the router every replica feeds every decode server; the toy proxy's groups are fixed.
    assert doc["feeds"] == {} and all(n["feeds"] == [f"decode-{d}" for d in range(8)] for n in nodes[:3])
    toy = plan_json("--decode-instances", "8", "-c", "serving.proxy.kind=toy")
    assert toy["feeds"]["decode-2"] == [f"prefill-0:{i}" for i in (12, 13, 14, 15)] + ["prefill-1:0", "prefill-1:1"]
    assert (doc["stack"], doc["region"], doc["cluster_tag"]) == ("GptOss8k1kStack", "us-east-2", {"gptoss:cluster": "gptoss-8k1k"})
    assert doc["billable"][0] == {"item": "trn3.48xlarge (on-demand)", "count": 11, "unit": "hour", "note": ""}
    assert [n["feeds"] for n in toy["nodes"][:3]] == [["decode-0", "decode-1", "decode-2"], ["decode-2", "decode-3", "decode-4", "decode-5"],
                                                       ["decode-5", "decode-6", "decode-7"]]  # fmt: skip
    out = plan("--decode-instances", "8").stdout
    assert "  11 x trn3.48xlarge: 3 prefill + 8 decode\n  48 prefill replicas (TP4), 8 decode servers (TP8 DP16), 8 routers" in out
    assert "endpoint: internal NLB on :8000" in out and "idle cores: 0" in out
    assert "  decode-0..7          decode          - 128/128  -" in out


def test_the_summary_fits_80_columns_and_says_what_it_acts_on() -> None:
    for args in ((), ("--decode-instances", "8"), ("--decode-instances", "40"), ("-c", "recipe=gptoss-20b-single"),
                 ("-c", "config=examples/private-no-egress.yaml")):  # fmt: skip
        r = plan(*args)
        assert r.returncode == 0, r.stderr
        assert max(map(len, r.stdout.splitlines())) <= 80, (args, r.stdout)
        assert len(r.stdout.splitlines()) <= 40, args
        assert r.stderr.splitlines()[0].startswith("stack GptOss"), r.stderr
    r = plan("-c", "config=examples/production-3p8d.yaml")
    assert r.stderr.splitlines()[0] == "stack GptOss8k1kProd · region us-east-2 · cluster tag gptoss:cluster=gptoss-prod"


def test_node_shows_one_nodes_units() -> None:
    r = plan("--node", "decode-0", "--width", "200")
    assert r.returncode == 0 and "gptoss-decode.service" in r.stdout and "gptoss-prefill@0" not in r.stdout
    r = plan("--node", "decode-9")
    assert r.returncode == 2 and "--node decode-9: no such node in GptOss8k1kStack. Fix: one of prefill-0, decode-0." in r.stderr


def test_partial_last_instance_shows_idle_cores() -> None:
    doc = plan_json("--decode-instances", "3")
    assert [(n["name"], n["replicas"], n["idle_cores"]) for n in doc["nodes"] if n["role"] == "prefill"] == [
        ("prefill-0", 16, 0),
        ("prefill-1", 2, 56),
    ]


def test_a_reader_that_stops_early_gets_no_error_message() -> None:
    """`gptoss plan --json | head -c 10`: the command stops quietly (exit 141, as cat), no 'internal error'."""
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "cluster.py"), "plan", "--json", "--decode-instances", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "error" not in err.lower() and "Traceback" not in err, err


def _svg_lines(svg: str) -> list[str]:
    import html
    import re

    return [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]


def _covered(lines: list[str], node: str, index: int) -> bool:
    """A replica is drawn when a label names its node and a range of replicas holding its index."""
    import re

    for line in lines:
        m = re.fullmatch(rf"{re.escape(node)} replicas (\d+)(?:-(\d+))?", line)
        if m and int(m.group(1)) <= index <= int(m.group(2) or m.group(1)):
            return True
    return False


LAYOUTS = [[f"recipe={r}"] for r in ("gptoss-120b-8k1k", "gptoss-120b-single", "gptoss-20b-single", "gptoss-120b-di", "gptoss-20b-di")] + [
    ["decode_instances=8"], ["decode_instances=8", "serving.proxy.kind=toy"], ["decode_instances=3", "prefill_per_decode=2"],
]  # fmt: skip


import pytest  # noqa: E402


@pytest.mark.parametrize("context", LAYOUTS, ids=[" ".join(c) for c in LAYOUTS])
def test_every_layouts_svg_draws_every_server_of_its_plan_and_stands_alone(context: list[str], tmp_path: Any) -> None:
    """Every vLLM server of the plan (each prefill replica, decode server, single server) is in the
    picture with its port, the proxy or router where the plan puts it, the load balancer's health
    check as the template has it; the SVG refers to no file outside itself."""
    import re

    args = [a for c in context for a in ("-c", c)]
    doc = plan_json(*args)
    out = tmp_path / "layout.svg"
    r = plan(*args, "--diagram", str(out))
    assert r.returncode == 0, r.stderr
    svg = out.read_text()
    assert not re.findall(r'href="(?!data:|#)[^"]*"', svg), "a file linked by path: the SVG must stand alone"
    lines = _svg_lines(svg)
    for n in doc["nodes"]:
        assert any(line.split()[:1] == [n["name"]] for line in lines), (n["name"], lines)
        servers = [s for s in n["services"] if s["argv"][:2] == ["vllm", "serve"]]
        assert servers, n["name"]
        if n["role"] == "prefill":
            for s in servers:
                index = int(s["unit"].split("@")[1].split(".")[0])
                assert _covered(lines, n["name"], index), (n["name"], index)
        else:
            port = servers[0]["argv"][servers[0]["argv"].index("--port") + 1]
            assert any(line.endswith(f":{port}") and ("TP" in line) for line in lines), (n["name"], port, lines)
    fronts = [line for line in lines if re.search(r"(router|proxy) :\d+$", line)]
    assert len(fronts) == doc["totals"]["proxies"], fronts
    if doc["load_balancer"]["internal_nlb"]:
        health = next(line for line in lines if line.startswith("health check"))
        assert health == {"vllm-router": "health check :8000 /readiness", "toy": "health check :8001 /ready"}[doc["proxy"]["kind"]]


def test_every_subcommand_describes_itself_and_every_option_has_help() -> None:
    from cluster_ops import cli

    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction)]
    assert set(sub.choices) >= {"plan", "recipes", "preflight", "pin-ami", "deploy", "destroy", "diff", "status", "wait-ready", "bench",
                                "save-cache", "local"}  # fmt: skip
    for name, sp in sub.choices.items():
        assert sp.description and len(sp.description) > 20, name
        assert [a.option_strings or a.dest for a in sp._actions if not a.help] == [], name
        r = gptoss_in_process(name, "--help")
        assert r.returncode == 0 and sp.description.split(":")[0][:40] in " ".join(r.stdout.split()), (name, r.stdout)


def test_tables_fit_80_columns_in_a_wide_terminal_unless_asked_wider() -> None:
    import os

    env = os.environ | {"COLUMNS": "200"}
    for args in (["recipes"], ["plan", "--details"], ["plan", "--decode-instances", "8"]):
        r = gptoss_in_process(*args, env=env)
        assert r.returncode == 0, r.stderr
        # One word longer than a line (a path) runs on; nothing else does.
        long = [line for line in r.stdout.splitlines() if len(line) > 80 and " " in line.strip().rstrip(" \\")]
        assert long == [], (args, long)
    r = gptoss_in_process("recipes", "--wide", env=env)
    assert max(len(line) for line in r.stdout.splitlines()) > 80


def test_recipes_at_80_columns_keep_every_name_a_user_copies_whole() -> None:
    from clusterspec.recipes import RECIPES

    r = gptoss_in_process("recipes", "--width", "80")
    assert r.returncode == 0, r.stderr
    cells = {c.strip() for line in r.stdout.splitlines() for c in line.split("│")}
    for recipe in RECIPES.values():
        assert recipe.name in cells and recipe.stack_name in cells, (recipe.name, r.stdout)
    assert max(len(line) for line in r.stdout.splitlines()) <= 80


def test_plan_rows_show_no_replica_count_on_decode_nodes() -> None:
    r = gptoss_in_process("plan", "--decode-instances", "8")
    (row,) = [line for line in r.stdout.splitlines() if line.strip().startswith("decode-0..7")]
    assert row.split()[:4] == ["decode-0..7", "decode", "-", "128/128"], row


def test_plan_says_how_a_change_of_every_node_rolls_and_what_spare_instances_it_needs() -> None:
    """On-Demand surges (rollout.max_surge 1): 3 + 8 rolls its 3 prefill and 8 decode nodes one of each role at a
    time, with a replacement and its predecessor's drain beside each role: 4 spare instances. max_surge 25 %
    halves decode's batches (8 x 25 % = 2 at once); a reservation replaces in place (max_unavailable), no spare."""
    out = plan("--decode-instances", "8").stdout
    assert "  a change of every node: prefill 3 batches of 1, decode 8 batches of 1\n    (surge, rollout.max_surge: 4 spare instances while it rolls)\n" in out
    doc = plan_json("--decode-instances", "8", "-c", "rollout.max_surge=25%")["rollout"]
    assert doc == {"surge": True, "roles": {"prefill": {"nodes": 3, "at_once": 1, "batches": 3, "spare_instances": 2},
                                            "decode": {"nodes": 8, "at_once": 2, "batches": 4, "spare_instances": 4}}}  # fmt: skip
    off = plan("--decode-instances", "8", "-c", "rollout.surge=off", "-c", "rollout.max_unavailable=25%").stdout
    assert "  a change of every node: prefill 3 batches of 1, decode 4 batches of 2\n    (in place, rollout.max_unavailable)\n" in off


def test_explain_says_what_each_term_of_the_summary_means_once() -> None:
    """Every term a user asked about (idle cores, AWS calls/s, spare instances) is explained, each once, within
    80 columns; each explained term is one the 3+8 summary shows (no legend of lines that are not there)."""
    r = plan("--decode-instances", "8", "--explain")
    assert r.returncode == 0, r.stderr
    summary, _, terms = r.stdout.partition("\nterms:\n")
    assert "what each line means: --explain" in summary
    assert max(map(len, r.stdout.splitlines())) <= 80, r.stdout
    explained = [line.strip().split(": ", 1)[0] for line in terms.splitlines() if line.startswith("  ") and not line.startswith("      ")]
    for term in ("idle cores", "AWS calls/s", "spare instances", "control plane", "cells", "feeds", "gate", "bodies"):
        assert explained.count(term) == 1, (term, explained)
    for term in explained:
        for word in term.split(", "):
            assert word in summary, f"--explain explains {word!r}, which the summary does not show"
    assert "\nterms:\n" not in plan("--decode-instances", "8").stdout, "the legend only when asked"
