"""One rule for a node's name, its group's name, its host variable and the node's paths: the Python
definitions (clusterspec/names.py, node_render/paths.py) and what the node scripts do with the
names and paths the stack renders for them. Each parity test runs the script's own expression
(read from the script, so an edit of either side that makes them differ fails here)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import sys
from typing import Any

import pytest

from clusterspec.loading import load_config
from clusterspec.names import decode_node, holder_name, host_var, node_name, node_order, parse_node_name
from node_render import haproxy, paths
from node_render.command_lines import router_fleet
from tests.conftest import ROOT

BIN = ROOT / "userdata" / "bin"
PRODUCTION = {"config": str(ROOT / "examples" / "production-3p8d.yaml")}
# The largest fleet the spec takes in one role: two-digit indices are where a rule that only
# looks at the last character, or sorts as text, goes wrong.
LARGE = {"decode_instances": "56", "serving.proxy.kind": "vllm-router"}


def _names(context: dict[str, str]) -> list[str]:
    return [n.name for n in load_config(context).layout.nodes]


def test_the_layout_names_nodes_by_role_and_index() -> None:
    names = _names(PRODUCTION)
    assert names == ["prefill-0", "prefill-1", "prefill-2", *(f"decode-{d}" for d in range(8))]
    assert node_name("prefill", 2) == "prefill-2" and decode_node(11) == "decode-11"
    assert parse_node_name("decode-11") == ("decode", 11) and parse_node_name("prefill-0") == ("prefill", 0)
    assert parse_node_name("server-0") == ("server", 0)
    for bad in ("decode-", "decode-01", "router-1", "decode-1-2", "Decode-1", "decode--1"):
        assert parse_node_name(bad) is None, bad
    assert sorted(["decode-10", "decode-2", "prefill-1"], key=node_order) == ["decode-2", "decode-10", "prefill-1"]
    assert host_var("decode-12") == "GPTOSS_HOST_DECODE_12" and holder_name("gptoss-prod", "decode-12") == "gptoss-prod-decode-12"
    cfg = load_config(LARGE)
    for node in cfg.layout.nodes:
        assert parse_node_name(node.name) == (node.role, node.index), node


def _node_module(script: str) -> Any:
    """A node script loaded as a module, from the scripts' folder (where the modules it imports are), without running it."""
    name = f"node_{script.removesuffix('.py').replace('-', '_')}"
    sys.path.insert(0, str(BIN))
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # nothing written into the scripts' folder
    try:
        loader = importlib.machinery.SourceFileLoader(name, str(BIN / script))
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))  # type: ignore[arg-type]
        sys.modules[name] = module  # a dataclass looks up its module
        loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BIN))
        sys.dont_write_bytecode = bytecode


@pytest.mark.parametrize("context", [PRODUCTION, LARGE], ids=["3+8", "56 decode"])
def test_the_node_scripts_apply_the_same_naming_rules(context: dict[str, str]) -> None:
    cfg = load_config(context)
    names = [n.name for n in cfg.layout.nodes]
    members = _node_module("gptoss-members")
    # The host variable of a member (gptoss-members' env form, what a toy proxy's unit reads).
    assert [members.host_var(n) for n in names] == [host_var(n) for n in names]
    # A group's name, less the cluster's prefix, is the node's (gptoss-members reads EC2's groups); another
    # cluster's group, or a name of no node's form, is no member.
    assert [members.node_of_group(holder_name(cfg.cluster_name, n), cfg.cluster_name) for n in names] == names
    assert members.node_of_group(holder_name("other", names[0]), cfg.cluster_name) is None
    assert members.node_of_group(f"{cfg.cluster_name}-decode-01", cfg.cluster_name) is None
    # A node's index (the roll's order: the next router waits for its predecessor).
    assert [members.node_index(n) for n in names] == [parse_node_name(n)[1] for n in names]  # type: ignore[index]
    # The router fleet document's pool, expanded to names by the node's one reader of it (gptoss_fleet.py).
    if cfg.proxy_kind == "vllm-router":
        proxy = next(p for p in cfg.layout.proxies if p.kind == "vllm-router")
        reader = _node_module("gptoss_fleet.py")
        fleet = reader.parse(router_fleet(cfg, proxy), "the document")
        servers = sorted({r.node for r in proxy.replicas} | {decode_node(d) for d in proxy.decode_servers}, key=node_order)
        assert sorted(fleet.members(), key=node_order) == servers
        # Its restart gap is the document's, and the reader's default for a document without one is the spec's.
        p = cfg.serving.proxy
        assert fleet.restart_gap_s == p.gate.lame_duck_s + p.router.request_timeout_s + p.router.restart_gap_s
        d = load_config({}).serving.proxy
        assert d.gate.lame_duck_s + d.router.request_timeout_s + d.router.restart_gap_s == reader.DEFAULT_RESTART_GAP_S


