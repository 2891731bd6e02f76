"""Each node role's allowlist, typed here independently of cluster_constructs/iam.py.

Every (action, resource) pair the template grants a node identity's role must be one this file
expects for that node, and every expected pair must be granted (nothing missing that the node
needs). Managed policies are expanded from a typed copy of their documented actions, so
attaching one is judged by what it really grants. What only one node may do (its own area of
the compile cache, marking its own instance unhealthy) must name that node alone.
"""

from __future__ import annotations

import json
from typing import Any

from clusterspec.config import ClusterConfig
from node_render.paths import package_object_key

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


# The stack's own compile cache bucket, as a resource names it (a Ref of the bucket).
CACHE_BUCKET = "<the stack's compile cache bucket>"
# The stack (the cell) that holds the node's group, by its own id: a Ref of AWS::StackId there.
OWN_STACK = "<the node's own stack>"
# The stack's State Manager document (rollout.software=in-place), by its Ref (its generated name).
APPLY_DOCUMENT = "<the stack's apply document>"


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
    if "Ref" in value and value["Ref"].startswith("CompileCacheBucket"):
        return CACHE_BUCKET
    if value == {"Ref": "AWS::StackId"}:
        return OWN_STACK
    if "Ref" in value and value["Ref"].startswith("NodeSoftwareApply"):
        return APPLY_DOCUMENT
    raise AssertionError(f"unexpected resource form {value}")


def _statements(doc: dict[str, Any]) -> set[tuple[str, str, str]]:
    out = set()
    for st in doc["Statement"]:
        assert st["Effect"] == "Allow", st
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        cond = json.dumps(st.get("Condition", {}), sort_keys=True)
        out |= {(a, _text(r), cond) for a in actions for r in resources}
    return out


def granted(template: dict[str, Any]) -> dict[str, set[tuple[str, str, str]]]:
    """Node name -> (action, resource, condition as JSON) of every statement its instances get, managed policies expanded."""
    resources = template["Resources"]
    # A node's role: the one of the instance profile its launch template names.
    profiles = {lid: res["Properties"]["Roles"][0]["Ref"] for lid, res in resources.items() if res["Type"] == "AWS::IAM::InstanceProfile"}
    node_roles: dict[str, str] = {}
    for res in resources.values():
        if res["Type"] == "AWS::AutoScaling::AutoScalingGroup":
            node = next(t["Value"] for t in res["Properties"]["Tags"] if t["Key"] == "gptoss:node")
            lt = resources[res["Properties"]["LaunchTemplate"]["LaunchTemplateId"]["Ref"]]
            node_roles[node] = profiles[lt["Properties"]["LaunchTemplateData"]["IamInstanceProfile"]["Arn"]["Fn::GetAtt"][0]]
    assert node_roles, "no node"
    out: dict[str, set[tuple[str, str, str]]] = {}
    for node, role in node_roles.items():
        got: set[tuple[str, str, str]] = set()
        props = resources[role]["Properties"]
        for arn in props.get("ManagedPolicyArns", []):
            name = _text(arn).rsplit("/", 1)[1]
            got |= {(a, "*", "{}") for a in MANAGED_ACTIONS.get(name, [f"<unknown managed policy {name}>"])}
        for inline in props.get("Policies", []):
            got |= _statements(inline["PolicyDocument"])
        for res in resources.values():
            if res["Type"] == "AWS::IAM::Policy" and {"Ref": role} in res["Properties"]["Roles"]:
                got |= _statements(res["Properties"]["PolicyDocument"])
        out[node] = got
    return out


