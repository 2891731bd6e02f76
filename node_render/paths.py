"""Where the project's files live on a node (the same on every node and in every test)."""

from __future__ import annotations

import hashlib
from pathlib import Path

USERDATA_DIR = Path(__file__).resolve().parent.parent / "userdata"

BIN = "/opt/gptoss/bin"

ETC = "/etc/gptoss"

UNIT_DIR = "/etc/systemd/system"

EXAMPLES_DIR = "/opt/gptoss/vllm-neuron"

# What a node keeps across boots on its root volume: the user data's bundle, the fetched scripts.
STATE_DIR = "/var/lib/gptoss"
BUNDLE = f"{STATE_DIR}/bundle.tar.xz"
# The software version a node runs ("<s3 uri> <sha256>" of the stack's software asset), written when
# its files are installed (at boot, or in place by gptoss-apply); the previous one beside it.
SOFTWARE_VERSION = f"{STATE_DIR}/software"
# One folder per version the node keeps (the current and the previous one): its own files as that
# version shipped them, which a failed in-place change is rolled back to.
SOFTWARE_DIR = f"{STATE_DIR}/versions"

# Values the stack knows only at deploy time (peers' IPs, where the scripts are), written by
# the user data's bootcmd; gptoss-identity adds this node's own IP.
DEPLOY_ENV = f"{ETC}/deploy.env"
# The deploy gate's presigned URL: root-only, read by gptoss-signal alone (never an EnvironmentFile).
SIGNAL_ENV = f"{ETC}/signal.env"

CLUSTER_ENV = f"{ETC}/cluster.env"

MANIFEST = f"{ETC}/manifest"

UNITS_FILE = f"{ETC}/units"

# For each long-running or one-shot unit of the node: the files it runs with (its unit, environment,
# scripts and what they read). gptoss-apply restarts a unit when one of them changes.
RESTARTS_FILE = f"{ETC}/restarts"

# The units a node must run and how each proves it serves (gptoss-signal, gptoss-health-watch, gptoss-status read it).
HEALTH_FILE = f"{ETC}/health"

# What the node's collector (gptoss-telemetry) publishes, and where from.
TELEMETRY_CONFIG = f"{ETC}/telemetry.json"

NODE_TARGET = "gptoss-node.target"


def cache_fleet_uri(compile_cache_s3_uri: str, toolchain: str | None = None) -> str:
    """The fleet's compile caches, one per toolchain key (files/ and manifest.json): written only by an operator's promotion."""
    fleet = f"{compile_cache_s3_uri.rstrip('/')}/fleet"
    return f"{fleet}/{toolchain}" if toolchain else fleet


def cache_nodes_uri(compile_cache_s3_uri: str) -> str:
    """Where nodes upload their compile caches: nodes/<node>/<toolchain key>/, each node identity its own area."""
    return f"{compile_cache_s3_uri.rstrip('/')}/nodes"


def cache_node_uri(compile_cache_s3_uri: str, node: str) -> str:
    """One node identity's own area: what it uploads and what its replacements restore."""
    return f"{cache_nodes_uri(compile_cache_s3_uri)}/{node}"

# vLLM's router: its own venv (one per pinned wheel); the fleet's members as this node last read
# them from EC2 (the toy proxy's addresses); this node's private IP for the NIXL side channel.
ROUTER_VENV_ROOT = "/opt/gptoss/vllm-router"
RUN_DIR = "/run/gptoss"
MEMBERS_ENV = f"{RUN_DIR}/members.env"
# A router reaches every server by name (prefill-0.gptoss.internal): gptoss-members keeps these
# names in /etc/hosts, so a replaced node's new address reaches a running router without a restart.
MEMBERS_DOMAIN = "gptoss.internal"
HOSTS_FILE = "/etc/hosts"
# What every router of the fleet runs with, read at run time (its settings and its pool): the
# stack's one SSM parameter (router_parameter), copied here by gptoss-members. Neither is in a
# node's user data, so a router setting or a new member replaces no instance.
ROUTER_FLEET = f"{RUN_DIR}/router-fleet"
# Which secret a router node reads its API keys from (gptoss-keys).
KEYS_ENV = f"{ETC}/keys.env"
NIXL_ENV = f"{RUN_DIR}/nixl.env"
# Behind vLLM's router, a node's servers leave the routers before gptoss-apply restarts them: while this
# file exists, each answers its health route 503 (the middleware DRAIN_MODULE, which vLLM loads from BIN).
SERVERS_DRAINING = f"{RUN_DIR}/servers-draining"
DRAIN_MODULE = "gptoss_drain"
# How gptoss-drain drains this node's servers (rendered on a server node behind the router only).
DRAIN_ENV = f"{ETC}/drain.env"

# Where `make setup` keeps the pinned router wheel the stack ships as an asset (not in git).
WHEELS_DIR = Path(__file__).resolve().parent.parent / ".wheels"


# The API gate's pinned HAProxy packages (a router node's own file when the spec names some; only
# gptoss-install-haproxy reads it, so a new router wheel does not restart the gate, nor new packages the router).
HAPROXY_ENV = f"{ETC}/haproxy.env"
# Where a router node keeps the pinned HAProxy packages it fetched (gptoss-install-haproxy).
HAPROXY_PACKAGES_DIR = f"{STATE_DIR}/haproxy-packages"
# Where the operator puts the pinned HAProxy packages for nodes with no apt source (serving.proxy.gate.packages; not in git).
DEBS_DIR = Path(__file__).resolve().parent.parent / ".debs"


# The router's wheel and where it is (a router node's own settings: only its router unit reads them).
ROUTER_ENV = f"{ETC}/router.env"


def router_object_key(sha256: str) -> str:
    """The wheel's key in the stack's asset bucket (the bucket of the software asset): the asset's hash is the
    pinned sha256 (AssetHashType.CUSTOM), which CDK hashes once more into the key; cluster_constructs.router
    checks at synth that the asset's key is this one. Known without CDK, so a node's software names it."""
    return f"{hashlib.sha256(sha256.encode()).hexdigest()}.whl"


def package_object_key(sha256: str) -> str:
    """A pinned package's key in the stack's asset bucket, by the same rule as the router wheel's."""
    return f"{hashlib.sha256(sha256.encode()).hexdigest()}.deb"


def router_venv(version: str, sha256: str) -> str:
    """The router's venv on a node: a new wheel gets a new venv, so a node never runs a half-replaced one."""
    return f"{ROUTER_VENV_ROOT}/{version}-{sha256[:12]}"


def member_host(node: str) -> str:
    """The name a router reaches a node by (in /etc/hosts, kept by gptoss-members)."""
    return f"{node}.{MEMBERS_DOMAIN}"


def software_parameter(cluster_name: str) -> str:
    """The SSM parameter that names the fleet's current software version (the stack writes it): every
    node reads it at boot (rollout.software=in-place), so a node that boots later runs the current one."""
    return f"/gptoss/{cluster_name}/software"


def router_parameter(cluster_name: str) -> str:
    """The SSM parameter that holds the fleet's router settings and pool (the stack writes it)."""
    return f"/gptoss/{cluster_name}/router"