# Every node path a script names must be one of the Python definitions (a directory the renderer
# writes into, or one of its files): a script that says /etc/gptoss/healthz fails here.
NODE_PATH = re.compile(r"/(?:etc|run|var/lib|opt)/gptoss[A-Za-z0-9_./@-]*")
DEFINED = {
    paths.ETC, paths.RUN_DIR, paths.STATE_DIR, paths.BIN, paths.ROUTER_VENV_ROOT, paths.EXAMPLES_DIR,
    paths.CLUSTER_ENV, paths.DEPLOY_ENV, paths.SIGNAL_ENV, paths.MANIFEST, paths.UNITS_FILE, paths.HEALTH_FILE,
    paths.TELEMETRY_CONFIG, paths.ROUTER_FLEET, paths.MEMBERS_ENV, paths.NIXL_ENV, paths.BUNDLE, paths.RESTARTS_FILE,
    paths.SOFTWARE_DIR, paths.SOFTWARE_VERSION, paths.DRAIN_ENV, paths.SERVERS_DRAINING, paths.ROUTER_ENV, paths.HAPROXY_PACKAGES_DIR, paths.HAPROXY_ENV,
    haproxy.API_CONFIG, haproxy.API_MAP, haproxy.API_SOCKET, haproxy.KEYS_MAP, haproxy.KEY_RATE_MAP, haproxy.KEY_CONCURRENCY_MAP,
    haproxy.KEYS_STATE, haproxy.NODE_KEY, haproxy.NODE_KEY_ENV,
}  # fmt: skip


def test_every_node_path_a_script_names_is_the_one_python_defines() -> None:
    found: dict[str, set[str]] = {}
    for script in sorted(BIN.iterdir()):
        for path in NODE_PATH.findall(script.read_text()):
            found.setdefault(path.rstrip("/."), set()).add(script.name)
    assert len(found) >= 10, "the scan found the scripts' paths"
    assert {p: sorted(s) for p, s in found.items() if p not in DEFINED} == {}
    # A default a script falls back to (${GPTOSS_X:-/path}) is the path the renderer writes.
    defaults = {
        ("gptoss-fetch-scripts", "GPTOSS_DEPLOY_ENV"): paths.DEPLOY_ENV,
        ("gptoss-env", "GPTOSS_CLUSTER_ENV"): paths.CLUSTER_ENV,
        ("gptoss-health-watch", "GPTOSS_HEALTH_FILE"): paths.HEALTH_FILE,
        ("gptoss-telemetry", "GPTOSS_TELEMETRY_CONFIG"): paths.TELEMETRY_CONFIG,
        ("gptoss-status", "GPTOSS_HEALTH_FILE"): paths.HEALTH_FILE,
        ("gptoss-drain", "GPTOSS_DRAIN_ENV"): paths.DRAIN_ENV,
        ("gptoss-drain", "GPTOSS_DRAIN_FILE"): paths.SERVERS_DRAINING,
        ("gptoss-apply", "GPTOSS_TELEMETRY_CONFIG"): paths.TELEMETRY_CONFIG,
        ("gptoss-keys", "GPTOSS_KEYS_MAP"): haproxy.KEYS_MAP,
        ("gptoss-keys", "GPTOSS_KEY_RATE_MAP"): haproxy.KEY_RATE_MAP,
        ("gptoss-keys", "GPTOSS_KEY_CONCURRENCY_MAP"): haproxy.KEY_CONCURRENCY_MAP,
        ("gptoss-keys", "GPTOSS_KEYS_STATE"): haproxy.KEYS_STATE,
        ("gptoss-api", "GPTOSS_KEYS_MAP"): haproxy.KEYS_MAP,
        ("gptoss-api", "GPTOSS_KEY_RATE_MAP"): haproxy.KEY_RATE_MAP,
        ("gptoss-api", "GPTOSS_KEY_CONCURRENCY_MAP"): haproxy.KEY_CONCURRENCY_MAP,
        ("gptoss-api", "GPTOSS_NODE_KEY"): haproxy.NODE_KEY,
        ("gptoss-api", "GPTOSS_NODE_KEY_ENV"): haproxy.NODE_KEY_ENV,
        ("gptoss-keys", "GPTOSS_NODE_KEY"): haproxy.NODE_KEY,
        ("gptoss-signal", "GPTOSS_NODE_KEY"): haproxy.NODE_KEY,
    }
    for (script, var), want in defaults.items():
        text = (BIN / script).read_text()
        said = re.findall(rf'{var}(?:=|:-|", ")"?(/[^"}}\s)]+)', text)
        assert said and set(said) == {want}, (script, var, said)


def test_the_parity_scan_fails_on_a_path_python_does_not_define() -> None:
    """The scan itself can fail: a path no definition holds is reported with its script."""
    text = 'health=${GPTOSS_HEALTH_FILE:-/etc/gptoss/healthz}\n'
    assert [p for p in NODE_PATH.findall(text) if p not in DEFINED] == ["/etc/gptoss/healthz"]
