"""The node role's allowlist, typed here independently of cluster_constructs/iam.py.

Every (action, resource) pair the template grants must be one this file expects for the
config, and every expected pair must be granted (nothing missing that the node needs). Managed
policies are expanded from a typed copy of their documented actions, so attaching one is
judged by what it really grants.
"""

from __future__ import annotations

import json
from typing import Any

from clusterspec.config import ClusterConfig

ACCOUNT = "123456789012"
ASSETS = f"cdk-hnb659fds-assets-{ACCOUNT}-us-east-2"

# AmazonSSMManagedInstanceCore, as AWS documents it (policy version v2): what attaching it would grant.
MANAGED_ACTIONS = {
    "AmazonSSMManagedInstanceCore": [
        "ssm:DescribeAssociation", "ssm:GetDeployablePatchSnapshotForInstance", "ssm:GetDocument", "ssm:DescribeDocument",
        "ssm:GetManifest", "ssm:GetParameter", "ssm:GetParameters", "ssm:ListAssociations", "ssm:ListInstanceAssociations",
        "ssm:PutInventory", "ssm:PutComplianceItems", "ssm:PutConfigurePackageResult", "ssm:UpdateAssociationStatus",
        "ssm:UpdateInstanceAssociationStatus", "ssm:UpdateInstanceInformation", "ssmmessages:CreateControlChannel",
        "ssmmessages:CreateDataChannel", "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel",
        "ec2messages:AcknowledgeMessage", "ec2messages:DeleteMessage", "ec2messages:FailMessage", "ec2messages:GetEndpoint",
        "ec2messages:GetMessages", "ec2messages:SendReply",
    ],
}  # fmt: skip

SSM_AGENT = (
    "ssm:UpdateInstanceInformation",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
    "ec2messages:AcknowledgeMessage",
    "ec2messages:DeleteMessage",
    "ec2messages:FailMessage",
    "ec2messages:GetEndpoint",
    "ec2messages:GetMessages",
    "ec2messages:SendReply",
)
# Actions that read data: never on "*".
DATA_READS = ("s3:GetObject", "secretsmanager:GetSecretValue", "kms:Decrypt", "ssm:GetParameter", "ssm:GetParameters",
              "ssm:GetParametersByPath", "logs:GetLogEvents", "logs:FilterLogEvents")  # fmt: skip


def _text(value: Any) -> str:
    """A resource as text: the partition, account and asset bucket tokens filled in."""
    if isinstance(value, str):
        return value
    if "Fn::Join" in value:
        return "".join(_text(v) for v in value["Fn::Join"][1])
    if value == {"Ref": "AWS::Partition"}:
        return "aws"
    if value == {"Ref": "AWS::AccountId"}:
        return ACCOUNT
    if "Fn::Sub" in value:
        return value["Fn::Sub"].replace("${AWS::AccountId}", ACCOUNT)
    raise AssertionError(f"unexpected resource form {value}")


def granted(template: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(action, resource, condition as JSON) for every statement of the node role, managed policies expanded."""
    out = set()
    resources = template["Resources"]
    # The roles the instances get: those of the instance profiles.
    node_roles = {r["Ref"] for res in resources.values() if res["Type"] == "AWS::IAM::InstanceProfile" for r in res["Properties"]["Roles"]}
    assert node_roles, "no instance profile"
    for lid, res in resources.items():
        if res["Type"] == "AWS::IAM::Role" and lid in node_roles:
            for arn in res["Properties"].get("ManagedPolicyArns", []):
                name = _text(arn).rsplit("/", 1)[1]
                out |= {(a, "*", "{}") for a in MANAGED_ACTIONS.get(name, [f"<unknown managed policy {name}>"])}
        if res["Type"] == "AWS::IAM::Policy" and {r["Ref"] for r in res["Properties"]["Roles"]} & node_roles:
            for st in res["Properties"]["PolicyDocument"]["Statement"]:
                assert st["Effect"] == "Allow", st
                actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
                resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
                cond = json.dumps(st.get("Condition", {}), sort_keys=True)
                out |= {(a, _text(r), cond) for a in actions for r in resources}
    return out


def _prefix(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key.strip("/")


def expected(cfg: ClusterConfig, scripts_key: str) -> set[tuple[str, str, str]]:
    """What a node of this config needs, and nothing else (README 'Security')."""
    none = "{}"
    out = {(a, "*", none) for a in SSM_AGENT}
    out.add(("s3:GetObject", f"arn:aws:s3:::{ASSETS}/{scripts_key}", none))
    reads = []
    if cfg.model.source == "s3" and cfg.model.s3_uri:
        reads.append(cfg.model.s3_uri)
    if cfg.examples.s3_uri:
        reads.append(cfg.examples.s3_uri)
    if cfg.compile_cache_s3_uri:
        reads.append(cfg.compile_cache_s3_uri.rstrip("/") + "/fleet")
    for uri in reads:
        bucket, key = _prefix(uri)
        out.add(("s3:GetObject", f"arn:aws:s3:::{bucket}/{key}/*", none))
        out.add(("s3:ListBucket", f"arn:aws:s3:::{bucket}", json.dumps({"StringLike": {"s3:prefix": [key, f"{key}/*"]}})))
    writes = []
    if cfg.results_s3_uri:
        writes.append(cfg.results_s3_uri)
    if cfg.compile_cache_s3_uri:
        writes.append(cfg.compile_cache_s3_uri.rstrip("/") + "/nodes/${aws:userid}")
    for uri in writes:
        bucket, key = _prefix(uri)
        out.add(("s3:PutObject", f"arn:aws:s3:::{bucket}/{key}/*", none))
    if cfg.kms_key_arns:
        via = [f"s3.{cfg.region}.amazonaws.com"] + ([f"secretsmanager.{cfg.region}.amazonaws.com"] if cfg.model.hf_token_secret_arn else [])
        cond = json.dumps({"StringEquals": {"kms:ViaService": via if len(via) > 1 else via[0]}}, sort_keys=True)
        actions = ["kms:Decrypt"] + (["kms:GenerateDataKey"] if writes else [])
        out |= {(a, k, cond) for a in actions for k in cfg.kms_key_arns}
    if cfg.model.hf_token_secret_arn:
        arn = cfg.model.hf_token_secret_arn
        out |= {("secretsmanager:GetSecretValue", arn, none), ("secretsmanager:GetSecretValue", f"{arn}-??????", none)}
    if cfg.observability.enabled:
        group = f"/gptoss/{cfg.cluster_name}"
        out |= {(a, f"arn:aws:logs:{cfg.region}:{ACCOUNT}:log-group:{group}:*", none) for a in ("logs:CreateLogStream", "logs:PutLogEvents")}
        out.add(("cloudwatch:PutMetricData", "*", json.dumps({"StringEquals": {"cloudwatch:namespace": "GptOss"}})))
    return out


def assert_least_privilege(template: dict[str, Any], cfg: ClusterConfig) -> None:
    """The template grants exactly the expected pairs, and no data read on '*'."""
    got = granted(template)
    (scripts,) = {r.split(f"{ASSETS}/", 1)[1] for a, r, _ in got if a == "s3:GetObject" and ASSETS in r}
    want = expected(cfg, scripts)
    assert got - want == set(), f"{cfg.stack_name}: granted beyond the allowlist: {sorted(got - want)}"
    assert want - got == set(), f"{cfg.stack_name}: the node lacks: {sorted(want - got)}"
    wide = sorted((a, r) for a, r, _ in got if r == "*" and a in DATA_READS)
    assert wide == [], f"{cfg.stack_name}: data readable everywhere: {wide}"
