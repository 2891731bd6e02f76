"""Who may call the model, in the template: the secret of API keys and who reads it, the TLS listener, PrivateLink.

Expectations are AWS's: a Network Load Balancer's TLS listener names its certificate and a security
policy, and its idle timeout cannot be set (ELB, "Update the TCP idle timeout": 350 s, fixed); an
endpoint service names the load balancer and its permissions name the principals; a secret's IAM ARN
ends in six random characters, so a grant by name ends in -??????.
"""

from __future__ import annotations

from typing import Any

from tests.stacks.template import of_type
from tests.stacks.test_client_paths import allowed, groups

CERT = "arn:aws:acm:us-east-2:123456789012:certificate/11111111-2222-3333-4444-555555555555"
CONSUMER = "arn:aws:iam::210987654321:root"
OPERATOR = "10.200.0.0/16"
ROUTED = {"serving.proxy.kind": "vllm-router", "proxy_load_balancer": "true"}


def secret_grants(t: dict[str, Any]) -> dict[str, list[Any]]:
    """Each role (logical id) and policy that grants a secretsmanager action: its resources."""
    out: dict[str, list[Any]] = {}
    for kind in ("AWS::IAM::Role", "AWS::IAM::Policy"):
        for lid, r in of_type(t, kind).items():
            docs = [p["PolicyDocument"] for p in r["Properties"].get("Policies", [])] + (
                [r["Properties"]["PolicyDocument"]] if "PolicyDocument" in r["Properties"] else [])
            for doc in docs:
                for st in doc["Statement"]:
                    actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
                    if any(a.startswith("secretsmanager:") for a in actions):
                        assert actions == ["secretsmanager:GetSecretValue"], (lid, actions)
                        out.setdefault(lid, []).append(st["Resource"])
    return out


def router_roles(t: dict[str, Any]) -> set[str]:
    """The roles that read the router fleet's parameter: the router nodes'."""
    found = set()
    for lid, r in of_type(t, "AWS::IAM::Role").items():
        for p in r["Properties"].get("Policies", []):
            if any("ssm:GetParameter" in str(st["Action"]) and "router" in str(st["Resource"]) for st in p["PolicyDocument"]["Statement"]):
                found.add(lid)
    return found


def test_a_router_cluster_gets_a_secret_of_keys_that_only_its_router_nodes_read(synth_variant: Any) -> None:
    t = synth_variant(**ROUTED)
    (secret,) = of_type(t, "AWS::SecretsManager::Secret").values()
    p = secret["Properties"]
    assert p["Name"] == "gptoss/gptoss-8k1k/api-keys"
    assert p["GenerateSecretString"] == {"SecretStringTemplate": '{"keys": []}', "GenerateStringKey": "initial",
                                         "PasswordLength": 48, "ExcludePunctuation": True}  # fmt: skip
    grants = secret_grants(t)
    routers = router_roles(t)
    assert routers and set(grants) == routers, "the router nodes' roles, and nothing else, read a secret"
    for resources in grants.values():
        text = str(resources)
        assert "secret:gptoss/gptoss-8k1k/api-keys-??????" in text and text.count("secret:") == 1, resources
    outputs = t["Outputs"]
    assert outputs["ApiKeysSecret"]["Value"] == "gptoss/gptoss-8k1k/api-keys"
    assert "get-secret-value --region us-east-2 --secret-id gptoss/gptoss-8k1k/api-keys" in outputs["ApiKeyInitial"]["Value"]
    # Without a certificate: one plain listener, no endpoint service.
    listeners = of_type(t, "AWS::ElasticLoadBalancingV2::Listener")
    assert [(r["Properties"]["Port"], r["Properties"]["Protocol"]) for r in listeners.values()] == [(8000, "TCP")]
    assert not of_type(t, "AWS::EC2::VPCEndpointService")


