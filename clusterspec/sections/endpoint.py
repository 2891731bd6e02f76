"""Who may call the model: API keys at the node's gate, per-key limits, TLS at the load balancer, PrivateLink.

The keys live in one Secrets Manager secret (the stack's, or the operator's in the same form); every
router node reads it again each keys_refresh_s and keeps only their sha256 (HAProxy's map), so a key
created, rotated or revoked takes effect on every router within a minute, and several keys are
valid at once (a rotation keeps the old one until its grace ends). TLS ends at the internal NLB (an
ACM certificate the operator names); PrivateLink is a VPC endpoint service over that NLB.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from clusterspec.base import Frozen
from clusterspec.errors import rule_error
from clusterspec.sections.sources import SECRET_ARN

CERTIFICATE_ARN = r"^arn:(aws[a-z-]*):acm:([a-z0-9-]+):([0-9]{12}):certificate/[0-9a-f-]{36}$"
# A principal allowed to connect an interface endpoint: an account's root, a role or a user (AWS's rules for
# AllowedPrincipals), or '*' (every account; with acceptance required, the operator still accepts each).
PRINCIPAL = re.compile(r"^(\*|arn:aws[a-z-]*:iam::[0-9]{12}:(root|role/[\w+=,.@/-]{1,512}|user/[\w+=,.@/-]{1,512}))$")
# The NLB's TLS listener policies that offer TLS 1.2 and 1.3 and nothing older (Elastic Load Balancing's
# "Security policies for your Network Load Balancer": the TLS13-1-2-* family; the FIPS and PQ variants too).
TLS_POLICIES = (
    "ELBSecurityPolicy-TLS13-1-2-2021-06",
    "ELBSecurityPolicy-TLS13-1-2-Res-2021-06",
    "ELBSecurityPolicy-TLS13-1-2-Ext1-2021-06",
    "ELBSecurityPolicy-TLS13-1-2-Ext2-2021-06",
    "ELBSecurityPolicy-TLS13-1-2-FIPS-2023-04",
    "ELBSecurityPolicy-TLS13-1-3-2021-06",
)
KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# The name the gate counts requests without a key under (auth=optional): no key of the secret takes it.
ANONYMOUS = "anonymous"
# The name the stack's own secret of keys is given (one per cluster; CloudFormation deletes it without a recovery
# window with the stack, so a cluster destroyed and deployed again under its name gets a new one).
KEYS_SECRET_PREFIX = "gptoss"


def keys_secret_name(cluster: str) -> str:
    """The stack's secret of API keys: the nodes and `gptoss keys` find it by this name."""
    return f"{KEYS_SECRET_PREFIX}/{cluster}/api-keys"


