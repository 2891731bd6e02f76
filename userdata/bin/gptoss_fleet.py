#!/usr/bin/env python3
"""The fleet's router document, read one way on the node (gptoss-members and gptoss-router-pool import this).

The document is the stack's SSM parameter, which gptoss-members copies to /run/gptoss/router-fleet; lines of
  version N                                  the document's form (none: 1); a reader refuses a newer one by name
  domain D                                   the members' names end in .D (gptoss-members keeps them in /etc/hosts)
  restart_gap S                              how far apart the routers restart for a new document
  arg TOKEN                                  one token of the router's settings, in order
  pool ROLE FIRST LAST FIRST_PORT LAST_PORT  nodes ROLE-FIRST..ROLE-LAST, each serving FIRST_PORT..LAST_PORT
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# The newest form of the document this reader knows. Version 1 is the document without a version line (what
# node_render.command_lines.router_fleet writes, and the form the readers of earlier releases take); a later form
# begins with `version N`. gptoss-members refuses a document this reader cannot use before it copies it, so a newer
# form reaching a node before the node's new reader (the parameter changes at deploy time, a node's software in
# place after it) restarts no router: the next members sync after the software update takes it.
VERSION = 1
# A document without restart_gap (none the stack writes): the spec's defaults, lame-duck 30 + request timeout
# 1,800 + restart gap 120 (tests/clusterspec/test_names.py holds it to the spec).
DEFAULT_RESTART_GAP_S = 1950
DOMAIN = re.compile(r"^[a-z0-9-]+(\.[a-z0-9-]+)*$")
POOL = re.compile(r"^(prefill|decode) ([0-9]+) ([0-9]+) ([0-9]+) ([0-9]+)$")


class FleetError(Exception):
    """A document this reader cannot use; the message names the line and the rule."""


@dataclass
class Fleet:
    domain: str = ""
    restart_gap_s: int = DEFAULT_RESTART_GAP_S
    args: list[str] = field(default_factory=list)
    # (role, first node index, last node index, first port, last port)
    pools: list[tuple[str, int, int, int, int]] = field(default_factory=list)

    def members(self) -> list[str]:
        """The nodes of the pool, by name (ROLE-INDEX), in the document's order."""
        return [f"{role}-{i}" for role, a, b, _, _ in self.pools for i in range(a, b + 1)]

    def urls(self) -> list[str]:
        """The router's --prefill and --decode arguments: every server at its node's name."""
        out = []
        for role, a, b, first, last in self.pools:
            for i in range(a, b + 1):
                for port in range(first, last + 1):
                    out += [f"--{role}", f"http://{role}-{i}.{self.domain}:{port}"]
        return out


def parse(text: str, where: str) -> Fleet:
    """The document in TEXT (read from WHERE, named in errors); FleetError when a line breaks its form."""
    fleet = Fleet()
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "":
            continue
        if kind == "version":
            if not rest.isdigit() or int(rest) < 1:
                raise FleetError(f"{where} holds '{line}', not version N")
            if int(rest) > VERSION:
                raise FleetError(f"{where} is a version {rest} document; this node reads up to version {VERSION}: the node's "
                                 "software update (in place, after the deploy) brings the reader that takes it")  # fmt: skip
        elif kind == "domain":
            fleet.domain = rest
        elif kind == "arg":
            fleet.args.append(rest)
        elif kind == "restart_gap":
            if not rest.isdigit():
                raise FleetError(f"{where} holds '{line}', not restart_gap SECONDS")
            fleet.restart_gap_s = int(rest)
        elif kind == "pool":
            m = POOL.match(rest)
            if not m:
                raise FleetError(f"{where} holds '{line}', not pool ROLE FIRST LAST FIRST_PORT LAST_PORT")
            fleet.pools.append((m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5])))
        else:
            raise FleetError(f"{where} holds '{line}', not a version, domain, restart_gap, arg or pool line")
    if not DOMAIN.match(fleet.domain):
        raise FleetError(f"{where} names no members' domain (domain D)")
    return fleet