def _prefix(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key.strip("/")


def _cache(cfg: ClusterConfig) -> str | None:
    if cfg.compile_cache_s3_uri:
        return cfg.compile_cache_s3_uri.rstrip("/")
    return f"s3://{CACHE_BUCKET}" if cfg.compile_cache_bucket else None


def _objects(bucket: str, key: str) -> str:
    return f"arn:aws:s3:::{bucket}/{key + '/' if key else ''}*"


# The stack's own buckets (its compile cache, the CDK asset bucket): granted only while they are this account's.
OWN = {"StringEquals": {"s3:ResourceAccount": {"Ref": "AWS::AccountId"}}}


def _list(bucket: str, key: str) -> tuple[str, str, str]:
    own = OWN if bucket in (CACHE_BUCKET, ASSETS) else {}
    return ("s3:ListBucket", f"arn:aws:s3:::{bucket}", json.dumps({**own, "StringLike": {"s3:prefix": [key, f"{key}/*"]}}, sort_keys=True))


def _when(bucket: str) -> str:
    return json.dumps(OWN if bucket in (CACHE_BUCKET, ASSETS) else {})


def expected(cfg: ClusterConfig, node: str, scripts_key: str, router_key: str | None) -> set[tuple[str, str, str]]:
    """What node `node` of this config needs, and nothing else (README 'Security')."""
    none = "{}"
    out = {(a, "*", none) for a in SSM_AGENT}
    out.add(("s3:GetObject", f"arn:aws:s3:::{ASSETS}/{scripts_key}", _when(ASSETS)))
    if cfg.rollout.software == "in-place":
        # Which software version is current (one parameter), State Manager's association of its own instance
        # (nothing narrower exists) and the one document it runs.
        out.add(("ssm:GetParameter", f"arn:aws:ssm:{cfg.region}:{ACCOUNT}:parameter/gptoss/{cfg.cluster_name}/software", none))
        out |= {(a, "*", none) for a in ("ssm:DescribeAssociation", "ssm:ListInstanceAssociations", "ssm:PutComplianceItems",
                                          "ssm:UpdateInstanceAssociationStatus")}  # fmt: skip
        out |= {(a, f"arn:aws:ssm:{cfg.region}:{ACCOUNT}:document/{APPLY_DOCUMENT}", none) for a in ("ssm:GetDocument", "ssm:DescribeDocument")}
    cache = _cache(cfg)
    reads = []
    if cfg.model.source == "s3" and cfg.model.s3_uri:
        reads.append(cfg.model.s3_uri)
    if cfg.examples.s3_uri:
        reads.append(cfg.examples.s3_uri)
    if cache:
        reads.append(f"{cache}/fleet")
    for uri in reads:
        bucket, key = _prefix(uri)
        out.add(("s3:GetObject", _objects(bucket, key), _when(bucket)))
        out.add(_list(bucket, key))
    if cfg.results_s3_uri:
        bucket, key = _prefix(cfg.results_s3_uri)
        out.add(("s3:PutObject", _objects(bucket, key), none))
    if cache:
        # This node's own area: what it saves, what its replacements restore.
        bucket, key = _prefix(f"{cache}/nodes/{node}")
        out |= {(a, _objects(bucket, key), _when(bucket)) for a in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject")}
        out.add(_list(bucket, key))
    if cfg.kms_key_arns:
        via = [f"s3.{cfg.region}.amazonaws.com"] + ([f"secretsmanager.{cfg.region}.amazonaws.com"] if cfg.model.hf_token_secret_arn else [])
        cond = json.dumps({"StringEquals": {"kms:ViaService": via if len(via) > 1 else via[0]}}, sort_keys=True)
        actions = ["kms:Decrypt"] + (["kms:GenerateDataKey"] if cfg.results_s3_uri or cache else [])
        out |= {(a, k, cond) for a in actions for k in cfg.kms_key_arns}
    if cfg.model.hf_token_secret_arn:
        arn = cfg.model.hf_token_secret_arn
        out |= {("secretsmanager:GetSecretValue", arn, none), ("secretsmanager:GetSecretValue", f"{arn}-??????", none)}
    if cfg.observability.enabled:
        group = f"/gptoss/{cfg.cluster_name}"
        out.add(("logs:CreateLogStream", f"arn:aws:logs:{cfg.region}:{ACCOUNT}:log-group:{group}:*", none))
        # Its own streams only (node/unit).
        out.add(("logs:PutLogEvents", f"arn:aws:logs:{cfg.region}:{ACCOUNT}:log-group:{group}:log-stream:{node}/*", none))
        # The cluster's own namespace: GptOss/<cluster_name>.
        out.add(("cloudwatch:PutMetricData", "*", json.dumps({"StringEquals": {"cloudwatch:namespace": f"GptOss/{cfg.cluster_name}"}})))
        if cfg.capacity.type == "capacity-block":
            # Its block's end date (the collector's clock before the reclaim): EC2's Describe calls take no resource.
            out.add(("ec2:DescribeCapacityReservations", "*", none))
    if cfg.healing.report_unhealthy:
        # Its own group, by name (the group's id is EC2's): no other node's.
        # The replacement budget: Auto Scaling's record of terminations (no resource-level permission exists).
        out.add(("autoscaling:DescribeScalingActivities", "*", none))
        out.add(("autoscaling:SetInstanceHealth",
                 f"arn:aws:autoscaling:{cfg.region}:{ACCOUNT}:autoScalingGroup:*:autoScalingGroupName/{cfg.cluster_name}-{node}", none))  # fmt: skip
    proxies = [p for p in cfg.layout.proxies if p.node == node]
    if proxies:
        # The fleet's members, by tag, and which of two instances of one node its group is letting go.
        out |= {("ec2:DescribeInstances", "*", none), ("autoscaling:DescribeAutoScalingInstances", "*", none)}
    if cfg.wait_for_ready:
        # Its verdict to its own group (a surge or a rollback waits for it), whatever the rollout's policy: its own
        # instance's aws:cloudformation tags, then its own stack only, to signal and to ask whether its gate was answered.
        out |= {("ec2:DescribeTags", "*", none), ("cloudformation:SignalResource", OWN_STACK, none),
                ("cloudformation:DescribeStackResource", OWN_STACK, none)}  # fmt: skip
    if router_key and any(p.kind == "vllm-router" for p in proxies):
        out.add(("s3:GetObject", f"arn:aws:s3:::{ASSETS}/{router_key}", _when(ASSETS)))
        # The API gate's pinned packages (nodes with no apt source), each by its own key.
        out |= {("s3:GetObject", f"arn:aws:s3:::{ASSETS}/{package_object_key(p.sha256)}", _when(ASSETS)) for p in cfg.serving.proxy.gate.packages}
        # The fleet's router settings and pool: this one parameter.
        out.add(("ssm:GetParameter", f"arn:aws:ssm:{cfg.region}:{ACCOUNT}:parameter/gptoss/{cfg.cluster_name}/router", none))
        if cfg.endpoint_auth == "keys":
            # The API keys: the cluster's one secret (the stack's by its name; IAM matches the full ARN's random suffix).
            given = cfg.serving.endpoint.keys_secret_arn
            names = [given, f"{given}-??????"] if given else [f"arn:aws:secretsmanager:{cfg.region}:{ACCOUNT}:secret:gptoss/{cfg.cluster_name}/api-keys-??????"]
            out |= {("secretsmanager:GetSecretValue", n, none) for n in names}
    return out


def assert_least_privilege(template: dict[str, Any], cfg: ClusterConfig) -> None:
    """Every node's role grants exactly its expected pairs, and no data read on '*'."""
    by_node = granted(template)
    assert sorted(by_node) == sorted(n.name for n in cfg.layout.nodes), "one role per node identity"
    assets = {r.split(f"{ASSETS}/", 1)[1] for got in by_node.values() for a, r, _ in got if a == "s3:GetObject" and ASSETS in r}
    (scripts,) = [k for k in assets if k.endswith(".xz")]
    routers = [k for k in assets if k.endswith(".whl")]
    for node, got in by_node.items():
        want = expected(cfg, node, scripts, routers[0] if routers else None)
        assert got - want == set(), f"{cfg.stack_name} {node}: granted beyond the allowlist: {sorted(got - want)}"
        assert want - got == set(), f"{cfg.stack_name} {node}: the node lacks: {sorted(want - got)}"
        wide = sorted((a, r) for a, r, _ in got if r == "*" and a in DATA_READS)
        assert wide == [], f"{cfg.stack_name} {node}: data readable everywhere: {wide}"
