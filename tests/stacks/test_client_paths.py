"""Every client path the README documents is open in both directions, hop by hop, in the template.

A hop from a security group to another needs an egress rule on the first and an ingress rule on
the second (a group with `allow_all_outbound=False` gets no egress from a peer's ingress rule);
a hop from a CIDR needs the ingress rule alone (security groups are stateful for the answers).
The walk reads every rule of the template, inline or separate, so a path that depends on a
missing rule fails whichever rule is missing.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.stacks.template import of_type

OPERATOR = "10.200.0.0/16"


def _ref(v: Any) -> str:
    """A security group's logical id from a GetAtt/Ref, or the CIDR / prefix list as given."""
    if isinstance(v, dict) and "Fn::GetAtt" in v:
        return str(v["Fn::GetAtt"][0])
    if isinstance(v, dict) and "Ref" in v:
        return str(v["Ref"])
    return json.dumps(v) if not isinstance(v, str) else v


def rules(t: dict[str, Any]) -> list[tuple[str, str, str, int, int]]:
    """(direction, group, peer, from, to) of every rule; -1 protocol covers every port."""
    out = []

    def add(direction: str, group: str, p: dict[str, Any]) -> None:
        peer = p.get("SourceSecurityGroupId") or p.get("DestinationSecurityGroupId") or p.get("CidrIp") or p.get("SourcePrefixListId") or p.get("DestinationPrefixListId")
        lo, hi = (0, 65535) if p["IpProtocol"] == "-1" else (p.get("FromPort"), p.get("ToPort"))
        if p["IpProtocol"] in ("tcp", "-1"):
            out.append((direction, group, _ref(peer), lo, hi))

    for lid, r in of_type(t, "AWS::EC2::SecurityGroup").items():
        for p in r["Properties"].get("SecurityGroupIngress", []):
            add("in", lid, p)
        for p in r["Properties"].get("SecurityGroupEgress", []):
            add("out", lid, p)
    for typ, direction in (("AWS::EC2::SecurityGroupIngress", "in"), ("AWS::EC2::SecurityGroupEgress", "out")):
        for r in of_type(t, typ).values():
            add(direction, _ref(r["Properties"]["GroupId"]), r["Properties"])
    return out


def allowed(t: dict[str, Any], src: str, dst: str, port: int) -> bool:
    """Can a connection from `src` (a group's logical id or a CIDR) reach `dst` (a group) on `port`?"""
    rs = rules(t)
    ingress = any(d == "in" and g == dst and peer == src and lo <= port <= hi for d, g, peer, lo, hi in rs)
    if src not in of_type(t, "AWS::EC2::SecurityGroup"):
        return ingress
    egress = any(d == "out" and g == src and peer in (dst, "0.0.0.0/0") and lo <= port <= hi for d, g, peer, lo, hi in rs)
    return ingress and egress


def groups(t: dict[str, Any]) -> tuple[str, str | None]:
    """The cluster's group and the load balancer's (None without one)."""
    ids = list(of_type(t, "AWS::EC2::SecurityGroup"))
    cluster = next(g for g in ids if g.startswith("SecurityGroup"))
    return cluster, next((g for g in ids if g.startswith("ProxyEndpoint")), None)


@pytest.mark.parametrize("kind,health_port", [("vllm-router", 8000), ("toy", 8001)])
def test_paths_through_the_load_balancer(synth_variant: Any, kind: str, health_port: int) -> None:
    t = synth_variant(decode_instances="8", proxy_ingress_cidr=OPERATOR, **{"serving.proxy.kind": kind})
    cluster, nlb = groups(t)
    assert nlb, "8 decode servers stand behind one internal NLB"
    # SSM port forward from a node to the NLB (the README's client path), then on to a proxy.
    assert allowed(t, cluster, nlb, 8000), "node -> NLB:8000"
    assert allowed(t, nlb, cluster, 8000), "NLB -> proxy:8000"
    # The NLB's health check reaches what it checks.
    assert allowed(t, nlb, cluster, health_port), f"NLB health check -> {health_port}"
    # The operator network reaches the NLB, and nothing else of the cluster but the endpoint.
    assert allowed(t, OPERATOR, nlb, 8000)
    assert not allowed(t, OPERATOR, cluster, 8000), "the operator network reaches the proxies only through the NLB"
    assert not allowed(t, OPERATOR, cluster, 8100) and not allowed(t, OPERATOR, cluster, 8200)
    # Routers and proxies reach every server of the fleet, on any node.
    for port in (8100, 8115, 8200):
        assert allowed(t, cluster, cluster, port)


def test_paths_to_the_one_proxy_without_a_load_balancer(synth_variant: Any) -> None:
    t = synth_variant(proxy_ingress_cidr=OPERATOR)
    cluster, nlb = groups(t)
    assert nlb is None
    assert allowed(t, OPERATOR, cluster, 8000), "operator network -> the proxy node"
    assert not allowed(t, OPERATOR, cluster, 8100)
    assert allowed(t, cluster, cluster, 8000), "SSM port forward to the proxy node from another node"
