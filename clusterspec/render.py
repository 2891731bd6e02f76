"""Render each node's plan, files and cloud-init user data from the config and the layout.

One rendering serves three readers: `cluster.py plan` prints the services, the CDK stack
embeds the user data, and the tests parse the user data back and compare it with the plan.
"""

from __future__ import annotations

import ast
import base64
import functools
import io
import json
import lzma
import re
import shlex
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import jinja2
import yaml

from clusterspec.config import ClusterConfig
from clusterspec.layout import Layout, Node, ProxyPlacement, Replica
from clusterspec.serving import Decode, Prefill, Server, Serving, json_arg

USERDATA_DIR = Path(__file__).resolve().parent.parent / "userdata"
BIN = "/opt/gptoss/bin"
ETC = "/etc/gptoss"
UNIT_DIR = "/etc/systemd/system"
EXAMPLES_DIR = "/opt/gptoss/vllm-neuron"
BUNDLE = "/var/lib/gptoss/bundle.tar.xz"
# Values the stack knows only at deploy time (peers' IPs, where the scripts are), written by
# the user data's bootcmd; gptoss-identity adds this node's own IP.
DEPLOY_ENV = f"{ETC}/deploy.env"
CLUSTER_ENV = f"{ETC}/cluster.env"
MANIFEST = f"{ETC}/manifest"
UNITS_FILE = f"{ETC}/units"
NODE_TARGET = "gptoss-node.target"
USER_DATA_LIMIT = 16 * 1024
RESTART_SEC = 5  # the growing wait is gptoss-backoff's, before each automatic restart
BACKOFF_MAX_S = 900  # gptoss-backoff's longest wait: an ExecStartPre must be allowed that long
IMDS_TIMEOUT_S = 600  # how long gptoss-identity asks the instance metadata before it fails
FETCH_TIMEOUT_S = 600  # how long gptoss-fetch-scripts asks S3 before it fails
# Scripts every node carries in its user data: the boot itself, fetching the others, and the
# status report (which must work when the fetch does not). The other scripts are the same on
# every node: the stack ships them once, as a file asset in S3 (see scripts_asset), which keeps
# each node's user data far below EC2's 16 KB.
NODE_SCRIPTS = frozenset({"gptoss-bootstrap", "gptoss-fetch-scripts", "gptoss-status"})
SCRIPTS_ASSET = "gptoss-scripts.tar.xz"

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(USERDATA_DIR / "units"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    # Shell text such as ${#ARR[@]} must never open a Jinja comment.
    comment_start_string="{##",
    comment_end_string="##}",
)


def host_var(node: str) -> str:
    """Environment variable that holds a node's private IP in deploy.env."""
    return "GPTOSS_HOST_" + re.sub(r"[^A-Z0-9]", "_", node.upper())


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
    peers: list[str] = field(default_factory=list)
    scripts: set[str] = field(default_factory=set)

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


# ---- quoting -----------------------------------------------------------------------------

_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./${}-]+$")


class Expand(str):
    """An Exec-line argument systemd must expand (${VAR}, %i): the project's own references.

    Every other argument is literal: its `$` and `%` are escaped, so a value reaches the server
    exactly as written.
    """

    __slots__ = ()


def systemd_quote(arg: str) -> str:
    """Quote one argument for an Exec line: literal unless it is an Expand."""
    if not isinstance(arg, Expand):
        arg = arg.replace("$", "$$").replace("%", "%%")
    elif re.search(r"%(?![in])", arg):
        raise ValueError(f"argument {arg!r} holds a systemd specifier other than %i and %n")
    if _SAFE.match(arg):
        return arg
    if "'" in arg or "\\" in arg or "\n" in arg:
        raise ValueError(f"argument {arg!r} cannot be single-quoted for systemd")
    return f"'{arg}'"


def env_file(env: Mapping[str, str]) -> str:
    """An environment file both systemd and bash read the same way."""
    lines = []
    for k, v in env.items():
        if "'" in v or "\n" in v:
            raise ValueError(f"environment value of {k} holds a quote or a newline: {v!r}")
        lines.append(f"{k}={v}" if _SAFE.match(v) and "$" not in v else f"{k}='{v}'")
    return "\n".join(lines) + "\n"


