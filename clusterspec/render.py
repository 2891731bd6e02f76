"""Render each node's units and files from the config and the layout.

What every server runs comes from commands.py, the scripts as shipped from node_scripts.py.
userdata.py packages what is rendered here (the bundle, the user data, the scripts asset); the
dependency goes that one way. `gptoss plan` prints the services rendered here, the stack
packages the files, and the tests compare the two.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import jinja2

from clusterspec import telemetry
from clusterspec.commands import (
    ROUTER_ARGS_AT,
    ROUTER_NODE_ARGS,
    bench_argv,
    decode_env,
    endpoint_port,
    health_url,
    host_var,
    model_dir,
    model_name,
    prefill_env,
    proxy_argv,
    replica_env,
    router_argv,
    router_pool,
    router_pool_args,
    schedule_path,
    server_env,
    vllm_argv,
)
from clusterspec.config import ClusterConfig
from clusterspec.haproxy import API_CONFIG, API_SOCKET, api_gate_config, api_gate_unit, open_files
from clusterspec.layout import Layout, Node, ProxyPlacement
from clusterspec.node_health import health_file
from clusterspec.node_scripts import NODE_SCRIPTS, shipped_scripts
from clusterspec.paths import (
    BIN,
    CLUSTER_ENV,
    DEPLOY_ENV,
    ETC,
    EXAMPLES_DIR,
    MANIFEST,
    MEMBERS_DOMAIN,
    MEMBERS_ENV,
    NIXL_ENV,
    NODE_TARGET,
    ROUTER_FLEET,
    UNIT_DIR,
    UNITS_FILE,
    USERDATA_DIR,
    router_parameter,
    router_venv,
)
from clusterspec.quoting import Expand, env_file, expand, systemd_quote
from clusterspec.router_cli import check_router_argv
from clusterspec.sections.boot import BACKOFF_MAX_S, RESTART_SEC, SIGNAL_MARGIN_S
from clusterspec.sections.proxy import REQUEST_TIMEOUT_MAX_S

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(USERDATA_DIR / "units"),
    undefined=jinja2.StrictUndefined,
    # The templates are part of the package: loaded once per process, not checked on disk per unit.
    auto_reload=False,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    # Shell text such as ${#ARR[@]} must never open a Jinja comment.
    comment_start_string="{##",
    comment_end_string="##}",
)


@dataclass(frozen=True)
class Service:
    """One command a unit runs: what `plan` prints for it (the server, after its waits)."""

    unit: str
    environment: dict[str, str]
    argv: list[str]
    step: str | None = None
    waits: tuple[str, ...] = ()

    def as_json(self) -> dict[str, object]:
        """The `plan --json` form of this service."""
        out: dict[str, object] = {"unit": self.unit, "environment": self.environment, "argv": self.argv}
        if self.step:
            out["step"] = self.step
        if self.waits:
            out["waits"] = list(self.waits)
        return out


@dataclass
class NodeRender:
    """Everything one node runs, and the files that make it run it."""

    node: Node
    instance_type: str
    services: list[Service]
    files: dict[str, tuple[str, int]] = field(default_factory=dict)
    units: list[str] = field(default_factory=list)
    wants: list[str] = field(default_factory=list)
    scripts: set[str] = field(default_factory=set)
    # Files the same on every node that has them (the API gate's configuration): shipped in the
    # scripts asset, not in each node's user data (16 KB at most).
    shared: dict[str, tuple[str, int]] = field(default_factory=dict)

    @property
    def servers(self) -> list[Service]:
        """The vLLM servers this node runs (not its proxy, router or benchmark legs)."""
        return [s for s in self.services if s.argv[:2] == ["vllm", "serve"]]

    def as_json(self) -> dict[str, object]:
        """The `plan --json` form of this node."""
        return {
            "name": self.node.name,
            "role": self.node.role,
            "instance_type": self.instance_type,
            "replicas": len(self.node.replicas),
            "idle_cores": self.node.idle_cores,
            "services": [s.as_json() for s in self.services],
        }


def cluster_env(cfg: ClusterConfig, node: Node) -> dict[str, str]:
    """Settings of the staging scripts and wrappers on one node (no secrets: an ARN at most)."""
    s = cfg.serving
    megakernel = s.disaggregated and s.decode.megakernel
    return {
        "AWS_REGION": cfg.region,
        "GPTOSS_CLUSTER": cfg.cluster_name,
        "GPTOSS_NODE": node.name,
        "GPTOSS_SELF_HOST_VAR": host_var(node.name),
        "GPTOSS_UNITS_FILE": f"{ETC}/units",
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
    return sorted({rep.node for p in proxies for rep in p.replicas} | {f"decode-{d}" for p in proxies for d in p.decode_servers})


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
        r = cfg.serving.proxy.router
        env |= {"GPTOSS_ROUTER_WHEEL": r.wheel, "GPTOSS_ROUTER_SHA256": r.sha256, "GPTOSS_API_PORT": str(cfg.serving.proxy.port)}
    return env


# ---- units -------------------------------------------------------------------------------


def _exec(argv: list[str]) -> str:
    return " ".join(systemd_quote(a) for a in argv)


def served(argv: list[str]) -> list[str]:
    """The command a unit's ExecStart finally runs: what follows its waits' last `--`."""
    return argv[len(argv) - argv[::-1].index("--") :] if "--" in argv else argv[2:]


def _limits(cfg: ClusterConfig) -> dict[str, int]:
    return {
        # Start jobs end when the main process runs (Type=exec); only the back-off before a
        # restart takes time in ExecStartPre. The long waits run inside the process.
        "backoff_timeout_s": BACKOFF_MAX_S + 60,
        "restart_sec": RESTART_SEC,
    }


def completion_url(cfg: ClusterConfig, node: Node) -> str:
    """Where the deploy gate sends its test completion: the node's proxy or single server ('' elsewhere)."""
    serves = node.role == "server" or bool(cfg.layout.proxies_on(node.name))
    return f"http://127.0.0.1:{endpoint_port(cfg)}/v1/completions" if serves else ""


