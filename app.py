#!/usr/bin/env python3
"""CDK app: read the parameters, validate them into the spec, build the stack. No AWS calls."""

from __future__ import annotations

import os
import sys

# CDK's built-in CloudFormation validator (a WASM linter, about 1.3 s of every synth) checks
# what cfn-lint checks; `make test` runs cfn-lint on every recipe and capacity mode, and cdk-nag
# runs at every synth below. CDK_VALIDATION=true cdk synth turns the built-in one back on. Set
# before aws_cdk starts its runtime, which reads it.
os.environ.setdefault("CDK_VALIDATION", "false")

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from clusterspec import limits
from clusterspec.errors import SpecError
from clusterspec.loading import load_config
from stacks.cluster_stack import GptOssClusterStack


def main() -> None:
    """Synthesize the cluster stack, or exit with the validation errors before writing anything."""
    app = cdk.App(stack_traces=False)  # no construct traces in the metadata: the CLI printed a jsii frame before each warning
    try:
        config = load_config(app.node.get_all_context())
        limits.check(config)
    except SpecError as e:
        print(f"invalid deployment parameters:\n{e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # a bug, not a bad value: one line unless asked for the traceback
        if os.environ.get("GPTOSS_DEBUG"):
            raise
        print(f"internal error while reading the parameters: {type(e).__name__}: {e} (set GPTOSS_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)
    GptOssClusterStack(app, config.stack_name, config=config)
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    app.synth()


if __name__ == "__main__":
    main()
