"""Operator parameters of a deployment, validated before anything is synthesized."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from clusterspec import strict_yaml, validate
from clusterspec.boot import SIGNAL_MARGIN_S, BootConfig
from clusterspec.cells import CELL_NODES
from clusterspec.errors import SpecError, explain, rule_error, show
from clusterspec.instance_types import KNOWN_INSTANCE_TYPES, InstanceType
from clusterspec.layout import Layout, compute_layout
from clusterspec.serving import ProxyKind, Serving

DEFAULT_AMI_PARAMETER = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"

# vLLM's router answers 200 here while at least one prefill and one decode server are healthy.
ROUTER_READINESS_PATH = "/readiness"


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
    ssm_endpoints: bool | None = Field(
        None, description="Interface endpoints for SSM (ssm, ssmmessages, ec2messages); default: created when egress is none."
    )
    placement_group: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$",
        description="An existing cluster placement group the nodes launch into, by name (one another fleet or a "
        "reservation shares); default: one of the stack's.",
    )  # fmt: skip
    flow_logs: bool = Field(True, description="VPC flow logs to CloudWatch Logs (new VPC).")
    flow_logs_traffic: Literal["REJECT", "ALL"] = Field(
        "REJECT", description="What the flow logs record: rejected traffic (default; cheap) or all of it."
    )

    @field_validator("vpc_cidr", "public_subnet_cidr")
    @classmethod
    def _cidr(cls, v: str, info: ValidationInfo) -> str:
        validate.cidr(f"network.{info.field_name}", v)
        return v

    @field_validator("subnet_cidr")
    @classmethod
    def _subnet(cls, v: str) -> str:
        validate.cidr("network.subnet_cidr", v)
        return v

    @property
    def existing(self) -> bool:
        """An existing VPC and subnet are used instead of new ones."""
        return self.vpc_id is not None

    @property
    def wants_ssm_endpoints(self) -> bool:
        """Whether the stack creates the SSM interface endpoints."""
        return self.egress == "none" if self.ssm_endpoints is None else self.ssm_endpoints

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
        if self.existing:
            ignored = sorted({"vpc_cidr", "subnet_cidr", "public_subnet_cidr", "flow_logs", "flow_logs_traffic"} & self.model_fields_set)
            if ignored:
                raise rule_error(
                    f"network.{ignored[0]}", getattr(self, ignored[0]), "describes a new VPC; an existing VPC keeps its own",
                    f"remove network.{ignored[0]} (or remove vpc_id and subnet_id for a new VPC)",
                )  # fmt: skip
            if self.route_table_id is None and self.s3_gateway_endpoint and "s3_gateway_endpoint" in self.model_fields_set:
                raise rule_error(
                    "network.route_table_id", None, "an S3 gateway endpoint in an existing VPC needs the subnet's route table",
                    "set network.route_table_id=rtb-..., or network.s3_gateway_endpoint=false if the VPC has one",
                )  # fmt: skip
            if self.egress == "none" and self.route_table_id is None and self.s3_gateway_endpoint:
                raise rule_error(
                    "network.route_table_id", None,
                    "with egress 'none' the nodes reach S3 only through a gateway endpoint, and the stack can add one only with "
                    "the subnet's route table",
                    "set network.route_table_id=rtb-... (the stack adds the endpoint), or network.s3_gateway_endpoint=false "
                    "if the VPC already routes S3 through one",
                )  # fmt: skip
        elif self.route_table_id is not None:
            raise rule_error(
                "network.route_table_id", self.route_table_id, "belongs to an existing VPC; a new VPC makes its own route table",
                "remove network.route_table_id, or set network.vpc_id and network.subnet_id",
            )  # fmt: skip
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


SECRET_ARN = r"^arn:(aws[a-z-]*):secretsmanager:([a-z0-9-]+):([0-9]{12}):secret:[A-Za-z0-9/_+=.@-]+$"


class ModelSource(_Frozen):
    """Where each node gets the checkpoint at boot."""

    source: Literal["huggingface", "s3"] = "huggingface"
    s3_uri: str | None = None
    hf_token_secret_arn: str | None = Field(None, pattern=SECRET_ARN)
    expected_shards: int = Field(15, gt=0, le=1000, description="safetensors shards of the servable checkpoint.")

    @field_validator("s3_uri")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        return v if v is None else validate.s3_uri("model.s3_uri", v)

    @model_validator(mode="after")
    def _source_rules(self) -> ModelSource:
        if self.source == "s3" and not self.s3_uri:
            raise rule_error(
                "model.s3_uri", None, "source 's3' needs the S3 location of the checkpoint", "set model.s3_uri=s3://bucket/prefix"
            )
        if self.source == "s3" and self.s3_uri and not validate.s3_parts(self.s3_uri)[1]:
            raise rule_error("model.s3_uri", self.s3_uri, "the checkpoint's files sit under a prefix, not at the bucket root", "give s3://bucket/prefix")
        return self


class ExamplesSource(_Frozen):
    """Where the vLLM Neuron examples (proxy, schedule helper) come from."""

    repo_url: str = "https://github.com/vllm-project/vllm-neuron.git"
    ref: str = Field(
        "release-2.33",
        min_length=1,
        description="Tag or commit of the SDK 2.33 examples; the exact tag name is UNCONFIRMED.",
    )
    s3_uri: str | None = None

    @field_validator("repo_url")
    @classmethod
    def _repo(cls, v: str) -> str:
        return validate.https_url("examples.repo_url", v)

    @field_validator("ref")
    @classmethod
    def _pinned(cls, v: str) -> str:
        return validate.git_ref("examples.ref", v)

    @field_validator("s3_uri")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        if v is None:
            return v
        validate.s3_uri("examples.s3_uri", v)
        if not validate.s3_parts(v)[1]:
            raise rule_error("examples.s3_uri", v, "the examples sit under a prefix, not at the bucket root", "give s3://bucket/prefix")
        return v


LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653)


class ObservabilityConfig(_Frozen):
    """Logs and metrics of every node to CloudWatch, one dashboard and alarms for the fleet."""

    enabled: bool = Field(True, description="The node's collector, the log group, the dashboard and the alarms.")
    interval_s: int = Field(60, ge=10, le=3600, description="How often each node publishes its metrics and ships its logs.")
    log_retention_days: int = Field(30, description="Retention of the cluster's log group (a CloudWatch Logs value).")
    alarm_topic_arn: str | None = Field(
        None, pattern=r"^arn:aws[a-z-]*:sns:[a-z0-9-]+:[0-9]{12}:[A-Za-z0-9_-]{1,256}$", description="SNS topic the alarms notify."
    )

    @field_validator("log_retention_days")
    @classmethod
    def _retention(cls, v: int) -> int:
        if v not in LOG_RETENTION_DAYS:
            raise rule_error(
                "observability.log_retention_days", v, "is not a retention CloudWatch Logs offers",
                f"use one of {', '.join(map(str, LOG_RETENTION_DAYS))}",
            )  # fmt: skip
        return v


class HealingConfig(_Frozen):
    """A node keeps its identity, not its instance: what replaces a lost one and what a node reports of itself.

    Each node identity (role, index, the replicas and ports it serves) is an Auto Scaling group
    of one instance: EC2's status checks and the node's own report (below) replace a failed
    instance with one of the same identity, in the same subnet, placement group and capacity.
    """

    members_poll_s: int = Field(
        30, ge=5, le=3600,
        description="How often a node re-reads the fleet's members (EC2, by the instances' identity tags): a replaced "
        "node's new address reaches a running router through its name in /etc/hosts, without a restart.",
    )  # fmt: skip
    report_unhealthy: bool = Field(
        True,
        description="A node that is up but cannot serve marks its own instance unhealthy, and its group replaces it: the "
        "node check failing after a reboot, Neuron execution errors past neuron_errors, a server in back-off longer than backoff_s.",
    )
    watch_interval_s: int = Field(
        60, ge=10, le=3600,
        description="How often a node's health watch checks whether it can serve (and reports itself when it cannot).",
    )  # fmt: skip
    backoff_s: int = Field(
        7200, ge=900, le=86400,
        description="A server restarting with back-off (crashing) for this long on a node that once served marks the node unhealthy.",
    )  # fmt: skip
    neuron_errors: int = Field(
        20, ge=1, le=100000,
        description="Neuron execution errors (neuron-monitor) in one check interval that mark the node unhealthy.",
    )  # fmt: skip
    grace_s: int = Field(
        900, ge=0, le=7200,
        description="The group's health-check grace period: EC2 status checks count from this long after a launch.",
    )  # fmt: skip


CR_ID = r"^cr-[0-9a-f]{8,17}$"
CR_GROUP_ARN = r"^arn:(aws[a-z-]*):resource-groups:([a-z0-9-]+):[0-9]{12}:group/[A-Za-z0-9_.-]{1,300}$"


class RoleCapacity(_Frozen):
    """The reservation one role launches into, when it is not the section's."""

    reservation_id: str | None = Field(None, pattern=CR_ID)
    reservation_group_arn: str | None = Field(None, pattern=CR_GROUP_ARN)


