"""Pin the DLAMI: resolve the SSM parameter once and record the image, the way the CDK caches
its own lookups (cdk.context.json), so a redeploy never moves the fleet to a new image.

The record is one context key per region and parameter, `gptoss:pinned-ami:REGION`:
{"ami_id", "name", "created", "parameter"}. `load_config` uses it in place of the parameter
while the config names that parameter and no ami_id of its own. Upgrading is deliberate:
`gptoss pin-ami` again (it shows the old and the new image), review, commit, deploy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster_ops import common
from clusterspec.config import ClusterConfig
from clusterspec.loading import pin_key


def resolve(cfg: ClusterConfig, ssm: Any, ec2: Any) -> dict[str, str]:
    """The image the config's SSM parameter names today, with its name and creation date."""
    from botocore.exceptions import ClientError

    parameter = cfg.ami_ssm_parameter or ""
    try:
        ami_id = ssm.get_parameter(Name=parameter)["Parameter"]["Value"]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") != "ParameterNotFound":
            raise
        raise common.CliError(
            f"no DLAMI parameter {parameter} in {cfg.region}: the Neuron DLAMIs are published only in regions that offer "
            "Trainium, under names that change with the SDK. Fix: check the region (-c region=...), set ami_ssm_parameter to a name "
            f"`aws ssm get-parameters-by-path --path /aws/service/neuron/dlami --recursive --region {cfg.region}` lists, "
            "or pin an image: -c ami_id=ami-..."
        ) from None
    images = ec2.describe_images(ImageIds=[ami_id])["Images"]
    image = images[0] if images else {}
    return {"ami_id": ami_id, "name": image.get("Name", ""), "created": image.get("CreationDate", ""), "parameter": parameter}


def write(context_file: Path, region: str, pin: dict[str, str]) -> dict[str, str] | None:
    """Record the pin in cdk.context.json (kept sorted, other keys untouched); returns the previous pin."""
    doc = json.loads(context_file.read_text()) if context_file.exists() else {}
    key = pin_key(region)
    previous = doc.get(key)
    doc[key] = pin
    context_file.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return previous
