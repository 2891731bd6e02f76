"""The tested serving configuration of reference 000 (Neuron SDK 2.33, gpt-oss-120b 8K/1K, 6P1D).

Every default here is a value of the reference's tables; the field description is the
reason the reference gives. The rest of the project derives ports, flags, environment,
security-group rules and systemd units from these objects and writes none of them again.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from clusterspec import validate
from clusterspec.base import Frozen
from clusterspec.errors import rule_error
from clusterspec.sections.flags import DECODE_ENV, EnvSetting, ExtraFlag, carried_json, check_env, check_extra_flags, drop_removed


class Shape(Frozen):
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
        carried_json("serving.shape.hf_overrides", v)
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


class Decode(Frozen):
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

    _env = field_validator("env", mode="before")(classmethod(lambda cls, v: drop_removed(v)))

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
        check_env("serving.decode.env", self.env)
        check_extra_flags("serving.decode.extra_flags", self.extra_flags)
        return self


class Prefill(Frozen):
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
        check_extra_flags("serving.prefill.extra_flags", self.extra_flags)
        return self

    def cores(self, index: int) -> tuple[int, int]:
        """First and last logical NeuronCore of replica `index` (4i .. 4i+3 for TP4)."""
        return self.tensor_parallel * index, self.tensor_parallel * index + self.tensor_parallel - 1


class Server(Frozen):
    """The one server of a single-instance recipe (reference 001, 'Deploy on a single instance')."""

    tensor_parallel: int = Field(8, gt=0, description="TP8: one server with tensor parallelism.")
    lnc: Literal[1, 2] = Field(2, description="The default logical-core config.")
    max_num_seqs: int = Field(4, gt=0, description="The batch bucket of the server.")
    port: int = Field(8000, ge=1024, le=65535, description="The server listens on port 8000.")
    enable_prefix_caching: bool = Field(True, description="--enable-prefix-caching.")
    max_logprobs: int | None = Field(None, ge=0, description="Left at vLLM's default (logprobs available).")
    env: dict[str, EnvSetting] = Field(default_factory=dict)
    extra_flags: tuple[ExtraFlag, ...] = ()

    _env = field_validator("env", mode="before")(classmethod(lambda cls, v: drop_removed(v)))

    @property
    def capacity(self) -> int:
        """Concurrent sequences of the server."""
        return self.max_num_seqs

    @model_validator(mode="after")
    def _server_rules(self) -> Server:
        check_env("serving.server.env", self.env)
        check_extra_flags("serving.server.extra_flags", self.extra_flags)
        return self