def parse_env_file(text: str) -> dict[str, str]:
    """Read an environment file written by env_file()."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = shlex.split(v)[0] if v else ""
    return out


def expand(arg: str, env: Mapping[str, str], instance: str | None = None) -> str:
    """What systemd makes of one argument: an Expand's ${VAR} and %i filled in, any other as is."""
    if not isinstance(arg, Expand):
        return arg
    out = re.sub(r"\$\{([A-Za-z0-9_]+)\}", lambda m: env.get(m.group(1), f"<{m.group(1)}>"), arg)
    return out.replace("%i", instance) if instance is not None else out


def systemd_expand(word: str, env: Mapping[str, str], instance: str | None = None) -> str:
    """Expand one word read back from an Exec line as systemd does: $$, ${VAR}, %%, %i, %n."""

    def var(m: re.Match[str]) -> str:
        return "$" if m.group(0) == "$$" else env.get(m.group(1), f"<{m.group(1)}>")

    def spec(m: re.Match[str]) -> str:
        return {"%%": "%", "%i": instance or "", "%n": "<unit>"}[m.group(0)]

    return re.sub(r"%[%in]", spec, re.sub(r"\$\$|\$\{([A-Za-z0-9_]+)\}", var, word))


# ---- command lines -----------------------------------------------------------------------


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
        "--decoder-hosts", Expand(f"${{{host_var(f'decode-{proxy.decode_server}')}}}"),
        "--decoder-ports", str(s.decode.http_port),
    ]  # fmt: skip


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


# ---- environments ------------------------------------------------------------------------


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
        "GPTOSS_MODEL_SHARDS": str(cfg.model.expected_shards),
        "GPTOSS_HF_TOKEN_SECRET_ARN": cfg.model.hf_token_secret_arn or "",
        "GPTOSS_EXAMPLES_DIR": EXAMPLES_DIR,
        "GPTOSS_EXAMPLES_REPO": cfg.examples.repo_url,
        "GPTOSS_EXAMPLES_REF": cfg.examples.ref,
        "GPTOSS_EXAMPLES_S3_URI": cfg.examples.s3_uri or "",
        # The examples' files this recipe runs (none for a single-instance recipe: nothing is fetched).
        "GPTOSS_PROXY_SCRIPT": s.proxy.script if s.disaggregated else "",
        "GPTOSS_SCHEDULE_SUBDIR": s.examples_dir if megakernel else "",
        "GPTOSS_SCHEDULE_HELPER": s.schedule_helper if megakernel else "",
        "GPTOSS_SCHEDULE_FILE": s.decode.schedule_file or "" if megakernel else "",
        "MEGAKERNEL_SCHEDULE_DIR": str(PurePosixPath(schedule_path(cfg)).parent),
        "MEGAKERNEL_SCOPE": s.decode.megakernel_scope,
        "GPTOSS_CACHE_DIR": f"{cfg.nvme_mount}/cache",
        "GPTOSS_COMPILE_CACHE_S3_URI": cfg.compile_cache_s3_uri or "",
        "GPTOSS_VENV_GLOB": cfg.venv_glob,
        "GPTOSS_RESULTS_DIR": cfg.results_dir,
        "GPTOSS_LOG_DIR": f"{cfg.results_dir}/logs",
        "GPTOSS_RESULTS_S3_URI": cfg.results_s3_uri or "",
        "GPTOSS_BENCH_RESULT_FILE": s.bench.result_file,
    }


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