def _unit(name: str, **values: object) -> tuple[str, int]:
    """A unit as a node receives it: its comment lines stay in the repository's template (the user
    data is limited to 16 KB per node and the template to 1 MB per stack; they cost ~0.9 KB a node)."""
    text = _ENV.get_template(f"{name}.j2").render(**values)
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#")), 0o644


def _render_server(cfg: ClusterConfig, out: NodeRender, bin_dir: str, *, role: str) -> None:
    """The decode server of a DI recipe, or the one server of a single-instance recipe."""
    s = cfg.serving
    name = "decode" if role == "decode" else "server"
    env = decode_env(cfg) if role == "decode" else server_env(cfg)
    port = s.decode.http_port if role == "decode" else s.server.port
    out.files[f"{ETC}/{name}.env"] = (env_file(env), 0o644)
    schedule = role == "decode" and s.decode.megakernel
    argv = [f"{bin_dir}/gptoss-exec", name, *([f"{bin_dir}/gptoss-prepare-schedule", "--"] if schedule else []),
            *vllm_argv(cfg, role, port=str(port))]  # fmt: skip
    description = (
        f"{model_name(cfg)} decode server (kv_consumer{', megakernel' if schedule else ''})" if role == "decode" else f"{model_name(cfg)} server"
    )
    unit = f"gptoss-{name}.service"
    out.files[f"{UNIT_DIR}/{unit}"] = _unit(
        "gptoss-server.service",
        bin=bin_dir,
        description=description,
        port=port,
        env_files=[f"{ETC}/{name}.env"],
        exec_start=_exec(argv),
        **_limits(cfg),
    )
    out.services.append(Service(unit, env, served(argv), waits=("staging", "megakernel schedule") if schedule else ("staging",)))
    out.units.append(unit)
    out.wants.append(unit)


def _render_prefill(cfg: ClusterConfig, node: Node, out: NodeRender, bin_dir: str) -> None:
    """One template unit; each replica differs only by its env file (cores, ports, config)."""
    s = cfg.serving
    penv = prefill_env(cfg)
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
    out.files[f"{UNIT_DIR}/gptoss-prefill@.service"] = _unit(
        "gptoss-prefill@.service",
        bin=bin_dir,
        env_files=[f"{ETC}/prefill.env", f"{ETC}/prefill@%i.env", *([NIXL_ENV] if routed else [])],
        needs_identity=routed,
        exec_start=_exec(template_argv),
        **_limits(cfg),
    )
    for r in node.replicas:
        renv = replica_env(cfg, r)
        out.files[f"{ETC}/prefill@{r.index}.env"] = (env_file(renv), 0o644)
        full = penv | renv | ({"VLLM_NIXL_SIDE_CHANNEL_HOST": f"<{node.name}>"} if routed else {})
        waits = ("staging",) if r.index == 0 else ("staging", "the node's first replica answers")
        out.services.append(Service(r.unit, full, [expand(a, full, str(r.index)) for a in served(template_argv)], waits=waits))
        out.units.append(r.unit)
    out.files[f"{UNIT_DIR}/gptoss-prefill.target"] = _unit(
        "gptoss-prefill.target", replicas=[r.unit for r in node.replicas]
    )
    out.units.append("gptoss-prefill.target")
    out.wants.append("gptoss-prefill.target")