def test_auth_none_without_a_certificate_makes_nothing_of_this(synth_variant: Any) -> None:
    t = synth_variant(**ROUTED, **{"serving.endpoint.auth": "none"})
    assert not of_type(t, "AWS::SecretsManager::Secret") and secret_grants(t) == {}
    assert "ApiKeysSecret" not in t["Outputs"] and "ProxyHttpsUrl" not in t["Outputs"]
    assert not of_type(t, "AWS::EC2::VPCEndpointService") and not of_type(t, "AWS::EC2::VPCEndpointServicePermissions")
    assert all(r["Properties"]["Protocol"] == "TCP" for r in of_type(t, "AWS::ElasticLoadBalancingV2::Listener").values())


def test_tls_and_privatelink_the_operator_reaches_only_the_tls_port_and_other_accounts_connect_through_the_service(synth_variant: Any) -> None:
    t = synth_variant(**ROUTED, proxy_ingress_cidr=OPERATOR, **{"serving.endpoint.certificate_arn": CERT,
                                                                "serving.endpoint.allowed_principals": f'["{CONSUMER}"]'})  # fmt: skip
    listeners = {r["Properties"]["Port"]: r["Properties"] for r in of_type(t, "AWS::ElasticLoadBalancingV2::Listener").values()}
    assert sorted(listeners) == [443, 8000]
    tls = listeners[443]
    assert tls["Protocol"] == "TLS" and tls["Certificates"] == [{"CertificateArn": CERT}]
    assert tls["SslPolicy"] == "ELBSecurityPolicy-TLS13-1-2-2021-06"
    assert "ListenerAttributes" not in tls, "a TLS listener's idle timeout is fixed at 350 s: setting it fails the deploy"
    assert listeners[8000]["Protocol"] == "TCP" and listeners[8000]["DefaultActions"] == tls["DefaultActions"], "both reach the same routers"
    cluster, nlb = groups(t)
    assert nlb
    assert allowed(t, OPERATOR, nlb, 443) and not allowed(t, OPERATOR, nlb, 8000), "the operator network gets TLS only"
    assert allowed(t, cluster, nlb, 8000) and allowed(t, cluster, nlb, 443), "the nodes (the SSM port forward) reach both"
    (service,) = of_type(t, "AWS::EC2::VPCEndpointService").values()
    (nlb_lid,) = of_type(t, "AWS::ElasticLoadBalancingV2::LoadBalancer")
    assert service["Properties"]["AcceptanceRequired"] is True
    assert service["Properties"]["NetworkLoadBalancerArns"] == [{"Ref": nlb_lid}]
    (perms,) = of_type(t, "AWS::EC2::VPCEndpointServicePermissions").values()
    assert perms["Properties"]["AllowedPrincipals"] == [CONSUMER]
    attrs = {a["Key"]: a["Value"] for a in of_type(t, "AWS::ElasticLoadBalancingV2::LoadBalancer")[nlb_lid]["Properties"].get("LoadBalancerAttributes", [])}
    nlb_props = of_type(t, "AWS::ElasticLoadBalancingV2::LoadBalancer")[nlb_lid]["Properties"]
    assert nlb_props.get("EnforceSecurityGroupInboundRulesOnPrivateLinkTraffic") == "off" or attrs.get(
        "enforce_security_group_inbound_rules_on_private_link_traffic") == "off", nlb_props
    outputs = t["Outputs"]
    assert outputs["ProxyHttpsUrl"]["Value"]["Fn::Join"][1][0] == "https://" and outputs["ProxyHttpsUrl"]["Value"]["Fn::Join"][1][-1] == ":443"
    # An endpoint service's name is com.amazonaws.vpce.<region>.<its id> (EC2's form).
    (service_lid,) = of_type(t, "AWS::EC2::VPCEndpointService")
    assert outputs["EndpointServiceName"]["Value"] == {"Fn::Join": [".", ["com.amazonaws.vpce", {"Ref": "AWS::Region"}, {"Ref": service_lid}]]}
    command = outputs["EndpointConsumerCommand"]["Value"]["Fn::Join"][1]
    assert command[0].startswith("aws ec2 create-vpc-endpoint --region us-east-2 --vpc-endpoint-type Interface --service-name ")
    assert "accept-vpc-endpoint-connections" in outputs["EndpointConsumerCommand"]["Description"]
