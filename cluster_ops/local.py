"""`gptoss local up|down|env`: the whole lifecycle on this machine, with no AWS account.

The local AWS is moto's server (the one the tests use) on localhost. `up` starts it (or uses the
one GPTOSS_LOCAL_ENDPOINT names), seeds what a real account has and the layout needs (the DLAMI
parameter, a model bucket), bootstraps the CDK, deploys examples/local.yaml
with `gptoss deploy` and shows `gptoss status`. `down` destroys the stack with `gptoss destroy`,
removes what moto's CloudFormation cannot delete itself, the seeds and the CDK bootstrap, lists
what is left against what the server held before `up` (nothing, or exit 1), and stops the server
it started. Both act only on a loopback endpoint in moto's account, never on AWS.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from cluster_ops.common import ROOT, CliError, checkout, state_dir

ACCOUNT = "123456789012"  # moto's account
REGION = "us-east-2"
PORT = 5005
CONFIG = "examples/local.yaml"
STACK = "GptOssLocalStack"
PARAMETER = "/gptoss/local/neuron-dlami"
BUCKET = "gptoss-local-models"
# The image the DLAMI parameter names locally: registered by `up` under a name that says what it is
# (moto's own images are Windows and Amazon Linux ones, which a deploy would print as the node's image).
IMAGE_NAME = "gptoss-local stand-in (moto: nothing boots from it)"
# `local env` keeps here what this shell had before it, so that `local env --unset` gives it back.
SAVED = "GPTOSS_LOCAL_SAVED_ENV"
TOOLKIT = "CDKToolkit"
# Resource types moto's CloudFormation (5.x) creates but does not delete: a destroy there leaves
# them, and the VPC behind them. CloudFormation on AWS deletes them.
MOTO_CANNOT_DELETE = ("AWS::EC2::VPCEndpoint", "AWS::EC2::FlowLog", "AWS::EC2::RouteTable")


def endpoint() -> str:
    """GPTOSS_LOCAL_ENDPOINT, else localhost on GPTOSS_LOCAL_PORT (5005). The host name `localhost`:
    the CDK finds its asset bucket by that name in the endpoint's URL."""
    url = os.environ.get("GPTOSS_LOCAL_ENDPOINT") or f"http://localhost:{os.environ.get('GPTOSS_LOCAL_PORT') or PORT}"
    host = urlparse(url).hostname
    if host not in ("localhost", "127.0.0.1", "::1"):
        raise CliError(f"GPTOSS_LOCAL_ENDPOINT={url}: the local lifecycle acts only on a loopback endpoint. "
                       "Fix: http://localhost:PORT (a moto server), or unset it.")  # fmt: skip
    return url