class CapacityConfig(_Frozen):
    """Where the instances' capacity comes from: On-Demand, a reservation (ODCR), or a Capacity Block for ML."""

    type: Literal["on-demand", "odcr", "capacity-block"] = Field(
        "on-demand",
        description="on-demand: whatever EC2 has. odcr: On-Demand Capacity Reservations. capacity-block: a Capacity Block "
        "for ML (launched with market type capacity-block, no placement group: the block places its instances together).",
    )
    reservation_id: str | None = Field(None, pattern=CR_ID, description="The reservation (cr-...) every role launches into.")
    reservation_group_arn: str | None = Field(
        None, pattern=CR_GROUP_ARN, description="Or a capacity-reservation resource group (odcr; UltraServer blocks)."
    )
    preference: Literal["targeted", "open"] = Field(
        "targeted",
        description="odcr: targeted launches into the reservation named; open uses any matching open reservation "
        "(reservation_id then only tells preflight which one to check).",
    )
    placement_group: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-]{1,255}$",
        description="odcr: the cluster placement group the reservation was made in; the nodes launch in it "
        "instead of a group of the stack's.",
    )
    roles: dict[Literal["prefill", "decode", "server"], RoleCapacity] = Field(
        default_factory=dict, description="Per-role reservation, over the section's (e.g. a block for decode, another for prefill)."
    )
    min_hours_left: float = Field(
        0, ge=0, le=24 * 182, description="capacity-block: preflight fails when the block has fewer usable hours left than this."
    )

    def target(self, role: str) -> tuple[str | None, str | None]:
        """(reservation id, group ARN) the role's instances launch into."""
        over = self.roles.get(role)  # type: ignore[call-overload]
        if over and (over.reservation_id or over.reservation_group_arn):
            return over.reservation_id, over.reservation_group_arn
        return self.reservation_id, self.reservation_group_arn

    @model_validator(mode="after")
    def _rules(self) -> CapacityConfig:
        given = [k for k in ("reservation_id", "reservation_group_arn", "placement_group") if getattr(self, k) is not None]
        if self.type == "on-demand":
            extra = given + (["roles"] if self.roles else [])
            if extra:
                raise rule_error(
                    f"capacity.{extra[0]}", getattr(self, extra[0]), "names a reservation, but capacity.type is on-demand",
                    "set capacity.type to odcr or capacity-block, or remove it",
                )  # fmt: skip
            return self
        if self.type == "capacity-block":
            if self.preference != "targeted":
                raise rule_error(
                    "capacity.preference", self.preference, "a Capacity Block is used only by launches that target it",
                    "remove capacity.preference (targeted)",
                )  # fmt: skip
            if self.placement_group:
                raise rule_error(
                    "capacity.placement_group", self.placement_group,
                    "a Capacity Block places its instances close together itself; a placement group of ours could conflict with it",
                    "remove capacity.placement_group",
                )  # fmt: skip
        if self.type == "odcr" and self.preference == "open":
            targets = [k for k in ("reservation_group_arn",) if getattr(self, k)] + (["roles"] if self.roles else [])
            if targets:
                raise rule_error(
                    f"capacity.{targets[0]}", getattr(self, targets[0]),
                    "preference open launches into any matching open reservation, never into a named target",
                    "set capacity.preference=targeted, or remove the target",
                )  # fmt: skip
            return self
        for role in ("prefill", "decode", "server", None):
            if role is not None and role not in self.roles:
                continue
            rid, group = self.target(role) if role else (self.reservation_id, self.reservation_group_arn)
            where = f"capacity.roles.{role}" if role else "capacity"
            if rid and group:
                raise rule_error(
                    f"{where}.reservation_group_arn", group, "a launch targets one reservation or one group, not both",
                    f"remove {where}.reservation_id or {where}.reservation_group_arn",
                )  # fmt: skip
        return self


