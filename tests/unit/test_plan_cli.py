"""`scripts/cluster.py plan`: the table and the JSON document users read."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.conftest import ROOT


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cluster.py"), "plan", *args], capture_output=True, text=True, cwd=ROOT
    )


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
    assert "  decode-0..7          decode          0 128/128  -" in out


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