def environment(url: str) -> dict[str, str]:
    """What every AWS client (boto3, the AWS CLI, the CDK) needs to talk to the local endpoint only."""
    return {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def _env(url: str) -> dict[str, str]:
    """This process's environment without the caller's AWS settings (a profile, real keys), with the local ones."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS")}
    return clean | environment(url)


def _answers(url: str) -> bool | None:
    """True: moto answers there; False: nothing listens; None: something else does."""
    # moto's dashboard page: cheap (data.json loads every service's backend first, seconds on a
    # busy machine), and titled Moto.
    try:
        with urllib.request.urlopen(f"{url}/moto-api/", timeout=10) as r:
            return True if b"<title>Moto</title>" in r.read() else None
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError):
        try:
            urllib.request.urlopen(url, timeout=10)
        except urllib.error.HTTPError:
            return None
        except OSError:
            return False
        return None


def _server_record() -> Path:
    return state_dir() / "local" / "server.json"


def _start_server(url: str) -> int:
    """The local AWS (cluster_ops/local_aws.py: moto's server, mended where the stack needs it) on
    the endpoint's port, detached (it outlives this command until `down`)."""
    port = urlparse(url).port or 80
    log = state_dir() / "local" / "moto.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "cluster_ops.local_aws", "-H", "127.0.0.1", "-p", str(port)], cwd=ROOT,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-300:].strip().splitlines()
            raise CliError(f"moto's server exited at start ({tail[-1] if tail else 'no output'}; log {log}). "
                           f"Fix: free port {port} or set GPTOSS_LOCAL_PORT.")  # fmt: skip
        if _answers(url):
            return proc.pid
        time.sleep(0.2)
    proc.terminate()
    raise CliError(f"moto's server did not answer on {url} within 30 s (log {log}). Fix: free port {port} or set GPTOSS_LOCAL_PORT.")


def _ours(url: str) -> int | None:
    """The pid of the local AWS this checkout's `up` started on url and that still runs, else None."""
    record = _server_record()
    try:
        doc = json.loads(record.read_text())
        pid = int(doc["pid"])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if doc.get("endpoint") == url and b"cluster_ops.local_aws" in cmdline else None


def _not_ours(url: str, verb: str) -> str:
    return (f"moto on {url} was not started by this checkout's `make local` (another checkout's, or one of yours): "
            f"{verb} it could act on another cluster. Fix: GPTOSS_LOCAL_PORT=PORT (a free port) for a server of this "
            f"checkout's own, or GPTOSS_LOCAL_ENDPOINT={url} to name that server on purpose")  # fmt: skip


def clients(url: str) -> Any:
    import boto3

    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)
    return lambda name: session.client(name, endpoint_url=url)


def inventory(client: Any) -> dict[str, list[str]]:
    """Every resource of the kinds the stack, the seeds and the CDK bootstrap make, by id."""
    ec2, iam, s3 = client("ec2"), client("iam"), client("s3")
    live = [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"] if i["State"]["Name"] not in ("terminated", "shutting-down")]
    kinds = {
        "stacks": [s["StackName"] for s in client("cloudformation").list_stacks()["StackSummaries"] if s["StackStatus"] != "DELETE_COMPLETE"],
        "instances": [i["InstanceId"] for i in live],
        "auto scaling groups": [g["AutoScalingGroupName"] for g in client("autoscaling").describe_auto_scaling_groups()["AutoScalingGroups"]],
        "launch templates": [t["LaunchTemplateName"] for t in ec2.describe_launch_templates()["LaunchTemplates"]],
        "VPCs": [v["VpcId"] for v in ec2.describe_vpcs()["Vpcs"]],
        "subnets": [s["SubnetId"] for s in ec2.describe_subnets()["Subnets"]],
        "route tables": [t["RouteTableId"] for t in ec2.describe_route_tables()["RouteTables"]],
        "security groups": [g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]],
        "VPC endpoints": [e["VpcEndpointId"] for e in ec2.describe_vpc_endpoints()["VpcEndpoints"] if e["State"].lower() != "deleted"],
        "flow logs": [f["FlowLogId"] for f in ec2.describe_flow_logs()["FlowLogs"]],
        "IAM roles": [r["RoleName"] for r in iam.list_roles()["Roles"]],
        "instance profiles": [p["InstanceProfileName"] for p in iam.list_instance_profiles()["InstanceProfiles"]],
        "managed policies": [p["PolicyName"] for p in iam.list_policies(Scope="Local")["Policies"]],
        "S3 buckets": [b["Name"] for b in s3.list_buckets()["Buckets"]],
        "SSM parameters": [p["Name"] for p in client("ssm").describe_parameters()["Parameters"]],
        "images": [i["ImageId"] for i in ec2.describe_images(Owners=["self"])["Images"]],
        "ECR repositories": [r["repositoryName"] for r in client("ecr").describe_repositories()["repositories"]],
        "log groups": [g["logGroupName"] for g in client("logs").describe_log_groups()["logGroups"]],
        "alarms": [a["AlarmName"] for a in client("cloudwatch").describe_alarms()["MetricAlarms"]],
        "event rules": [r["Name"] for r in client("events").list_rules()["Rules"]],
        "SNS topics": [t["TopicArn"] for t in client("sns").list_topics()["Topics"]],
    }
    return {k: sorted(v) for k, v in kinds.items()}


def _run(cmd: list[str], url: str, *, quiet: bool = False, cwd: Path | None = None) -> int:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, cwd=cwd or checkout(), env=_env(url), stdin=subprocess.DEVNULL, capture_output=quiet, text=True)
    if quiet and r.returncode != 0:
        print((r.stdout + r.stderr)[-2000:], file=sys.stderr)
    return r.returncode


