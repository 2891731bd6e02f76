"""The endpoint of a disaggregated fleet: the examples' toy proxy, or vLLM's router (a pinned wheel, its policies and failure settings)."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator, model_validator

from clusterspec.base import Frozen
from clusterspec.errors import rule_error
from clusterspec.sections.flags import ExtraFlag, repo_path, route_path

ProxyKind = Literal["toy", "vllm-router"]
RouterPolicy = Literal["random", "round_robin", "power_of_two", "cache_aware", "consistent_hash"]


# The longest request_timeout_s: the router unit's stop timeout is this and a margin (the API gate
# bounds a router's drain by the fleet's own request timeout, which the unit does not carry).
REQUEST_TIMEOUT_MAX_S = 86400


class Router(Frozen):
    """vLLM's own router (PyPI vllm-router): a pinned wheel, its routing policies and failure settings.

    The defaults are what the loopback experiments measured (docs/benchmarks.md
    'The endpoint under faults' and 'Health checks under saturation'): a server that refuses connections is out within
    failure threshold x interval (3 s), one that stopped answering within that plus the timeout
    (13 s); what the router sent it before that is answered 500 and sent again by the node's API
    gate (serving.proxy.gate.retries: 0.1.17 has no retry loop and no circuit breaker on its PD
    path, so the spec renders none of its --retry-* and --cb-* flags); a server slowed by a burst of
    long prompts stays in.
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
        description="Unset: round_robin. Measured (make bench-policy, docs/benchmarks.md): vllm-router 0.1.17's power_of_two "
        "asks each server for /get_load, which vLLM's servers answer 404, so it picks between two servers on nothing and "
        "queues as random does; round_robin queued least over uneven requests (it refuses power_of_two over one server).",
    )
    decode_policy: RouterPolicy | None = Field(None, description="The same rule for the decode servers.")
    health_check_interval_s: int = Field(1, ge=1, le=300, description="How often the router asks every server's /health.")
    health_check_timeout_s: int = Field(
        10, ge=1, le=60,
        description="A /health answer slower than this counts as a failure. vLLM answers /health on the event loop that "
        "tokenizes prompts, so a burst of long prompts delays it by seconds: make bench-health measured 1 s ejecting busy "
        "servers that were serving (578 failed requests in 15 s, 11 ejections, 4 readmissions) and 10 s none.",
    )  # fmt: skip
    health_failure_threshold: int = Field(
        1, ge=1, le=20,
        description="Failed checks in a row that take a server out of rotation. make bench-health (10 s timeout): 1 ejected "
        "nothing that was serving under saturation and took a killed server out within 0.2 s, so the gate's retries hid it "
        "(0 failed requests when a decode server died, against 18 with 3); the cost: one failed check takes a server out for "
        "health_success_threshold checks.",
    )  # fmt: skip
    health_success_threshold: int = Field(2, ge=1, le=20, description="Passed checks in a row that bring it back (2: one lucky answer does not).")
    request_timeout_s: int = Field(1800, ge=10, le=REQUEST_TIMEOUT_MAX_S, description="The longest one request may take end to end.")
    worker_startup_check_interval_s: int = Field(
        1, ge=1, le=300,
        description="How often a starting router looks for its servers (the router's default, 30 s, kept a restarted "
        "router out of service for 30 s with every server up).",
    )  # fmt: skip
    metrics_port: int = Field(8029, ge=1024, le=65535, description="Prometheus metrics, on 127.0.0.1 (the node's collector reads them).")
    internal_port: int = Field(
        8010, ge=1024, le=65535,
        description="The router itself, on 127.0.0.1 (its admin routes answer there alone); clients reach serving.proxy.port, "
        "where gptoss-router passes on only the OpenAI API and the health routes.",
    )  # fmt: skip
    restart_gap_s: int = Field(
        120, ge=5, le=3600,
        description="A new router setting or pool restarts the routers one at a time: decode-0 first, each next one once the "
        "one before serves the new document again (its API gate's readiness says so). Each restart goes lame-duck "
        "(serving.proxy.gate.lame_duck_s), drains (request_timeout_s), then starts; this is how long its start may take on "
        "top of those before the next router stops waiting and the roll stops there. Run-time data (the fleet's SSM "
        "parameter): changing it replaces no instance.",
    )  # fmt: skip
    max_routers: int = Field(
        8, ge=1, le=64,
        description="Routers run on the first this many decode nodes (each behind the load balancer); the others serve "
        "only. Every router health-checks every server each interval and its node reads EC2 and SSM each members poll, "
        "so this bounds the control plane as the fleet grows (plan prints its load).",
    )  # fmt: skip
    extra_flags: tuple[ExtraFlag, ...] = Field(
        (), description="Router flags the spec does not model; checked against the pinned router's own parser at plan time."
    )

    def check_policies(self, *, prefill: int, decode: int) -> None:
        """The router's refusal at start, at plan time: power_of_two over fewer than two servers of a role."""
        for role, chosen, servers in (("prefill", self.prefill_policy, prefill), ("decode", self.decode_policy, decode)):
            if chosen == "power_of_two" and servers < 2:
                raise rule_error(
                    f"serving.proxy.router.{role}_policy", chosen,
                    f"vllm-router refuses to start with power_of_two over {servers} {role} server ('Power-of-two policy for {role} "
                    f"requires at least 2 {role} workers')", "remove it (round_robin is chosen over one server) or use round_robin",
                )  # fmt: skip

    @model_validator(mode="after")
    def _router_rules(self) -> Router:
        if f"-{self.version}-" not in self.wheel:
            raise rule_error(
                "serving.proxy.router.wheel", self.wheel, f"is not a wheel of version {self.version}",
                "give the wheel file of the pinned version (and its sha256)",
            )  # fmt: skip
        seen: set[str] = set()
        for flag in self.extra_flags:
            if flag.name in seen:
                raise rule_error("serving.proxy.router.extra_flags", flag.name, "is given twice", "keep one")
            seen.add(flag.name)
        return self


