"""The serving section: one recipe's whole tested serving configuration (defaults: reference 000) and its benchmark client."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from clusterspec import validate
from clusterspec.base import Frozen
from clusterspec.errors import rule_error
from clusterspec.sections.endpoint import Endpoint
from clusterspec.sections.flags import COMMON_ENV, EnvSetting, check_env, drop_removed, repo_path, route_path
from clusterspec.sections.proxy import Proxy
from clusterspec.sections.servers import Decode, Prefill, Server, Shape


class Bench(Frozen):
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


class Serving(Frozen):
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
    endpoint: Endpoint = Field(default_factory=Endpoint)
    bench: Bench = Field(default_factory=Bench)

    _common_env = field_validator("common_env", mode="before")(classmethod(lambda cls, v: drop_removed(v)))

    @field_validator("model_id")
    @classmethod
    def _model_id(cls, v: str) -> str:
        # huggingface_hub's own rules (validate_repo_id), which refuse the download otherwise: each part 1-96 of
        # A-Z a-z 0-9 . _ -, not starting or ending with '-' or '.', no '--' or '..', no '.git' at the end.
        part = r"[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
        if not re.fullmatch(f"{part}/{part}", v) or "--" in v or ".." in v or v.endswith(".git"):
            raise rule_error(
                "serving.model_id", v,
                "is not a Hugging Face model id huggingface_hub accepts (org/name: letters, digits, '.', '_', '-', neither part "
                "starting or ending with '-' or '.', no '--' or '..', at most 96 characters each)", "give e.g. openai/gpt-oss-120b",
            )  # fmt: skip
        return v

    @field_validator("examples_dir")
    @classmethod
    def _examples_dir(cls, v: str) -> str:
        return repo_path("serving.examples_dir", v)

    @field_validator("schedule_helper")
    @classmethod
    def _helper(cls, v: str) -> str:
        return validate.file_name("serving.schedule_helper", v)

    @field_validator("server_health_path")
    @classmethod
    def _health(cls, v: str) -> str:
        return route_path("serving.server_health_path", v)

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
        check_env("serving.common_env", self.common_env)
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

    def check_ports(self, *, per_node: int, routed: bool) -> None:
        """Reject any two listeners of one node whose port ranges overlap (`per_node` prefill replicas; `routed`: vLLM's router)."""
        s = self
        ranges: list[tuple[str, int, int]] = [
            ("serving.proxy.port", s.proxy.port, s.proxy.port),
            ("serving.proxy.group_health_port", s.proxy.group_health_port, s.proxy.group_health_port),
            ("serving.decode.http_port", s.decode.http_port, s.decode.http_port),
            ("serving.decode.side_channel_port", *s.decode.side_channel_ports),
            ("serving.prefill.http_port_base", s.prefill.http_port(0), s.prefill.http_port(per_node - 1)),
        ]
        if routed:
            r = s.proxy.router
            ranges += [("serving.proxy.router.internal_port", r.internal_port, r.internal_port),
                       ("serving.proxy.router.metrics_port", r.metrics_port, r.metrics_port)]  # fmt: skip
        ranges += [
            (f"serving.prefill.side_channel_port_base (replica {i})", *s.prefill.side_channel_range(i)) for i in range(per_node)
        ]
        for i, (name_a, lo_a, hi_a) in enumerate(ranges):
            if hi_a > 65535:
                raise rule_error(name_a.split(" ")[0], lo_a, f"its range ends at {hi_a}, past 65535", "lower the base port")
            for name_b, lo_b, hi_b in ranges[i + 1 :]:
                if lo_a <= hi_b and lo_b <= hi_a:
                    raise rule_error(
                        name_b.split(" ")[0],
                        lo_b,
                        f"ports {lo_b}-{hi_b} ({name_b}) collide with {lo_a}-{hi_a} ({name_a}) for "
                        f"{per_node} replicas per instance",
                        "move one of the two port bases so the ranges are disjoint",
                    )