def seed(client: Any) -> str:
    """What a real account has that the layout names: the DLAMI parameter (an image of the account's
    own, named as the stand-in it is), the bucket the checkpoint and caches come from. (moto has no
    placement groups: the layout's group name is taken as given; on AWS it must exist.)"""
    ec2 = client("ec2")
    own = [i["ImageId"] for i in ec2.describe_images(Owners=["self"])["Images"] if i.get("Name") == IMAGE_NAME]
    image = own[0] if own else ec2.register_image(Name=IMAGE_NAME, Description="the local lifecycle's DLAMI stand-in")["ImageId"]
    client("ssm").put_parameter(Name=PARAMETER, Value=image, Type="String", DataType="aws:ec2:image", Overwrite=True)
    s3 = client("s3")
    if BUCKET not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    return str(image)


def _stack_resources(cfn: Any, stack: str) -> list[dict[str, Any]]:
    """A stack's resources and its nested stacks' (the cells)."""
    try:
        out = list(cfn.list_stack_resources(StackName=stack)["StackResourceSummaries"])
    except Exception:  # no such stack: nothing of it to remove
        return []
    for r in list(out):
        if r["ResourceType"] == "AWS::CloudFormation::Stack" and r.get("PhysicalResourceId"):
            out += _stack_resources(cfn, r["PhysicalResourceId"])
    return out


def remove_what_moto_cannot_delete(client: Any, stack: str) -> int:
    """Delete, through the EC2 API and by the ids CloudFormation recorded, only the types moto's
    CloudFormation leaves behind (the VPC's delete would fail on them)."""
    resources = _stack_resources(client("cloudformation"), stack)
    ids = {t: [r["PhysicalResourceId"] for r in resources if r["ResourceType"] == t and r.get("PhysicalResourceId")] for t in MOTO_CANNOT_DELETE}
    ec2 = client("ec2")
    if ids["AWS::EC2::VPCEndpoint"]:
        ec2.delete_vpc_endpoints(VpcEndpointIds=ids["AWS::EC2::VPCEndpoint"])
    if ids["AWS::EC2::FlowLog"]:
        ec2.delete_flow_logs(FlowLogIds=ids["AWS::EC2::FlowLog"])
    tables = ec2.describe_route_tables(RouteTableIds=ids["AWS::EC2::RouteTable"])["RouteTables"] if ids["AWS::EC2::RouteTable"] else []
    for table in tables:
        for assoc in table["Associations"]:
            if not assoc.get("Main"):
                ec2.disassociate_route_table(AssociationId=assoc["RouteTableAssociationId"])
        ec2.delete_route_table(RouteTableId=table["RouteTableId"])
    return sum(map(len, ids.values()))