RecipeName = Literal["gptoss-120b-8k1k", "gptoss-120b-single", "gptoss-20b-single", "gptoss-120b-di", "gptoss-20b-di"]


class ClusterConfig(_Frozen):
    """Every parameter of one deployment; defaults give the tested two-node 6P1D cluster."""

    _layout: Layout | None = PrivateAttr(default=None)

    recipe: RecipeName = Field("gptoss-120b-8k1k", description="The documented deployment to run (README 'Recipes').")
    stack_name: str = Field("GptOss8k1kStack", pattern=r"^[A-Za-z][A-Za-z0-9-]{0,127}$")
    cluster_name: str = Field("gptoss-8k1k", pattern=r"^[a-z](-?[a-z0-9])*$", max_length=31)
    region: str = "us-east-2"
    availability_zone: str = "us-east-2a"
    instance_type: str = "trn3.48xlarge"
    instance_overrides: dict[str, StrictInt] = Field(
        default_factory=dict, description="Override unpublished table values, e.g. network_cards."
    )
    ami_ssm_parameter: str | None = Field(DEFAULT_AMI_PARAMETER, pattern=r"^/[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$", max_length=1011)
    ami_id: str | None = Field(None, pattern=r"^ami-[0-9a-f]{8,17}$")
    root_volume_gb: int = Field(512, description="The Neuron setup guide asks for at least 512 GB; gp3 holds up to 16,384 GiB.")
    stage_timeout_s: int = Field(7200, ge=600, le=86400, description="Longest one staging attempt may take at boot.")
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    termination_protection: bool = False
    detailed_monitoring: bool = True
    wait_for_ready: bool = Field(
        True,
        description="cdk deploy ends when every node serves (a completion through each proxy) or fails naming the unit; "
        "a failed create rolls back instead of leaving a broken fleet billing.",
    )
    ready_timeout_s: int | None = Field(
        None,
        ge=600,
        le=43200,
        description="How long the deploy gate waits per node (CloudFormation allows 12 h at most). Default: every boot "
        "step's retry budget + stage_timeout_s + the servers' start + the signal's margin, rounded up to 5 minutes, 6 h at least.",
    )
    boot: BootConfig = Field(default_factory=BootConfig, description="Each boot step's retry budget (README 'Boot retries').")
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
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
    compile_cache_s3_uri: str | None = Field(
        None,
        description="Where nodes save their compiled graphs and restore them from. Unset: a bucket the stack creates "
        "(compile_cache_bucket), emptied and deleted by gptoss destroy.",
    )
    compile_cache_bucket: bool = Field(
        True, description="With compile_cache_s3_uri unset, the stack creates the compile cache's bucket; false: no compile cache."
    )
    healing: HealingConfig = Field(default_factory=HealingConfig, description="Replacement of lost nodes (README 'Healing').")
    cell_nodes: int = Field(
        CELL_NODES, ge=1, le=60,
        description="The most nodes of one role in one nested stack (a cell). Changing it moves nodes between cells, which "
        "replaces their instances: choose it once.",
    )  # fmt: skip
    results_s3_uri: str | None = None
    kms_key_arns: tuple[str, ...] = Field(
        (), description="Customer-managed KMS keys of the S3 buckets the nodes read and write (kms:Decrypt, GenerateDataKey on these only)."
    )
    nvme_mount: str = "/opt/dlami/nvme"
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

    @model_validator(mode="before")
    @classmethod
    def _ami_id_pins(cls, data: Any) -> Any:
        """ami_id alone pins the image: the DLAMI parameter is then not asked (unless it is set too, which is refused)."""
        if isinstance(data, dict) and data.get("ami_id") is not None and "ami_ssm_parameter" not in data:
            return data | {"ami_ssm_parameter": None}
        return data

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        return validate.region("region", v)

    @field_validator("root_volume_gb")
    @classmethod
    def _root(cls, v: int) -> int:
        if v < 512:
            raise rule_error(
                "root_volume_gb", v, "the Neuron setup guide asks for a root volume of at least 512 GB", "set root_volume_gb >= 512"
            )
        if v > 16384:
            raise rule_error("root_volume_gb", v, "a gp3 volume holds at most 16,384 GiB", "set root_volume_gb <= 16384")
        return v

    @field_validator("proxy_ingress_cidr")
    @classmethod
    def _ingress(cls, v: str | None) -> str | None:
        return v if v is None else validate.operator_cidr("proxy_ingress_cidr", v)

    @field_validator("compile_cache_s3_uri", "results_s3_uri")
    @classmethod
    def _write_prefix(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        validate.s3_uri(str(info.field_name), v)
        if not validate.s3_parts(v)[1]:
            raise rule_error(
                str(info.field_name), v, "nodes get write access here: a bucket root would open the whole bucket to them",
                f"give a prefix of its own, e.g. {v}/{'neuron-cache' if 'cache' in str(info.field_name) else 'results'}",
            )  # fmt: skip
        return v

    @field_validator("kms_key_arns")
    @classmethod
    def _kms(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) > MAX_KMS_KEYS:
            raise rule_error(
                "kms_key_arns", f"{len(v)} keys",
                f"each key adds about 80 characters to the node role's inline policy, which IAM caps at 10,240 for a role; "
                f"at most {MAX_KMS_KEYS} keys", "list only the keys of the buckets and the secret this cluster uses",
            )  # fmt: skip
        for arn in v:
            # A single-region key id is a UUID; a multi-region key's is mrk- and 32 hex digits.
            if not re.fullmatch(r"arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|mrk-[0-9a-f]{32})", arn):
                raise rule_error("kms_key_arns", arn, "is not a KMS key ARN (an alias grants nothing in IAM)", "give arn:aws:kms:REGION:ACCOUNT:key/KEY-ID")
        if len(set(v)) != len(v):
            raise rule_error("kms_key_arns", sorted(a for a in set(v) if v.count(a) > 1)[0], "is listed twice", "keep one")
        return v

    @field_validator("nvme_mount", "results_dir")
    @classmethod
    def _dirs(cls, v: str, info: ValidationInfo) -> str:
        return validate.node_path(str(info.field_name), v)

    @field_validator("venv_glob")
    @classmethod
    def _venv(cls, v: str) -> str:
        return validate.node_path("venv_glob", v, glob=True)

    @field_validator("decode_instances", "prefill_per_decode", "replicas_per_prefill_instance")
    @classmethod
    def _counts(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v > 1000:
            raise rule_error(str(info.field_name), v, "is more than any fleet one stack can hold", "lower it (plan shows the largest that fits)")
        return v

    @property
    def hardware(self) -> InstanceType:
        """The instance-type table row, with the operator's overrides applied."""
        base = KNOWN_INSTANCE_TYPES[self.instance_type]
        return InstanceType.model_validate(base.model_dump() | dict(self.instance_overrides))

    @property
    def gate_needs_s(self) -> int:
        """The longest a node within every one of its own limits takes to serve, plus the signal's margin."""
        return self.boot.budget_s(self.stage_timeout_s) + self.serving.engine_ready_timeout_s + SIGNAL_MARGIN_S

    @property
    def gate_timeout_s(self) -> int:
        """How long the deploy gate waits per node: ready_timeout_s, else what the node's limits need (6 h at least,
        room for a server's restarts), rounded up to 5 minutes."""
        return self.ready_timeout_s or max(21600, -(-self.gate_needs_s // 300) * 300)

    @property
    def proxy_kind(self) -> ProxyKind | None:
        """What serves the endpoint of a DI fleet: serving.proxy.kind, else the router beyond one decode server."""
        if not self.serving.disaggregated:
            return None
        return self.serving.proxy.kind or ("vllm-router" if self.decode_instances > 1 else "toy")

    @property
    def proxy_kind_reason(self) -> str:
        """Why `proxy_kind` is what it is, in words `plan` prints (serving.proxy.kind chooses)."""
        kind = self.proxy_kind
        if kind is None:
            return "a single-instance recipe: clients talk to its one server"
        if self.serving.proxy.kind:
            return "chosen in the config"
        if kind == "toy":
            return "one decode server, as the references test it"
        return f"{self.decode_instances} decode servers: it health-checks and retries"

    @property
    def proxy_health_path(self) -> str:
        """The endpoint's readiness route: the router's, the toy proxy's, or the single server's."""
        if self.proxy_kind == "vllm-router":
            return ROUTER_READINESS_PATH
        return self.serving.proxy.health_path if self.serving.disaggregated else self.serving.server_health_path

    @property
    def endpoint_health_check(self) -> tuple[int, str]:
        """(port, path) the load balancer checks on each proxy node: the router's readiness, or the
        toy proxy's whole group (gptoss-group-health: its own /healthcheck answers while its servers are dead)."""
        if self.proxy_kind == "vllm-router":
            return self.serving.proxy.port, ROUTER_READINESS_PATH
        return self.serving.proxy.group_health_port, "/ready"

    @property
    def layout(self) -> Layout:
        """The fleet these parameters describe (computed once per config: every node's rendering asks)."""
        if self._layout is None:
            self._layout = self._compute_layout()
        return self._layout

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> ClusterConfig:
        """A copy (with `update` applied) that computes its own layout."""
        copy = super().model_copy(update=update, deep=deep)
        copy._layout = None
        return copy

    def _compute_layout(self) -> Layout:
        return compute_layout(
            decode_instances=self.decode_instances,
            prefill_per_decode=self.prefill_per_decode,
            instance_type=self.hardware,
            serving=self.serving,
            replicas_per_prefill_instance=self.replicas_per_prefill_instance,
            proxy_kind=self.proxy_kind or "toy",
        )

    @property
    def compile_cache_enabled(self) -> bool:
        """Nodes save and restore compile caches: at compile_cache_s3_uri, or in the stack's own bucket."""
        return self.compile_cache_s3_uri is not None or self.compile_cache_bucket

    def router_policy(self, role: str) -> str:
        """The router's policy for one role: the spec's, else power_of_two over two or more servers, round_robin over one."""
        r = self.serving.proxy.router
        chosen = r.prefill_policy if role == "prefill" else r.decode_policy
        servers = len(self.layout.replicas) if role == "prefill" else len(self.layout.decode_nodes)
        return chosen or ("power_of_two" if servers >= 2 else "round_robin")

    @property
    def load_balanced(self) -> bool:
        """One internal NLB fronts the proxies."""
        if self.proxy_load_balancer is None:
            return self.layout.load_balanced
        return self.proxy_load_balancer

    @model_validator(mode="after")
    def _config_rules(self) -> ClusterConfig:
        if self.serving.recipe != self.recipe:
            raise rule_error(
                "serving.recipe", self.serving.recipe, f"is set by the recipe ({self.recipe})", "remove serving.recipe; choose the recipe with recipe=NAME"
            )
        if self.proxy_load_balancer and not self.serving.disaggregated:
            raise rule_error(
                "proxy_load_balancer", True,
                f"the {self.recipe} recipe runs one server per instance and no proxy: the load balancer's health check "
                "would ask a port nothing serves", "remove proxy_load_balancer (the outputs name each instance's server URL)",
            )  # fmt: skip
        if self.instance_type not in KNOWN_INSTANCE_TYPES:
            raise rule_error(
                "instance_type",
                self.instance_type,
                f"no hardware table entry (known: {', '.join(sorted(KNOWN_INSTANCE_TYPES))})",
                "use a known type, or add its row to clusterspec/instance_types.py",
            )
        overridable = [f for f in InstanceType.model_fields if f not in ("name", "unpublished", "mxfp4")]
        unknown = sorted(set(self.instance_overrides) - set(overridable))
        if unknown:
            raise rule_error(
                "instance_overrides", unknown, "only hardware counts can be overridden", f"use some of {', '.join(overridable)}"
            )
        try:
            hw = self.hardware
        except ValidationError as e:
            err = e.errors()[0]
            key = str(err["loc"][0])
            raise rule_error(
                f"instance_overrides.{key}", err.get("input"), err["msg"].lower(), f"set instance_overrides.{key} to what AWS reports (preflight shows it)"
            ) from None
        if hw.efa_interfaces > hw.network_cards:
            raise rule_error(
                "instance_overrides.efa_interfaces", hw.efa_interfaces, f"an instance has at most one EFA interface per network card ({hw.network_cards})",
                f"set efa_interfaces <= network_cards ({hw.network_cards})",
            )  # fmt: skip
        if hw.efa_interfaces < 1:
            raise rule_error(
                "instance_overrides.efa_interfaces", hw.efa_interfaces, "the KV transfer between prefill and decode runs over EFA",
                "set efa_interfaces to what AWS reports (at least 1), or use an EFA instance type",
            )  # fmt: skip
        validate.availability_zone("availability_zone", self.availability_zone, self.region)
        partition = validate.region_partition(self.region)
        if self.model.hf_token_secret_arn:
            m = re.fullmatch(SECRET_ARN, self.model.hf_token_secret_arn)
            assert m is not None
            if (m.group(1), m.group(2)) != (partition, self.region):
                raise rule_error(
                    "model.hf_token_secret_arn", self.model.hf_token_secret_arn,
                    f"the nodes ask Secrets Manager in their own region ({self.region}, partition {partition})",
                    f"replicate the secret to {self.region} and give that ARN",
                )  # fmt: skip
        _check_capacity(self, partition)
        needs = self.gate_needs_s
        limits = (
            f"boot retries {self.boot.budget_s(self.stage_timeout_s) - self.stage_timeout_s} s + staging {self.stage_timeout_s} s + "
            f"server start {self.serving.engine_ready_timeout_s} s + the signal's margin {SIGNAL_MARGIN_S} s = {needs} s"
        )
        if self.wait_for_ready and needs > 43200 and self.ready_timeout_s is None:
            raise rule_error(
                "stage_timeout_s", self.stage_timeout_s, f"no deploy gate can wait for a node within its own limits ({limits}; "
                "CloudFormation waits 43200 s at most)",
                "lower stage_timeout_s, VLLM_ENGINE_READY_TIMEOUT_S or the boot budgets, or set wait_for_ready=false",
            )  # fmt: skip
        if self.wait_for_ready and self.ready_timeout_s is not None and self.ready_timeout_s < needs:
            fix = (
                f"raise ready_timeout_s to {needs} or more (or leave it unset), or set wait_for_ready=false"
                if needs <= 43200
                else "lower stage_timeout_s, VLLM_ENGINE_READY_TIMEOUT_S or the boot budgets (the deploy gate waits 43200 s at most), "
                "or set wait_for_ready=false"
            )
            raise rule_error(
                "ready_timeout_s", self.ready_timeout_s, f"the deploy gate would fail a node still within its own limits ({limits})", fix
            )
        topic = self.observability.alarm_topic_arn
        if topic and (topic.split(":")[3] != self.region or topic.split(":")[1] != partition):
            raise rule_error(
                "observability.alarm_topic_arn", topic, f"CloudWatch alarms in {self.region} notify topics of {self.region}",
                f"give a topic of {self.region}",
            )  # fmt: skip
        for arn in self.kms_key_arns:
            if arn.split(":")[3] != self.region or arn.split(":")[1] != partition:
                raise rule_error("kms_key_arns", arn, f"S3 in {self.region} uses keys of {self.region}", f"give the key of the bucket in {self.region}")
        reads = {"model.s3_uri": self.model.s3_uri if self.model.source == "s3" else None, "examples.s3_uri": self.examples.s3_uri}
        writes = {"results_s3_uri": self.results_s3_uri, "compile_cache_s3_uri": self.compile_cache_s3_uri}
        for w_name, w in writes.items():
            for other, o in (reads | {k: v for k, v in writes.items() if k != w_name}).items():
                if w and o and validate.s3_overlap(w, o) and not (w_name == "compile_cache_s3_uri" and other == "results_s3_uri"):
                    raise rule_error(
                        w_name, w, f"overlaps {other} ({o}); nodes get write access to {w_name}",
                        "give each location a prefix of its own, neither inside the other",
                    )  # fmt: skip
        venv_prefix = self.venv_glob.split("*")[0].split("?")[0].split("[")[0].rstrip("/") or "/"
        validate.node_path("nvme_mount", self.nvme_mount, not_above=(venv_prefix,))
        if (self.ami_ssm_parameter is None) == (self.ami_id is None):
            raise rule_error(
                "ami_id",
                self.ami_id,
                "exactly one of ami_ssm_parameter and ami_id selects the Neuron DLAMI",
                "give ami_id=ami-... alone (it pins the image), or leave it unset and name the parameter",
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
                # Only the DI recipes run files of the examples (the proxy, the schedule).
                ("examples.s3_uri", self.examples.s3_uri is not None or not self.serving.disaggregated),
            ):
                if not ok:
                    raise rule_error(
                        field,
                        self.model.source if field == "model.source" else None,
                        "with network.egress='none' the nodes cannot reach Hugging Face or GitHub",
                        "stage the checkpoint and the examples in S3 (model.source='s3', model.s3_uri, "
                        "examples.s3_uri), or use network.egress='nat'",
                    )
            if self.network.ssm_endpoints is False and not self.network.existing:
                raise rule_error(
                    "network.ssm_endpoints", False,
                    "with network.egress='none' a new VPC reaches SSM (the port forward, status, bench) and CloudWatch only "
                    "through the interface endpoints the stack creates",
                    "remove network.ssm_endpoints (or use network.egress='nat')",
                )  # fmt: skip
            if not self.network.s3_gateway_endpoint and not self.network.existing:
                raise rule_error(
                    "network.s3_gateway_endpoint",
                    False,
                    "with network.egress='none' S3 is reachable only through the gateway endpoint",
                    "set network.s3_gateway_endpoint=true",
                )
        pg = self.network.placement_group
        if pg and self.capacity.type == "capacity-block":
            raise rule_error("network.placement_group", pg, "a Capacity Block places its instances together itself: EC2 takes no placement group for it",
                             "remove network.placement_group")  # fmt: skip
        if pg and self.capacity.placement_group and pg != self.capacity.placement_group:
            raise rule_error("network.placement_group", pg, f"capacity.placement_group names another group ({self.capacity.placement_group})",
                             "give one of them (the reservation's group)")  # fmt: skip
        if self.proxy_kind == "vllm-router":
            r = self.serving.proxy.router
            for role, chosen, servers in (("prefill", r.prefill_policy, len(self.layout.replicas)), ("decode", r.decode_policy, len(self.layout.decode_nodes))):
                if chosen == "power_of_two" and servers < 2:
                    raise rule_error(
                        f"serving.proxy.router.{role}_policy", chosen,
                        f"vllm-router refuses to start with power_of_two over {servers} {role} server ('Power-of-two policy for {role} "
                        f"requires at least 2 {role} workers')", "remove it (round_robin is chosen over one server) or use round_robin",
                    )  # fmt: skip
        _check_subnet_size(self)
        _check_ports(self)
        return self


# AWS keeps 5 addresses of every subnet; a Network Load Balancer asks for 8 free ones in its subnet.
AWS_RESERVED_IPS = 5
NLB_FREE_IPS = 8


def _check_subnet_size(cfg: ClusterConfig) -> None:
    """A new subnet holds every node's primary interface, the load balancer and the endpoints."""
    if cfg.network.existing:
        return  # its size is AWS's to tell: preflight reads it
    try:
        layout = cfg.layout
    except SpecError:
        return  # the fleet's own errors are reported by the layout
    endpoints = len(interface_endpoints(cfg))
    need = len(layout.nodes) + (NLB_FREE_IPS if cfg.load_balanced else 0) + endpoints
    net = ipaddress.ip_network(cfg.network.subnet_cidr)
    usable = net.num_addresses - AWS_RESERVED_IPS
    if usable < need:
        prefix = 32 - (need + AWS_RESERVED_IPS - 1).bit_length()
        raise rule_error(
            "network.subnet_cidr", cfg.network.subnet_cidr,
            f"holds {usable} usable addresses; the fleet needs {need} ({len(layout.nodes)} nodes"
            + (f", {NLB_FREE_IPS} for the load balancer" if cfg.load_balanced else "")
            + (f", {endpoints} for the interface endpoints" if endpoints else "") + ")",
            f"use a /{min(prefix, 28)} or larger subnet",
        )  # fmt: skip


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


def _check_capacity(self: ClusterConfig, partition: str | None) -> None:  # the config's own check, kept out of the class for length
    """The reservations name this stack's roles, region and partition, and every role has one when it must."""
    cap = self.capacity
    roles: tuple[str, ...] = ("prefill", "decode") if self.serving.disaggregated else ("server",)
    for role in cap.roles:
        if role not in roles:
            raise rule_error(
                f"capacity.roles.{role}", cap.roles[role].model_dump(exclude_none=True),
                f"recipe {self.recipe} has no {role} instances (its roles: {', '.join(roles)})",
                f"use capacity.roles.{' or capacity.roles.'.join(roles)}",
            )  # fmt: skip
    groups = {"capacity": cap.reservation_group_arn} | {f"capacity.roles.{r}": c.reservation_group_arn for r, c in cap.roles.items()}
    for where, group in groups.items():
        m = re.fullmatch(CR_GROUP_ARN, group or "")
        if m and (m.group(1), m.group(2)) != (partition, self.region):
            raise rule_error(
                f"{where}.reservation_group_arn", group, f"instances in {self.region} launch into reservations of {self.region}",
                f"give a resource group of {self.region}",
            )  # fmt: skip
    if cap.type == "on-demand" or (cap.type == "odcr" and cap.preference == "open"):
        return
    for name in roles:
        if cap.target(name) == (None, None):
            kind = "a Capacity Block is used only by launches that name it" if cap.type == "capacity-block" else (
                "a targeted launch names its reservation")
            raise rule_error(
                "capacity.reservation_id", None, f"{kind}, and the {name} instances have none",
                f"set capacity.reservation_id=cr-... (or capacity.roles.{name}.reservation_id)"
                + (", or capacity.preference=open to use any matching open reservation" if cap.type == "odcr" else ""),
            )  # fmt: skip

def interface_endpoints(cfg: ClusterConfig) -> tuple[str, ...]:
    """The interface endpoints the stack makes without egress (one ENI each in the subnet): SSM, EC2 and Auto Scaling
    for the members and self-reports, CloudWatch for telemetry."""
    if not cfg.network.wants_ssm_endpoints:
        return ()
    # ec2: the fleet's members (DescribeInstances by tag); autoscaling: a node marking its own instance unhealthy.
    members = ("ec2",) if any(cfg.layout.proxies) else ()
    healing = ("autoscaling",) if cfg.healing.report_unhealthy else ()
    return ("ssm", "ssmmessages", "ec2messages", *members, *healing) + (("logs", "monitoring") if cfg.observability.enabled else ())


_CONTEXT_KEYS = set(ClusterConfig.model_fields)
_SECTIONS = {k for k, f in ClusterConfig.model_fields.items() if isinstance(f.default_factory, type) and issubclass(f.default_factory, BaseModel)}
_JSON_FIX = (
    "quote names and strings with double quotes, e.g. -c 'network={\"egress\": \"none\"}', "
    "or set one value with a dotted key, e.g. -c network.egress=none"
)


def _parse_context_value(key: str, value: Any) -> Any:
    """`cdk -c key=value` gives strings: JSON for nested values, true/false, null."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    # Only `null` clears a value: `none` is a value of its own (network.egress=none).
    if text == "null":
        return None
    if text in {"true", "false"}:
        return text == "true"
    if re.fullmatch(r"[-+]?(?:[0-9]+_[0-9_]*|0[0-9]{1,19})", text, re.ASCII):
        raise SpecError(
            [
                f"{key}={show(value)}: is a number with an underscore or a leading zero, which tools read differently "
                "(10 or 1_0, 1000 or octal 512). Fix: write the decimal number without underscores or leading zeros."
            ]
        )
    if text[:1] and text[:1] in "{[":
        try:
            return json.loads(text)
        except RecursionError:
            raise SpecError([f"{key}: nests lists or mappings too deeply to read. Fix: {_JSON_FIX}."]) from None
        except json.JSONDecodeError as e:
            raise SpecError([f"{key}={value!r}: is not valid JSON ({e.msg} at column {e.colno}). Fix: {_JSON_FIX}."]) from None
    return value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """-c network.egress=none sets data["network"]["egress"]."""
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        current = node.setdefault(part, {})
        if not isinstance(current, dict):
            where = ".".join(parts[: i + 1])
            raise SpecError([f"{key}: {where} is not a section of settings. Fix: set {where} itself, or remove -c {key}."])
        node = current
    node[parts[-1]] = value


def _read_file(path: str) -> dict[str, Any]:
    """A YAML or JSON config file, every way it can be wrong turned into one message."""
    p = Path(path)
    where = f"config={path!r}"
    if not p.exists():
        raise SpecError([f"{where}: the config file does not exist. Fix: pass -c config=<path to a YAML or JSON file>."])
    if p.is_dir():
        raise SpecError([f"{where}: is a directory. Fix: name a YAML or JSON file in it, e.g. examples/production-3p8d.yaml."])
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise SpecError([f"{where}: is {size:,} bytes; a config file is at most {MAX_CONFIG_BYTES:,} (the examples are under 1,000). Fix: keep only the settings you change."])
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecError([f"{where}: is not UTF-8 text. Fix: save it as UTF-8."]) from None
    except OSError as e:
        raise SpecError([f"{where}: cannot be read ({e.strerror}). Fix: check the path and its permissions."]) from None
    try:
        loaded = strict_yaml.load(text)
    except strict_yaml.StrictYamlError as e:
        mark = e.problem_mark
        raise SpecError([f"{where}: {e.problem} (line {mark.line + 1}, column {mark.column + 1}). Fix: {e.fix}."]) from None
    except RecursionError:
        raise SpecError([f"{where}: nests lists or mappings too deeply to read. Fix: write the settings as README 'Parameters' shows them."]) from None
    except yaml.constructor.ConstructorError as e:
        raise SpecError(
            [f"{where}: uses a YAML tag a config may not use ({e.problem}). Fix: write plain values (no !! or ! tags)."]
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError([f"{where}: is not valid YAML ({at}{getattr(e, 'problem', None) or e}). Fix: correct the file there."]) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SpecError([f"{where}: the file must hold a mapping of settings. Fix: write `key: value` lines."])
    bad = [k for k in loaded if not isinstance(k, str)]
    if bad:
        raise SpecError([f"{where}: key {bad[0]!r} is not a setting name. Fix: use the names in README 'Parameters'."])
    return loaded


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, mappings merged key by key (lists and values replaced)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _with_recipe(data: dict[str, Any]) -> dict[str, Any]:
    """The chosen recipe's parameters, then the user's on top."""
    from clusterspec.recipes import DEFAULT_RECIPE, RECIPES

    name = data.get("recipe", DEFAULT_RECIPE)
    if not isinstance(name, str) or name not in RECIPES:
        raise SpecError([f"recipe={show(name)}: is not a recipe. Fix: use one of {', '.join(RECIPES)} (README 'Recipes')."])
    recipe = RECIPES[name]
    serving = data.get("serving")
    if isinstance(serving, dict):
        _recipe_facts(recipe.name, recipe.serving.model_dump(mode="json"), serving)
    return deep_merge(recipe.defaults(), data)


# What a recipe's reference tested, not a setting: the topology its units are built for and the
# decode EP degree its reference vouches for (the guard against untested degrees hangs on it).
RECIPE_FACTS = ("topology", "tested_decode_ep")
_SIZE = re.compile(r"gpt-oss-([0-9]+)b", re.IGNORECASE)


def _recipe_facts(name: str, facts: dict[str, Any], serving: dict[str, Any]) -> None:
    """Refuse a user's value for what the recipe's reference fixed, and a checkpoint of another size."""
    for key in RECIPE_FACTS:
        if key in serving and serving[key] != facts[key] and str(serving[key]) != str(facts[key]):  # -c gives text
            raise SpecError(
                [
                    f"serving.{key}={show(serving[key])}: is what the {name} recipe's reference tested ({facts[key]!r}), "
                    f"not a setting. Fix: remove serving.{key}, or choose the recipe that runs what you want with recipe=NAME."
                ]
            )
    model = serving.get("model_id")
    ours, theirs = _SIZE.search(str(facts["model_id"])), _SIZE.search(str(model)) if isinstance(model, str) else None
    if ours and theirs and ours.group(1) != theirs.group(1):
        raise SpecError(
            [
                f"serving.model_id={show(model)}: names a {theirs.group(1)}B checkpoint; the {name} recipe's flags, cores and "
                f"shard count are sized for {ours.group(1)}B ({facts['model_id']}). Fix: choose the {theirs.group(1)}B recipe "
                "(gptoss recipes lists them), or a checkpoint of the recipe's size."
            ]
        )


def pin_key(region: str) -> str:
    """The context key `gptoss pin-ami` records a region's image under (cdk.context.json)."""
    return f"gptoss:pinned-ami:{region}"


def _apply_pin(data: dict[str, Any], context: dict[str, Any]) -> None:
    """Use the pinned image while the config names the pinned parameter and no ami_id of its own."""
    region = data.get("region") or ClusterConfig.model_fields["region"].default
    parameter = data.get("ami_ssm_parameter", DEFAULT_AMI_PARAMETER)
    pin = context.get(pin_key(str(region)))
    if isinstance(pin, str):
        try:
            pin = json.loads(pin)
        except ValueError:
            pin = None
    if isinstance(pin, dict) and data.get("ami_id") is None and parameter and pin.get("parameter") == parameter:
        data["ami_id"], data["ami_ssm_parameter"] = pin.get("ami_id"), None


# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: systemd, bash and YAML
# read each of them as the end of a line or drop it; no setting documents one.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_DEPTH = 10
MAX_KMS_KEYS = 64
MAX_CONFIG_BYTES = 256 * 1024
MAX_ITEMS = 1000


def check_text(value: Any, where: str = "", depth: int = 0) -> None:
    """Every setting, at any depth: one line of printable, valid text, in bounded structures.

    Runs on the merged settings before the model sees them, so each refusal names the user's
    field (`serving.server_health_path`), not the variable a unit would have carried it in.
    """
    at = where or "config"
    if depth > MAX_DEPTH:
        raise SpecError([f"{at}: nested more than {MAX_DEPTH} levels deep; no setting is. Fix: write the setting as README 'Parameters' shows it."])
    if isinstance(value, dict | list | tuple) and len(value) > MAX_ITEMS:
        raise SpecError([f"{at}: holds {len(value):,} entries; no setting takes more than {MAX_ITEMS:,}. Fix: remove the extra entries."])
    if isinstance(value, dict):
        for k, v in value.items():
            name = f"{where}.{k}" if where else str(k)
            if isinstance(k, str):
                _check_string(f"{at} (a name in it)", k)
            check_text(v, name, depth + 1)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_text(v, f"{at}[{i}]", depth + 1)
    elif isinstance(value, str):
        _check_string(at, value)


def _types(annotation: Any) -> tuple[Any, ...]:
    """The types an annotation admits, unions and Optional flattened (Annotated unwrapped)."""
    import types
    import typing

    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return tuple(t for a in typing.get_args(annotation) for t in _types(a))
    return (annotation,)


def check_numbers(model: type[BaseModel], data: Any, where: str = "") -> None:
    """A yes/no where a number belongs is refused (pydantic would read true as 1, false as 0)."""
    import typing

    if not isinstance(data, dict):
        return
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        at = f"{where}.{key}" if where else key
        admitted = _types(field.annotation)
        if isinstance(value, bool) and bool not in admitted and (int in admitted or float in admitted):
            example = f" (e.g. {field.default})" if isinstance(field.default, int | float) and not isinstance(field.default, bool) else ""
            raise SpecError([f"{at}={show(value)}: is a yes/no, not a number. Fix: give {at} as a number{example}."])
        for t in admitted:
            origin, args = typing.get_origin(t), typing.get_args(t)
            if isinstance(t, type) and issubclass(t, BaseModel):
                check_numbers(t, value, at)
            elif origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel) and isinstance(value, dict):
                for k, v in value.items():
                    check_numbers(args[1], v, f"{at}.{k}")
            elif origin in (list, tuple) and args and isinstance(args[0], type) and issubclass(args[0], BaseModel) and isinstance(value, list):
                for i, v in enumerate(value):
                    check_numbers(args[0], v, f"{at}[{i}]")


def _check_string(where: str, value: str) -> None:
    if any("\ud800" <= ch <= "\udfff" for ch in value):
        raise SpecError([f"{where}={show(value)}: is not valid UTF-8 text. Fix: give the value as UTF-8 text."])
    m = _CONTROL.search(value)
    if m:
        raise SpecError(
            [
                f"{where}={show(value)}: holds the control character {m.group()!r} at position {m.start()}; "
                "a setting is one line of printable text (systemd and bash would end or drop the line there). Fix: remove it."
            ]
        )


# Where the CDK CLI cuts a -c value: it splits KEY=VALUE with the JavaScript pattern /=(.*)/,
# whose '.' stops at these four line terminators.
CLI_LINE_BREAKS = "\n\r\u2028\u2029"


def load_config(context: dict[str, Any]) -> ClusterConfig:
    """Build the config from a `config` file (YAML/JSON) and CDK context keys; context wins."""
    data: dict[str, Any] = {}
    path = context.get("config")
    if path:
        data.update(_read_file(str(path)))
    for key, value in context.items():
        if key == "config" or key.startswith(("@aws-cdk", "aws-cdk", "cdk-", "acknowledged-issue")) or ":" in key:
            continue
        top = key.split(".", 1)[0]
        if top not in _CONTEXT_KEYS and top != "capacity_reservation_id":
            raise SpecError(
                [
                    f"{key}={value!r}: is not a known setting. Fix: remove -c {key} or check its spelling "
                    f"(known: {', '.join(sorted(_CONTEXT_KEYS))})."
                ]
            )
        if isinstance(value, str) and any(ch in value for ch in CLI_LINE_BREAKS):
            raise SpecError(
                [
                    f"{key}={show(value)}: holds a line break; the CDK CLI keeps only the text before the first line "
                    "break of a -c value, so the template would get another value than plan checks. "
                    "Fix: give the value on one line (JSON for nested values)."
                ]
            )
        parsed = _parse_context_value(key, value)
        if "." in key:
            if top not in _SECTIONS:
                raise SpecError([f"{key}: {top} is a value, not a section of settings. Fix: -c {top}=VALUE."])
            _set_dotted(data, key, parsed)
        else:
            data[key] = parsed
    if "capacity_reservation_id" in data:
        rid = data["capacity_reservation_id"]
        raise SpecError(
            [
                f"capacity_reservation_id={rid!r}: moved into the capacity section (it also takes Capacity Blocks and groups). "
                f"Fix: -c capacity='{{\"type\": \"odcr\", \"reservation_id\": \"{rid}\"}}' "
                "(or capacity.type: capacity-block for a Capacity Block for ML)."
            ]
        )
    check_text(data)
    check_numbers(ClusterConfig, data)
    data = _with_recipe(data)
    _apply_pin(data, context)
    try:
        cfg = ClusterConfig.model_validate(data)
        cfg.layout  # noqa: B018 - validates the fleet too
    except ValidationError as e:
        raise explain(e) from None
    return cfg