def _unit(name: str, **values: object) -> tuple[str, int]:
    return _ENV.get_template(f"{name}.j2").render(**values), 0o644


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
    out.files[f"{UNIT_DIR}/gptoss-prefill@.service"] = _unit(
        "gptoss-prefill@.service",
        bin=bin_dir,
        env_files=[f"{ETC}/prefill.env", f"{ETC}/prefill@%i.env"],
        exec_start=_exec(template_argv),
        **_limits(cfg),
    )
    for r in node.replicas:
        renv = replica_env(cfg, r)
        out.files[f"{ETC}/prefill@{r.index}.env"] = (env_file(renv), 0o644)
        full = penv | renv
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
    urls = [Expand(health_url(f"${{{host_var(r.node)}}}", r.http_port, s.server_health_path)) for r in proxy.replicas]
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
    out.files[f"{UNIT_DIR}/gptoss-proxy.service"] = _unit(
        "gptoss-proxy.service",
        bin=bin_dir,
        port=s.proxy.port,
        decode_server=proxy.decode_server,
        env_files=[DEPLOY_ENV],
        exec_start=_exec(argv),
        **_limits(cfg),
    )
    out.services.append(
        Service("gptoss-proxy.service", hosts_env, [expand(a, hosts_env) for a in served(argv)], waits=("staging", "every server of its group answers"))
    )
    group = [f"{bin_dir}/gptoss-group-health", str(s.proxy.group_health_port),
             health_url("127.0.0.1", s.proxy.port, s.proxy.health_path), *urls]  # fmt: skip
    out.files[f"{UNIT_DIR}/gptoss-group-health.service"] = _unit(
        "gptoss-group-health.service",
        port=s.proxy.group_health_port,
        decode_server=proxy.decode_server,
        env_files=[DEPLOY_ENV],
        exec_start=_exec(group),
        **_limits(cfg),
    )
    out.units += ["gptoss-proxy.service", "gptoss-group-health.service"]
    out.wants += ["gptoss-proxy.service", "gptoss-group-health.service"]
    out.peers = sorted({p[1:-1] for p in hosts_env.values()} - {node.name})


def _render_bench(cfg: ClusterConfig, out: NodeRender, bin_dir: str) -> None:
    """The reference's two benchmark legs as one oneshot unit that never starts by itself."""
    s = cfg.serving
    b = s.bench
    bench_env = {"NETRC": b.netrc}
    out.files[f"{ETC}/bench.env"] = (env_file(bench_env), 0o644)
    legs = [("warmup", b.warmup_prompts, b.warmup_result_file), ("measured", b.measured_prompts, b.result_file)]
    lines = [[f"{bin_dir}/gptoss-exec", "bench", *bench_argv(cfg, n, f)] for _, n, f in legs]
    route = s.proxy.health_path if s.disaggregated else s.server_health_path
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


def render_node(cfg: ClusterConfig, layout: Layout, node: Node, *, bin_dir: str = BIN) -> NodeRender:
    """Render the services and files of one node."""
    out = NodeRender(node=node, instance_type=cfg.instance_type, services=[])
    out.files[CLUSTER_ENV] = (env_file(cluster_env(cfg, node)), 0o644)
    base = {
        "bin": bin_dir,
        "nvme_mount": cfg.nvme_mount,
        "stage_timeout_s": cfg.stage_timeout_s,
        "imds_timeout_s": IMDS_TIMEOUT_S,
        "fetch_timeout_s": FETCH_TIMEOUT_S,
        "deploy_env": DEPLOY_ENV,
    }
    for name in ("gptoss-scripts.service", "gptoss-nvme.service", "gptoss-identity.service", "gptoss-stage.service"):
        out.files[f"{UNIT_DIR}/{name}"] = _unit(name, **base, **_limits(cfg))
        out.units.append(name)
        out.wants.append(name)
    if node.role == "prefill":
        _render_prefill(cfg, node, out, bin_dir)
    else:
        _render_server(cfg, out, bin_dir, role=node.role)
    for proxy in layout.proxies_on(node.name):
        _render_proxy(cfg, node, proxy, out, bin_dir)
    if layout.proxies_on(node.name) or node.role == "server":
        _render_bench(cfg, out, bin_dir)
    out.files[f"{UNIT_DIR}/{NODE_TARGET}"] = _unit(NODE_TARGET, node=node.name, wants=out.wants)
    out.files[f"{ETC}/health"] = (health_file(cfg, out), 0o644)
    out.scripts = _needed_scripts(out.files, save_cache=cfg.compile_cache_s3_uri is not None)
    scripts = _scripts()
    for name in sorted(out.scripts & NODE_SCRIPTS):
        out.files[f"{bin_dir}/{name}"] = (scripts[name], 0o755)
    out.files[UNITS_FILE] = ("\n".join(out.units) + "\n", 0o644)
    shipped = {*out.files, MANIFEST, *(f"{bin_dir}/{n}" for n in out.scripts)}
    out.files[MANIFEST] = ("\n".join(sorted(shipped)) + "\n", 0o644)
    return out