def _group_urls(cfg: ClusterConfig, proxy: ProxyPlacement) -> list[str]:
    """Health routes of every server a proxy routes to (hosts from deploy.env)."""
    s = cfg.serving
    urls: list[str] = [Expand(health_url(f"${{{host_var(r.node)}}}", r.http_port, s.server_health_path)) for r in proxy.replicas]
    urls.append(Expand(health_url(f"${{{host_var(f'decode-{proxy.decode_server}')}}}", s.decode.http_port, s.server_health_path)))
    return urls


def _render_proxy(cfg: ClusterConfig, node: Node, proxy: ProxyPlacement, out: NodeRender, bin_dir: str) -> None:
    """The proxy of one decode server, started once its replicas and decode server answer."""
    s = cfg.serving
    decode = f"decode-{proxy.decode_server}"
    hosts_env = {host_var(p): f"<{p}>" for p in sorted({r.node for r in proxy.replicas} | {decode})}
    urls = _group_urls(cfg, proxy)
    # The proxy waits for every server, which may first wait for staging and compiles.
    wait_s = cfg.stage_timeout_s + 2 * s.engine_ready_timeout_s
    argv = [f"{bin_dir}/gptoss-exec", "proxy", f"{bin_dir}/gptoss-wait-healthy", str(wait_s), *urls, "--", *proxy_argv(cfg, proxy)]
    # "-": the members file is written by the unit's own ExecStartPre (gptoss-members write), and
    # systemd reads environment files before each state's first process.
    out.files[f"{UNIT_DIR}/gptoss-proxy.service"] = _unit(
        "gptoss-proxy.service",
        bin=bin_dir,
        port=s.proxy.port,
        decode_server=proxy.decode_server,
        env_files=[DEPLOY_ENV, f"-{MEMBERS_ENV}"],
        exec_start=_exec(argv),
        # It holds no state: its own short back-off (serving.proxy.restart_backoff_s), not the servers'.
        backoff_s=s.proxy.restart_backoff_s,
        backoff_max_s=s.proxy.restart_backoff_max_s,
        # A start waits for its back-off, then for the members (gptoss-members: up to 600 s).
        start_timeout_s=s.proxy.restart_backoff_max_s + 660,
        **_limits(cfg),
    )
    out.services.append(
        Service("gptoss-proxy.service", hosts_env, [expand(a, hosts_env) for a in served(argv)], waits=("staging", "the members (EC2)", "every server of its group answers"))
    )
    group = [f"{bin_dir}/gptoss-group-health", str(s.proxy.group_health_port),
             health_url("127.0.0.1", s.proxy.port, s.proxy.health_path), *urls]  # fmt: skip
    out.files[f"{UNIT_DIR}/gptoss-group-health.service"] = _unit(
        "gptoss-group-health.service",
        bin=bin_dir,
        port=s.proxy.group_health_port,
        decode_server=proxy.decode_server,
        env_files=[DEPLOY_ENV, f"-{MEMBERS_ENV}"],
        exec_start=_exec(group),
        **_limits(cfg),
    )
    out.units += ["gptoss-proxy.service", "gptoss-group-health.service"]
    out.wants += ["gptoss-proxy.service", "gptoss-group-health.service"]
    _render_members(cfg, out, bin_dir, what="addresses of the proxy's group; the proxy restarts when one is replaced")


