"""Render each node's units and files from the config and the layout.

What every server runs comes from commands.py, the scripts as shipped from node_scripts.py.
userdata.py packages what is rendered here (the bundle, the user data, the scripts asset); the
dependency goes that one way. `gptoss plan` prints the services rendered here, the stack
packages the files, and the tests compare the two.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import PurePosixPath

from clusterspec.config import ClusterConfig
from clusterspec.layout import Layout, Node
from clusterspec.names import decode_node, host_var
from clusterspec.sections.boot import SIGNAL_MARGIN_S
from node_render import telemetry
from node_render.command_lines import (
    bench_argv,
    decode_env,
    drain_env,
    drains,
    endpoint_port,
    health_url,
    model_dir,
    model_name,
    prefill_env,
    replica_env,
    schedule_path,
    server_env,
    vllm_argv,
)
from node_render.haproxy import API_SOCKET, NODE_KEY_ENV, NODE_KEY_PLACEHOLDER
from node_render.node_files import NodeRender, Service, exec_line, served, unit_file, unit_limits
from node_render.node_health import health_file
from node_render.node_scripts import NODE_SCRIPTS, shipped_scripts
from node_render.paths import (
    BIN,
    CLUSTER_ENV,
    DEPLOY_ENV,
    DRAIN_ENV,
    ETC,
    EXAMPLES_DIR,
    HEALTH_FILE,
    MANIFEST,
    MEMBERS_DOMAIN,
    NIXL_ENV,
    NODE_TARGET,
    RESTARTS_FILE,
    TELEMETRY_CONFIG,
    UNIT_DIR,
    UNITS_FILE,
    router_parameter,
)
from node_render.proxies import render_proxy, render_router
from node_render.quoting import Expand, env_file, expand


def cluster_env(cfg: ClusterConfig, node: Node) -> dict[str, str]:
    """Settings of the staging scripts and wrappers on one node (no secrets: an ARN at most)."""
    s = cfg.serving
    megakernel = s.disaggregated and s.decode.megakernel
    return {
        "AWS_REGION": cfg.region,
        "GPTOSS_CLUSTER": cfg.cluster_name,
        "GPTOSS_NODE": node.name,
        "GPTOSS_SELF_HOST_VAR": host_var(node.name),
        "GPTOSS_NVME_MOUNT": cfg.nvme_mount,
        "GPTOSS_MODEL_DIR": model_dir(cfg),
        "GPTOSS_MODEL_SOURCE": cfg.model.source,
        "GPTOSS_MODEL_ID": s.model_id,
        "GPTOSS_MODEL_S3_URI": cfg.model.s3_uri or "",
        "GPTOSS_MODEL_REVISION": cfg.model.revision or "",
        "GPTOSS_MODEL_SHARDS": str(cfg.model.expected_shards),
        "GPTOSS_HF_TOKEN_SECRET_ARN": cfg.model.hf_token_secret_arn or "",
        "GPTOSS_EXAMPLES_DIR": EXAMPLES_DIR,
        "GPTOSS_EXAMPLES_REPO": cfg.examples.repo_url,
        "GPTOSS_EXAMPLES_REF": cfg.examples.ref,
        "GPTOSS_EXAMPLES_COMMIT": cfg.examples.pinned_commit or "",
        "GPTOSS_EXAMPLES_S3_URI": cfg.examples.s3_uri or "",
        # The examples' files this recipe runs (none for a single-instance recipe: nothing is fetched).
        # Only where the toy proxy runs: vLLM's router is not one of the examples' files.
        "GPTOSS_PROXY_SCRIPT": s.proxy.script if cfg.proxy_kind == "toy" else "",
        "GPTOSS_SCHEDULE_SUBDIR": s.examples_dir if megakernel else "",
        "GPTOSS_SCHEDULE_HELPER": s.schedule_helper if megakernel else "",
        "GPTOSS_SCHEDULE_FILE": s.decode.schedule_file or "" if megakernel else "",
        "MEGAKERNEL_SCHEDULE_DIR": str(PurePosixPath(schedule_path(cfg)).parent),
        "MEGAKERNEL_SCOPE": s.decode.megakernel_scope,
        "GPTOSS_CACHE_DIR": f"{cfg.nvme_mount}/cache",
        "GPTOSS_VENV_GLOB": cfg.venv_glob,
        "GPTOSS_INSTANCE_TYPE": cfg.instance_type,
        "GPTOSS_RESULTS_DIR": cfg.results_dir,
        "GPTOSS_LOG_DIR": f"{cfg.results_dir}/logs",
        "GPTOSS_RESULTS_S3_URI": cfg.results_s3_uri or "",
        "GPTOSS_BENCH_RESULT_FILE": s.bench.result_file,
        # The node check (instance table) and the deploy gate.
        "GPTOSS_EXPECT_NEURON": str(cfg.hardware.neuron_devices),
        "GPTOSS_EXPECT_EFA": str(cfg.hardware.efa_interfaces if s.disaggregated else 0),
        "GPTOSS_EGRESS": cfg.network.egress,
        # The NIXL a DI node installs when its image lacks that version (pip lines joined by ';').
        "GPTOSS_NIXL_VERSION": (cfg.nixl.version or "") if s.disaggregated else "",
        "GPTOSS_NIXL_REQUIREMENTS": ";".join(cfg.nixl.requirements) if s.disaggregated else "",
        "GPTOSS_READY_TIMEOUT_S": str(cfg.gate_timeout_s),
        "GPTOSS_SIGNAL_MARGIN_S": str(SIGNAL_MARGIN_S),
        "GPTOSS_STAGE_ATTEMPTS": str(cfg.boot.stage_attempts),
        # How long a server waits for this boot's staging before it fails by name.
        "GPTOSS_STAGE_WAIT_S": str(cfg.boot.budget_s(cfg.stage_timeout_s)),
        "GPTOSS_COMPLETION_URL": completion_url(cfg, node),
        # A node that cannot serve marks its own instance unhealthy (gptoss-health-watch).
        "GPTOSS_UNHEALTHY_BACKOFF_S": str(cfg.healing.backoff_s),
        "GPTOSS_UNHEALTHY_NEURON_ERRORS": str(cfg.healing.neuron_errors),
    } | _members_env(cfg, node)


def members_needed(cfg: ClusterConfig, node: Node) -> list[str]:
    """The nodes whose addresses this node's proxy or router needs (none elsewhere)."""
    proxies = cfg.layout.proxies_on(node.name)
    return sorted({rep.node for p in proxies for rep in p.replicas} | {decode_node(d) for p in proxies for d in p.decode_servers})


