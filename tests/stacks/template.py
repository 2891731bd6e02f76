"""Reading a synthesized template: resources by type, launch templates and groups by node, the security group's
rules, and the template normalized for its snapshot (the asset hashes and the CLI's own metadata out)."""

from __future__ import annotations

import json
from typing import Any


def of_type(template: dict[str, Any], rtype: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == rtype}


def one(template: dict[str, Any], rtype: str) -> tuple[str, dict[str, Any]]:
    found = of_type(template, rtype)
    assert len(found) == 1, f"expected one {rtype}, found {sorted(found)}"
    return next(iter(found.items()))


def group_id(template: dict[str, Any]) -> str:
    groups = [k for k in of_type(template, "AWS::EC2::SecurityGroup") if k.startswith("SecurityGroup")]
    assert len(groups) == 1
    return groups[0]


def self_ref(template: dict[str, Any]) -> dict[str, Any]:
    return {"Fn::GetAtt": [group_id(template), "GroupId"]}


def ingress_rules(template: dict[str, Any]) -> set[tuple[Any, ...]]:
    """(protocol, from, to, source) of every ingress rule of the cluster group."""
    sg = group_id(template)
    rules = set()
    for r in of_type(template, "AWS::EC2::SecurityGroupIngress").values():
        p = r["Properties"]
        if p["GroupId"] != {"Fn::GetAtt": [sg, "GroupId"]}:
            continue
        src = p.get("SourceSecurityGroupId") or p.get("CidrIp") or p.get("SourcePrefixListId")
        src = "self" if src == {"Fn::GetAtt": [sg, "GroupId"]} else json.dumps(src, sort_keys=True)
        rules.add((p["IpProtocol"], p.get("FromPort"), p.get("ToPort"), src))
    for p in template["Resources"][sg]["Properties"].get("SecurityGroupIngress", []):
        rules.add((p["IpProtocol"], p.get("FromPort"), p.get("ToPort"), p.get("CidrIp") or p.get("SourcePrefixListId")))
    return rules


def launch_templates(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """LaunchTemplateData by role (of the first node of each: every node identity has its own)."""
    out = {}
    for k, v in of_type(template, "AWS::EC2::LaunchTemplate").items():
        role = "prefill" if k.startswith("Prefill") else "decode"
        out.setdefault(role, v["Properties"]["LaunchTemplateData"])
    return out


def groups(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each node identity's Auto Scaling group (its properties), by node name."""
    out = {}
    for v in of_type(template, "AWS::AutoScaling::AutoScalingGroup").values():
        node = next(t["Value"] for t in v["Properties"]["Tags"] if t["Key"] == "gptoss:node")
        out[node] = v["Properties"] | {"UpdatePolicy": v.get("UpdatePolicy"), "DependsOn": v.get("DependsOn", [])}
    return out




def normalized(template: dict[str, Any]) -> dict[str, Any]:
    """The template without what the CLI adds on its own (metadata, bootstrap-version rule)."""
    t = json.loads(json.dumps(template))
    t["Resources"].pop("CDKMetadata", None)
    t.get("Conditions", {}).pop("CDKMetadataAvailable", None)
    if not t.get("Conditions"):
        t.pop("Conditions", None)
    t.get("Parameters", {}).pop("BootstrapVersion", None)
    t.pop("Rules", None)
    for r in t["Resources"].values():
        r.pop("Metadata", None)
        if r["Type"] == "AWS::CloudFormation::Stack":
            # A cell's template travels as an asset named by its hash; its resources are compared here flattened.
            r["Properties"]["TemplateURL"] = "<the cell's template>"
        if r["Type"] == "AWS::EC2::LaunchTemplate":
            # Decode the bundle so a change to one script reads as a diff of that script.
            from node_render.userdata import parse_user_data

            data = r["Properties"]["LaunchTemplateData"]
            joined = data["UserData"]["Fn::Base64"]
            parts = joined["Fn::Join"][1] if isinstance(joined, dict) else [joined]
            text = "".join(
                p
                if isinstance(p, str)
                else "<" + (".".join(p["Fn::GetAtt"]) if "Fn::GetAtt" in p else p["Ref"].rstrip("0123456789ABCDEF") if "Ref" in p else "bucket") + ">"
                for p in parts
            )
            files, deploy, doc = parse_user_data(text)
            data["UserData"] = {
                "bootcmd": [c[:3] + (["<bundle>"] if c[2].startswith("mkdir") else c[3:]) for c in doc["bootcmd"][:2]]
                + doc["bootcmd"][2:],
                "deploy.env": deploy,
                "bundle": {path: {"mode": oct(mode), "text": body.splitlines()} for path, (body, mode) in files.items()},
            }
        # The CLI's minimizePolicies flag sorts a statement's resources; an in-process synth does not.
        docs = [r["Properties"]["PolicyDocument"]] if r["Type"] == "AWS::IAM::Policy" else []
        docs += [p["PolicyDocument"] for p in r["Properties"].get("Policies", [])] if r["Type"] == "AWS::IAM::Role" else []
        for doc in docs:
            for st in doc["Statement"]:
                if isinstance(st.get("Resource"), list):
                    st["Resource"] = sorted(st["Resource"], key=lambda x: json.dumps(x, sort_keys=True))
    return t
