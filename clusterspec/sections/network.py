"""The network section: a new VPC with one private subnet, or an existing VPC and subnet."""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from clusterspec import validate
from clusterspec.base import Frozen
from clusterspec.errors import rule_error


class NetworkConfig(Frozen):
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
    s3_prefix_list_id: str | None = Field(
        None, pattern=r"^pl-[0-9a-f]{8,17}$",
        description="egress=none: the region's AWS-managed S3 prefix list (com.amazonaws.<region>.s3; `gptoss preflight` "
        "names it); the nodes' HTTPS egress then reaches S3 alone instead of any address.",
    )  # fmt: skip
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
        if self.s3_prefix_list_id and self.egress != "none":
            raise rule_error(
                "network.s3_prefix_list_id", self.s3_prefix_list_id,
                "with egress 'nat' the nodes' HTTPS reaches Hugging Face, GitHub and PyPI, not S3 alone",
                "unset network.s3_prefix_list_id, or use network.egress=none",
            )  # fmt: skip
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


def interface_endpoints(cfg: Any) -> tuple[str, ...]:  # a ClusterConfig (which imports this module)
    """The interface endpoints the stack makes without egress (one ENI each in the subnet): SSM, EC2 and Auto Scaling
    for the members and self-reports, CloudFormation for a node's signal to its group, CloudWatch for telemetry."""
    if not cfg.network.wants_ssm_endpoints:
        return ()
    # ec2: the members (and a node's own tags, for its signal); autoscaling: a node's report, the members' leaving instance.
    members = ("ec2",) if any(cfg.layout.proxies) or cfg.wait_for_ready else ()
    healing = ("autoscaling",) if cfg.healing.report_unhealthy or any(cfg.layout.proxies) else ()
    # cloudformation: a node's verdict to its group (a surge's or a rollback's update waits for it), whatever the policy.
    signal = ("cloudformation",) if cfg.wait_for_ready else ()
    keys = ("secretsmanager",) if cfg.endpoint_auth == "keys" else ()  # the router nodes read the API keys
    return ("ssm", "ssmmessages", "ec2messages", *members, *healing, *signal, *keys) + (("logs", "monitoring") if cfg.observability.enabled else ())
