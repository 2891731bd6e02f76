"""The proxy of each node that runs one: the examples' toy proxy over its group, or vLLM's router over
the whole fleet behind the API gate (HAProxy), and the members timer that keeps their addresses."""

from __future__ import annotations

from clusterspec.config import ClusterConfig
from clusterspec.layout import Node, ProxyPlacement
from clusterspec.names import decode_node, host_var
from clusterspec.sections.boot import RESTART_SEC
from clusterspec.sections.endpoint import keys_secret_name
from clusterspec.sections.proxy import REQUEST_TIMEOUT_MAX_S
from node_render.command_lines import (
    health_url,
    proxy_argv,
    router_node_args,
    router_pool,
    router_pool_args,
    router_program,
    router_settings,
)
from node_render.haproxy import API_CONFIG, KeyCheck, api_gate_config, api_gate_unit, open_files
from node_render.node_files import NodeRender, Service, exec_line, served, unit_file, unit_limits
from node_render.paths import (
    CLUSTER_ENV,
    DEPLOY_ENV,
    HAPROXY_ENV,
    KEYS_ENV,
    MEMBERS_ENV,
    ROUTER_ENV,
    ROUTER_FLEET,
    UNIT_DIR,
    package_object_key,
    router_object_key,
    router_parameter,
    router_venv,
)
from node_render.quoting import Expand, env_file, expand
from node_render.router_cli import check_router_argv


def group_urls(cfg: ClusterConfig, proxy: ProxyPlacement) -> list[str]:
    """Health routes of every server a proxy routes to (hosts from deploy.env)."""
    s = cfg.serving
    urls: list[str] = [Expand(health_url(f"${{{host_var(r.node)}}}", r.http_port, s.server_health_path)) for r in proxy.replicas]
    urls.append(Expand(health_url(f"${{{host_var(f'decode-{proxy.decode_server}')}}}", s.decode.http_port, s.server_health_path)))
    return urls


def render_proxy(cfg: ClusterConfig, node: Node, proxy: ProxyPlacement, out: NodeRender, bin_dir: str) -> None:
    """The proxy of one decode server, started once its replicas and decode server answer."""
    s = cfg.serving
    decode = decode_node(proxy.decode_server)
    hosts_env = {host_var(p): f"<{p}>" for p in sorted({r.node for r in proxy.replicas} | {decode})}
    urls = group_urls(cfg, proxy)
    # The proxy waits for every server, which may first wait for staging and compiles.
    wait_s = cfg.stage_timeout_s + 2 * s.engine_ready_timeout_s
    argv = [f"{bin_dir}/gptoss-exec", "proxy", f"{bin_dir}/gptoss-wait-healthy", str(wait_s), *urls, "--", *proxy_argv(cfg, proxy)]
    # "-": the members file is written by the unit's own ExecStartPre (gptoss-members write), and
    # systemd reads environment files before each state's first process.
    out.files[f"{UNIT_DIR}/gptoss-proxy.service"] = unit_file(
        "gptoss-proxy.service",
        bin=bin_dir,
        port=s.proxy.port,
        decode_server=proxy.decode_server,
        env_files=[DEPLOY_ENV, f"-{MEMBERS_ENV}"],
        exec_start=exec_line(argv),
        # It holds no state: its own short back-off (serving.proxy.restart_backoff_s), not the servers'.
        backoff_s=s.proxy.restart_backoff_s,
        backoff_max_s=s.proxy.restart_backoff_max_s,
        # A start waits for its back-off, then for the members (gptoss-members: up to 600 s).
        start_timeout_s=s.proxy.restart_backoff_max_s + 660,
        **unit_limits(cfg),
    )
    out.services.append(
        Service("gptoss-proxy.service", hosts_env, [expand(a, hosts_env) for a in served(argv)], waits=("staging", "the members (EC2)", "every server of its group answers"))
    )
    group = [f"{bin_dir}/gptoss-group-health", str(s.proxy.group_health_port),
             health_url("127.0.0.1", s.proxy.port, s.proxy.health_path), *urls]  # fmt: skip
    out.files[f"{UNIT_DIR}/gptoss-group-health.service"] = unit_file(
        "gptoss-group-health.service",
        bin=bin_dir,
        port=s.proxy.group_health_port,
        decode_server=proxy.decode_server,
        env_files=[DEPLOY_ENV, f"-{MEMBERS_ENV}"],
        exec_start=exec_line(group),
        **unit_limits(cfg),
    )
    out.units += ["gptoss-proxy.service", "gptoss-group-health.service"]
    out.wants += ["gptoss-proxy.service", "gptoss-group-health.service"]
    render_members(cfg, out, bin_dir, what="addresses of the proxy's group; the proxy restarts when one is replaced")


