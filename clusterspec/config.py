"""Every parameter of one deployment: the sections composed, and the rules that span them."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, PrivateAttr, StrictInt, ValidationError, ValidationInfo, field_validator, model_validator

from clusterspec import validate
from clusterspec.base import Frozen
from clusterspec.cells import CELL_NODES
from clusterspec.errors import SpecError, rule_error, show
from clusterspec.instance_types import KNOWN_INSTANCE_TYPES, InstanceType
from clusterspec.layout import Layout, compute_layout
from clusterspec.sections.boot import SIGNAL_MARGIN_S, BootConfig
from clusterspec.sections.capacity import CapacityConfig
from clusterspec.sections.healing import HealingConfig
from clusterspec.sections.network import NetworkConfig, interface_endpoints
from clusterspec.sections.observability import ObservabilityConfig
from clusterspec.sections.proxy import ProxyKind
from clusterspec.sections.rollout import RolloutConfig
from clusterspec.sections.serving import Serving
from clusterspec.sections.sources import SECRET_ARN, ExamplesSource, ModelSource, NixlSource

DEFAULT_AMI_PARAMETER = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"

# vLLM's router answers 200 here while at least one prefill and one decode server are healthy.
ROUTER_READINESS_PATH = "/readiness"

# Each key adds about 80 characters to the node role's inline policy (IAM caps a role's at 10,240).
MAX_KMS_KEYS = 64


RecipeName = Literal["gptoss-120b-8k1k", "gptoss-120b-single", "gptoss-20b-single", "gptoss-120b-di", "gptoss-20b-di"]


class ClusterConfig(Frozen):
    """Every parameter of one deployment; defaults give the tested two-node 6P1D cluster."""

    _layout: Layout | None = PrivateAttr(default=None)
    # The settings the user gave (dotted, every prefix), as loading found them before the recipe's.
    _given: frozenset[str] = PrivateAttr(default=frozenset())

    recipe: RecipeName = Field("gptoss-120b-8k1k", description="The documented deployment to run (README 'Recipes and layouts').")
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
    acknowledge_unpinned_ami: bool = Field(
        False,
        description="Keep the image unpinned on purpose (it moves with ami_ssm_parameter at every deploy): the synth's "
        "gptoss:unpinned-ami warning is then acknowledged instead of printed.",
    )
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
    boot: BootConfig = Field(default_factory=BootConfig, description="Each boot step's retry budget (docs/node.md 'Boot retries').")
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
    nixl: NixlSource = Field(default_factory=NixlSource)
    compile_cache_s3_uri: str | None = Field(
        None,
        description="Where nodes save their compiled graphs and restore them from. Unset: a bucket the stack creates "
        "(compile_cache_bucket), emptied and deleted by gptoss destroy.",
    )
    compile_cache_bucket: bool = Field(
        True, description="With compile_cache_s3_uri unset, the stack creates the compile cache's bucket; false: no compile cache."
    )
    healing: HealingConfig = Field(default_factory=HealingConfig, description="Replacement of lost nodes (docs/design.md 'Healing').")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="How a change that replaces instances goes through a running fleet (docs/design.md 'Changes')."
    )
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
    def endpoint_auth(self) -> str:
        """Whether a /v1/ request needs an API key: serving.endpoint.auth, else keys wherever the API gate runs."""
        return self.serving.endpoint.auth_for(self.proxy_kind)

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
        return f"{self.decode_instances} decode servers: it health-checks them"

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

    def ignored_settings(self) -> list[str]:
        """Settings the user gave that another of their choices makes irrelevant, one line each (plan and
        synth say them; the value is kept, not refused: it takes effect when the other choice changes)."""
        given = self._given

        def note(key: str, value: Any, why: str) -> str:
            return f"{key}={show(value)} has no effect: {why}"

        out = []
        cap, net, obs, heal, model = self.capacity, self.network, self.observability, self.healing, self.model
        if cap.type == "on-demand":
            out += [note(f"capacity.{k}", getattr(cap, k), "capacity.type is on-demand") for k in ("preference", "min_hours_left") if f"capacity.{k}" in given]
        elif cap.type == "odcr" and "capacity.min_hours_left" in given:
            out.append(note("capacity.min_hours_left", cap.min_hours_left, "it checks a Capacity Block; capacity.type is odcr"))
        if not net.flow_logs and "network.flow_logs_traffic" in given:
            out.append(note("network.flow_logs_traffic", net.flow_logs_traffic, "network.flow_logs is false"))
        if net.egress == "none" and "network.public_subnet_cidr" in given:
            out.append(note("network.public_subnet_cidr", net.public_subnet_cidr, "network.egress is none: no NAT gateway, no public subnet"))
        if not obs.enabled:
            out += [note(f"observability.{k}", getattr(obs, k), "observability.enabled is false")
                    for k in ("interval_s", "log_retention_days") if f"observability.{k}" in given]  # fmt: skip
        if obs.alarm_topic_arn and "observability.alarm_emails" in given:
            out.append(note("observability.alarm_emails", list(obs.alarm_emails), "observability.alarm_topic_arn names your topic; subscribe to it"))
        if not heal.report_unhealthy:
            out += [note(f"healing.{k}", getattr(heal, k), "healing.report_unhealthy is false")
                    for k in ("watch_interval_s", "backoff_s", "neuron_errors") if f"healing.{k}" in given]  # fmt: skip
        if not self.wait_for_ready and "ready_timeout_s" in given:
            out.append(note("ready_timeout_s", self.ready_timeout_s, "wait_for_ready is false (no deploy gate)"))
        if self.proxy_kind != "vllm-router" and "serving.proxy.router" in given:
            what = f"the endpoint is the {'toy proxy' if self.proxy_kind == 'toy' else 'single server'}, not vLLM's router"
            out.append(f"serving.proxy.router has no effect: {what} (serving.proxy.kind)")
        if model.source == "huggingface" and "model.s3_uri" in given:
            out.append(note("model.s3_uri", model.s3_uri, "model.source is huggingface"))
        if not self.serving.disaggregated and "nixl.requirements" in given:
            out.append(note("nixl.requirements", list(self.nixl.requirements), "a single-instance recipe runs no NIXL"))
        if self.examples.s3_uri and "examples.commit" in given:
            out.append(note("examples.commit", self.examples.commit, "examples.s3_uri is the copy the nodes take"))
        if model.source == "s3" and "model.hf_token_secret_arn" in given:
            out.append(note("model.hf_token_secret_arn", model.hf_token_secret_arn, "model.source is s3"))
        if self.ami_id and "acknowledge_unpinned_ami" in given:
            out.append(note("acknowledge_unpinned_ami", self.acknowledge_unpinned_ami, f"the image is pinned ({self.ami_id})"))
        if self.compile_cache_s3_uri and "compile_cache_bucket" in given:
            out.append(note("compile_cache_bucket", self.compile_cache_bucket, "compile_cache_s3_uri names the compile cache"))
        return out

    @property
    def compile_cache_enabled(self) -> bool:
        """Nodes save and restore compile caches: at compile_cache_s3_uri, or in the stack's own bucket."""
        return self.compile_cache_s3_uri is not None or self.compile_cache_bucket

    def router_policy(self, role: str) -> str:
        """The router's policy for one role: the spec's, else round_robin (make bench-policy: the pinned router's
        power_of_two balances on /get_load, a route vLLM's servers do not serve, and queues as random does)."""
        r = self.serving.proxy.router
        chosen = r.prefill_policy if role == "prefill" else r.decode_policy
        return chosen or "round_robin"

    @property
    def load_balanced(self) -> bool:
        """One internal NLB fronts the proxies."""
        if self.proxy_load_balancer is None:
            return self.layout.load_balanced
        return self.proxy_load_balancer

    @property
    def surge(self) -> bool:
        """Whether a replacement is launched and serving before the instance it replaces goes (rollout.surge)."""
        return self.rollout.surges(self.capacity.type, self.wait_for_ready)

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
        self.capacity.check(roles=("prefill", "decode") if self.serving.disaggregated else ("server",), recipe=self.recipe,
                            region=self.region, partition=partition)  # fmt: skip
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
        e = self.serving.endpoint  # the layout's own errors come later: only TLS and PrivateLink ask for it here
        e.check(gate=self.proxy_kind, recipe=self.recipe, load_balanced=bool(e.certificate_arn or e.allowed_principals) and self.load_balanced, region=self.region, partition=partition, plain_port=self.serving.proxy.port)  # fmt: skip
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
            if self.nixl.requirements and self.serving.disaggregated:
                raise rule_error(
                    "nixl.requirements", list(self.nixl.requirements),
                    "with network.egress='none' a node cannot reach PyPI to install the pinned NIXL",
                    "use a DLAMI whose vLLM venv has NIXL and unset nixl.requirements, or use network.egress='nat'",
                )  # fmt: skip
            gate = self.serving.proxy.gate
            if self.proxy_kind == "vllm-router" and not gate.packages and not gate.from_image:
                raise rule_error(
                    "serving.proxy.gate.packages", [],
                    f"with network.egress='none' a router node cannot reach an apt source to install HAProxy {gate.haproxy_version}, "
                    "the API gate in front of its router",
                    f"put the pinned haproxy_{gate.haproxy_version}.* package (and each dependency the image lacks) in .debs/ and "
                    "name them in serving.proxy.gate.packages with their sha256, or set serving.proxy.gate.from_image=true for an "
                    "image that carries it, or use network.egress='nat'",
                )  # fmt: skip
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
            # Counted, not placed: the layout (and its own refusals, a fleet too large) comes after validation.
            self.serving.proxy.router.check_policies(prefill=self.decode_instances * self.prefill_per_decode, decode=self.decode_instances)
        self.rollout.check(wait_for_ready=self.wait_for_ready, members_poll_s=self.healing.members_poll_s)
        _check_subnet_size(self)
        s = self.serving
        per_node = max(1, self.replicas_per_prefill_instance or self.hardware.logical_cores(s.prefill.lnc) // s.prefill.tensor_parallel)
        s.check_ports(per_node=per_node, routed=self.proxy_kind == "vllm-router")
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

