"""Cells: the nested stacks that hold the node identities, so that a fleet of any size is one stack name.

A node's resources (its group, launch template, role, instance profile and deploy gate) live in
a cell of its role: node i of a role is in that role's cell i // cell_nodes. The assignment
depends on nothing but the role, the index and cell_nodes, so a fleet that grows (or shrinks)
adds (or removes) nodes at the end of a role's last cell and never moves a node from one nested
stack to another, which would replace its instance. What every node shares (network, security
group, load balancer, scripts, the compile cache's bucket, dashboards and alarms) stays in the
parent stack, which is what `cdk deploy` and `cdk destroy` name.
"""

from __future__ import annotations

from dataclasses import dataclass

from clusterspec.layout import Layout, Node

# Nodes per cell: a cell of 24 trn3 nodes is about 640 KB of template and 145 resources, well
# within CloudFormation's 1 MB and 500 (node_render.limits checks every cell).
CELL_NODES = 24


@dataclass(frozen=True)
class Cell:
    """One nested stack: its construct id and the nodes it holds."""

    name: str
    role: str
    nodes: tuple[Node, ...]


def cell_name(node: Node, cell_nodes: int = CELL_NODES) -> str:
    """The cell a node lives in: PrefillCell0, DecodeCell1, ... (its role's, by its index)."""
    return f"{node.role.capitalize()}Cell{node.index // cell_nodes}"


def cells(layout: Layout, cell_nodes: int = CELL_NODES) -> list[Cell]:
    """The fleet's cells, in fleet order."""
    out: dict[str, list[Node]] = {}
    for n in layout.nodes:
        out.setdefault(cell_name(n, cell_nodes), []).append(n)
    return [Cell(name, nodes[0].role, tuple(nodes)) for name, nodes in out.items()]