class Endpoint(Frozen):
    """Who may call the model, and how: API keys, per-key limits, TLS and PrivateLink."""

    auth: Literal["keys", "optional", "none"] | None = Field(
        None,
        description="'keys': every /v1/ request needs `Authorization: Bearer <key>` of a key in the cluster's secret, "
        "checked by the router nodes' API gate before the router sees it (401 otherwise). 'optional': the way there for a "
        "cluster whose clients send no key yet: a request with a key is checked and limited as with 'keys', one without "
        "passes, counted under the name 'anonymous' (KeyRequests shows when none is left). 'none': anyone who reaches the "
        "port may call the model (plan says so). Unset: keys wherever the gate runs (vLLM's router), none for the toy "
        "proxy and the single-instance recipes, which have no gate.",
    )
    keys_secret_arn: str | None = Field(
        None, pattern=SECRET_ARN,
        description="The operator's own secret of keys (the form `gptoss keys` writes: docs/operations.md 'API keys'), "
        "kept across a destroy. Unset: the stack creates gptoss/<cluster_name>/api-keys with one generated key "
        "('initial'), deleted with the stack.",
    )  # fmt: skip
    keys_refresh_s: int = Field(
        30, ge=5, le=60,
        description="How often each router node reads the secret again: a created, rotated or revoked key holds on every "
        "router within this and one read's time.",
    )  # fmt: skip
    key_requests_per_s: int = Field(
        20, ge=1, le=100000,
        description="Requests a second one key may send to one router node; more are answered 429 with Retry-After: 1 "
        "(other keys are not affected). A key's own limit (`gptoss keys create --requests-per-s`) replaces it.",
    )  # fmt: skip
    key_concurrency: int = Field(
        256, ge=1, le=100000,
        description="Requests of one key a router node serves at once; one more is answered 429 with Retry-After: 1. "
        "A key's own limit (`gptoss keys create --concurrency`) replaces it.",
    )  # fmt: skip
    certificate_arn: str | None = Field(
        None, pattern=CERTIFICATE_ARN,
        description="An ACM certificate (in the cluster's region) for a TLS listener on tls_port of the load balancer. "
        "Unset: the endpoint is plain HTTP inside the VPC (synth says so).",
    )  # fmt: skip
    tls_port: int = Field(443, ge=1, le=65535, description="The load balancer's TLS port (with certificate_arn).")
    tls_policy: str = Field(
        "ELBSecurityPolicy-TLS13-1-2-2021-06",
        description="The TLS listener's security policy: one that offers TLS 1.3 and 1.2 only (TLS_POLICIES).",
    )
    plain_port: bool = Field(
        True,
        description="With a certificate, the plain port (serving.proxy.port) stays open to the cluster's own nodes alone, "
        "for the SSM port forward; the operator's CIDR or prefix list gets only the TLS port. false: no plain listener.",
    )  # fmt: skip
    allowed_principals: tuple[str, ...] = Field(
        (),
        description="PrivateLink: accounts, roles or users (IAM ARNs, or '*') allowed to create an interface endpoint "
        "to a VPC endpoint service over the load balancer, so clients in other VPCs and accounts reach the model without "
        "peering or an open CIDR. Empty: no endpoint service.",
    )  # fmt: skip
    acceptance_required: bool = Field(
        True, description="Each endpoint a principal creates waits for the operator's acceptance before it connects."
    )

    @field_validator("tls_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in TLS_POLICIES:
            raise rule_error(
                "serving.endpoint.tls_policy", v, "is not a TLS 1.3/1.2-only policy of the Network Load Balancer",
                f"use one of {', '.join(TLS_POLICIES)}",
            )  # fmt: skip
        return v

    @field_validator("allowed_principals")
    @classmethod
    def _principals(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            if not PRINCIPAL.match(p):
                raise rule_error(
                    "serving.endpoint.allowed_principals", p, "is not an IAM principal ARN an endpoint service allows",
                    "give arn:aws:iam::<account>:root, ...:role/<name>, ...:user/<name>, or '*'",
                )  # fmt: skip
            if v.count(p) > 1:
                raise rule_error("serving.endpoint.allowed_principals", p, "is given twice", "keep one")
        return v

    @model_validator(mode="after")
    def _endpoint_rules(self) -> Endpoint:
        if "*" in self.allowed_principals and not self.acceptance_required:
            raise rule_error(
                "serving.endpoint.acceptance_required", False,
                "with allowed_principals '*' any AWS account could connect to the model unasked",
                "keep acceptance_required=true, or name the accounts in allowed_principals",
            )  # fmt: skip
        if not self.plain_port and not self.certificate_arn:
            raise rule_error(
                "serving.endpoint.plain_port", False, "without a certificate the plain port is the only listener",
                "set serving.endpoint.certificate_arn, or keep plain_port=true",
            )  # fmt: skip
        return self

    def auth_for(self, gate: str | None) -> str:
        """'keys' or 'none': auth, else keys wherever the API gate runs (`gate`: the endpoint's proxy kind)."""
        if self.auth == "optional":
            return "keys"  # the same secret, reader and gate; only the gate's rule for a request without a key differs
        return self.auth or ("keys" if gate == "vllm-router" else "none")

    def auth_reason(self, gate: str | None, cluster: str) -> str:
        """Why auth_for is what it is, in words `plan` prints."""
        if self.auth == "none":
            return "serving.endpoint.auth=none: anyone who reaches the port may call the model"
        if self.auth_for(gate) == "keys":
            where = "the operator's secret" if self.keys_secret_arn else f"the stack's secret {keys_secret_name(cluster)}"
            if self.auth == "optional":
                return f"API keys from {where}, checked where a request sends one; a request without one passes (auth=optional)"
            return f"API keys from {where}, checked at each router node's gate"
        what = "the toy proxy" if gate == "toy" else "the single server"
        return f"no keys: {what} has no API gate (serving.proxy.kind=vllm-router puts one in front)"

    def check(self, *, gate: str | None, recipe: str, load_balanced: bool, region: str, partition: str | None, plain_port: int) -> None:
        """Against what serves the endpoint: keys need the API gate (`gate`: vllm-router), TLS and PrivateLink the load balancer."""
        if self.auth in ("keys", "optional") and gate != "vllm-router":
            what = "the toy proxy" if gate == "toy" else f"the {recipe} recipe's single server"
            raise rule_error(
                "serving.endpoint.auth", self.auth, f"{what} has no API gate to check keys (only vLLM's router nodes run one)",
                "set serving.proxy.kind=vllm-router, or serving.endpoint.auth=none",
            )  # fmt: skip
        if self.keys_secret_arn and self.auth_for(gate) != "keys":
            raise rule_error(
                "serving.endpoint.keys_secret_arn", self.keys_secret_arn, f"no key is checked ({self.auth_reason(gate, '')})",
                "remove keys_secret_arn, or use vLLM's router with serving.endpoint.auth=keys",
            )  # fmt: skip
        for field, given in (("certificate_arn", self.certificate_arn), ("allowed_principals", list(self.allowed_principals))):
            if given and not load_balanced:
                raise rule_error(
                    f"serving.endpoint.{field}", given, "it is a property of the load balancer, and this cluster has none",
                    "set proxy_load_balancer=true",
                )  # fmt: skip
        for field, arn, pattern, service in (("certificate_arn", self.certificate_arn, CERTIFICATE_ARN, "ACM"),
                                             ("keys_secret_arn", self.keys_secret_arn, SECRET_ARN, "Secrets Manager")):  # fmt: skip
            m = re.fullmatch(pattern, arn) if arn else None
            if m and (m.group(1), m.group(2)) != (partition, region):
                raise rule_error(
                    f"serving.endpoint.{field}", arn, f"the cluster in {region} uses {service} in {region}",
                    f"create or replicate it in {region} and give that ARN",
                )  # fmt: skip
        if self.certificate_arn and self.tls_port == plain_port:
            raise rule_error(
                "serving.endpoint.tls_port", self.tls_port, "is the plain port (serving.proxy.port) too", "give the TLS listener a port of its own (443)"
            )  # fmt: skip
