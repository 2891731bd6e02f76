"""State Manager applying a new software version in place, replayed by its documented rules (moto runs no
association): what `cdk deploy` of a software change does to a running fleet with rollout.software=in-place.

The rules, as AWS documents them:
- An association runs on its targets (instances by tag) at most MaxConcurrency at a time (AWS Systems
  Manager User Guide, "Understanding targets and rate controls in State Manager associations").
- MaxErrors "0": "the system stops sending requests after the first error is returned"; "executions that are
  already running an association when MaxErrors is reached are allowed to complete" (SSM API Reference,
  CreateAssociation, MaxErrors).
- A new version of an association's parameters runs it again at once on its targets (API Reference,
  UpdateAssociation; ApplyOnlyAtCronInterval is false); CloudFormation waits up to
  WaitForSuccessTimeoutSeconds for the association's status to be Success and fails the resource otherwise
  (CloudFormation User Guide, AWS::SSM::Association, WaitForSuccessTimeoutSeconds).
- A failed resource fails the stack update, and CloudFormation's rollback updates the association back to its
  previous parameters: the previous version runs again, at the same rate, on every target.
Each node is the project's own gptoss-apply: a node that serves again within its bound succeeds; one that does
not goes back to the version it ran by itself and fails (its rollback's restart is part of its time). A node
that runs the association's version already succeeds at once (nothing to do).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Association:
    """One role's association, as the template says it."""

    role: str
    nodes: tuple[str, ...]  # the role's instances, in the order State Manager reaches them
    max_concurrency: int
    wait_s: int  # WaitForSuccessTimeoutSeconds
    apply_timeout_s: int  # the document's TimeoutSeconds: the node's own bound to serve again


@dataclass
class Outcome:
    state: str = "UPDATE_COMPLETE"
    ended: float = 0.0
    reason: str = ""
    out: list[tuple[str, float, float]] = field(default_factory=list)  # (node, from, to): its servers restarting
    batches: dict[str, list[list[str]]] = field(default_factory=dict)  # role -> nodes started together
    reached: list[str] = field(default_factory=list)  # nodes that ran the new version (or tried)
    rolled_back: list[str] = field(default_factory=list)  # nodes CloudFormation's rollback reached again

    def min_serving(self, nodes: list[str]) -> int:
        """The fewest of NODES serving at once over the whole change."""
        points = sorted({t for n, a, b in self.out if n in nodes for t in (a, b)})
        worst = len(nodes)
        for t in points:
            down = {n for n, a, b in self.out if n in nodes and a <= t < b}
            worst = min(worst, len(nodes) - len(down))
        return worst


def _run(assoc: Association, start: float, restart_s: Mapping[str, float], fails: frozenset[str], changed: set[str], o: Outcome,
         *, record: bool = True) -> tuple[float, str | None]:  # fmt: skip
    """One run of an association from START: (when it ended, the node that failed or None)."""
    running: list[tuple[float, str]] = []
    queue = list(assoc.nodes)
    now, failed = start, None
    batch: list[str] = []
    o.batches.setdefault(assoc.role, [])
    while queue or running:
        while queue and len(running) < assoc.max_concurrency and failed is None:
            node = queue.pop(0)
            if node not in changed:
                continue  # its version is the association's already: success at once
            took = restart_s[node] if node not in fails else assoc.apply_timeout_s + restart_s[node]
            heapq.heappush(running, (now + took, node))
            o.out.append((node, now, now + took))
            o.reached.append(node)
            batch.append(node)
        if batch and record:
            o.batches[assoc.role].append(sorted(batch))
        batch = []
        if not running:
            break
        now, node = heapq.heappop(running)
        done = [node]
        while running and running[0][0] == now:  # every execution that ends at this moment
            done.append(heapq.heappop(running)[1])
        for node in done:
            if node in fails and failed is None:
                failed = node  # MaxErrors 0: no new target; the ones running complete
    return now, failed


def replay(associations: list[Association], restart_s: Mapping[str, float], changed: set[str], fails: frozenset[str] = frozenset()) -> Outcome:
    """A software change through the roles' associations, each after the one before (their DependsOn), and
    CloudFormation's rollback if one fails or outlasts its WaitForSuccessTimeoutSeconds. CHANGED: the nodes
    whose software the change touches (the others succeed at once)."""
    o = Outcome()
    now = 0.0
    done: list[Association] = []
    for assoc in associations:
        ended, failed = _run(assoc, now, restart_s, fails, changed, o)
        if failed is not None or ended - now > assoc.wait_s:
            o.state = "UPDATE_ROLLBACK_COMPLETE"
            o.reason = (f"{assoc.role}: {failed} did not serve again within {assoc.apply_timeout_s} s (rolled back by itself)" if failed
                        else f"{assoc.role}: not Success within WaitForSuccessTimeoutSeconds {assoc.wait_s}")  # fmt: skip
            # The rollback: every association this update changed runs the previous version again, at its rate.
            back = {n for n in o.reached if n not in fails}
            now = ended
            for prior in [*done, assoc]:
                before = len(o.reached)
                now, _ = _run(prior, now, restart_s, frozenset(), back, o, record=False)
                o.rolled_back += o.reached[before:]
                del o.reached[before:]
            o.ended = now
            return o
        done.append(assoc)
        now = ended
    o.ended = now
    return o


def from_template(resources: Mapping[str, dict], nodes_by_role: Mapping[str, list[str]]) -> list[Association]:
    """The roles' associations of a (flattened) template, in the order their DependsOn chain runs them."""
    found = {lid: res for lid, res in resources.items() if res.get("Type") == "AWS::SSM::Association"}
    ordered: list[str] = []
    while len(ordered) < len(found):
        for lid, res in found.items():
            deps = res.get("DependsOn", [])
            if lid not in ordered and all(d in ordered or d not in found for d in ([deps] if isinstance(deps, str) else deps)):
                ordered.append(lid)
    out = []
    for lid in ordered:
        p = found[lid]["Properties"]
        role = next(t["Values"][0] for t in p["Targets"] if t["Key"] == "tag:gptoss:role")
        out.append(Association(role, tuple(nodes_by_role[role]), int(p["MaxConcurrency"]), int(p["WaitForSuccessTimeoutSeconds"]),
                               int(p["Parameters"]["TimeoutSeconds"][0])))  # fmt: skip
    return out