def _members_env(cfg: ClusterConfig, node: Node) -> dict[str, str]:
    """What the members step of a node with a proxy or router needs, and a router's install (nothing elsewhere)."""
    proxies = cfg.layout.proxies_on(node.name)
    if not proxies:
        return {}
    routed = any(p.kind == "vllm-router" for p in proxies)
    env = {
        # A router's members and settings: the fleet's SSM parameter (router_fleet), read at run time; the toy's are here.
        "GPTOSS_MEMBERS_NEED": "" if routed else " ".join(members_needed(cfg, node)),
        "GPTOSS_MEMBERS_DOMAIN": MEMBERS_DOMAIN,
        # A router follows names in /etc/hosts; the toy proxy takes addresses and restarts when one changes.
        "GPTOSS_MEMBERS_FORM": "hosts" if routed else "env",
        "GPTOSS_ROUTER_PARAMETER": router_parameter(cfg.cluster_name) if routed else "",
        "GPTOSS_MEMBERS_RESTART": "" if routed else "gptoss-proxy.service gptoss-group-health.service",
    }
    if routed:
        env |= {"GPTOSS_API_PORT": str(cfg.serving.proxy.port)}
    return env


# ---- units -------------------------------------------------------------------------------


def completion_url(cfg: ClusterConfig, node: Node) -> str:
    """Where the deploy gate sends its test completion: the node's proxy or single server ('' elsewhere)."""
    serves = node.role == "server" or bool(cfg.layout.proxies_on(node.name))
    return f"http://127.0.0.1:{endpoint_port(cfg)}/v1/completions" if serves else ""