def render_router(cfg: ClusterConfig, node: Node, proxy: ProxyPlacement, out: NodeRender, bin_dir: str) -> None:
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
    if r.extra_flags:
        modeled = [*router_node_args(cfg), *router_settings(cfg, extra_flags=False), *pool_args]
        check_router_argv(modeled, [(f.name, f.value) for f in r.extra_flags], r.wheel, r.sha256)
    argv = [f"{bin_dir}/gptoss-exec", "proxy", f"{bin_dir}/gptoss-install-router", venv, "--",
            f"{bin_dir}/gptoss-router-pool", ROUTER_FLEET, "--", *router_program(cfg, bin_dir=bin_dir), *router_node_args(cfg)]  # fmt: skip
    out.files[f"{UNIT_DIR}/gptoss-proxy.service"] = unit_file(
        "gptoss-router.service",
        bin=bin_dir,
        port=r.internal_port,
        fleet=ROUTER_FLEET,
        parameter=router_parameter(cfg.cluster_name),
        env_files=[DEPLOY_ENV],
        exec_start=exec_line(argv),
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
    # The wheel (its name, sha256 and key in the stack's asset bucket): software, so a new wheel restarts this unit in
    # place on the router nodes alone (gptoss-apply), never a server, and no launch template changes.
    out.files[ROUTER_ENV] = (env_file({"GPTOSS_ROUTER_WHEEL": r.wheel, "GPTOSS_ROUTER_SHA256": r.sha256,
                                       "GPTOSS_ROUTER_KEY": router_object_key(r.sha256)}), 0o644)  # fmt: skip
    # The API gate's pinned packages, if any (KEY:SHA256:FILE each, in the same bucket): gptoss-install-haproxy.
    if s.proxy.gate.packages:
        packages = " ".join(f"{package_object_key(p.sha256)}:{p.sha256}:{p.file}" for p in s.proxy.gate.packages)
        out.files[HAPROXY_ENV] = (env_file({"GPTOSS_HAPROXY_PACKAGES": packages}), 0o644)
    keys = KeyCheck.of(s.endpoint) if cfg.endpoint_auth == "keys" else None
    out.shared[API_CONFIG] = (api_gate_config(s.proxy, max_model_len=s.shape.max_model_len, bind=f"{s.proxy.bind_host}:{s.proxy.port}",
                                              router_port=r.internal_port, keys=keys), 0o644)  # fmt: skip
    out.files[f"{UNIT_DIR}/gptoss-api.service"] = unit_file(
        "gptoss-api.service", **api_gate_unit(s.proxy, bin_dir=bin_dir, restart_sec=RESTART_SEC, keys=keys is not None)
    )
    if keys:
        # The API keys: this secret, read again every keys_refresh_s (gptoss-keys.timer).
        secret = s.endpoint.keys_secret_arn or keys_secret_name(cfg.cluster_name)
        # The same on every router node: shipped with the gate's configuration, not in each node's user data.
        out.shared[KEYS_ENV] = (env_file({"GPTOSS_KEYS_SECRET": secret}), 0o644)
        out.shared[f"{UNIT_DIR}/gptoss-keys.service"] = unit_file("gptoss-keys.service", bin=bin_dir, secret=secret, cluster_env=CLUSTER_ENV, keys_env=KEYS_ENV)
        out.shared[f"{UNIT_DIR}/gptoss-keys.timer"] = unit_file("gptoss-keys.timer", refresh_s=s.endpoint.keys_refresh_s)
        out.units.append("gptoss-keys.timer")
        out.wants.append("gptoss-keys.timer")
    # Its environment: deploy.env (this node's own address); gptoss-install-router reads router.env (its wheel).
    effective = [*served(argv), *router_settings(cfg), *pool_args]
    out.services.append(Service("gptoss-proxy.service", {host_var(node.name): f"<{node.name}>"}, effective, waits=("the router's venv",)))
    out.units += ["gptoss-proxy.service", "gptoss-api.service"]
    out.wants += ["gptoss-proxy.service", "gptoss-api.service"]
    render_members(cfg, out, bin_dir, what="every server's name in /etc/hosts, and the routers' settings and pool (SSM)")


def render_members(cfg: ClusterConfig, out: NodeRender, bin_dir: str, *, what: str) -> None:
    """gptoss-members.timer: the fleet's members from EC2 every healing.members_poll_s."""
    out.files[f"{UNIT_DIR}/gptoss-members.service"] = unit_file("gptoss-members.service", bin=bin_dir, what=what)
    out.files[f"{UNIT_DIR}/gptoss-members.timer"] = unit_file("gptoss-members.timer", poll_s=cfg.healing.members_poll_s)
    out.units.append("gptoss-members.timer")
    out.wants.append("gptoss-members.timer")