def _empty_bucket(s3: Any, bucket: str) -> None:
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"], "VersionId": o["VersionId"]} for o in page.get("Versions", []) + page.get("DeleteMarkers", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def remove_bootstrap_and_seeds(client: Any) -> None:
    """The CDK bootstrap stack and what it retains (its staging bucket and image repository), then the seeds."""
    cfn, s3 = client("cloudformation"), client("s3")
    retained = [r for r in _stack_resources(cfn, TOOLKIT) if r["ResourceType"] in ("AWS::S3::Bucket", "AWS::ECR::Repository")]
    if any(s["StackName"] == TOOLKIT and s["StackStatus"] != "DELETE_COMPLETE" for s in cfn.list_stacks()["StackSummaries"]):
        cfn.delete_stack(StackName=TOOLKIT)
        cfn.get_waiter("stack_delete_complete").wait(StackName=TOOLKIT, WaiterConfig={"Delay": 1, "MaxAttempts": 120})
    buckets = {b["Name"] for b in s3.list_buckets()["Buckets"]}
    for r in retained:
        name = r["PhysicalResourceId"]
        if r["ResourceType"] == "AWS::S3::Bucket" and name in buckets:
            _empty_bucket(s3, name)
            s3.delete_bucket(Bucket=name)
        elif r["ResourceType"] == "AWS::ECR::Repository":
            try:
                client("ecr").delete_repository(repositoryName=name, force=True)
            except client("ecr").exceptions.RepositoryNotFoundException:
                pass
    if BUCKET in buckets:
        _empty_bucket(s3, BUCKET)
        s3.delete_bucket(Bucket=BUCKET)
    try:
        client("ssm").delete_parameter(Name=PARAMETER)
    except client("ssm").exceptions.ParameterNotFound:
        pass
    ec2 = client("ec2")
    for i in ec2.describe_images(Owners=["self"])["Images"]:
        if i.get("Name") == IMAGE_NAME:
            ec2.deregister_image(ImageId=i["ImageId"])


def _check_account(client: Any, url: str) -> None:
    account = client("sts").get_caller_identity()["Account"]
    if account != ACCOUNT:
        raise CliError(f"{url} answers for account {account}, not moto's {ACCOUNT}: the local lifecycle does not act on it.")


def up(gptoss: str) -> int:
    """Start (or reuse) the local AWS, seed it, bootstrap, deploy the local layout, show its status."""
    url = endpoint()
    started = time.monotonic()
    found = _answers(url)
    if found is None:
        raise CliError(f"something that is not moto answers on {url}. Fix: stop it, or pick a free port: GPTOSS_LOCAL_PORT=PORT make local")
    record = _server_record()
    if found:
        if not (os.environ.get("GPTOSS_LOCAL_ENDPOINT") or _ours(url)):
            raise CliError(_not_ours(url, "deploying to") + ". Nothing was deployed.")
        print(f"local AWS: moto already answers on {url}", file=sys.stderr)
    else:
        if os.environ.get("GPTOSS_LOCAL_ENDPOINT"):
            raise CliError(f"nothing answers on GPTOSS_LOCAL_ENDPOINT={url}. Fix: start moto there, or unset it to let `make local` start one.")
        pid = _start_server(url)
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"endpoint": url, "pid": pid}) + "\n")
        print(f"local AWS: started moto's server on {url} (pid {pid}, log {record.parent / 'moto.log'})", file=sys.stderr)
    client = clients(url)
    _check_account(client, url)
    baseline = record.parent / "baseline.json"
    if not baseline.exists():
        baseline.parent.mkdir(parents=True, exist_ok=True)
        baseline.write_text(json.dumps({"endpoint": url, "inventory": inventory(client)}, indent=1) + "\n")
    image = seed(client)
    print(f"seeded: SSM parameter {PARAMETER} = {image} ({IMAGE_NAME!r}), bucket s3://{BUCKET}", file=sys.stderr)
    print("bootstrapping the CDK in the local account (about 20 s)", file=sys.stderr, flush=True)
    cdk = str(ROOT / "node_modules" / ".bin" / "cdk")
    record.parent.mkdir(parents=True, exist_ok=True)
    # In the state folder, not the checkout: with its environment named, bootstrap needs no app (from
    # the checkout, cdk.json's, it would synthesize the default stack for nothing).
    if _run([cdk, "bootstrap", f"aws://{ACCOUNT}/{REGION}", "--no-notices"], url, quiet=True, cwd=record.parent) != 0:
        raise CliError("cdk bootstrap failed against the local endpoint (its output is above).", 1)
    print("deploying (seconds: the synth, the asset upload, CloudFormation in moto)", file=sys.stderr, flush=True)
    if _run([gptoss, "deploy", "-c", f"config={CONFIG}", "--require-approval", "never"], url) != 0:
        raise CliError("the local deploy failed (above). `make local-down` removes what it made.", 1)
    # moto's Run Command reaches no node: status shows each identity's instance, and that no unit answered.
    _run([gptoss, "status", "-c", f"config={CONFIG}"], url)
    print(f"\nlocal cluster {STACK} is up in {time.monotonic() - started:.0f} s (moto: instances exist, nothing boots on them).\n"
          f"  other commands against it:  eval \"$({gptoss_name()} local env)\"; then e.g. gptoss diff -c config={CONFIG}\n"
          "  remove it all:              make local-down", file=sys.stderr)  # fmt: skip
    return 0