def _render_server(cfg: ClusterConfig, out: NodeRender, bin_dir: str, *, role: str) -> None:
    """The decode server of a DI recipe, or the one server of a single-instance recipe."""
    s = cfg.serving
    name = "decode" if role == "decode" else "server"
    env = decode_env(cfg) | drain_env(cfg, role, bin_dir) if role == "decode" else server_env(cfg)
    port = s.decode.http_port if role == "decode" else s.server.port
    out.files[f"{ETC}/{name}.env"] = (env_file(env), 0o644)
    schedule = role == "decode" and s.decode.megakernel
    argv = [f"{bin_dir}/gptoss-exec", name, *([f"{bin_dir}/gptoss-prepare-schedule", "--"] if schedule else []),
            *vllm_argv(cfg, role, port=str(port))]  # fmt: skip
    description = (
        f"{model_name(cfg)} decode server (kv_consumer{', megakernel' if schedule else ''})" if role == "decode" else f"{model_name(cfg)} server"
    )
    unit = f"gptoss-{name}.service"
    out.files[f"{UNIT_DIR}/{unit}"] = unit_file(
        "gptoss-server.service",
        bin=bin_dir,
        description=description,
        port=port,
        env_files=[f"{ETC}/{name}.env"],
        exec_start=exec_line(argv),
        **unit_limits(cfg),
    )
    out.services.append(Service(unit, env, served(argv), waits=("staging", "megakernel schedule") if schedule else ("staging",)))
    out.units.append(unit)
    out.wants.append(unit)


def _render_prefill(cfg: ClusterConfig, node: Node, out: NodeRender, bin_dir: str) -> None:
    """One template unit; each replica differs only by its env file (cores, ports, config)."""
    s = cfg.serving
    penv = prefill_env(cfg) | drain_env(cfg, "prefill", bin_dir)
    out.files[f"{ETC}/prefill.env"] = (env_file(penv), 0o644)
    first = node.replicas[0]
    gate = [
        f"{bin_dir}/gptoss-prefill-gate",
        Expand("%i"),
        str(s.engine_ready_timeout_s),
        first.unit,
        *(health_url("127.0.0.1", r.http_port, s.server_health_path) for r in node.replicas),
        "--",
    ]
    template_argv = [
        f"{bin_dir}/gptoss-exec",
        Expand("prefill_%i"),
        *gate,
        *vllm_argv(cfg, "prefill", port=Expand("${GPTOSS_HTTP_PORT}"), additional_config=Expand("${GPTOSS_ADDITIONAL_CONFIG}")),
    ]
    # Behind the router, a replica's KV handshake address is this node's private IP (the router
    # hands the prefill's answer to decode unchanged; the toy proxy rewrites it to the host it used).
    routed = cfg.proxy_kind == "vllm-router"
    out.files[f"{UNIT_DIR}/gptoss-prefill@.service"] = unit_file(
        "gptoss-prefill@.service",
        bin=bin_dir,
        env_files=[f"{ETC}/prefill.env", f"{ETC}/prefill@%i.env", *([NIXL_ENV] if routed else [])],
        needs_identity=routed,
        exec_start=exec_line(template_argv),
        **unit_limits(cfg),
    )
    for r in node.replicas:
        renv = replica_env(cfg, r)
        out.files[f"{ETC}/prefill@{r.index}.env"] = (env_file(renv), 0o644)
        full = penv | renv | ({"VLLM_NIXL_SIDE_CHANNEL_HOST": f"<{node.name}>"} if routed else {})
        waits = ("staging",) if r.index == 0 else ("staging", "the node's first replica answers")
        out.services.append(Service(r.unit, full, [expand(a, full, str(r.index)) for a in served(template_argv)], waits=waits))
        out.units.append(r.unit)
    out.files[f"{UNIT_DIR}/gptoss-prefill.target"] = unit_file(
        "gptoss-prefill.target", replicas=[r.unit for r in node.replicas]
    )
    out.units.append("gptoss-prefill.target")
    out.wants.append("gptoss-prefill.target")


