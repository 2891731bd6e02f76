"""What each server of a recipe runs: its command line and its environment, from the spec.

One rendering serves the units (render.py), `plan`, and the tests that compare both with the
references' tables.
"""

from __future__ import annotations

import functools
from typing import Any

from clusterspec.config import ClusterConfig
from clusterspec.layout import ProxyPlacement, Replica
from clusterspec.names import decode_node, host_var, node_order
from clusterspec.sections.flags import json_arg
from clusterspec.sections.servers import Decode, Prefill, Server
from clusterspec.sections.serving import Serving
from node_render.haproxy import body_cap
from node_render.paths import DRAIN_MODULE, EXAMPLES_DIR, MEMBERS_DOMAIN, SERVERS_DRAINING, member_host, router_venv
from node_render.quoting import Expand


def _neuron_config(s: Serving, role: str) -> dict[str, object]:
    """neuron_config of one role, in the order the references write it; None and False leave a key out."""
    sh = s.shape
    cfg: dict[str, object] = {"quantization": sh.quantization} if sh.quantization == "mxfp4" else {}
    if role == "decode":
        d = s.decode
        if d.ep_in_neuron_config:
            cfg["ep_degree"] = d.ep_degree
        cfg |= {"embedding_dp_size": d.embedding_dp_size, "lm_head_dp_size": d.lm_head_dp_size}
        if d.tail_hops:
            cfg["gpt_oss_tail_hops"] = list(d.tail_hops)
        seqs = d.max_num_seqs
    elif role == "prefill":
        cfg["ep_degree"] = s.prefill.ep_degree
        seqs = s.prefill.max_num_seqs
    else:
        seqs = s.server.max_num_seqs
    if sh.fp8_packed_kv and sh.kv_cache_dtype:
        cfg["fp8_packed_kv"] = True
    if sh.kv_segment_buckets:
        cfg["kv_segment_size_buckets"] = [sh.max_num_batched_tokens]
    cfg |= {"num_batched_tokens_buckets": [sh.max_num_batched_tokens], "num_seqs_buckets": [seqs]}
    return cfg


def _role(s: Serving, role: str) -> Decode | Prefill | Server:
    return s.decode if role == "decode" else s.prefill if role == "prefill" else s.server


def vllm_argv(cfg: ClusterConfig, role: str, *, port: str, additional_config: str | None = None) -> list[str]:
    """`vllm serve` of a decode server, a prefill replica or a single-instance server, from the spec."""
    s, sh = cfg.serving, cfg.serving.shape
    r = _role(s, role)
    argv = ["vllm", "serve", model_dir(cfg), "--tensor-parallel-size", str(r.tensor_parallel)]
    if role != "server":
        assert isinstance(r, Decode | Prefill)
        argv += ["--data-parallel-size", str(r.data_parallel), "--enable-expert-parallel"]
    if role == "decode" and s.decode.optimization_level is not None:
        argv += ["--optimization-level", str(s.decode.optimization_level)]
    if role == "server" and s.server.enable_prefix_caching:
        argv.append("--enable-prefix-caching")
    if sh.dtype:
        argv += ["--dtype", sh.dtype]
    argv += [
        "--max-model-len", str(sh.max_model_len),
        "--max-num-batched-tokens", str(sh.max_num_batched_tokens),
        "--max-num-seqs", str(r.max_num_seqs),
    ]  # fmt: skip
    if sh.block_size is not None:
        argv += ["--block-size", str(sh.block_size)]
    if sh.kv_cache_dtype is not None:
        argv += ["--kv-cache-dtype", sh.kv_cache_dtype]
    if r.max_logprobs is not None:
        argv += ["--max-logprobs", str(r.max_logprobs)]
    if sh.keep_hybrid_kv_cache_manager:
        argv.append("--no-disable-hybrid-kv-cache-manager")
    if sh.distributed_executor_backend:
        argv += ["--distributed-executor-backend", sh.distributed_executor_backend]
    argv += ["--port", port, "--hf-overrides", json_arg(sh.hf_overrides)]
    if role != "server":
        kv_transfer = {
            "kv_connector": sh.kv_connector,
            "kv_role": "kv_consumer" if role == "decode" else "kv_producer",
            "kv_buffer_device": sh.kv_buffer_device,
            "kv_connector_extra_config": {"backends": list(sh.nixl_backends)},
        }
        argv += ["--kv-transfer-config", json_arg(kv_transfer)]
    argv += ["--additional-config", additional_config or json_arg({"neuron_config": _neuron_config(s, role)})]
    if drains(cfg, role):
        # Its health route answers 503 while the node drains it out of the routers (gptoss_drain.py, gptoss-drain).
        argv += ["--middleware", f"{DRAIN_MODULE}.Drain"]
    for flag in r.extra_flags:
        argv += [flag.name] + ([flag.value] if flag.value is not None else [])
    return argv


