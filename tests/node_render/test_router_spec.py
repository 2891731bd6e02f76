"""Which proxy runs where, and the router's command line as the pinned router's own parser reads it."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from clusterspec.errors import SpecError
from clusterspec.loading import load_config
from clusterspec.recipes import RECIPES
from node_render.limits import check
from node_render.paths import WHEELS_DIR
from node_render.render import render_cluster
from node_render.router_cli import router_parser
from tests.conftest import ROOT


def _flags(*flags: dict[str, Any]) -> dict[str, Any]:
    return {"decode_instances": 8, "serving.proxy.router.extra_flags": json.dumps(list(flags))}


def test_the_references_layouts_keep_the_toy_proxy_and_a_fleet_gets_the_router() -> None:
    assert load_config({}).proxy_kind == "toy"
    for name in RECIPES:
        cfg = load_config({"recipe": name})
        assert cfg.proxy_kind == ("toy" if cfg.serving.disaggregated else None), name
    fleet = load_config({"decode_instances": 8})
    assert fleet.proxy_kind == "vllm-router"
    assert [p.node for p in fleet.layout.proxies] == [f"decode-{d}" for d in range(8)]
    # Every router knows every replica and every decode server: no fixed groups.
    assert all(len(p.replicas) == 48 and p.decode_servers == tuple(range(8)) for p in fleet.layout.proxies)
    toy = load_config({"decode_instances": 8, "serving.proxy.kind": "toy"})
    assert [len(p.replicas) for p in toy.layout.proxies] == [6] * 8 and all(len(p.decode_servers) == 1 for p in toy.layout.proxies)


def test_the_toy_layouts_render_exactly_the_references_proxy() -> None:
    for r in render_cluster(load_config({})):
        for s in r.services:
            if s.unit == "gptoss-proxy.service":
                assert s.argv[:2] == ["python3", "/opt/gptoss/vllm-neuron/examples/vllm_neuron/vllm/disaggregated_inference/toy_proxy_server.py"]
        assert not any("VLLM_NIXL_SIDE_CHANNEL_HOST" in s.environment and s.environment["VLLM_NIXL_SIDE_CHANNEL_HOST"] != "0.0.0.0" for s in r.services)


def test_behind_the_router_a_replica_hands_out_its_node_address() -> None:
    for r in render_cluster(load_config({"decode_instances": 8})):
        for s in r.services:
            if s.unit.startswith("gptoss-prefill@"):
                assert s.environment["VLLM_NIXL_SIDE_CHANNEL_HOST"] == f"<{r.node.name}>"


def test_plan_says_which_proxy_runs_and_why() -> None:
    def plan(*ctx: str) -> str:
        res = subprocess.run([str(ROOT / ".venv/bin/gptoss"), "plan", *ctx], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        return res.stdout

    assert "proxy: the examples' toy proxy on prefill-0\n    why: one decode server, as the references test it" in plan()
    assert ("proxy: vLLM router 0.1.17 on decode-0..7\n    why: 8 decode servers: it health-checks them (serving.proxy.kind)\n"
            "    gate: HAProxy 2.8, 2 retries before the first byte (500/502/504, no reply)\n"
            "    bodies: retried up to 48,128 B, refused 413 over 229,376 B\n") in plan("-c", "decode_instances=8")  # fmt: skip
    doc = json.loads(plan("-c", "decode_instances=8", "--json"))
    assert doc["proxy"] == {"kind": "vllm-router", "why": "8 decode servers: it health-checks them",
                            "nodes": [f"decode-{d}" for d in range(8)], "health_path": "/readiness",
                            "gate": {"haproxy": "2.8", "retries": 2, "retry_on": ["conn-failure", "empty-response", "junk-response", "500", "502", "504"],
                                     "retried_bodies_up_to": 48128, "body_cap": 229376,
                                     "retry_budget_percent": 10, "max_requests": 1024, "lame_duck_s": 30}}  # fmt: skip
    assert "gate:" not in plan(), "the toy proxy has no gate"


def test_the_rendered_router_command_line_parses_with_the_pinned_routers_own_parser() -> None:
    cfg = load_config({"decode_instances": 8})
    r = cfg.serving.proxy.router
    parser = router_parser(WHEELS_DIR / r.wheel, r.sha256)
    (svc,) = [s for s in render_cluster(cfg)[-1].services if s.unit == "gptoss-proxy.service"]
    args = parser.parse_args(svc.argv[2:])
    assert args.vllm_pd_disaggregation and args.kv_connector == "nixl"
    assert len(args.prefill) == 48 and len(args.decode) == 8
    assert (args.health_check_interval_secs, args.health_failure_threshold) == (r.health_check_interval_s, r.health_failure_threshold)
    # 0.1.17's PD path has no retry loop and no breaker: the spec sets none of their flags (the API gate retries), the router's defaults stay.
    assert not any(a.startswith(("--retry-", "--cb-")) for a in svc.argv)
    assert args.worker_startup_timeout_secs == cfg.serving.engine_ready_timeout_s


@pytest.mark.parametrize(
    "flag,rule",
    [
        ({"name": "--queue-siz", "value": "200"}, "is not a flag of vllm-router (abbreviations are refused)"),
        ({"name": "--port", "value": "9000"}, "sets what the spec already sets from a typed field"),
        ({"name": "--health-failure-threshold", "value": "9"}, "sets what the spec already sets from a typed field"),
        ({"name": "--queue-size"}, "takes a value"),
        ({"name": "--disable-retries", "value": "yes"}, "takes no value"),
        ({"name": "--log-level", "value": "loud"}, "vllm-router refuses the command line: argument --log-level: invalid choice"),
    ],
)
def test_extra_router_flags_are_refused_at_plan_time_by_the_routers_parser(flag: dict[str, Any], rule: str) -> None:
    with pytest.raises(SpecError) as e:
        check(load_config(_flags({**flag, "reason": "test"})))
    assert str(e.value).startswith("  - serving.proxy.router.extra_flags=") and rule in str(e.value)


def test_an_extra_router_flag_the_router_knows_reaches_its_command_line() -> None:
    cfg = load_config(_flags({"name": "--queue-size", "value": "400", "reason": "bursts"}, {"name": "--log-level", "value": "debug", "reason": "x"}))
    check(cfg)
    (svc,) = [s for s in render_cluster(cfg)[-1].services if s.unit == "gptoss-proxy.service"]
    i = svc.argv.index("--queue-size")
    assert svc.argv[i : i + 4] == ["--queue-size", "400", "--log-level", "debug"]


def test_either_kind_deploys_anywhere_the_router_on_the_references_layout_too(synth_variant: Any) -> None:
    from tests.stacks.template import of_type

    t = synth_variant(**{"serving.proxy.kind": "vllm-router"})
    # One parameter: the routers' settings and pool (read at run time); the members' addresses come from EC2.
    ((_, param),) = [(k, v) for k, v in of_type(t, "AWS::SSM::Parameter").items() if v["Properties"]["Name"].endswith("/router")]
    assert (param["Properties"]["Name"], param["Properties"]["Type"], param["Properties"]["Tier"]) == ("/gptoss/gptoss-8k1k/router", "String", "Standard")
    assert param["Properties"]["Value"].splitlines()[-2:] == ["pool prefill 0 0 8100 8105", "pool decode 0 0 8200 8200"]
    assert not of_type(t, "AWS::ElasticLoadBalancingV2::LoadBalancer"), "one router: no load balancer"
    roles = {lid: r for lid, r in of_type(t, "AWS::IAM::Role").items() if lid.startswith(("Prefill", "Decode"))}
    statements = {lid: r["Properties"].get("Policies", [{}])[0].get("PolicyDocument", {}).get("Statement", []) for lid, r in roles.items()}
    # The router runs on decode-0 (it outlives the loss of any prefill node): only its role reads the
    # wheel and the members; the prefill node's role does neither.
    (decode,) = [lid for lid in roles if lid.startswith("Decode0")]
    (prefill,) = [lid for lid in roles if lid.startswith("Prefill0")]
    wheel = [st for st in statements[decode] if st["Action"] == "s3:GetObject" and ".whl" in json.dumps(st["Resource"])]
    assert wheel, "the router wheel asset, by its ARN, for the router's node"
    # The members' read (CDK may merge it with the health watch's other read on '*').
    assert any("ec2:DescribeInstances" in json.dumps(st["Action"]) and st["Resource"] == "*" for st in statements[decode]), statements[decode]
    assert not [st for st in statements[prefill] if "ec2:DescribeInstances" in json.dumps(st) or ".whl" in json.dumps(st)]
    # The router's node reads that one parameter; the prefill node reads none.
    reads = [st for st in statements[decode] if st["Action"] == "ssm:GetParameter"]
    assert [json.dumps(st["Resource"]) for st in reads] == [json.dumps({"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":ssm:us-east-2:", {"Ref": "AWS::AccountId"}, ":parameter/gptoss/gptoss-8k1k/router"]]})]
    assert not [st for st in statements[prefill] if "ssm:GetParameter" in json.dumps(st)]
    toy = synth_variant(decode_instances="8", **{"serving.proxy.kind": "toy"})
    toy_roles = [r for lid, r in of_type(toy, "AWS::IAM::Role").items() if lid.startswith("Decode")]
    assert toy_roles and all(".whl" not in json.dumps(r) for r in toy_roles), "the toy proxy needs no wheel"


def test_the_fleets_router_document_is_a_few_lines_for_any_fleet_and_expands_to_every_server(tmp_path: Any, shipped: Any) -> None:
    """The routers' settings and pool are the fleet's (one SSM parameter, read at run time), not a node's:
    one `pool` line per run of nodes of one role and port range, so 8 decode nodes or 800 are one line."""
    from node_render.command_lines import router_fleet

    cfg = load_config({"decode_instances": 9})
    doc = router_fleet(cfg, cfg.layout.proxies[0])
    lines = doc.splitlines()
    assert lines[0] == "domain gptoss.internal"
    assert [x for x in lines if x.startswith("pool ")] == ["pool prefill 0 2 8100 8115", "pool prefill 3 3 8100 8105", "pool decode 0 8 8200 8200"]
    # The next router of a roll waits for one that restarts: its lame-duck 30 s, its drain (the request timeout, 1,800 s) and its start (120 s).
    assert lines[1] == "restart_gap 1950", "serving.proxy.gate.lame_duck_s + router.request_timeout_s + router.restart_gap_s"
    assert lines[2:6] == ["arg --vllm-pd-disaggregation", "arg --kv-connector", "arg nixl", "arg --prefill-policy"]
    assert "arg --request-timeout-secs" in lines and lines[lines.index("arg --request-timeout-secs") + 1] == "arg 1800"
    (tmp_path / "fleet").write_text(doc)
    res = subprocess.run([str(shipped("gptoss-router-pool")), str(tmp_path / "fleet"), "--", "printf", "%s\\n", "router"],
                         env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    out = res.stdout.split("\n")[:-1]
    settings = [x.removeprefix("arg ") for x in lines if x.startswith("arg ")]
    assert out[0] == "router" and out[1 : 1 + len(settings)] == settings
    urls = out[1 + len(settings) :]
    assert len(urls) == 2 * (3 * 16 + 6 + 9)
    # Every server by its node's name: gptoss-members keeps the names at the current addresses.
    assert urls[:2] == ["--prefill", "http://prefill-0.gptoss.internal:8100"] and urls[-2:] == ["--decode", "http://decode-8.gptoss.internal:8200"]
    assert urls[2 * 53 : 2 * 54] == ["--prefill", "http://prefill-3.gptoss.internal:8105"] and "http://prefill-3.gptoss.internal:8106" not in urls
    assert (tmp_path / "fleet.started").read_text() == doc, "what the running router started with, for gptoss-members to compare"
    # A document that says its form (the next writer's `version 1`) is read the same; a newer form is refused by name.
    (tmp_path / "fleet").write_text("version 1\n" + doc)
    res = subprocess.run([str(shipped("gptoss-router-pool")), str(tmp_path / "fleet"), "--", "printf", "%s\\n", "router"],
                         env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    assert res.stdout.split("\n")[:-1] == out
    # A malformed line: the router does not start with a hole in its pool.
    for bad, said in ((doc.replace("pool decode 0 8", "pool decode 0 8 ; rm"), "not pool ROLE FIRST LAST FIRST_PORT LAST_PORT"),
                      (doc.replace("domain gptoss.internal\n", ""), "names no members' domain"),
                      (doc.replace("restart_gap 1950", "restart_gap soon"), "not restart_gap SECONDS"),
                      ("\n".join(x for x in lines if not x.startswith("pool ")), "names no server"),
                      ("version 2\n" + doc, "is a version 2 document; this node reads up to version 1"),
                      ("", "is missing or empty")):  # fmt: skip
        (tmp_path / "fleet").write_text(bad)
        res = subprocess.run([str(shipped("gptoss-router-pool")), str(tmp_path / "fleet"), "--", "true"], env={"PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        assert res.returncode == 1 and said in res.stderr, (said, res.stderr)


# The router's whole command line for the production layout (3 prefill + 8 decode instances), typed
# from the spec's defaults and the reference's ports (prefill replica i of a node on 8100 + i, the
# decode server on 8200), not from the code that renders it: a changed flag or value fails here.
ROUTER_3P8D = [
    "/opt/gptoss/vllm-router/0.1.17-85c96bea4d57/bin/python", "/opt/gptoss/bin/gptoss-router",
    # Clients reach the API gate (HAProxy) on 8000; the router and its admin routes listen on loopback alone.
    "--host", "127.0.0.1",
    "--port", "8010",
    "--vllm-pd-disaggregation",
    "--kv-connector", "nixl",
    # round_robin: the pinned router's power_of_two balances on a route vLLM does not serve (make bench-policy).
    "--prefill-policy", "round_robin",
    "--decode-policy", "round_robin",
    "--health-check-endpoint", "/health",
    "--health-check-interval-secs", "1",
    # vLLM's /health waits for its tokenizing event loop: 10 s, 3 failures, 2 passes (make bench-health).
    "--health-check-timeout-secs", "10",
    "--health-failure-threshold", "1",
    "--health-success-threshold", "2",
    "--request-timeout-secs", "1800",
    # The body cap, 10,240 tokens x 16 B + 64 KiB: HAProxy reads it from Content-Length, the router holds a chunked body to it.
    "--max-payload-size", "229376",
    "--worker-startup-timeout-secs", "14400",
    "--worker-startup-check-interval", "1",
    "--prometheus-host", "127.0.0.1",
    "--prometheus-port", "8029",
]  # fmt: skip
ROUTER_3P8D_POOL = [a for n in range(3) for i in range(16) for a in ("--prefill", f"http://prefill-{n}.gptoss.internal:{8100 + i}")] + [
    a for d in range(8) for a in ("--decode", f"http://decode-{d}.gptoss.internal:8200")
]


def test_the_production_routers_command_line_is_the_typed_one_on_every_router_node() -> None:
    plan = subprocess.run([str(ROOT / ".venv" / "bin" / "gptoss"), "plan", "-c", "config=examples/production-3p8d.yaml", "--json"],
                          capture_output=True, text=True, cwd=ROOT, check=True)  # fmt: skip
    nodes = json.loads(plan.stdout)["nodes"]
    routers = {n["name"]: s for n in nodes for s in n["services"] if s["unit"] == "gptoss-proxy.service"}
    assert sorted(routers) == sorted(f"decode-{d}" for d in range(8))
    for name, service in routers.items():
        assert service["argv"] == ROUTER_3P8D + ROUTER_3P8D_POOL, name
    # The same command line, run as the node runs it, parses with the pinned router's own parser.
    pinned = load_config({}).serving.proxy.router
    parsed = router_parser(WHEELS_DIR / pinned.wheel, pinned.sha256).parse_args(ROUTER_3P8D[4:] + ROUTER_3P8D_POOL)
    assert parsed.request_timeout_secs == 1800 and parsed.prefill_policy == "round_robin"


def test_a_router_node_of_the_production_layout_snapshot(snapshot: Any) -> None:
    """What a router node of 3 + 8 runs, file by file (its units, env files, the router's pool): a
    safety net on top of the typed command line above (snapshots are regenerated on purpose, the
    typed lists are not)."""
    from syrupy.extensions.json import JSONSnapshotExtension

    cfg = load_config({"config": str(ROOT / "examples" / "production-3p8d.yaml")})
    (router,) = [r for r in render_cluster(cfg) if r.node.name == "decode-0"]
    files = {path: text for path, (text, _) in sorted(router.files.items()) if not path.startswith("/opt/gptoss/bin/")}
    assert "/etc/gptoss/router-pool" not in files and "/etc/systemd/system/gptoss-proxy.service" in files
    assert files == snapshot(extension_class=JSONSnapshotExtension)


def test_routers_run_on_the_first_max_routers_decode_nodes_so_the_control_plane_stays_bounded(synth_variant: Any) -> None:
    """Every router checks every server each second and its node reads EC2 and SSM each members poll:
    with a router on every decode node that grows with the square of the fleet (200 decode: 200 x 1,400
    servers = 280,000 checks/s; 1,000 routers reading EC2 every 30 s: 33 calls/s). Routers run on the
    first serving.proxy.router.max_routers (8) decode nodes; plan prints the load."""
    from cluster_ops.plan_view import control_plane

    # (fleet, routers, servers, checks/s, EC2 DescribeInstances/s), typed: 16 replicas a prefill node, 6 prefill replicas a decode server.
    for ctx, routers, servers, checks, ec2 in (
        ({"config": str(ROOT / "examples" / "production-3p8d.yaml")}, 8, 3 * 16 + 8, 448, 8 / 30),
        ({"decode_instances": 200}, 8, 200 * 6 + 200, 11_200, 8 / 30),
        ({"decode_instances": 200, "serving.proxy.router.max_routers": 3}, 3, 1_400, 4_200, 3 / 30),
        ({"decode_instances": 4}, 4, 4 * 6 + 4, 112, 4 / 30),
    ):
        c = control_plane(load_config(ctx))
        assert (c["routers"], c["servers"], c["health_checks_per_s"], c["health_checks_per_server_per_s"]) == (routers, servers, checks, routers), ctx
        assert c["ec2_describe_instances_per_s"] == pytest.approx(ec2) and c["ssm_get_parameter_per_s"] == pytest.approx(ec2), ctx
    huge = load_config({"decode_instances": 8}).model_copy(update={"decode_instances": 1000})
    assert control_plane(huge)["routers"] == 8 and control_plane(huge)["ec2_describe_instances_per_s"] == pytest.approx(8 / 30)
    toy = control_plane(load_config({}))
    assert (toy["routers"], toy["health_checks_per_s"], toy["ec2_describe_instances_per_s"]) == (0, 0, pytest.approx(1 / 30))
    # The load balancer's targets and the routers' rights follow: 3 of 8 decode nodes.
    t = synth_variant(decode_instances="8", **{"serving.proxy.router.max_routers": "3"})
    groups = {lid: g for lid, g in of_type_all(t, "AWS::AutoScaling::AutoScalingGroup").items()}
    targeted = sorted(lid[:7] for lid, g in groups.items() if g["Properties"].get("TargetGroupARNs"))
    assert targeted == ["Decode0", "Decode1", "Decode2"], targeted
    roles = {lid: json.dumps(r) for lid, r in of_type_all(t, "AWS::IAM::Role").items() if lid.startswith("Decode")}
    readers = sorted(lid[:7] for lid, r in roles.items() if "ssm:GetParameter" in r)
    assert readers == ["Decode0", "Decode1", "Decode2"], readers
    plan = subprocess.run([str(ROOT / ".venv" / "bin" / "gptoss"), "plan", "-c", "decode_instances=200"], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "  proxy: vLLM router 0.1.17 on decode-0..7\n" in plan.stdout
    assert "  control plane: 8 routers check 1,400 servers: 11,200 checks/s (8/s a server)\n" in plan.stdout
    assert "    AWS calls/s: members EC2 0.27 + SSM 0.27 (8 nodes), metrics 4.58\n" in plan.stdout


def of_type_all(t: dict[str, Any], kind: str) -> dict[str, Any]:
    from tests.stacks.template import of_type

    return dict(of_type(t, kind))
