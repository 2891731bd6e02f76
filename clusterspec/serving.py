"""The tested serving configuration of reference 000 (Neuron SDK 2.33, gpt-oss-120b 8K/1K, 6P1D).

Every default here is a value of the reference's tables; the field description is the
reason the reference gives. The rest of the project derives ports, flags, environment,
security-group rules and systemd units from these objects and writes none of them again.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from clusterspec import validate
from clusterspec.errors import rule_error


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EnvSetting(_Frozen):
    """One environment variable of a server, with the reason it is set."""

    value: str
    reason: str

    @field_validator("value")
    @classmethod
    def _carried(cls, v: str) -> str:
        return validate.carried("serving env value", v)


class ExtraFlag(_Frozen):
    """A serving flag the spec does not model; added after the tested flags."""

    name: str = Field(pattern=r"^--[a-z0-9][a-z0-9-]*$", max_length=100)
    value: str | None = None
    reason: str = Field(min_length=1)

    @field_validator("value")
    @classmethod
    def _carried(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v == "--":
            raise rule_error("extra flag value", v, "'--' ends the wrappers' own arguments on the node", "pass the flag's real value")
        # A backslash starts one of systemd's C escapes on an Exec line.
        return validate.carried("extra flag value", v, extra={"\\": "a backslash"})


def _env(**pairs: tuple[str, str]) -> dict[str, EnvSetting]:
    return {k: EnvSetting(value=v, reason=r) for k, (v, r) in pairs.items()}


COMMON_ENV = _env(
    VLLM_NEURON_BACKEND=(
        "neuron_native",
        "The compile route; libtorch-neuronx-lite selects its native-route setup only for an explicit value.",
    ),
    NEURON_LIBTORCH_DISABLE_GRAPH_CAPTURE_BACKEND=("1", "The native route needs the graph-capture backend off."),
    TORCH_NEURONX_VOCAB_SHARDING_SPMD_DISABLE=(
        "1",
        "Turns off the vocab-sharding FX pass, so the per-rank vocab offset stays out of the graph.",
    ),
    NEURON_RT_DBG_VECTOR_DGE_SKIP_NOTIF=(
        "1",
        "Packed-FP8 KV writes benign out-of-bound skip notifications that otherwise stop the decode server on a long run.",
    ),
    VLLM_NEURON_NIXL_PROGRESS_THREAD_DELAY_US=(
        "250",
        "The NIXL progress thread polls with no delay by default and takes a core from the worker.",
    ),
    VLLM_NIXL_SIDE_CHANNEL_HOST=("0.0.0.0", "The side channel must accept the KV handshake from the other node."),
    NEURON_LIBTORCH_COMPILATION_TIMEOUT=(
        "2400",
        "Seconds for the compile of one graph; the default 600 is shorter than one prefill graph compile.",
    ),
    VLLM_ENGINE_READY_TIMEOUT_S=(
        "14400",
        "Seconds for the startup of one server; the first prefill replica compiles its graph during startup.",
    ),
)

DECODE_ENV = _env(
    VLLM_NEURON_MEGA_COLLECTIVE_PRIVATE_SRC=(
        "1",
        "Keeps the source tensors of a collective off shared HBM; a toolchain that requires it stops the trace without it.",
    ),
    VLLM_NEURON_BATCH_QUEUE_DEPTH=("4", "Four batches in flight hide the host time of a step."),
    NEURON_RT_XU_WORKER_ENABLE_LOW_LATENCY_COMPLETION=(
        "0",
        "The completion poll backs off and gives host cores back to the workers.",
    ),
    VLLM_NEURON_MEGA_FUSE_EMBED=("1", "The token embedding inside the megakernel."),
    VLLM_NEURON_TAIL_FLAT_ROW_GATHER=("1", "One row gather in the fused tail."),
)

# Variables the renderer computes from typed fields; an env table may not set them by hand.
DERIVED_ENV = frozenset(
    {
        "NEURON_LOGICAL_NC_CONFIG",
        "NEURON_VISIBLE_DEVICES",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_NEURON_MEGA_DMA_ORDER_CONSTRAINTS_FILE",
    }
)


# Environment values the servers read as whole seconds; a bad one stops them hours in.
SECONDS_ENV = {
    "VLLM_ENGINE_READY_TIMEOUT_S": 43200,
    "NEURON_LIBTORCH_COMPILATION_TIMEOUT": 43200,
    "VLLM_NEURON_COMPILATION_TIMEOUT": 43200,
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": 43200,
}


# What a server's process needs as the units and the venv set it: an env table may not replace it.
UNIT_ENV = frozenset({"PATH", "HOME", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "NEURON_RT_VISIBLE_CORES"})


def _drop_removed(v: Any) -> Any:
    """An env table entry set to null is removed (-c serving.common_env.X=null): tables merge key by key."""
    return {k: e for k, e in v.items() if e is not None} if isinstance(v, dict) else v


def _check_env(field: str, env: dict[str, EnvSetting]) -> None:
    for name, setting in env.items():
        validate.env_name(f"{field}.{name}", name)
        if name in SECONDS_ENV:
            validate.positive_int_text(f"{field}.{name}", setting.value, maximum=SECONDS_ENV[name])
    owned = sorted(UNIT_ENV & set(env))
    if owned:
        raise rule_error(
            field, owned,
            "the units and the venv set these for every server (the command search path, the loader, the NeuronCores a server binds)",
            "remove them from the env table (NeuronCores follow the layout: replicas_per_prefill_instance and lnc)",
        )  # fmt: skip
    derived = sorted(DERIVED_ENV & set(env))
    if derived:
        raise rule_error(
            field,
            derived,
            "these variables are derived from typed fields (lnc, ports, layout, schedule path)",
            "remove them from the env table and set the typed field instead",
        )


class Shape(_Frozen):
    """Settings every server of a recipe shares (reference 000, 'Shape'; None leaves a flag out)."""

    max_model_len: int = Field(10240, gt=0, description="Holds the 8,192 input tokens and the 1,024 output tokens.")
    max_num_batched_tokens: int = Field(
        8192, gt=0, description="One prefill segment holds the whole prompt; one bucket [8192] on both roles."
    )
    output_len: int = Field(1024, gt=0, description="The tested shape's output tokens (8K in, 1K out).")
    block_size: int | None = Field(128, gt=0, description="The KV block size of the packed FP8 cache.")
    kv_cache_dtype: Literal["fp8"] | None = Field("fp8", description="The packed FP8 KV layout prefill writes and the megakernel reads.")
    fp8_packed_kv: bool = Field(True, description="The packed FP8 KV layout prefill writes and the megakernel reads.")
    kv_segment_buckets: bool = Field(True, description="One kv_segment_size_buckets entry, the prompt's size, for a single compiled graph.")
    dtype: Literal["bfloat16"] | None = Field(None, description="--dtype; reference 000 passes none.")
    keep_hybrid_kv_cache_manager: bool = Field(
        True, description="--no-disable-hybrid-kv-cache-manager: the sliding-window layers need it."
    )
    hf_overrides: dict[str, Any] = Field(
        default_factory=lambda: {"quantization_config": {}},
        description="Lets vLLM load the published MXFP4 checkpoint.",
    )
    quantization: Literal["mxfp4", "bf16"] | None = Field(
        "mxfp4",
        description="neuron_config.quantization 'mxfp4' selects the Neuron MXFP4 path (Trn3 only); 'bf16' leaves the key "
        "out and runs BF16 (Trn2); None leaves the choice to the backend (it picks MXFP4 on Trn3).",
    )
    distributed_executor_backend: Literal["mp"] | None = Field("mp", description="The multiprocess executor.")
    kv_connector: Literal["NixlConnector"] = Field("NixlConnector", description="KV transfer over NIXL.")
    kv_buffer_device: str = Field(
        "cuda", pattern=r"^[a-z]+$", description="As in the DI command of the Neuron gpt-oss tutorial (reference 001)."
    )
    nixl_backends: tuple[Annotated[str, Field(pattern=r"^[A-Z][A-Z0-9_]*$")], ...] = Field(
        ("LIBFABRIC",), min_length=1, description="NIXL over libfabric, that is EFA on AWS."
    )

    @field_validator("hf_overrides")
    @classmethod
    def _overrides(cls, v: dict[str, Any]) -> dict[str, Any]:
        _carried_json("serving.shape.hf_overrides", v)
        return v

    @property
    def input_len(self) -> int:
        """Prompt tokens of the tested shape."""
        return self.max_num_batched_tokens


    @model_validator(mode="after")
    def _shape_fits(self) -> Shape:
        if self.max_num_batched_tokens + self.output_len > self.max_model_len:
            raise rule_error(
                "serving.shape.max_model_len",
                self.max_model_len,
                f"must hold max_num_batched_tokens + {self.output_len} output tokens "
                f"= {self.max_num_batched_tokens + self.output_len}",
                f"set max_model_len >= {self.max_num_batched_tokens + self.output_len}",
            )
        return self


class Decode(_Frozen):
    """The decode server (reference 000, node B: the megakernel decode)."""

    tensor_parallel: int = Field(8, gt=0, description="TP8 ranks.")
    data_parallel: int = Field(16, gt=0, description="16 TP8 ranks give 128 ranks.")
    ep_degree: int = Field(128, gt=0, description="One expert on each of the 128 ranks (EP = TP x DP).")
    lnc: Literal[1, 2] = Field(1, description="NEURON_LOGICAL_NC_CONFIG=1: the megakernel needs one logical core per physical core.")
    max_num_seqs: int = Field(
        8, gt=0, description="The partition axis caps the per-rank decode batch at 128 * TP / EP = 8."
    )
    optimization_level: int | None = Field(2, ge=0, le=3, description="The compiler optimization level of the decode graph.")
    max_logprobs: int | None = Field(0, ge=0, description="--max-logprobs 0: no logprob gather.")
    ep_in_neuron_config: bool = Field(True, description="neuron_config carries ep_degree (reference 000 does; 001 derives it from TP x DP).")
    visible_all_cores: bool = Field(False, description="NEURON_VISIBLE_DEVICES names every core of the instance (reference 001).")
    embedding_dp_size: int = Field(1, gt=0, description="The megakernel builds the token embedding; not sharded over DP.")
    lm_head_dp_size: int = Field(16, gt=0, description="The lm_head is replicated over the 16 data-parallel ranks.")
    tail_hops: tuple[Annotated[int, Field(gt=0)], ...] = Field(
        (128,), description="One 128-rank all-to-all in the fused tail (gpt_oss_tail_hops; left out when empty)."
    )
    http_port: int = Field(8200, ge=1024, le=65535, description="The decode server's HTTP port.")
    side_channel_port: int = Field(8759, ge=1024, le=65535, description="Past the last prefill side-channel port.")
    env: dict[str, EnvSetting] = Field(default_factory=lambda: dict(DECODE_ENV))
    schedule_file: str | None = Field(
        "gpt_oss_120b_megakernel_dma_order.json",
        description="The shipped DMA-order schedule (MEGAKERNEL_SCHEDULE) in the examples directory; None: no megakernel.",
    )
    megakernel_scope: str = Field("auto", pattern=r"^(auto|[0-9]+)$", description="MEGAKERNEL_SCOPE: auto gives 250 on the native route.")
    extra_flags: tuple[ExtraFlag, ...] = ()

    _env = field_validator("env", mode="before")(classmethod(lambda cls, v: _drop_removed(v)))

    @field_validator("schedule_file")
    @classmethod
    def _schedule(cls, v: str | None) -> str | None:
        return v if v is None else validate.file_name("serving.decode.schedule_file", v)

    @property
    def megakernel(self) -> bool:
        """The megakernel decode of reference 000 (a DMA-order schedule is written before it starts)."""
        return self.schedule_file is not None

    @property
    def capacity(self) -> int:
        """Concurrent sequences of one decode server: max_num_seqs on each DP rank."""
        return self.max_num_seqs * self.data_parallel

    @property
    def side_channel_ports(self) -> tuple[int, int]:
        """Side-channel range covering base+dp_rank (current vLLM) and base+dp*tp+tp (older)."""
        return self.side_channel_port, self.side_channel_port + self.data_parallel * self.tensor_parallel - 1

    def visible_cores(self, instance_cores: int) -> str:
        """NEURON_VISIBLE_DEVICES of the decode server: every logical core ('0-63' at LNC=2)."""
        return f"0-{instance_cores - 1}"

    @model_validator(mode="after")
    def _decode_rules(self) -> Decode:
        if self.ep_degree != self.tensor_parallel * self.data_parallel:
            raise rule_error(
                "serving.decode.ep_degree",
                self.ep_degree,
                f"decode EP must equal TP x DP = {self.tensor_parallel} x {self.data_parallel} "
                f"= {self.tensor_parallel * self.data_parallel} (one expert slice per rank)",
                f"set ep_degree to {self.tensor_parallel * self.data_parallel} or change tensor_parallel/data_parallel",
            )
        cap = 128 * self.tensor_parallel // self.ep_degree
        if self.megakernel and self.max_num_seqs > cap:
            raise rule_error(
                "serving.decode.max_num_seqs",
                self.max_num_seqs,
                f"the partition axis caps it at 128*TP/EP = {cap} for TP{self.tensor_parallel} "
                f"EP{self.ep_degree} (else the trace stops with 'Partition dim size must be preserved')",
                f"set max_num_seqs <= {cap}",
            )
        if self.lm_head_dp_size != self.data_parallel:
            raise rule_error(
                "serving.decode.lm_head_dp_size",
                self.lm_head_dp_size,
                f"the lm_head is replicated over the data-parallel ranks: it must equal data_parallel={self.data_parallel}",
                f"set lm_head_dp_size to {self.data_parallel}",
            )
        _check_env("serving.decode.env", self.env)
        _check_extra_flags("serving.decode.extra_flags", self.extra_flags)
        return self


class Prefill(_Frozen):
    """One TP4 prefill replica; replicas differ only in cores and ports."""

    tensor_parallel: int = Field(4, gt=0, description="TP4 for each replica.")
    data_parallel: Literal[1] = Field(
        1, description="Separate DP1 servers: expert parallelism cannot share DP ranks on the prefill graph."
    )
    ep_degree: int = Field(2, gt=0, description="ep_degree 2 sets the MoE expert-parallel width of prefill.")
    lnc: Literal[1, 2] = Field(2, description="The prefill graph runs the per-layer path at LNC=2.")
    max_num_seqs: int = Field(1, gt=0, description="One prompt for each prefill step.")
    http_port_base: int = Field(8100, ge=1024, le=65535, description="Replica i serves HTTP on 8100 + i.")
    side_channel_port_base: int = Field(5559, ge=1024, le=65535, description="Replica i uses side channel 5559 + 100 * i.")
    side_channel_port_step: int = Field(100, gt=0, description="One side-channel port block for each replica.")
    side_channel_in_config: bool = Field(
        True, description="The side-channel port also goes into nixl_side_channel_port of the additional config (reference 000)."
    )
    max_logprobs: int | None = Field(0, ge=0, description="--max-logprobs 0: no logprob gather.")
    extra_flags: tuple[ExtraFlag, ...] = ()

    def http_port(self, index: int) -> int:
        """HTTP port of replica `index` on its instance."""
        return self.http_port_base + index

    def side_channel_port(self, index: int) -> int:
        """NIXL side-channel base port of replica `index` on its instance."""
        return self.side_channel_port_base + self.side_channel_port_step * index

    def side_channel_range(self, index: int) -> tuple[int, int]:
        """Ports of replica `index`: base+dp_rank (current vLLM), and base+dp*tp+tp (older) when the
        step between replicas leaves room for it (reference 001 spaces replicas one port apart)."""
        base = self.side_channel_port(index)
        span = self.data_parallel * self.tensor_parallel if self.side_channel_port_step >= self.data_parallel * self.tensor_parallel else self.data_parallel
        return base, base + span - 1

    @model_validator(mode="after")
    def _prefill_rules(self) -> Prefill:
        _check_extra_flags("serving.prefill.extra_flags", self.extra_flags)
        return self

    def cores(self, index: int) -> tuple[int, int]:
        """First and last logical NeuronCore of replica `index` (4i .. 4i+3 for TP4)."""
        return self.tensor_parallel * index, self.tensor_parallel * index + self.tensor_parallel - 1


class Server(_Frozen):
    """The one server of a single-instance recipe (reference 001, 'Deploy on a single instance')."""

    tensor_parallel: int = Field(8, gt=0, description="TP8: one server with tensor parallelism.")
    lnc: Literal[1, 2] = Field(2, description="The default logical-core config.")
    max_num_seqs: int = Field(4, gt=0, description="The batch bucket of the server.")
    port: int = Field(8000, ge=1024, le=65535, description="The server listens on port 8000.")
    enable_prefix_caching: bool = Field(True, description="--enable-prefix-caching.")
    max_logprobs: int | None = Field(None, ge=0, description="Left at vLLM's default (logprobs available).")
    env: dict[str, EnvSetting] = Field(default_factory=dict)
    extra_flags: tuple[ExtraFlag, ...] = ()

    _env = field_validator("env", mode="before")(classmethod(lambda cls, v: _drop_removed(v)))

    @property
    def capacity(self) -> int:
        """Concurrent sequences of the server."""
        return self.max_num_seqs

    @model_validator(mode="after")
    def _server_rules(self) -> Server:
        _check_env("serving.server.env", self.env)
        _check_extra_flags("serving.server.extra_flags", self.extra_flags)
        return self


ProxyKind = Literal["toy", "vllm-router"]
RouterPolicy = Literal["random", "round_robin", "power_of_two", "cache_aware", "consistent_hash"]


class Router(_Frozen):
    """vLLM's own router (PyPI vllm-router): a pinned wheel, its routing policies and failure settings.

    The defaults are what the loopback fault test measured (README 'Router'): a dead server is
    out of rotation within the health window (failure threshold x interval + timeout); what the
    router sent it before that fails (0.1.17 does not retry a failed handoff on another server),
    nothing after.
    """

    version: str = Field("0.1.17", pattern=r"^[0-9]+(\.[0-9]+){1,3}$", description="The vllm-router release.")
    wheel: str = Field(
        "vllm_router-0.1.17-cp38-abi3-manylinux_2_28_x86_64.whl",
        pattern=r"^vllm_router-[0-9.]+-cp3[0-9]+-abi3-manylinux_[0-9]+_[0-9]+_x86_64\.whl$",
        description="The release's wheel for the nodes (abi3: any CPython of the DLAMI; no compiled dependency).",
    )
    sha256: str = Field(
        "85c96bea4d573a49b5a8ae4c72ee3dfe733aba26b6f1ff1256e6142f1f42694d",
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the wheel: `make setup` refuses another file, and a node checks what it fetches.",
    )
    prefill_policy: RouterPolicy | None = Field(
        None,
        description="Unset: power_of_two (least loaded of two random servers; needs no tokenizer route on the servers) "
        "with two or more prefill servers, round_robin with one (vllm-router 0.1.17 refuses power_of_two over one server).",
    )
    decode_policy: RouterPolicy | None = Field(None, description="The same rule for the decode servers.")
    health_check_interval_s: int = Field(1, ge=1, le=300, description="How often the router asks every server's /health.")
    health_check_timeout_s: int = Field(1, ge=1, le=60, description="A /health answer slower than this counts as a failure.")
    health_failure_threshold: int = Field(2, ge=1, le=20, description="Failed checks in a row that take a server out of rotation.")
    health_success_threshold: int = Field(1, ge=1, le=20, description="Passed checks in a row that bring it back.")
    retry_max_retries: int = Field(3, ge=0, le=10, description="A request that failed to reach a server is sent again, to another.")
    retry_initial_backoff_ms: int = Field(20, ge=1, le=10000, description="First pause before a retry.")
    retry_max_backoff_ms: int = Field(500, ge=1, le=60000, description="Longest pause between retries.")
    cb_failure_threshold: int = Field(3, ge=1, le=100, description="Failures in a row that open a server's circuit breaker.")
    cb_timeout_s: int = Field(5, ge=1, le=600, description="How long an open breaker keeps the server out before one trial request.")
    request_timeout_s: int = Field(1800, ge=10, le=86400, description="The longest one request may take end to end.")
    metrics_port: int = Field(8029, ge=1024, le=65535, description="Prometheus metrics, on 127.0.0.1 (the node's collector reads them).")
    extra_flags: tuple[ExtraFlag, ...] = Field(
        (), description="Router flags the spec does not model; checked against the pinned router's own parser at plan time."
    )

    @model_validator(mode="after")
    def _router_rules(self) -> Router:
        if f"-{self.version}-" not in self.wheel:
            raise rule_error(
                "serving.proxy.router.wheel", self.wheel, f"is not a wheel of version {self.version}",
                "give the wheel file of the pinned version (and its sha256)",
            )  # fmt: skip
        if self.retry_max_backoff_ms < self.retry_initial_backoff_ms:
            raise rule_error(
                "serving.proxy.router.retry_max_backoff_ms", self.retry_max_backoff_ms,
                f"is below retry_initial_backoff_ms={self.retry_initial_backoff_ms}", "raise it or lower the initial back-off",
            )  # fmt: skip
        seen: set[str] = set()
        for flag in self.extra_flags:
            if flag.name in seen:
                raise rule_error("serving.proxy.router.extra_flags", flag.name, "is given twice", "keep one")
            seen.add(flag.name)
        return self


class Proxy(_Frozen):
    """The endpoint of a DI fleet: the examples' toy proxy, or vLLM's router."""

    kind: ProxyKind | None = Field(
        None,
        description="'toy' runs the references' toy_proxy_server.py exactly as they do (one per decode server, a fixed "
        "group of replicas); 'vllm-router' runs vLLM's router, which health-checks and retries. Unset: the router when "
        "the fleet has more than one decode server, the toy proxy for the references' one-decode layouts.",
    )
    router: Router = Field(default_factory=Router)
    port: int = Field(8000, ge=1024, le=65535, description="The client endpoint.")
    bind_host: str = Field("0.0.0.0", description="The proxy defaults to 127.0.0.1; other nodes and the NLB must reach it.")
    health_path: str = Field("/healthcheck", description="The proxy has no /health route.")
    group_health_port: int = Field(
        8001,
        ge=1024,
        le=65535,
        description="The project's health route for the load balancer: ready only when the proxy and every server "
        "of its group answer (the proxy's own /healthcheck answers as long as its process runs).",
    )
    script: str = Field(
        "examples/vllm_neuron/vllm/disaggregated_inference/toy_proxy_server.py",
        description="Path of the proxy inside the vLLM Neuron repository.",
    )

    @field_validator("script")
    @classmethod
    def _script(cls, v: str) -> str:
        return _repo_path("serving.proxy.script", v)

    @field_validator("health_path")
    @classmethod
    def _route(cls, v: str) -> str:
        return _route_path("serving.proxy.health_path", v)

    @field_validator("bind_host")
    @classmethod
    def _bind(cls, v: str) -> str:
        try:
            ipaddress.IPv4Address(v)
        except ValueError:
            raise rule_error("serving.proxy.bind_host", v, "must be an IPv4 address", "use 0.0.0.0 (other nodes and the load balancer reach the proxy)") from None
        return v


class Bench(_Frozen):
    """The benchmark client (reference 000 step 5: random prompts of the shape, --ignore-eos)."""

    warmup_prompts: int = Field(1280, gt=0, description="The first leg after a launch is not a valid measurement.")
    measured_prompts: int = Field(12800, gt=0, description="The result leg.")
    netrc: str = Field("/dev/null", description="vllm bench serve reads ~/.netrc before each request; keep it local.")
    result_file: str = Field("bench_clean.json", description="The measured leg's result, in the results directory.")
    warmup_result_file: str = Field("bench_warmup.json", description="The warm-up leg's result, kept apart: not a measurement.")

    @field_validator("result_file", "warmup_result_file")
    @classmethod
    def _files(cls, v: str, info: ValidationInfo) -> str:
        return validate.file_name(f"serving.bench.{info.field_name}", v)

    @field_validator("netrc")
    @classmethod
    def _netrc(cls, v: str) -> str:
        if v != "/dev/null":
            validate.node_path("serving.bench.netrc", v)
        return v

    @model_validator(mode="after")
    def _apart(self) -> Bench:
        if self.result_file == self.warmup_result_file:
            raise rule_error(
                "serving.bench.warmup_result_file", self.warmup_result_file, "the warm-up leg would overwrite the measured result",
                "give the two legs different file names",
            )  # fmt: skip
        return self


class Serving(_Frozen):
    """The whole tested serving configuration of one recipe (defaults: reference 000)."""

    recipe: str = Field("gptoss-120b-8k1k", description="The recipe these values come from (see clusterspec/recipes).")
    topology: Literal["disaggregated", "single"] = Field(
        "disaggregated", description="Prefill replicas and decode servers behind proxies, or one server per instance."
    )
    explicit_lnc: bool = Field(
        True, description="NEURON_LOGICAL_NC_CONFIG is set on each server (reference 000); else the default (2) applies."
    )
    tested_decode_ep: int | None = Field(
        None, description="The decode EP degree the recipe's reference tested; another one is refused."
    )
    model_id: str = Field("openai/gpt-oss-120b", description="The Hugging Face checkpoint.")
    examples_dir: str = Field(
        "examples/vllm_neuron/models/gpt_oss/120b/mxfp4/multinode_DI_8k1k",
        description="The 8K/1K scripts, the schedule and its helper in the vLLM Neuron repository.",
    )
    schedule_helper: str = Field(
        "prepare_megakernel_schedule.py", description="Writes the schedule into MEGAKERNEL_SCHEDULE_DIR."
    )
    server_health_path: str = Field("/health", description="vLLM servers answer GET /health.")
    shape: Shape = Field(default_factory=Shape)
    decode: Decode = Field(default_factory=Decode)
    prefill: Prefill = Field(default_factory=Prefill)
    server: Server = Field(default_factory=Server)
    common_env: dict[str, EnvSetting] = Field(default_factory=lambda: dict(COMMON_ENV))
    proxy: Proxy = Field(default_factory=Proxy)
    bench: Bench = Field(default_factory=Bench)

    _common_env = field_validator("common_env", mode="before")(classmethod(lambda cls, v: _drop_removed(v)))

    @field_validator("model_id")
    @classmethod
    def _model_id(cls, v: str) -> str:
        if not re.fullmatch(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$", v) or ".." in v:
            raise rule_error("serving.model_id", v, "is not a Hugging Face model id (org/name)", "give e.g. openai/gpt-oss-120b")
        return v

    @field_validator("examples_dir")
    @classmethod
    def _examples_dir(cls, v: str) -> str:
        return _repo_path("serving.examples_dir", v)

    @field_validator("schedule_helper")
    @classmethod
    def _helper(cls, v: str) -> str:
        return validate.file_name("serving.schedule_helper", v)

    @field_validator("server_health_path")
    @classmethod
    def _health(cls, v: str) -> str:
        return _route_path("serving.server_health_path", v)

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode on separate servers (the DI recipes)."""
        return self.topology == "disaggregated"

    @property
    def engine_ready_timeout_s(self) -> int:
        """VLLM_ENGINE_READY_TIMEOUT_S: the longest a server may take to start (vLLM's default 600 when unset)."""
        setting = self.common_env.get("VLLM_ENGINE_READY_TIMEOUT_S")
        return int(setting.value) if setting else 600

    @property
    def capacity(self) -> int:
        """Concurrent sequences behind one endpoint: the decode server's, or the single server's."""
        return self.decode.capacity if self.disaggregated else self.server.capacity

    @model_validator(mode="after")
    def _serving_rules(self) -> Serving:
        _check_env("serving.common_env", self.common_env)
        if self.disaggregated and "VLLM_ENGINE_READY_TIMEOUT_S" not in self.common_env:
            raise rule_error(
                "serving.common_env",
                sorted(self.common_env),
                "VLLM_ENGINE_READY_TIMEOUT_S is required: the replicas' and the proxy's waits are sized from it",
                "add VLLM_ENGINE_READY_TIMEOUT_S (the tested value is 14400)",
            )
        if self.disaggregated and self.tested_decode_ep is not None and self.decode.ep_degree != self.tested_decode_ep:
            raise rule_error(
                "serving.decode.data_parallel", self.decode.data_parallel,
                f"gives EP{self.decode.ep_degree}; the {self.recipe} recipe is tested at EP{self.tested_decode_ep} and its "
                "reference warns that untested EP degrees have produced degenerate output",
                f"keep data_parallel={self.tested_decode_ep // self.decode.tensor_parallel} (EP{self.tested_decode_ep})",
            )  # fmt: skip
        if self.disaggregated and not self.decode.megakernel and self.decode.embedding_dp_size != self.decode.data_parallel:
            raise rule_error(
                "serving.decode.embedding_dp_size", self.decode.embedding_dp_size,
                f"is replicated over the data-parallel ranks in this recipe: it must equal data_parallel={self.decode.data_parallel}",
                f"set embedding_dp_size to {self.decode.data_parallel}",
            )  # fmt: skip
        return self


