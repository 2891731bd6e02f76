"""Fill the guest's moto S3 with what the harness passed (fw_cfg section "s3").

"objects": {"s3://bucket/key": "fw_cfg file name"}: the bytes of that fw_cfg file.
"disk_objects": {"s3://bucket/key": {"disk": NAME, "size": N}}: the first N bytes of the virtio disk
/dev/disk/by-id/virtio-gptoss-NAME (large files: fw_cfg is read byte by byte).
"hub_prefixes": {"s3://bucket/prefix": "org/name"}: the fake Hub's repository, file by file.
Section "logs", "groups": [...]: CloudWatch Logs groups the stack would have made (moto serves
CloudWatch and CloudWatch Logs on the same port).
Section "ssm", "parameters": {name: value}: what the stack writes to Parameter Store (the fleet's
members for the routers).
Section "secrets", "name" and "hf_token": the Hugging Face token as the operator stores it in
Secrets Manager (the node asks for it by its partial ARN).
"""

import json
import sys
import time
import urllib.request
from pathlib import Path

import boto3

sys.path.insert(0, "/usr/local/lib/fakes")
import fakectl

for _ in range(300):
    try:
        urllib.request.urlopen("http://127.0.0.1:5000/moto-api/", timeout=2)
        break
    except OSError:
        time.sleep(0.5)
s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:5000", region_name="us-east-2",
                  aws_access_key_id="testing", aws_secret_access_key="testing")
settings = fakectl.settings("s3")


def put(uri: str, body: bytes) -> None:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-east-2"})
    s3.put_object(Bucket=bucket, Key=key, Body=body)


for uri, name in settings.get("objects", {}).items():
    put(uri, Path(f"/sys/firmware/qemu_fw_cfg/by_name/opt/gptoss/{name}/raw").read_bytes())
for uri, disk in settings.get("disk_objects", {}).items():
    device = Path(f"/dev/disk/by-id/virtio-gptoss-{disk['disk']}")
    for _ in range(120):  # udev makes the link during coldplug, which may still run
        if device.exists():
            break
        time.sleep(0.5)
    with device.open("rb") as f:
        put(uri, f.read(disk["size"]))
for prefix, repo in settings.get("hub_prefixes", {}).items():
    root = Path("/srv/hub") / repo
    for p in sorted(root.rglob("*")):
        if p.is_file():
            put(f"{prefix.rstrip('/')}/{p.relative_to(root)}", p.read_bytes())
logs = boto3.client(
    "logs",
    endpoint_url="http://127.0.0.1:5000",
    region_name="us-east-2",
    aws_access_key_id="testing",
    aws_secret_access_key="testing",
)
for group in fakectl.settings("logs").get("groups", []):
    logs.create_log_group(logGroupName=group)
secrets = fakectl.settings("secrets")
if secrets.get("name"):
    sm = boto3.client("secretsmanager", endpoint_url="http://127.0.0.1:5000", region_name="us-east-2",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    sm.create_secret(Name=secrets["name"], SecretString=secrets["hf_token"])
ssm_parameters = fakectl.settings("ssm").get("parameters", {})
if ssm_parameters:
    ssm = boto3.client("ssm", endpoint_url="http://127.0.0.1:5000", region_name="us-east-2",
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    for name, value in ssm_parameters.items():
        ssm.put_parameter(Name=name, Value=value, Type="String", Overwrite=True)
print(json.dumps({"seeded": sorted(settings.get("objects", {})) + sorted(settings.get("hub_prefixes", {}))}))