def strip_comments(name: str, text: str) -> str:
    """A script as shipped to a node: comment-only lines dropped (the repository keeps them).

    User data is limited to 16 KB per node and the template to 1 MB per stack; the comments
    explain the scripts to their maintainers, not to the node. The shebang, shellcheck
    directives and heredoc bodies are kept verbatim.
    """
    lines = text.splitlines()
    out = [lines[0], f"# {name}: userdata/bin/{name} of the cluster project, comments stripped"]
    heredoc_end: str | None = None
    for line in lines[1:]:
        if heredoc_end is not None:
            out.append(line)
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("# shellcheck"):
            continue
        out.append(line)
        m = re.search(r"<<-?\s*'?(\w+)'?\s*$", line)
        if m:
            heredoc_end = m.group(1)
    return "\n".join(out) + "\n"


def strip_python(name: str, text: str) -> str:
    """A Python script as shipped: docstrings and comments dropped, the code re-printed by `ast`.

    The same reason as strip_comments; the repository keeps the documented source.
    """
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    shebang = text.splitlines()[0]
    return f"{shebang}\n# {name}: userdata/bin/{name} of the cluster project, docstrings stripped\n{ast.unparse(tree)}\n"


def ship(name: str, text: str) -> str:
    """A script as a node receives it (bash or Python, by its shebang)."""
    return strip_python(name, text) if text.startswith("#!/usr/bin/env python3") else strip_comments(name, text)


@functools.cache
def _scripts() -> dict[str, str]:
    return {p.name: ship(p.name, p.read_text()) for p in sorted((USERDATA_DIR / "bin").iterdir()) if p.is_file()}


def node_script(name: str) -> str:
    """The text of a script as a node receives it."""
    return _scripts()[name]


def health_checks(cfg: ClusterConfig, render: NodeRender) -> list[tuple[str, str | None, str | None]]:
    """(unit, local health URL or None, phase name or None) for every unit a ready node runs."""
    s = cfg.serving
    checks: list[tuple[str, str | None, str | None]] = [
        ("gptoss-scripts.service", None, None),
        ("gptoss-nvme.service", None, None),
        ("gptoss-identity.service", None, None),
        ("gptoss-stage.service", None, None),
    ]
    for svc in render.services:
        if svc.unit == "gptoss-decode.service":
            checks.append((svc.unit, health_url("127.0.0.1", s.decode.http_port, s.server_health_path), "decode"))
        elif svc.unit == "gptoss-server.service":
            checks.append((svc.unit, health_url("127.0.0.1", s.server.port, s.server_health_path), "server"))
        elif svc.unit.startswith("gptoss-prefill@"):
            port = int(svc.environment["GPTOSS_HTTP_PORT"])
            index = svc.unit.split("@")[1].split(".")[0]
            checks.append((svc.unit, health_url("127.0.0.1", port, s.server_health_path), f"prefill_{index}"))
        elif svc.unit == "gptoss-proxy.service":
            checks.append((svc.unit, health_url("127.0.0.1", s.proxy.port, s.proxy.health_path), "proxy"))
            checks.append(("gptoss-group-health.service", health_url("127.0.0.1", s.proxy.group_health_port, "/ready"), None))
    return checks


def health_file(cfg: ClusterConfig, render: NodeRender) -> str:
    """`unit url phase` lines read by gptoss-status (`-` where there is none)."""
    return "".join(f"{unit} {url or '-'} {phase or '-'}\n" for unit, url, phase in health_checks(cfg, render))


def _needed_scripts(files: dict[str, tuple[str, int]], *, save_cache: bool) -> set[str]:
    """The scripts this node's units (and those scripts) name, plus its boot, fetch and status."""
    scripts = _scripts()
    wanted = set(NODE_SCRIPTS) | ({"gptoss-save-cache"} if save_cache else set())
    texts = [text for text, _ in files.values()]
    while True:
        found = {name for name in scripts for text in texts if name in text} | wanted
        if found == wanted:
            return wanted
        wanted = found
        texts = [scripts[n] for n in wanted]