# Flags the spec models with typed fields; an extra flag may not set one of them a second time.
MODELED_FLAGS = frozenset(
    ["--tensor-parallel-size", "--data-parallel-size", "--enable-expert-parallel", "--optimization-level", "--max-model-len", "--max-num-batched-tokens", "--max-num-seqs", "--block-size", "--kv-cache-dtype", "--max-logprobs", "--no-disable-hybrid-kv-cache-manager", "--distributed-executor-backend", "--port", "--hf-overrides", "--kv-transfer-config", "--additional-config", "--dtype", "--enable-prefix-caching", "--host"]
)


# Flags the units and the deploy gate depend on without a typed field: the model's name (the gate
# and the proxy ask for the model by its path) and a file of flags that would override the rest.
OWNED_FLAGS = frozenset(["--model", "--served-model-name", "--config"])


def _owned_spellings() -> frozenset[str]:
    """Every spelling argparse maps to a modeled or owned flag: the flag, its --no- negation
    (BooleanOptionalAction) and, for a --no- flag, its positive form."""
    out = set(MODELED_FLAGS | OWNED_FLAGS)
    for flag in MODELED_FLAGS:
        out.add(f"--{flag[5:]}" if flag.startswith("--no-") else f"--no-{flag[2:]}")
    return frozenset(out)