class Package(Frozen):
    """A pinned Debian package file the nodes install with dpkg (from the stack's assets, no apt source)."""

    file: str = Field(
        ..., pattern=r"^[a-z0-9][a-z0-9.+-]*_[A-Za-z0-9.+~-]+_(amd64|all)\.deb$",
        description="The package file's own name (name_version_arch.deb), as it lies in .debs/ (not in git).",
    )  # fmt: skip
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$", description="sha256 of the file: the synth refuses another file, a node another download.")


class Gate(Frozen):
    """HAProxy in front of a router node's router: the endpoint clients and the load balancer reach.

    It passes on only the OpenAI API and the health routes, buffers each request whole so that a
    request whose prefill failed or whose decode server could not be reached is sent again through
    the router (before any byte of an answer went out), bounds connections, heads, bodies and idle
    answers, and answers /readiness 503 while its router goes lame-duck before a restart.
    """

    haproxy_version: str = Field(
        "2.8", pattern=r"^[0-9]+\.[0-9]+$",
        description="The HAProxy release the node runs, major.minor: the image's own package (Ubuntu 24.04, the Neuron "
        "DLAMI's, ships 2.8); a node installs haproxy=<this>.* from its apt sources when the image lacks it, and refuses another.",
    )  # fmt: skip
    packages: tuple[Package, ...] = Field(
        (),
        description="For nodes with no apt source (network.egress='none') and an image without HAProxy: the pinned "
        "haproxy_<haproxy_version>.* package file and each dependency the image lacks (Ubuntu 24.04's haproxy 2.8 needs "
        "liblua5.4-0 besides what a server image has), put in .debs/ and named here with their sha256. The stack ships "
        "them as assets; the router nodes run exactly these: a node whose haproxy package is another version fetches them "
        "from S3, checks each sha256 and installs them with dpkg (a new pin is applied in place by a restart of the gate). "
        "Empty: the image's package, else the node's apt sources.",
    )  # fmt: skip
    from_image: bool = Field(
        False,
        description="The image carries HAProxy <haproxy_version> (a custom AMI): with network.egress='none' no package "
        "is needed; a node whose image lacks it after all fails its gate's start naming the version.",
    )  # fmt: skip
    max_connections: int = Field(
        4096, ge=64, le=100000,
        description="Client connections one node holds (keep-alive ones included); the unit's open-file limit is sized from it.",
    )  # fmt: skip
    max_requests: int = Field(
        1024, ge=8, le=50000,
        description="Requests one node passes to its router at once; one more is answered 503 with Retry-After at once "
        "(not queued: the load balancer's other targets or the client's retry serve it sooner).",
    )  # fmt: skip
    retries: int = Field(
        2, ge=0, le=2,
        description="More attempts for a request whose first failed before any byte of its answer (the router's 500 for a "
        "failed prefill, 502/504, a refused or reset connection to the router): each through the router again, which picks "
        "the next server. Never on 429 or 503 (a full queue) and never after a byte went to the client.",
    )  # fmt: skip
    retry_budget_percent: int = Field(
        10, ge=1, le=100,
        description="Retries stop while more than this share of the node's requests of the last 10 s failed (and at least "
        "10 did): retries then only multiply an overload or an outage.",
    )  # fmt: skip
    head_timeout_s: int = Field(30, ge=1, le=3600, description="The longest a client may take to send a request, head and body.")
    idle_timeout_s: int = Field(
        900, ge=1, le=86400,
        description="The longest silence of an answer: before its first byte (a non-streamed completion is silent until it is "
        "done) and between two chunks of a stream. The router's request timeout bounds the whole request.",
    )  # fmt: skip
    threads: int = Field(
        1, ge=1, le=64,
        description="HAProxy's threads (nbthread). One passes on far more requests a second than a node's router serves "
        "(docs/benchmarks.md); each more costs CPU the router and the decode server share.",
    )  # fmt: skip
    buffer_kib: int = Field(
        64, ge=32, le=4096,
        description="HAProxy's buffer, per direction of each request. A request whose head and body fit in it, less the "
        "16 KiB HAProxy keeps for rewrites, is held whole and can be retried (64 KiB: a body of about 48 KB, a prompt of "
        "some 10,000 tokens); a longer one passes through as it arrives and is not retried. Each connection holds two: "
        "a larger buffer retries longer prompts and costs memory and throughput (docs/benchmarks.md).",
    )  # fmt: skip
    body_bytes_per_token: int = Field(
        16, ge=4, le=64,
        description="The request body cap is serving.shape.max_model_len x this + 64 KiB (a token is about 4 bytes of text; "
        "JSON escapes and chat framing take the rest): a longer body could not fit the model's context anyway. HAProxy "
        "refuses a longer Content-Length before the router sees a byte; the router (--max-payload-size) refuses a chunked "
        "body that grows past it.",
    )  # fmt: skip
    lame_duck_s: int = Field(
        30, ge=0, le=600,
        description="Before its router restarts, the node answers /readiness 503 this long while it serves what it holds, "
        "so that the load balancer (2 failed checks 10 s apart) stops sending it new connections first.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _package_rules(self) -> Gate:
        if not self.packages:
            return self
        files = [p.file for p in self.packages]
        for f in files:
            if files.count(f) > 1:
                raise rule_error("serving.proxy.gate.packages", f, "is given twice", "keep one")
        if not [f for f in files if f.startswith(f"haproxy_{self.haproxy_version}.")]:
            raise rule_error(
                "serving.proxy.gate.packages", files, f"holds no haproxy_{self.haproxy_version}.* package (serving.proxy.gate.haproxy_version)",
                f"add the haproxy_{self.haproxy_version}.<patch>-<release>_amd64.deb file of the image's release, or set "
                "haproxy_version to the release the packages hold",
            )  # fmt: skip
        return self


class Proxy(Frozen):
    """The endpoint of a DI fleet: the examples' toy proxy, or vLLM's router."""

    kind: ProxyKind | None = Field(
        None,
        description="'toy' runs the references' toy_proxy_server.py exactly as they do (one per decode server, a fixed "
        "group of replicas); 'vllm-router' runs vLLM's router, which health-checks its servers, behind HAProxy, which "
        "retries what failed before its first byte. Unset: the router when "
        "the fleet has more than one decode server, the toy proxy for the references' one-decode layouts.",
    )
    router: Router = Field(default_factory=Router)
    gate: Gate = Field(default_factory=Gate)
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
    restart_backoff_s: int = Field(
        1, ge=1, le=600,
        description="A proxy or router that exits is started again after this, doubling while it keeps failing (it holds "
        "no state: not the servers' 60 s that guard a compile).",
    )  # fmt: skip
    restart_backoff_max_s: int = Field(30, ge=1, le=3600, description="The longest pause between two restarts of a proxy or router.")

    @field_validator("script")
    @classmethod
    def _script(cls, v: str) -> str:
        return repo_path("serving.proxy.script", v)

    @field_validator("health_path")
    @classmethod
    def _route(cls, v: str) -> str:
        return route_path("serving.proxy.health_path", v)

    @field_validator("bind_host")
    @classmethod
    def _bind(cls, v: str) -> str:
        try:
            ipaddress.IPv4Address(v)
        except ValueError:
            raise rule_error("serving.proxy.bind_host", v, "must be an IPv4 address", "use 0.0.0.0 (other nodes and the load balancer reach the proxy)") from None
        return v

    @model_validator(mode="after")
    def _backoff(self) -> Proxy:
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise rule_error(
                "serving.proxy.restart_backoff_max_s", self.restart_backoff_max_s,
                f"is below restart_backoff_s={self.restart_backoff_s}", "raise it or lower restart_backoff_s",
            )  # fmt: skip
        return self
