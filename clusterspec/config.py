"""Operator parameters of a deployment, validated before anything is synthesized."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from clusterspec.errors import SpecError, explain, rule_error
from clusterspec.instance_types import KNOWN_INSTANCE_TYPES, InstanceType
from clusterspec.layout import Layout, compute_layout
from clusterspec.serving import Serving

DEFAULT_AMI_PARAMETER = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NetworkConfig(_Frozen):
    """A new VPC with one private subnet, or an existing VPC and subnet."""

    vpc_id: str | None = Field(None, pattern=r"^vpc-[0-9a-f]{8,17}$")
    subnet_id: str | None = Field(None, pattern=r"^subnet-[0-9a-f]{8,17}$")
    route_table_id: str | None = Field(
        None, pattern=r"^rtb-[0-9a-f]{8,17}$", description="Existing VPC: route table for the S3 gateway endpoint."
    )
    vpc_cidr: str = "10.42.0.0/16"
    subnet_cidr: str = Field("10.42.0.0/20", description="The nodes' private subnet.")
    public_subnet_cidr: str = Field("10.42.16.0/28", description="Holds only the NAT gateway (egress=nat).")
    egress: Literal["nat", "none"] = Field(
        "nat",
        description="nat: internet egress through a NAT gateway (Hugging Face, git). none: no route out; "
        "model and examples from S3 through the gateway endpoint, SSM through interface endpoints.",
    )
    s3_gateway_endpoint: bool = True
    flow_logs: bool = Field(True, description="VPC flow logs to CloudWatch Logs (rejected traffic only).")

    @field_validator("vpc_cidr", "subnet_cidr", "public_subnet_cidr")
    @classmethod
    def _cidr(cls, v: str, info: ValidationInfo) -> str:
        try:
            ipaddress.ip_network(v)
        except ValueError as e:
            raise rule_error(f"network.{info.field_name}", v, f"is not an IPv4 CIDR block ({e})", "give a block like 10.42.0.0/16") from None
        return v

    @property
    def existing(self) -> bool:
        """An existing VPC and subnet are used instead of new ones."""
        return self.vpc_id is not None

    @model_validator(mode="after")
    def _network_rules(self) -> NetworkConfig:
        if (self.vpc_id is None) != (self.subnet_id is None):
            given = "vpc_id" if self.vpc_id else "subnet_id"
            raise rule_error(
                f"network.{given}",
                self.vpc_id or self.subnet_id,
                "an existing network needs both vpc_id and subnet_id (EFA nodes share one subnet)",
                "set both network.vpc_id and network.subnet_id, or neither for a new VPC",
            )
        if not self.existing:
            vpc = ipaddress.ip_network(self.vpc_cidr)
            for name in ("subnet_cidr", "public_subnet_cidr"):
                sub = ipaddress.ip_network(getattr(self, name))
                if not sub.subnet_of(vpc):  # type: ignore[arg-type]
                    raise rule_error(
                        f"network.{name}", str(sub), f"must lie inside vpc_cidr {vpc}", f"pick a block inside {vpc}"
                    )
            if ipaddress.ip_network(self.subnet_cidr).overlaps(ipaddress.ip_network(self.public_subnet_cidr)):
                raise rule_error(
                    "network.public_subnet_cidr",
                    self.public_subnet_cidr,
                    f"overlaps subnet_cidr {self.subnet_cidr}",
                    "pick disjoint blocks",
                )
        return self


class ModelSource(_Frozen):
    """Where each node gets the checkpoint at boot."""

    source: Literal["huggingface", "s3"] = "huggingface"
    s3_uri: str | None = Field(None, pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")
    hf_token_secret_arn: str | None = Field(None, pattern=r"^arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:\d{12}:secret:.+$")
    expected_shards: int = Field(15, gt=0, description="safetensors shards of the servable checkpoint.")

    @model_validator(mode="after")
    def _source_rules(self) -> ModelSource:
        if self.source == "s3" and not self.s3_uri:
            raise rule_error(
                "model.s3_uri", None, "source 's3' needs the S3 location of the checkpoint", "set model.s3_uri=s3://bucket/prefix"
            )
        return self


class ExamplesSource(_Frozen):
    """Where the vLLM Neuron examples (proxy, schedule helper) come from."""

    repo_url: str = "https://github.com/vllm-project/vllm-neuron.git"
    ref: str = Field(
        "release-2.33",
        min_length=1,
        description="Tag or commit of the SDK 2.33 examples; the exact tag name is UNCONFIRMED.",
    )
    s3_uri: str | None = Field(None, pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")

    @field_validator("ref")
    @classmethod
    def _pinned(cls, v: str) -> str:
        if v in {"main", "master", "HEAD"}:
            raise rule_error(
                "examples.ref", v, "is a moving branch: nodes booted at different times would run different code", "pin a tag or a commit"
            )
        return v


class ClusterConfig(_Frozen):
    """Every parameter of one deployment; defaults give the tested two-node 6P1D cluster."""

    stack_name: str = Field("GptOss8k1kStack", pattern=r"^[A-Za-z][A-Za-z0-9-]{0,127}$")
    cluster_name: str = Field("gptoss-8k1k", pattern=r"^[a-z][a-z0-9-]{0,30}$")
    region: str = Field("us-east-2", pattern=r"^[a-z]{2}(-[a-z]+)+-\d$")
    availability_zone: str = "us-east-2a"
    instance_type: str = "trn3.48xlarge"
    instance_overrides: dict[str, int] = Field(
        default_factory=dict, description="Override unpublished table values, e.g. network_cards."
    )
    ami_ssm_parameter: str | None = Field(DEFAULT_AMI_PARAMETER, pattern=r"^/[A-Za-z0-9_./-]+$")
    ami_id: str | None = Field(None, pattern=r"^ami-[0-9a-f]{8,17}$")
    root_volume_gb: int = Field(512, description="The Neuron setup guide asks for at least 512 GB.")
    stage_timeout_s: int = Field(7200, ge=600, description="Longest the model and cache staging may take at boot.")
    capacity_reservation_id: str | None = Field(None, pattern=r"^cr-[0-9a-f]{8,17}$")
    termination_protection: bool = False
    detailed_monitoring: bool = True
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    proxy_load_balancer: bool | None = Field(
        None,
        description="Internal NLB over the proxies; default on when there are several proxies. Off: clients "
        "(or your own router) use the per-proxy URLs in the outputs.",
    )
    proxy_ingress_cidr: str | None = None
    proxy_ingress_prefix_list_id: str | None = Field(None, pattern=r"^pl-[0-9a-f]{8,17}$")
    model: ModelSource = Field(default_factory=ModelSource)
    examples: ExamplesSource = Field(default_factory=ExamplesSource)
    compile_cache_s3_uri: str | None = Field(None, pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")
    results_s3_uri: str | None = Field(None, pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")
    nvme_mount: str = Field("/opt/dlami/nvme", pattern=r"^/[A-Za-z0-9_./-]+$")
    venv_glob: str = Field(
        "/opt/aws_neuronx_venv_pytorch_inference_vllm*", description="The DLAMI's vLLM venv (exact 2.33 name UNCONFIRMED)."
    )
    results_dir: str = Field(
        "/root/gpt-oss-120b-8k1k-results", description="BENCH_RESULT_DIR of the reference (~ of the service user, root)."
    )
    decode_instances: int = Field(1, description="Decode servers; one per instance.")
    prefill_per_decode: int = Field(6, description="Prefill replicas per decode server (the tested ratio is 6).")
    replicas_per_prefill_instance: int | None = Field(None, description="Default: fill each prefill instance.")
    serving: Serving = Field(default_factory=Serving)

    @field_validator("root_volume_gb")
    @classmethod
    def _root(cls, v: int) -> int:
        if v < 512:
            raise rule_error(
                "root_volume_gb", v, "the Neuron setup guide asks for a root volume of at least 512 GB", "set root_volume_gb >= 512"
            )
        return v

    @field_validator("proxy_ingress_cidr")
    @classmethod
    def _ingress(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            net = ipaddress.ip_network(v, strict=False)
        except ValueError:
            raise rule_error("proxy_ingress_cidr", v, "is not a CIDR block", "give a block like 203.0.113.0/24") from None
        if net.prefixlen == 0:
            raise rule_error(
                "proxy_ingress_cidr",
                v,
                "opening the proxy to the whole internet is refused (no public ingress)",
                "give your office or VPN CIDR, or use the SSM port forward",
            )
        return v

    @property
    def hardware(self) -> InstanceType:
        """The instance-type table row, with the operator's overrides applied."""
        return KNOWN_INSTANCE_TYPES[self.instance_type].model_copy(update=self.instance_overrides)

    @property
    def layout(self) -> Layout:
        """The fleet these parameters describe."""
        return compute_layout(
            decode_instances=self.decode_instances,
            prefill_per_decode=self.prefill_per_decode,
            instance_type=self.hardware,
            serving=self.serving,
            replicas_per_prefill_instance=self.replicas_per_prefill_instance,
        )

    @property
    def load_balanced(self) -> bool:
        """One internal NLB fronts the proxies."""
        if self.proxy_load_balancer is None:
            return self.layout.load_balanced
        return self.proxy_load_balancer

    @model_validator(mode="after")
    def _config_rules(self) -> ClusterConfig:
        if self.instance_type not in KNOWN_INSTANCE_TYPES:
            raise rule_error(
                "instance_type",
                self.instance_type,
                f"no hardware table entry (known: {', '.join(sorted(KNOWN_INSTANCE_TYPES))})",
                "use a known type, or add its row to clusterspec/instance_types.py",
            )
        unknown = sorted(set(self.instance_overrides) - set(InstanceType.model_fields) - {"name"})
        if unknown or "name" in self.instance_overrides:
            raise rule_error(
                "instance_overrides",
                unknown or ["name"],
                "only hardware fields can be overridden",
                f"use some of {', '.join(f for f in InstanceType.model_fields if f not in ('name', 'unpublished'))}",
            )
        if not self.availability_zone.startswith(self.region):
            raise rule_error(
                "availability_zone",
                self.availability_zone,
                f"must be a zone of region {self.region} (EFA nodes share one subnet in one AZ)",
                f"set availability_zone to e.g. {self.region}a, or change region",
            )
        if (self.ami_ssm_parameter is None) == (self.ami_id is None):
            raise rule_error(
                "ami_id",
                self.ami_id,
                "exactly one of ami_ssm_parameter and ami_id selects the Neuron DLAMI",
                "set ami_id=ami-... and ami_ssm_parameter to null, or leave ami_id unset",
            )
        if self.proxy_ingress_cidr and self.proxy_ingress_prefix_list_id:
            raise rule_error(
                "proxy_ingress_prefix_list_id",
                self.proxy_ingress_prefix_list_id,
                "give the operator network as a CIDR or a prefix list, not both",
                "unset one of proxy_ingress_cidr and proxy_ingress_prefix_list_id",
            )
        if self.network.egress == "none":
            for field, ok in (
                ("model.source", self.model.source == "s3"),
                ("examples.s3_uri", self.examples.s3_uri is not None),
            ):
                if not ok:
                    raise rule_error(
                        field,
                        self.model.source if field == "model.source" else None,
                        "with network.egress='none' the nodes cannot reach Hugging Face or GitHub",
                        "stage the checkpoint and the examples in S3 (model.source='s3', model.s3_uri, "
                        "examples.s3_uri), or use network.egress='nat'",
                    )
            if not self.network.s3_gateway_endpoint:
                raise rule_error(
                    "network.s3_gateway_endpoint",
                    False,
                    "with network.egress='none' S3 is reachable only through the gateway endpoint",
                    "set network.s3_gateway_endpoint=true",
                )
        _check_ports(self)
        return self