def gptoss_name() -> str:
    return ".venv/bin/gptoss"


def down(gptoss: str) -> int:
    """Destroy the local stack and everything `up` made; list what is left; stop the server `up` started."""
    url = endpoint()
    record = _server_record()
    found = _answers(url)
    if found is None:
        raise CliError(f"something that is not moto answers on {url}: nothing was removed.")
    if not found:
        print(f"local AWS: nothing answers on {url}: nothing to remove", file=sys.stderr)
        for f in ("server.json", "baseline.json"):
            (record.parent / f).unlink(missing_ok=True)
        return 0
    if not (os.environ.get("GPTOSS_LOCAL_ENDPOINT") or _ours(url)):
        raise CliError(_not_ours(url, "removing what is on") + ". Nothing was removed.")
    client = clients(url)
    _check_account(client, url)
    removed = remove_what_moto_cannot_delete(client, STACK)
    if removed:
        print(f"removed {removed} resources moto's CloudFormation cannot delete itself (VPC endpoints, flow logs, route tables)", file=sys.stderr)
    deployed = any(s["StackName"] == STACK and s["StackStatus"] != "DELETE_COMPLETE" for s in client("cloudformation").list_stacks()["StackSummaries"])
    if deployed and _run([gptoss, "destroy", "-c", f"config={CONFIG}", "--yes"], url) != 0:
        raise CliError("the local destroy failed (above); run `make local-down` again once it is fixed.", 1)
    remove_bootstrap_and_seeds(client)
    baseline_path = record.parent / "baseline.json"
    baseline = json.loads(baseline_path.read_text())["inventory"] if baseline_path.exists() else {}
    now = inventory(client)
    left = {k: sorted(set(v) - set(baseline.get(k, []))) for k, v in now.items()}
    left = {k: v for k, v in left.items() if v}
    if left:
        print("left in the local account:\n" + "\n".join(f"  {k}: {', '.join(v)}" for k, v in left.items()), file=sys.stderr)
    else:
        print(f"left in the local account: nothing ({len(now)} kinds of resource listed, compared with before `make local`)", file=sys.stderr)
    baseline_path.unlink(missing_ok=True)
    if record.exists():
        pid = int(json.loads(record.read_text())["pid"])
        try:
            os.kill(pid, signal.SIGTERM)
            print(f"stopped moto's server (pid {pid})", file=sys.stderr)
        except ProcessLookupError:
            pass
        record.unlink()
    print(f"a shell that ran `eval \"$({gptoss_name()} local env)\"` still points its AWS clients at {url}; "
          f"leave it with: eval \"$({gptoss_name()} local env --unset)\"", file=sys.stderr)  # fmt: skip
    return 1 if left else 0


def env(unset: bool = False) -> int:
    """The exports that point the AWS clients of this shell at the local endpoint, keeping what the shell had
    (--unset: what gives it back: the values it had before, and an unset of what it did not have)."""
    keys = list(environment("").keys())
    if unset:
        try:
            before = json.loads(os.environ.get(SAVED) or "{}")
        except ValueError:
            before = {}
        lines = [f"export {k}={shlex.quote(before[k])}" if isinstance(before.get(k), str) else f"unset {k}" for k in keys]
        print("\n".join([*lines, f"unset {SAVED}"]))
        return 0
    url = endpoint()
    # Run twice in one shell, the first run's record stays: it holds what the shell had before either.
    saved = os.environ.get(SAVED) or json.dumps({k: os.environ[k] for k in keys if k in os.environ}, sort_keys=True)
    exports = {**environment(url), SAVED: saved}
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in exports.items()))
    return 0