def _render_router(cfg: ClusterConfig, node: Node, proxy: ProxyPlacement, out: NodeRender, bin_dir: str) -> None:
    """vLLM's router over every server of the fleet, each reached by its node's name.

    The unit carries only what is this node's (the gate's and the router's addresses); the settings
    and the pool are the fleet's SSM parameter (router_fleet), which gptoss-members copies to the
    node and watches (a change restarts the routers one node at a time, and replaces no instance).
    gptoss-router-pool turns it into the router's arguments, each server at its node's name, which
    gptoss-members keeps in /etc/hosts. The plan shows the command line that results.
    """
    s = cfg.serving
    r = s.proxy.router
    venv = router_venv(r.version, r.sha256)
    pool = router_pool(cfg, proxy)
    pool_args = list(router_pool_args(tuple(pool)))
    routed = router_argv(cfg, bin_dir=bin_dir)
    if r.extra_flags:
        extra_tokens = sum(1 + (f.value is not None) for f in r.extra_flags)
        check_router_argv(routed[ROUTER_ARGS_AT:-extra_tokens] + pool_args, [(f.name, f.value) for f in r.extra_flags], r.wheel, r.sha256)
    argv = [f"{bin_dir}/gptoss-exec", "proxy", f"{bin_dir}/gptoss-install-router", venv, "--",
            f"{bin_dir}/gptoss-router-pool", ROUTER_FLEET, "--", *routed[:ROUTER_NODE_ARGS]]  # fmt: skip
    out.files[f"{UNIT_DIR}/gptoss-proxy.service"] = _unit(
        "gptoss-router.service",
        bin=bin_dir,
        port=r.internal_port,
        fleet=ROUTER_FLEET,
        parameter=router_parameter(cfg.cluster_name),
        env_files=[DEPLOY_ENV],
        exec_start=_exec(argv),
        backoff_s=s.proxy.restart_backoff_s,
        backoff_max_s=s.proxy.restart_backoff_max_s,
        # A start waits for its back-off, then for one answer from EC2 (gptoss-members hosts).
        start_timeout_s=s.proxy.restart_backoff_max_s + 180,
        # For the lame-duck (ExecStop), then for the router's own drain: each is bounded by the lame-duck
        # and the router's request timeout, which is run-time data (the unit holds the spec's longest).
        stop_timeout_s=s.proxy.gate.lame_duck_s + REQUEST_TIMEOUT_MAX_S + 60,
        lame_duck_s=s.proxy.gate.lame_duck_s,
        open_files=open_files(s.proxy),
        restart_sec=RESTART_SEC,
    )
    out.shared[API_CONFIG] = (api_gate_config(s.proxy, max_model_len=s.shape.max_model_len, bind=f"{s.proxy.bind_host}:{s.proxy.port}",
                                              router_port=r.internal_port), 0o644)  # fmt: skip
    out.files[f"{UNIT_DIR}/gptoss-api.service"] = _unit("gptoss-api.service", **api_gate_unit(s.proxy, bin_dir=bin_dir, restart_sec=RESTART_SEC))
    # Its environment: deploy.env (where the router's wheel is, and this node's own address).
    effective = [*served(argv), *routed[ROUTER_NODE_ARGS:], *pool_args]
    out.services.append(Service("gptoss-proxy.service", {host_var(node.name): f"<{node.name}>"}, effective, waits=("the router's venv",)))
    out.units += ["gptoss-proxy.service", "gptoss-api.service"]
    out.wants += ["gptoss-proxy.service", "gptoss-api.service"]
    _render_members(cfg, out, bin_dir, what="every server's name in /etc/hosts, and the routers' settings and pool (SSM)")


def _render_members(cfg: ClusterConfig, out: NodeRender, bin_dir: str, *, what: str) -> None:
    """gptoss-members.timer: the fleet's members from EC2 every healing.members_poll_s."""
    out.files[f"{UNIT_DIR}/gptoss-members.service"] = _unit("gptoss-members.service", bin=bin_dir, what=what)
    out.files[f"{UNIT_DIR}/gptoss-members.timer"] = _unit("gptoss-members.timer", poll_s=cfg.healing.members_poll_s)
    out.units.append("gptoss-members.timer")
    out.wants.append("gptoss-members.timer")