def prefill_additional_config(cfg: ClusterConfig, replica: Replica) -> str:
    """Additional config of one replica (reference 000 puts its side-channel port in nixl_side_channel_port)."""
    doc: dict[str, object] = {"neuron_config": _neuron_config(cfg.serving, "prefill")}
    if cfg.serving.prefill.side_channel_in_config:
        doc["nixl_side_channel_port"] = replica.side_channel_port
    return json_arg(doc)


def proxy_argv(cfg: ClusterConfig, proxy: ProxyPlacement) -> list[str]:
    """The example proxy: one prefill host per port, then the decode host."""
    p, s = cfg.serving.proxy, cfg.serving
    return [
        "python3", f"{EXAMPLES_DIR}/{p.script}",
        "--host", p.bind_host,
        "--port", str(p.port),
        "--prefiller-hosts", *[Expand(f"${{{host_var(r.node)}}}") for r in proxy.replicas],
        "--prefiller-ports", *[str(r.http_port) for r in proxy.replicas],
        "--decoder-hosts", Expand(f"${{{host_var(decode_node(proxy.decode_server))}}}"),
        "--decoder-ports", str(s.decode.http_port),
    ]  # fmt: skip


def router_program(cfg: ClusterConfig, *, bin_dir: str) -> list[str]:
    """The router's interpreter (its venv, from the pinned wheel) and gptoss-router."""
    r = cfg.serving.proxy.router
    return [f"{router_venv(r.version, r.sha256)}/bin/python", f"{bin_dir}/gptoss-router"]


def router_node_args(cfg: ClusterConfig) -> list[str]:
    """The router's arguments that are each router node's own: where it listens."""
    # Clients reach the API gate (HAProxy, node_render/haproxy.py); the router (and its admin routes) answers on loopback alone.
    return ["--host", "127.0.0.1", "--port", str(cfg.serving.proxy.router.internal_port)]


def router_settings(cfg: ClusterConfig, *, extra_flags: bool = True) -> list[str]:
    """The router's settings in NIXL P/D mode, the fleet's (read at run time: router_fleet), from the spec;
    the operator's extra flags last unless `extra_flags` is False. Its servers are router_pool_args."""
    p, s = cfg.serving.proxy, cfg.serving
    r = p.router
    argv = [
        "--vllm-pd-disaggregation",
        "--kv-connector", "nixl",
        "--prefill-policy", cfg.router_policy("prefill"),
        "--decode-policy", cfg.router_policy("decode"),
        "--health-check-endpoint", s.server_health_path,
        "--health-check-interval-secs", str(r.health_check_interval_s),
        "--health-check-timeout-secs", str(r.health_check_timeout_s),
        "--health-failure-threshold", str(r.health_failure_threshold),
        "--health-success-threshold", str(r.health_success_threshold),
        "--request-timeout-secs", str(r.request_timeout_s),
        # The body cap of any body, a chunked one included (the gate refuses a longer Content-Length first).
        "--max-payload-size", str(body_cap(p, s.shape.max_model_len)),
        # Servers compile for hours; the router health-checks them meanwhile and serves with those that answer.
        "--worker-startup-timeout-secs", str(s.engine_ready_timeout_s),
        "--worker-startup-check-interval", str(r.worker_startup_check_interval_s),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(r.metrics_port),
    ]  # fmt: skip
    for flag in r.extra_flags if extra_flags else ():
        argv += [flag.name] + ([flag.value] if flag.value is not None else [])
    return argv