def _render_bench(cfg: ClusterConfig, out: NodeRender, bin_dir: str) -> None:
    """The reference's two benchmark legs as one oneshot unit that never starts by itself."""
    s = cfg.serving
    b = s.bench
    bench_env = {"NETRC": b.netrc}
    out.files[f"{ETC}/bench.env"] = (env_file(bench_env), 0o644)
    legs = [("warmup", b.warmup_prompts, b.warmup_result_file), ("measured", b.measured_prompts, b.result_file)]
    lines = [[f"{bin_dir}/gptoss-exec", "bench", *bench_argv(cfg, n, f)] for _, n, f in legs]
    route = cfg.proxy_health_path
    out.files[f"{UNIT_DIR}/gptoss-bench.service"] = unit_file(
        "gptoss-bench.service",
        bin=bin_dir,
        description=f"{model_name(cfg)} {s.shape.input_len // 1024}K/{s.shape.output_len // 1024}K benchmark "
        + ("through the proxy" if s.disaggregated else "against the server"),
        endpoint_unit="gptoss-proxy.service" if s.disaggregated else "gptoss-server.service",
        # Behind a gate that takes only keys, the benchmark sends the node's own (OPENAI_API_KEY, which vllm bench sends as Bearer).
        env_files=[f"{ETC}/bench.env", *([f"-{NODE_KEY_ENV}"] if cfg.endpoint_auth == "keys" else [])],
        wait=exec_line([f"{bin_dir}/gptoss-wait-healthy", "60", health_url("127.0.0.1", endpoint_port(cfg), route)]),
        exec_start=[exec_line(line) for line in lines],
    )
    # The plan names the node's own key (made at boot, never known before) where the gate takes only keys.
    planned = bench_env | ({"OPENAI_API_KEY": NODE_KEY_PLACEHOLDER} if cfg.endpoint_auth == "keys" else {})
    for (step, _, _), line in zip(legs, lines, strict=True):
        out.services.append(Service("gptoss-bench.service", planned, line[2:], step=step))


def _render_drain(cfg: ClusterConfig, node: Node, out: NodeRender) -> None:
    """DRAIN_ENV, for gptoss-drain on a server node behind vLLM's router: its servers' units and metrics
    (what each holds), how long the routers' health checks take to see a 503 (interval x failures in a row
    + one check's timeout + a second), and how long what a server holds may still take (the request timeout)."""
    if not drains(cfg, node.role):
        return
    r = cfg.serving.proxy.router
    ports = {"gptoss-decode.service": str(cfg.serving.decode.http_port)}
    servers = [(svc.unit, port) for svc in out.services if (port := svc.environment.get("GPTOSS_HTTP_PORT") or ports.get(svc.unit))]
    env = {
        "GPTOSS_DRAIN_UNITS": " ".join(unit for unit, _ in servers),
        "GPTOSS_DRAIN_METRICS": " ".join(health_url("127.0.0.1", int(port), "/metrics") for _, port in servers),
        "GPTOSS_DRAIN_HOLD_S": str(r.health_check_interval_s * r.health_failure_threshold + r.health_check_timeout_s + 1),
        "GPTOSS_DRAIN_TIMEOUT_S": str(r.request_timeout_s),
    }
    out.files[DRAIN_ENV] = (env_file(env), 0o644)


def _render_telemetry(cfg: ClusterConfig, node: Node, out: NodeRender, bin_dir: str) -> None:
    """The collector: every server's metrics and health, the node's unit states and journal."""
    servers = []
    for svc in out.services:
        port = {"gptoss-decode.service": cfg.serving.decode.http_port, "gptoss-server.service": cfg.serving.server.port}.get(
            svc.unit
        )
        if svc.unit.startswith("gptoss-prefill@"):
            port = int(svc.environment["GPTOSS_HTTP_PORT"])
        if port is None:
            continue
        name = f"{node.name}/{svc.unit.removeprefix('gptoss-').removesuffix('.service')}"
        servers.append({"name": name, "unit": svc.unit, "health_url": health_url("127.0.0.1", port, cfg.serving.server_health_path),
                        "metrics_url": health_url("127.0.0.1", port, "/metrics")})  # fmt: skip
    # And the services the node's timers run (their logs say what the members were, why a node asked to be replaced).
    units = [u for u in out.units if u.endswith(".service")] + [u.replace(".timer", ".service") for u in out.units if u.endswith(".timer")]
    units.append("gptoss-telemetry.service")
    routed = any(p.kind == "vllm-router" for p in cfg.layout.proxies_on(node.name))
    router_url = health_url("127.0.0.1", cfg.serving.proxy.router.metrics_port, "/metrics") if routed else None
    out.files[TELEMETRY_CONFIG] = (telemetry.node_config(cfg, node, servers, units, router_url, API_SOCKET if routed else None), 0o644)
    out.files[f"{UNIT_DIR}/gptoss-telemetry.service"] = unit_file(
        "gptoss-telemetry.service", bin=bin_dir, log_group=telemetry.log_group(cfg), namespace=telemetry.namespace(cfg)
    )
    out.units.append("gptoss-telemetry.service")
    out.wants.append("gptoss-telemetry.service")


