"""A node's name, its Auto Scaling group's name and its host variable: one rule each.

The spec's layout names every node from its role and index here; the renderer, the constructs, the
operator's commands and the benchmarks take names from here (never `f"decode-{d}"` or a
`rpartition("-")` of their own). The node scripts apply the same rules to the names the stack
renders for them; tests/clusterspec/test_names.py holds them to these.
"""

from __future__ import annotations

import re

# A single-server recipe's one node is server-0.
ROLES = ("prefill", "decode", "server")
_NAME = re.compile(r"^(prefill|decode|server)-(0|[1-9][0-9]*)$")


def node_name(role: str, index: int) -> str:
    """The name of a role's node `index`: prefill-0, decode-7."""
    assert role in ROLES and index >= 0, (role, index)
    return f"{role}-{index}"


def decode_node(index: int) -> str:
    """The node of decode server `index` (one decode server per decode node)."""
    return node_name("decode", index)


def parse_node_name(name: str) -> tuple[str, int] | None:
    """(role, index) of a node's name, or None for anything that is not one."""
    m = _NAME.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def node_order(name: str) -> tuple[str, int]:
    """A sort key that puts decode-2 before decode-10 (a name that is no node's sorts by itself)."""
    return parse_node_name(name) or (name, 0)


def host_var(node: str) -> str:
    """The environment variable that holds a node's private IP (its own in deploy.env, a toy proxy's group in members.env)."""
    return "GPTOSS_HOST_" + re.sub(r"[^A-Z0-9]", "_", node.upper())


def holder_name(cluster_name: str, node: str) -> str:
    """The Auto Scaling group that holds a node identity's one instance (the node marks only its own)."""
    return f"{cluster_name}-{node}"
