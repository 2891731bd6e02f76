#!/usr/bin/env python3
"""CDK app: read the parameters, validate them into the spec, build the stack. No AWS calls."""

from __future__ import annotations

import sys

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from clusterspec.config import load_config
from clusterspec.errors import SpecError
from stacks.cluster_stack import GptOssClusterStack


def main() -> None:
    """Synthesize the cluster stack, or exit with the validation errors before writing anything."""
    app = cdk.App()
    try:
        config = load_config(app.node.get_all_context())
    except SpecError as e:
        print(f"invalid deployment parameters:\n{e}", file=sys.stderr)
        sys.exit(1)
    GptOssClusterStack(app, config.stack_name, config=config)
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    app.synth()


if __name__ == "__main__":
    main()