def render_node(cfg: ClusterConfig, layout: Layout, node: Node, *, bin_dir: str = BIN) -> NodeRender:
    """Render the services and files of one node."""
    out = NodeRender(node=node, instance_type=cfg.instance_type, services=[])
    out.files[CLUSTER_ENV] = (env_file(cluster_env(cfg, node)), 0o644)
    base = {
        "bin": bin_dir,
        "nvme_mount": cfg.nvme_mount,
        "stage_timeout_s": cfg.stage_timeout_s,
        "boot": cfg.boot,
        "caps": cfg.boot.unit_caps_s,
        "deploy_env": DEPLOY_ENV,
        "efa": cfg.serving.disaggregated,
    }
    for name in (
        "gptoss-scripts.service",
        "gptoss-nvme.service",
        "gptoss-identity.service",
        "gptoss-node-check.service",
        "gptoss-stage.service",
    ):
        out.files[f"{UNIT_DIR}/{name}"] = unit_file(name, **base, **unit_limits(cfg))
        out.units.append(name)
        out.wants.append(name)
    if node.role == "prefill":
        _render_prefill(cfg, node, out, bin_dir)
    else:
        _render_server(cfg, out, bin_dir, role=node.role)
    for proxy in layout.proxies_on(node.name):
        if proxy.kind == "vllm-router":
            render_router(cfg, node, proxy, out, bin_dir)
        else:
            render_proxy(cfg, node, proxy, out, bin_dir)
    if layout.proxies_on(node.name) or node.role == "server":
        _render_bench(cfg, out, bin_dir)
    if cfg.wait_for_ready:
        out.files[f"{UNIT_DIR}/gptoss-signal.service"] = unit_file("gptoss-signal.service", bin=bin_dir)
        out.units.append("gptoss-signal.service")
        out.wants.append("gptoss-signal.service")
    if cfg.compile_cache_enabled:
        # Once the servers answer, the compiled graphs go to this identity's own area of the cache.
        out.files[f"{UNIT_DIR}/gptoss-cache-save.service"] = unit_file("gptoss-cache-save.service", bin=bin_dir)
        out.units.append("gptoss-cache-save.service")
        out.wants.append("gptoss-cache-save.service")
    if cfg.healing.report_unhealthy:
        out.files[f"{UNIT_DIR}/gptoss-health-watch.service"] = unit_file("gptoss-health-watch.service", bin=bin_dir, h=cfg.healing)
        out.files[f"{UNIT_DIR}/gptoss-health-watch.timer"] = unit_file("gptoss-health-watch.timer", interval_s=cfg.healing.watch_interval_s)
        out.units.append("gptoss-health-watch.timer")
        out.wants.append("gptoss-health-watch.timer")
    if cfg.observability.enabled:
        _render_telemetry(cfg, node, out, bin_dir)
    _render_drain(cfg, node, out)
    out.files[f"{UNIT_DIR}/{NODE_TARGET}"] = unit_file(NODE_TARGET, node=node.name, wants=out.wants)
    out.files[HEALTH_FILE] = (health_file(cfg, out), 0o644)
    out.scripts = _needed_scripts(out.files | out.shared, save_cache=cfg.compile_cache_enabled, in_place=cfg.rollout.software == "in-place")
    scripts = shipped_scripts()
    for name in sorted(out.scripts & NODE_SCRIPTS):
        out.files[f"{bin_dir}/{name}"] = (scripts[name], 0o755)
    out.files[UNITS_FILE] = ("\n".join(out.units) + "\n", 0o644)
    out.files[RESTARTS_FILE] = (restarts_file(out, bin_dir), 0o644)
    shipped = {*out.files, *out.shared, MANIFEST, *(f"{bin_dir}/{n}" for n in out.scripts)}
    out.files[MANIFEST] = ("\n".join(sorted(shipped)) + "\n", 0o644)
    return out