OWNED_SPELLINGS = _owned_spellings()


def _check_extra_flags(field: str, flags: tuple[ExtraFlag, ...]) -> None:
    seen: set[str] = set()
    for flag in flags:
        # vLLM's parser takes any unambiguous prefix of a flag (--max-num-seq is --max-num-seqs).
        owned = sorted(o for o in OWNED_SPELLINGS if o.startswith(flag.name))
        as_read = "" if flag.name in owned else f" (vLLM reads it as {' or '.join(owned)})"
        if any(o not in OWNED_FLAGS for o in owned):
            raise rule_error(
                field, flag.name, f"the spec sets this flag from a typed field{as_read}; a second copy would decide which one vLLM reads",
                "set the typed field under serving.* instead (see README 'Parameters')",
            )  # fmt: skip
        if owned:
            raise rule_error(
                field, flag.name, f"the units set this flag themselves{as_read}: the deploy gate and the proxy ask for the model by its path",
                "remove it",
            )  # fmt: skip
        if flag.name in seen:
            raise rule_error(field, flag.name, "is given twice", "keep one")
        seen.add(flag.name)


def _carried_json(field: str, value: Any) -> None:
    """A JSON argument must survive systemd's quoting: no single quote, no backslash (json escapes)."""
    text = json_arg(value)
    for ch, name in (("'", "a single quote"), ("\\", "a backslash or an escaped character")):
        if ch in text:
            raise rule_error(field, text, f"its JSON holds {name}, which cannot be carried into a unit's command line", "remove it")


def _repo_path(field: str, value: str) -> str:
    """A relative path inside the examples repository."""
    parts = value.split("/")
    if value.startswith("/") or ".." in parts or "." in parts or "" in parts or not re.fullmatch(r"^[A-Za-z0-9_./-]+$", value):
        raise rule_error(field, value, "must be a relative path inside the vLLM Neuron repository (no '..', no leading '/')", "give the path as in the repository")
    return value


def _route_path(field: str, value: str) -> str:
    if not re.fullmatch(r"^/[A-Za-z0-9/_.-]*$", value):
        raise rule_error(field, value, "must be an HTTP path starting with /", "give a route like /health")
    return value


def json_arg(value: Any) -> str:
    """Serialize a JSON command-line argument the same way everywhere (stable, compact)."""
    return json.dumps(value, separators=(", ", ": "))