def router_fleet(cfg: ClusterConfig, proxy: ProxyPlacement) -> str:
    """What every router of the fleet reads at run time (the stack's SSM parameter, which
    gptoss-members copies to the node): the members' domain, how long the next router of a roll
    waits for one that restarts (gptoss-members reads it), the router's settings (one `arg`
    line per token) and its pool (one `pool ROLE FIRST LAST FIRST_PORT LAST_PORT` line per run
    of consecutive nodes of one role and port range: a few lines for any fleet size).
    gptoss-router-pool turns it into the router's arguments."""
    p = cfg.serving.proxy
    # How long the next router waits for one that restarts: its lame-duck, its drain (the request timeout) and its start.
    lines = [f"domain {MEMBERS_DOMAIN}", f"restart_gap {p.gate.lame_duck_s + p.router.request_timeout_s + p.router.restart_gap_s}"]
    lines += [f"arg {t}" for t in router_settings(cfg)]
    runs: list[list[Any]] = []
    for role, node, first, last in router_pool(cfg, proxy):
        i = node_order(node)[1]
        if runs and runs[-1][0] == role and runs[-1][2] == i - 1 and runs[-1][3:] == [first, last]:
            runs[-1][2] = i
        else:
            runs.append([role, i, i, first, last])
    return "\n".join(lines + [f"pool {r} {a} {b} {p} {q}" for r, a, b, p, q in runs]) + "\n"


def router_pool(cfg: ClusterConfig, proxy: ProxyPlacement) -> list[tuple[str, str, int, int]]:
    """The servers a router routes to, one line per node: (role, node, first port, last port).

    A node's replicas hold consecutive ports, so the pool grows by one line per node, not per
    replica: every router node carries the whole fleet's pool (gptoss-router-pool expands it).
    """
    ports: dict[str, list[int]] = {}
    for rep in proxy.replicas:
        ports.setdefault(rep.node, []).append(rep.http_port)
    pool = []
    for node, ps in ports.items():
        assert ps == list(range(ps[0], ps[0] + len(ps))), f"{node}: replica ports not consecutive: {ps}"
        pool.append(("prefill", node, ps[0], ps[-1]))
    port = cfg.serving.decode.http_port
    pool += [("decode", decode_node(d), port, port) for d in proxy.decode_servers]
    return pool


@functools.lru_cache(maxsize=8)
def router_pool_args(pool: tuple[tuple[str, str, int, int], ...]) -> tuple[str, ...]:
    """The router's --prefill and --decode URLs of a pool, each at its node's name (gptoss-members keeps it in /etc/hosts).

    Every router of a fleet has the same pool: built once, not once per router node.
    """
    out: list[str] = []
    for role, node, first, last in pool:
        for port in range(first, last + 1):
            out += [f"--{role}", f"http://{member_host(node)}:{port}"]
    return tuple(out)


def endpoint_port(cfg: ClusterConfig) -> int:
    """The port clients send requests to: the proxy's, or the single server's."""
    return cfg.serving.proxy.port if cfg.serving.disaggregated else cfg.serving.server.port


def bench_argv(cfg: ClusterConfig, prompts: int, result_file: str) -> list[str]:
    """One leg of the benchmark: random prompts of the shape, its output length, concurrency = capacity."""
    s = cfg.serving
    return [
        "vllm", "bench", "serve",
        "--backend", "vllm",
        "--base-url", f"http://127.0.0.1:{endpoint_port(cfg)}",
        "--model", model_dir(cfg),
        "--dataset-name", "random",
        "--random-input-len", str(s.shape.input_len),
        "--random-output-len", str(s.shape.output_len),
        "--ignore-eos",
        "--max-concurrency", str(s.capacity),
        "--num-prompts", str(prompts),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--save-result",
        "--result-dir", cfg.results_dir,
        "--result-filename", result_file,
    ]  # fmt: skip


