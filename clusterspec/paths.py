"""Where the project's files live on a node (the same on every node and in every test)."""

from __future__ import annotations

from pathlib import Path

USERDATA_DIR = Path(__file__).resolve().parent.parent / "userdata"

BIN = "/opt/gptoss/bin"

ETC = "/etc/gptoss"

UNIT_DIR = "/etc/systemd/system"

EXAMPLES_DIR = "/opt/gptoss/vllm-neuron"

BUNDLE = "/var/lib/gptoss/bundle.tar.xz"

# Values the stack knows only at deploy time (peers' IPs, where the scripts are), written by
# the user data's bootcmd; gptoss-identity adds this node's own IP.
DEPLOY_ENV = f"{ETC}/deploy.env"
# The deploy gate's presigned URL: root-only, read by gptoss-signal alone (never an EnvironmentFile).
SIGNAL_ENV = f"{ETC}/signal.env"

CLUSTER_ENV = f"{ETC}/cluster.env"

MANIFEST = f"{ETC}/manifest"

UNITS_FILE = f"{ETC}/units"

NODE_TARGET = "gptoss-node.target"


def cache_fleet_uri(compile_cache_s3_uri: str) -> str:
    """The fleet's compile cache (files/ and manifest.json): written only by an operator's promotion."""
    return f"{compile_cache_s3_uri.rstrip('/')}/fleet"


def cache_nodes_uri(compile_cache_s3_uri: str) -> str:
    """Where nodes upload their compile caches: nodes/<role id>:<instance id>/, each node its own."""
    return f"{compile_cache_s3_uri.rstrip('/')}/nodes"