def _render_bench(cfg: ClusterConfig, out: NodeRender, bin_dir: str) -> None:
    """The reference's two benchmark legs as one oneshot unit that never starts by itself."""
    s = cfg.serving
    b = s.bench
    bench_env = {"NETRC": b.netrc}
    out.files[f"{ETC}/bench.env"] = (env_file(bench_env), 0o644)
    legs = [("warmup", b.warmup_prompts, b.warmup_result_file), ("measured", b.measured_prompts, b.result_file)]
    lines = [[f"{bin_dir}/gptoss-exec", "bench", *bench_argv(cfg, n, f)] for _, n, f in legs]
    route = cfg.proxy_health_path
    out.files[f"{UNIT_DIR}/gptoss-bench.service"] = _unit(
        "gptoss-bench.service",
        bin=bin_dir,
        description=f"{model_name(cfg)} {s.shape.input_len // 1024}K/{s.shape.output_len // 1024}K benchmark "
        + ("through the proxy" if s.disaggregated else "against the server"),
        endpoint_unit="gptoss-proxy.service" if s.disaggregated else "gptoss-server.service",
        env_files=[f"{ETC}/bench.env"],
        wait=_exec([f"{bin_dir}/gptoss-wait-healthy", "60", health_url("127.0.0.1", endpoint_port(cfg), route)]),
        exec_start=[_exec(line) for line in lines],
    )
    for (step, _, _), line in zip(legs, lines, strict=True):
        out.services.append(Service("gptoss-bench.service", bench_env, line[2:], step=step))


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
    out.files[f"{ETC}/telemetry.json"] = (telemetry.node_config(cfg, node, servers, units, router_url, API_SOCKET if routed else None), 0o644)
    out.files[f"{UNIT_DIR}/gptoss-telemetry.service"] = _unit(
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
        out.files[f"{UNIT_DIR}/{name}"] = _unit(name, **base, **_limits(cfg))
        out.units.append(name)
        out.wants.append(name)
    if node.role == "prefill":
        _render_prefill(cfg, node, out, bin_dir)
    else:
        _render_server(cfg, out, bin_dir, role=node.role)
    for proxy in layout.proxies_on(node.name):
        if proxy.kind == "vllm-router":
            _render_router(cfg, node, proxy, out, bin_dir)
        else:
            _render_proxy(cfg, node, proxy, out, bin_dir)
    if layout.proxies_on(node.name) or node.role == "server":
        _render_bench(cfg, out, bin_dir)
    if cfg.wait_for_ready:
        out.files[f"{UNIT_DIR}/gptoss-signal.service"] = _unit("gptoss-signal.service", bin=bin_dir)
        out.units.append("gptoss-signal.service")
        out.wants.append("gptoss-signal.service")
    if cfg.compile_cache_enabled:
        # Once the servers answer, the compiled graphs go to this identity's own area of the cache.
        out.files[f"{UNIT_DIR}/gptoss-cache-save.service"] = _unit("gptoss-cache-save.service", bin=bin_dir)
        out.units.append("gptoss-cache-save.service")
        out.wants.append("gptoss-cache-save.service")
    if cfg.healing.report_unhealthy:
        out.files[f"{UNIT_DIR}/gptoss-health-watch.service"] = _unit("gptoss-health-watch.service", bin=bin_dir, h=cfg.healing)
        out.files[f"{UNIT_DIR}/gptoss-health-watch.timer"] = _unit("gptoss-health-watch.timer", interval_s=cfg.healing.watch_interval_s)
        out.units.append("gptoss-health-watch.timer")
        out.wants.append("gptoss-health-watch.timer")
    if cfg.observability.enabled:
        _render_telemetry(cfg, node, out, bin_dir)
    out.files[f"{UNIT_DIR}/{NODE_TARGET}"] = _unit(NODE_TARGET, node=node.name, wants=out.wants)
    out.files[f"{ETC}/health"] = (health_file(cfg, out), 0o644)
    out.scripts = _needed_scripts(out.files, save_cache=cfg.compile_cache_enabled)
    scripts = shipped_scripts()
    for name in sorted(out.scripts & NODE_SCRIPTS):
        out.files[f"{bin_dir}/{name}"] = (scripts[name], 0o755)
    out.files[UNITS_FILE] = ("\n".join(out.units) + "\n", 0o644)
    shipped = {*out.files, *out.shared, MANIFEST, *(f"{bin_dir}/{n}" for n in out.scripts)}
    out.files[MANIFEST] = ("\n".join(sorted(shipped)) + "\n", 0o644)
    return out


@functools.cache
def _script_references() -> dict[str, frozenset[str]]:
    """For each shipped script, the scripts its text names (once per process, not once per node)."""
    scripts = shipped_scripts()
    return {n: frozenset(m for m in scripts if m in text) for n, text in scripts.items()}


def _needed_scripts(files: dict[str, tuple[str, int]], *, save_cache: bool) -> set[str]:
    """The scripts this node's units (and those scripts) name, plus its boot, fetch and status."""
    wanted = set(NODE_SCRIPTS) | ({"gptoss-save-cache"} if save_cache else set())
    # One search per script name over all of the node's files (a NUL cannot be part of a name).
    text = "\0".join(t for t, _ in files.values())
    found = {name for name in shipped_scripts() if name in text} | wanted
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