def _check_ports(cfg: ClusterConfig) -> None:
    """Reject any two listeners of one node whose port ranges overlap."""
    s = cfg.serving
    per_node = max(1, cfg.replicas_per_prefill_instance or cfg.hardware.logical_cores(s.prefill.lnc) // s.prefill.tensor_parallel)
    ranges: list[tuple[str, int, int]] = [
        ("serving.proxy.port", s.proxy.port, s.proxy.port),
        ("serving.proxy.group_health_port", s.proxy.group_health_port, s.proxy.group_health_port),
        ("serving.decode.http_port", s.decode.http_port, s.decode.http_port),
        ("serving.decode.side_channel_port", *s.decode.side_channel_ports),
        ("serving.prefill.http_port_base", s.prefill.http_port(0), s.prefill.http_port(per_node - 1)),
    ]
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


_CONTEXT_KEYS = set(ClusterConfig.model_fields)


def _parse_context_value(value: Any) -> Any:
    """`cdk -c key=value` gives strings; accept JSON for nested values and null."""
    if isinstance(value, str):
        text = value.strip()
        if text in {"null", "none", "None"}:
            return None
        if text[:1] in "{[" or text in {"true", "false"}:
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return value
    return value


def load_config(context: dict[str, Any]) -> ClusterConfig:
    """Build the config from a `config` file (YAML/JSON) and CDK context keys; context wins."""
    data: dict[str, Any] = {}
    path = context.get("config")
    if path:
        p = Path(path)
        if not p.is_file():
            raise SpecError([f"config={path!r}: the config file does not exist. Fix: pass -c config=<path to a YAML or JSON file>."])
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise SpecError([f"config={path!r}: the file must hold a mapping of settings. Fix: write `key: value` lines."])
        data.update(loaded)
    for key, value in context.items():
        if key == "config" or key.startswith(("@aws-cdk", "aws-cdk", "cdk-", "acknowledged-issue")) or ":" in key:
            continue
        if key not in _CONTEXT_KEYS:
            raise SpecError(
                [
                    f"{key}={value!r}: is not a known setting. Fix: remove -c {key} or check its spelling "
                    f"(known: {', '.join(sorted(_CONTEXT_KEYS))})."
                ]
            )
        data[key] = _parse_context_value(value)
    try:
        cfg = ClusterConfig.model_validate(data)
        cfg.layout  # noqa: B018 - validates the fleet too
    except ValidationError as e:
        raise explain(e) from None
    from clusterspec import limits  # rendering imports this module

    limits.check(cfg)
    return cfg