def scripts_asset(renders: list[NodeRender], *, bin_dir: str = BIN) -> bytes:
    """The scripts every node fetches: one reproducible tarball for the whole stack."""
    scripts = _scripts()
    names = set().union(*(r.scripts for r in renders)) - NODE_SCRIPTS
    return bundle({f"{bin_dir}/{n}": (scripts[n], 0o755) for n in sorted(names)})


def render_cluster(cfg: ClusterConfig) -> list[NodeRender]:
    """Render every node of the fleet."""
    layout = cfg.layout
    return [render_node(cfg, layout, n) for n in layout.nodes]


# ---- user data ---------------------------------------------------------------------------


def bundle(files: Mapping[str, tuple[str, int]]) -> bytes:
    """A reproducible xz tarball of a node's files (sorted, zero mtimes, root-owned).

    xz rather than gzip: it keeps a node's user data about 8% smaller, which is what lets
    one stack hold 64 decode instances under CloudFormation's 1 MB template limit.
    """
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in sorted(files):
            text, mode = files[path]
            data = text.encode()
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    # A 1 MiB dictionary holds the whole tarball; preset 9's 64 MiB would only cost time.
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": 1 << 20}]
    return lzma.compress(raw.getvalue(), format=lzma.FORMAT_XZ, filters=filters)


def unbundle(blob: bytes) -> dict[str, tuple[str, int]]:
    """Read a bundle back (tests, the snapshot)."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(blob))) as tar:
        for m in tar.getmembers():
            f = tar.extractfile(m)
            assert f is not None
            out["/" + m.name] = (f.read().decode(), m.mode)
    return out


_EXTRACT = f"mkdir -p {PurePosixPath(BUNDLE).parent} {ETC} && echo \"$0\" | base64 -d > {BUNDLE} && tar -xJf {BUNDLE} -C /"
_DEPLOY = f"printf '%s\\n' \"$@\" > {DEPLOY_ENV}"


def user_data(render: NodeRender, hosts: Mapping[str, str], *, scripts_uri: str, scripts_sha256: str) -> str:
    """cloud-init user data: the node's bundle, its peers' IPs and where its scripts are.

    `hosts` (peer name -> IP) and `scripts_uri` are CDK tokens at synth; CloudFormation fills
    them in. The scripts' sha256 is computed here, so the node checks what it fetches.

    Everything is applied in `bootcmd`, which cloud-init runs at every boot with the current
    user data: a spec change deployed with `cdk deploy` (CloudFormation stops the instance,
    changes its user data and starts it) takes effect, where write_files and runcmd would run
    only once per instance. gptoss-bootstrap then starts the node's target at every boot
    (there is no first-boot special case). Data goes to `sh -c` as arguments, never inside
    the script text.
    """
    missing = [p for p in render.peers if p not in hosts]
    if missing:
        raise ValueError(f"{render.node.name}: no address given for peers {missing}")
    values = [f"{host_var(p)}={hosts[p]}" for p in render.peers]
    values += [f"GPTOSS_SCRIPTS_URI={scripts_uri}", f"GPTOSS_SCRIPTS_SHA256={scripts_sha256}"]
    doc = {
        "bootcmd": [
            ["sh", "-c", _EXTRACT, base64.b64encode(bundle(render.files)).decode()],
            ["sh", "-c", _DEPLOY, "sh", *values],
            [f"{BIN}/gptoss-bootstrap"],
        ],
    }
    return "#cloud-config\n" + yaml.safe_dump(doc, sort_keys=False, width=1 << 20)


def parse_user_data(text: str) -> tuple[dict[str, tuple[str, int]], dict[str, str], dict[str, Any]]:
    """Parse user data back into (bundle files, deploy.env, the cloud-config document)."""
    doc = yaml.safe_load(text)
    extract, hosts, *_ = doc["bootcmd"]
    assert extract[:3] == ["sh", "-c", _EXTRACT] and hosts[:4] == ["sh", "-c", _DEPLOY, "sh"], doc["bootcmd"]
    files = unbundle(base64.b64decode(extract[3]))
    return files, parse_env_file("\n".join(hosts[4:])), doc


def plan_json(renders: list[NodeRender]) -> str:
    """The `plan --json` document."""
    return json.dumps({"nodes": [r.as_json() for r in renders]}, indent=2)