def model_name(cfg: ClusterConfig) -> str:
    """The checkpoint's name without its org (gpt-oss-120b)."""
    return cfg.serving.model_id.rsplit("/", 1)[-1]


def model_dir(cfg: ClusterConfig) -> str:
    """Where the checkpoint lives on every node (the reference's MODEL_ID)."""
    return f"{cfg.nvme_mount}/models/{cfg.serving.model_id.rsplit('/', 1)[-1]}"


def schedule_path(cfg: ClusterConfig) -> str:
    """The fixed schedule path the decode server reads."""
    return f"{cfg.nvme_mount}/cache/megakernel_schedule/active_dma_order.json"


def health_url(host: str, port: int, path: str) -> str:
    """URL a wait polls."""
    return f"http://{host}:{port}{path}"


def _common(cfg: ClusterConfig) -> dict[str, str]:
    return {k: v.value for k, v in cfg.serving.common_env.items()}


def _lnc(cfg: ClusterConfig, lnc: int) -> dict[str, str]:
    return {"NEURON_LOGICAL_NC_CONFIG": str(lnc)} if cfg.serving.explicit_lnc else {}


def decode_env(cfg: ClusterConfig) -> dict[str, str]:
    """Environment of the decode server: both-roles table, then decode-only table."""
    d = cfg.serving.decode
    env = _common(cfg) | _lnc(cfg, d.lnc)
    if d.visible_all_cores:
        env["NEURON_VISIBLE_DEVICES"] = d.visible_cores(cfg.hardware.logical_cores(d.lnc))
    env |= {k: v.value for k, v in d.env.items()}
    if d.megakernel:
        env["VLLM_NEURON_MEGA_DMA_ORDER_CONSTRAINTS_FILE"] = schedule_path(cfg)
    return env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(d.side_channel_port)}


def drains(cfg: ClusterConfig, role: str) -> bool:
    """Whether a server of ROLE leaves its routers before an in-place restart: behind vLLM's router, which
    health-checks it (the toy proxy checks nothing, and the references' command lines stay as tested)."""
    return cfg.proxy_kind == "vllm-router" and role in ("prefill", "decode")


def drain_env(cfg: ClusterConfig, role: str, bin_dir: str) -> dict[str, str]:
    """What a draining server's middleware reads: where it is (vLLM imports it from BIN), the file that
    drains it and the health route it then answers 503 (the routers' --health-check-endpoint)."""
    if not drains(cfg, role):
        return {}
    # No bytecode beside the module: the bin folder holds the shipped files alone (vLLM's own venv is compiled at install).
    return {"PYTHONPATH": bin_dir, "PYTHONDONTWRITEBYTECODE": "1", "GPTOSS_DRAIN_FILE": SERVERS_DRAINING,
            "GPTOSS_DRAIN_HEALTH_PATH": cfg.serving.server_health_path}


def prefill_env(cfg: ClusterConfig) -> dict[str, str]:
    """Environment shared by every prefill replica of a node."""
    return _common(cfg) | _lnc(cfg, cfg.serving.prefill.lnc)


def server_env(cfg: ClusterConfig) -> dict[str, str]:
    """Environment of a single-instance server."""
    s = cfg.serving.server
    return _common(cfg) | _lnc(cfg, s.lnc) | {k: v.value for k, v in s.env.items()}


def replica_env(cfg: ClusterConfig, replica: Replica) -> dict[str, str]:
    """Per-replica environment: its cores, its side channel, and its port and config for the Exec line."""
    return {
        "NEURON_VISIBLE_DEVICES": replica.visible_cores,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(replica.side_channel_port),
        "GPTOSS_HTTP_PORT": str(replica.http_port),
        "GPTOSS_ADDITIONAL_CONFIG": prefill_additional_config(cfg, replica),
    }