def _names(script: str, text: str) -> bool:
    """Whether TEXT names a shipped script: by its file name, or a module (X.py) by its import name (`import X`,
    `from X import`, `X.Class` as vLLM's --middleware takes it)."""
    return script in text or (script.endswith(".py") and re.search(rf"\b{re.escape(script[:-3])}\b", text) is not None)


@functools.cache
def _script_references() -> dict[str, frozenset[str]]:
    """For each shipped script, the scripts its text names (once per process, not once per node)."""
    scripts = shipped_scripts()
    return {n: frozenset(m for m in scripts if _names(m, text)) for n, text in scripts.items()}


# Never restarted by a software change: the unit that installs the software (its files are the boot's),
# the deploy gate's verdict (once per instance: an in-place change is judged by gptoss-apply itself) and
# the compile cache's save (once per instance, after it first served). A new version of theirs runs at
# the instance's next boot.
NOT_RESTARTED = frozenset({"gptoss-scripts.service", "gptoss-signal.service", "gptoss-cache-save.service"})


def restarts_file(out: NodeRender, bin_dir: str = BIN) -> str:
    """RESTARTS_FILE: one line per unit the node starts (a target, a timer's service aside), the unit
    then every file of the node it runs with: its unit file, the scripts its lines name and the scripts
    those name, and every file of the node that any of these texts names (its environment files, the
    cluster's settings, the health list). A change of one of them restarts the unit in place."""
    scripts = shipped_scripts()
    refs = _script_references()
    paths = [p for p in out.files if not p.startswith(f"{bin_dir}/")]
    lines = []
    for unit in out.units:
        if unit in NOT_RESTARTED or not unit.endswith(".service"):
            continue
        template, _, instance = unit.partition("@")
        unit_path = f"{UNIT_DIR}/{template}@.service" if instance else f"{UNIT_DIR}/{unit}"
        text = out.files[unit_path][0].replace("%i", instance.removesuffix(".service"))
        named = {n for n in scripts if _names(n, text)}
        while True:
            more = named.union(*(refs[n] for n in named))
            if more == named:
                break
            named = more
        texts = [text, *(scripts[n] for n in named)]
        files = {unit_path, *(f"{bin_dir}/{n}" for n in named)} | {p for p in paths if any(p in t for t in texts)}
        lines.append(" ".join([unit, *sorted(files)]))
    return "\n".join(lines) + "\n"


def _needed_scripts(files: dict[str, tuple[str, int]], *, save_cache: bool, in_place: bool = False) -> set[str]:
    """The scripts this node's units (and those scripts) name, plus its boot, fetch and status (and the
    in-place change's own, gptoss-apply, which State Manager runs)."""
    wanted = set(NODE_SCRIPTS) | ({"gptoss-save-cache"} if save_cache else set()) | ({"gptoss-apply"} if in_place else set())
    # One search per script name over all of the node's files (a NUL cannot be part of a name).
    text = "\0".join(t for t, _ in files.values())
    found = {name for name in shipped_scripts() if _names(name, text)} | wanted
    refs = _script_references()
    while found != wanted:
        wanted = found
        found = wanted.union(*(refs[n] for n in wanted))
    return wanted


def render_cluster(cfg: ClusterConfig) -> list[NodeRender]:
    """Render every node of the fleet."""
    layout = cfg.layout
    return [render_node(cfg, layout, n) for n in layout.nodes]


def plan_json(renders: list[NodeRender]) -> str:
    """The `plan --json` document."""
    return json.dumps({"nodes": [r.as_json() for r in renders]}, indent=2)
